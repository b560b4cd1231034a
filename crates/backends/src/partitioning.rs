//! nbdkit's partitioning plugin: files served as the partitions of a
//! virtual disk whose partition table (MBR, with logical partitions past
//! the fourth, or GPT) is made up on the fly, laid out byte for byte as
//! nbdkit lays it out: each partition aligned as asked (1 MiB by default)
//! and padded to a whole sector, the primary table first and GPT's backup
//! last. The tables cannot be changed (a write must leave them as they
//! are), the padding takes only zeros; the partitions are the files.
//!
//! GPT's unique partition GUIDs are drawn as nbdkit draws them, from its
//! generator seeded with the time in seconds: a disk made in the same
//! second as nbdkit's is the same to the byte.

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, DeviceRef, Error, Result, WriteFlags};

use crate::nbdkit_random::Xoshiro256;

/// The sector size of the tables.
pub const SECTOR: u64 = 512;
/// The largest (and default) alignment of a partition.
pub const MAX_ALIGNMENT: u64 = 2048 * SECTOR;
/// The partition id of an MBR partition unless told otherwise (Linux).
pub const DEFAULT_MBR_ID: u8 = 0x83;
/// The GPT partition type unless told otherwise (Linux filesystem data).
pub const DEFAULT_TYPE_GUID: &str = "0FC63DAF-8483-4772-8E79-3D69D8477DE4";
/// The largest disk an MBR describes, as nbdkit estimates it.
pub const MAX_MBR_DISK_SIZE: u64 = u32::MAX as u64 * SECTOR - 5 * MAX_ALIGNMENT;

const GPT_MIN_PARTITIONS: u64 = 128;
const GPT_ENTRY_SIZE: u64 = 128;
/// nbdkit's `sizeof (struct gpt_header)`: 92 bytes of fields, padded to 96.
const GPT_HEADER_SIZE: usize = 96;

/// The kind of partition table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableType {
    /// A DOS master boot record.
    Mbr,
    /// A GUID partition table.
    Gpt,
}

/// One partition: the file and how it is described.
pub struct Partition {
    /// The file's name (GPT names the partition after it).
    pub name: String,
    /// The file.
    pub device: DeviceRef,
    /// Where it may start: a multiple of this.
    pub alignment: u64,
    /// Its MBR partition id.
    pub mbr_id: u8,
    /// Its GPT partition type.
    pub type_guid: [u8; 16],
}

/// A GPT GUID as GPT stores it (its first three fields little endian),
/// from `XXXXXXXX-XXXX-XXXX-XXXX-XXXXXXXXXXXX`, braces allowed around it.
pub fn parse_guid(s: &str) -> Option<[u8; 16]> {
    let s = s
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .unwrap_or(s);
    let b = s.as_bytes();
    if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
        return None;
    }
    let hex: Vec<u8> = b.iter().copied().filter(|&c| c != b'-').collect();
    if hex.len() != 32 || !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let byte =
        |i: usize| u8::from_str_radix(std::str::from_utf8(&hex[2 * i..2 * i + 2]).ok()?, 16).ok();
    let mut out = [0u8; 16];
    let order = [3, 2, 1, 0, 5, 4, 7, 6, 8, 9, 10, 11, 12, 13, 14, 15];
    for (o, &i) in out.iter_mut().zip(&order) {
        *o = byte(i)?;
    }
    Some(out)
}

/// What a range of the virtual disk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    /// Table `n` (bytes made up here).
    Table(usize),
    /// Partition `n`'s file.
    File(usize),
    /// Padding: zeros.
    Zero,
}

#[derive(Debug, Clone, Copy)]
struct Region {
    start: u64,
    len: u64,
    content: Content,
}

impl Region {
    fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// The virtual disk.
pub struct PartitioningDevice {
    partitions: Vec<Partition>,
    regions: Vec<Region>,
    tables: Vec<Vec<u8>>,
    size: u64,
    writable: bool,
}

/// The regions of a disk, appended in order (nbdkit's `regions`).
#[derive(Default)]
struct Layout {
    regions: Vec<Region>,
}

impl Layout {
    fn size(&self) -> u64 {
        self.regions.last().map_or(0, Region::end)
    }
    fn pad(&mut self, alignment: u64) {
        let start = self.size();
        if !start.is_multiple_of(alignment) {
            let len = start.next_multiple_of(alignment) - start;
            self.push(len, Content::Zero);
        }
    }
    fn push(&mut self, len: u64, content: Content) -> Region {
        let r = Region {
            start: self.size(),
            len,
            content,
        };
        self.regions.push(r);
        r
    }
}

/// An MBR partition entry for `start..start+len` (nbdkit's CHS "too
/// large" and LBA fields).
fn mbr_entry(out: &mut [u8], start: u64, len: u64, bootable: bool, id: u8) {
    let chs = [254u8, 0xff, 0xff];
    out[0] = if bootable { 0x80 } else { 0 };
    out[1..4].copy_from_slice(&chs);
    out[4] = id;
    out[5..8].copy_from_slice(&chs);
    out[8..12].copy_from_slice(&((start / SECTOR) as u32).to_le_bytes());
    out[12..16].copy_from_slice(&(len.div_ceil(SECTOR) as u32).to_le_bytes());
}

fn boot_signature(sector: &mut [u8]) {
    sector[0x1fe] = 0x55;
    sector[0x1ff] = 0xaa;
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(bytes);
    c.sum()
}

impl PartitioningDevice {
    /// The disk holding `partitions` under a table of `table` (by
    /// default GPT when MBR cannot hold them: more than 4, or more than
    /// [`MAX_MBR_DISK_SIZE`] bytes); `writable` when the files were
    /// opened for writing.
    pub fn new(
        partitions: Vec<Partition>,
        table: Option<TableType>,
        writable: bool,
    ) -> Result<PartitioningDevice> {
        if partitions.is_empty() {
            return Err(Error::invalid(
                "at least one file= parameter must be supplied",
            ));
        }
        let total: u64 = partitions.iter().map(|p| p.device.size()).sum();
        let needs_gpt = total > MAX_MBR_DISK_SIZE;
        let table = match table {
            Some(TableType::Mbr) if needs_gpt => {
                return Err(Error::invalid(format!(
                    "MBR partition table type supports a maximum virtual disk size of about 2 TB, \
                     but you requested {} partition(s) and a total size of {total} bytes \
                     (> {MAX_MBR_DISK_SIZE}).  Try using: partition-type=gpt",
                    partitions.len()
                )));
            }
            Some(t) => t,
            None if needs_gpt || partitions.len() > 4 => TableType::Gpt,
            None => TableType::Mbr,
        };
        let n = partitions.len() as u64;
        let pta_lbas = n.next_multiple_of(GPT_MIN_PARTITIONS) * GPT_ENTRY_SIZE / SECTOR;
        let mut layout = Layout::default();
        let mut tables = Vec::new();
        // The primary table, then the partitions (logical ones each after
        // its EBR), then GPT's backup.
        let primary_len = match table {
            TableType::Mbr => SECTOR,
            TableType::Gpt => (2 + pta_lbas) * SECTOR,
        };
        tables.push(vec![0u8; primary_len as usize]);
        layout.push(primary_len, Content::Table(0));
        let mut ebrs = Vec::new();
        let mut files = Vec::new();
        for (i, p) in partitions.iter().enumerate() {
            if table == TableType::Mbr && partitions.len() > 4 && i >= 3 {
                tables.push(vec![0u8; SECTOR as usize]);
                ebrs.push(layout.push(SECTOR, Content::Table(tables.len() - 1)));
            }
            layout.pad(p.alignment);
            files.push(layout.push(p.device.size(), Content::File(i)));
            layout.pad(SECTOR);
        }
        if table == TableType::Gpt {
            tables.push(vec![0u8; ((pta_lbas + 1) * SECTOR) as usize]);
            layout.push((pta_lbas + 1) * SECTOR, Content::Table(tables.len() - 1));
        }
        let size = layout.size();
        match table {
            TableType::Mbr => mbr_tables(&mut tables, &partitions, &files, &ebrs, size),
            TableType::Gpt => gpt_tables(&mut tables, &partitions, &files, size, pta_lbas),
        }
        Ok(PartitioningDevice {
            partitions,
            regions: layout.regions,
            tables,
            size,
            writable,
        })
    }

    /// Calls `f(region, offset in it, offset in the request, length)` for
    /// the pieces of a request.
    fn pieces(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Region, u64, usize, usize) -> Result<()>,
    ) -> Result<()> {
        check_range(self.size, offset, len)?;
        let mut done = 0u64;
        let mut i = self.regions.partition_point(|r| r.end() <= offset);
        while done < len {
            let r = &self.regions[i];
            let pos = offset + done;
            let n = (r.end() - pos).min(len - done);
            f(r, pos - r.start, done as usize, n as usize)?;
            done += n;
            i += 1;
        }
        Ok(())
    }
}

/// The MBR (and the EBRs of logical partitions past the third when there
/// are more than four).
fn mbr_tables(
    tables: &mut [Vec<u8>],
    parts: &[Partition],
    files: &[Region],
    ebrs: &[Region],
    size: u64,
) {
    boot_signature(&mut tables[0]);
    // Four primary partitions, or three and the extended one.
    let primaries = if parts.len() <= 4 { parts.len() } else { 3 };
    for (i, f) in files.iter().take(primaries).enumerate() {
        let at = 0x1be + 16 * i;
        mbr_entry(
            &mut tables[0][at..at + 16],
            f.start,
            f.len,
            i == 0,
            parts[i].mbr_id,
        );
    }
    if parts.len() <= 4 {
        return;
    }
    // The extended partition: from the first EBR to the end of the disk.
    let first = ebrs[0];
    mbr_entry(
        &mut tables[0][0x1ee..0x1fe],
        first.start,
        size - first.start,
        false,
        0xf,
    );
    for i in 3..parts.len() {
        let (ebr, file) = (ebrs[i - 3], files[i]);
        let Content::Table(t) = ebr.content else {
            unreachable!("EBRs are tables")
        };
        let sector = &mut tables[t];
        boot_signature(sector);
        mbr_entry(
            &mut sector[0x1be..0x1ce],
            file.start - ebr.start,
            file.len,
            false,
            parts[i].mbr_id,
        );
        if i + 1 < parts.len() {
            let (next_ebr, next_file) = (ebrs[i - 2], files[i + 1]);
            mbr_entry(
                &mut sector[0x1ce..0x1de],
                next_ebr.start - first.start,
                next_file.end() - next_ebr.start,
                false,
                0xf,
            );
        }
    }
}

/// GPT's protective MBR, headers and entries, primary and backup.
fn gpt_tables(
    tables: &mut [Vec<u8>],
    parts: &[Partition],
    files: &[Region],
    size: u64,
    pta_lbas: u64,
) {
    let backup = tables.len() - 1;
    // Protective MBR: as much of the disk as it can describe.
    let end = (size - 1).min(u32::MAX as u64 * SECTOR);
    mbr_entry(
        &mut tables[0][0x1be..0x1ce],
        SECTOR,
        end - SECTOR + 1,
        false,
        0xee,
    );
    boot_signature(&mut tables[0]);
    // The entries, in the order of the partitions on the disk.
    let mut rng = Xoshiro256::seeded(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    );
    let guids: Vec<[u8; 16]> = parts
        .iter()
        .map(|_| std::array::from_fn(|_| rng.next_u64() as u8))
        .collect();
    let mut entries = vec![0u8; (pta_lbas * SECTOR) as usize];
    for (i, f) in files.iter().enumerate() {
        let e = &mut entries[i * GPT_ENTRY_SIZE as usize..(i + 1) * GPT_ENTRY_SIZE as usize];
        e[0..16].copy_from_slice(&parts[i].type_guid);
        e[16..32].copy_from_slice(&guids[i]);
        e[32..40].copy_from_slice(&(f.start / SECTOR).to_le_bytes());
        e[40..48].copy_from_slice(&((f.end() - 1) / SECTOR).to_le_bytes());
        e[48..56].copy_from_slice(&(if i == 0 { 4u64 } else { 0 }).to_le_bytes());
        let name = parts[i].name.as_bytes();
        if name.len() < 36 && name.is_ascii() {
            for (j, &c) in name.iter().enumerate() {
                e[56 + 2 * j] = c;
            }
        }
    }
    let entries_crc = crc32(&entries);
    let lbas = size / SECTOR;
    let header = |primary: bool| -> Vec<u8> {
        let mut h = vec![0u8; GPT_HEADER_SIZE];
        h[0..8].copy_from_slice(b"EFI PART");
        h[8..12].copy_from_slice(&[0, 0, 1, 0]);
        h[12..16].copy_from_slice(&(GPT_HEADER_SIZE as u32).to_le_bytes());
        let (current, other) = if primary {
            (1, lbas - 1)
        } else {
            (lbas - 1, 1)
        };
        h[24..32].copy_from_slice(&current.to_le_bytes());
        h[32..40].copy_from_slice(&other.to_le_bytes());
        h[40..48].copy_from_slice(&(2 + pta_lbas).to_le_bytes());
        h[48..56].copy_from_slice(&(lbas - pta_lbas - 2).to_le_bytes());
        let entries_lba = if primary { 2 } else { lbas - pta_lbas - 1 };
        h[72..80].copy_from_slice(&entries_lba.to_le_bytes());
        let count = (parts.len() as u64).next_multiple_of(GPT_MIN_PARTITIONS) as u32;
        h[80..84].copy_from_slice(&count.to_le_bytes());
        h[84..88].copy_from_slice(&(GPT_ENTRY_SIZE as u32).to_le_bytes());
        h[88..92].copy_from_slice(&entries_crc.to_le_bytes());
        let crc = crc32(&h);
        h[16..20].copy_from_slice(&crc.to_le_bytes());
        h
    };
    let s = SECTOR as usize;
    tables[0][s..s + GPT_HEADER_SIZE].copy_from_slice(&header(true));
    tables[0][2 * s..].copy_from_slice(&entries);
    let at = (pta_lbas * SECTOR) as usize;
    tables[backup][..at].copy_from_slice(&entries);
    tables[backup][at..at + GPT_HEADER_SIZE].copy_from_slice(&header(false));
}

impl BlockDevice for PartitioningDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        // As nbdkit offers it: flush (the files), FUA by flushing, no
        // trim, write-zeroes by writing zeros, everything data.
        let w = self.writable;
        Capabilities {
            can_flush: w,
            can_fua: w,
            can_multi_conn: true,
            can_cache: true,
            ..crate::zeroes_by_writing(w)
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.pieces(offset, buf.len() as u64, |r, at, from, n| {
            let out = &mut buf[from..from + n];
            match r.content {
                Content::Table(t) => {
                    out.copy_from_slice(&self.tables[t][at as usize..at as usize + n])
                }
                Content::File(i) => self.partitions[i].device.read_at(out, at)?,
                Content::Zero => out.fill(0),
            }
            Ok(())
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.pieces(offset, buf.len() as u64, |r, at, from, n| {
            let data = &buf[from..from + n];
            match r.content {
                Content::Table(t) if data != &self.tables[t][at as usize..at as usize + n] => Err(
                    Error::io("attempt to change partition table of virtual disk"),
                ),
                Content::Zero if !diskit_core::zero::is_zero(data) => {
                    Err(Error::io("write non-zeroes to padding region"))
                }
                Content::File(i) => self.partitions[i].device.write_at(data, at, flags),
                _ => Ok(()),
            }
        })
    }
    fn flush(&self) -> Result<()> {
        for p in &self.partitions {
            p.device.flush()?;
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("partitioning({} partitions)", self.partitions.len())
    }
    fn close(&self) -> Result<()> {
        let mut first = Ok(());
        for p in &self.partitions {
            let r = p.device.close();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryDevice;
    use std::sync::Arc;

    fn part(size: u64, name: &str) -> Partition {
        Partition {
            name: name.into(),
            device: Arc::new(MemoryDevice::new(size)),
            alignment: MAX_ALIGNMENT,
            mbr_id: DEFAULT_MBR_ID,
            type_guid: parse_guid(DEFAULT_TYPE_GUID).unwrap(),
        }
    }

    #[test]
    fn guids_are_stored_mixed_endian() {
        let g = parse_guid("{0FC63DAF-8483-4772-8E79-3D69D8477DE4}").unwrap();
        assert_eq!(&g[..4], &[0xaf, 0x3d, 0xc6, 0x0f]);
        assert_eq!(&g[8..10], &[0x8e, 0x79]);
        assert!(parse_guid("0FC63DAF-8483-4772-8E79-3D69D8477DEX").is_none());
    }

    #[test]
    fn mbr_layout_aligns_and_pads() {
        let d = PartitioningDevice::new(vec![part(1000, "a"), part(3, "b")], None, true).unwrap();
        let mut mbr = [0u8; 512];
        d.read_at(&mut mbr, 0).unwrap();
        assert_eq!(&mbr[0x1fe..], &[0x55, 0xaa]);
        assert_eq!(mbr[0x1be], 0x80);
        assert_eq!(
            u32::from_le_bytes(mbr[0x1c6..0x1ca].try_into().unwrap()),
            2048
        );
        assert_eq!(u32::from_le_bytes(mbr[0x1ca..0x1ce].try_into().unwrap()), 2);
        assert_eq!(
            u32::from_le_bytes(mbr[0x1d6..0x1da].try_into().unwrap()),
            4096
        );
        assert_eq!(d.size(), (4096 + 1) * 512);
        assert!(d.write_at(&[1], 0, WriteFlags::NONE).is_err());
        assert!(d.write_at(&[1], 1500, WriteFlags::NONE).is_err(), "padding");
        d.write_at(&[7], 1 << 20, WriteFlags::NONE).unwrap();
    }

    #[test]
    fn gpt_headers_check_out() {
        let parts = (0..5).map(|i| part(4096, &format!("p{i}"))).collect();
        let d = PartitioningDevice::new(parts, None, false).unwrap();
        let mut lba = vec![0u8; 512 * 34];
        d.read_at(&mut lba, 0).unwrap();
        let h = &lba[512..512 + GPT_HEADER_SIZE];
        assert_eq!(&h[..8], b"EFI PART");
        let mut copy = h.to_vec();
        copy[16..20].fill(0);
        assert_eq!(crc32(&copy).to_le_bytes(), h[16..20]);
        assert_eq!(crc32(&lba[1024..]).to_le_bytes(), h[88..92]);
    }
}
