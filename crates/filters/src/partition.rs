//! The partition filter (nbdkit-partition-filter): serves one partition of
//! a partitioned disk.
//!
//! - `partition=N` (required): the partition's number, from 1. On an MBR
//!   disk, 1–4 are the primary entries and 5 on the logical partitions of
//!   the extended partition, in the order of its chain; on a GPT disk, the
//!   entries of the partition array.
//!
//! The table is read from the device below when the filter is stacked, with
//! 512-byte sectors, as nbdkit reads it. A GPT disk is one whose MBR has a
//! protective entry (type 0xEE). Every field is checked before use: a
//! partition that runs past the end of the disk, an empty or extended
//! entry, a GPT header or array that makes no sense, or an extended chain
//! that loops or leaves its partition is an error that says which. The
//! partition is then served as the offset filter serves a window.

use diskit_core::{BlockDevice, Error, Result};

use crate::offset::{Offset, OffsetConfig};
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["partition"];

/// Bytes per sector of the tables.
const SECTOR: u64 = 512;
/// MBR partition types of extended partitions.
const EXTENDED: [u8; 3] = [0x05, 0x0f, 0x85];
/// The MBR type of a GPT disk's protective entry.
const GPT_PROTECTIVE: u8 = 0xee;
/// Logical partitions followed at most (a longer chain is refused).
const MAX_LOGICAL: u32 = 1024;

/// The parameters, as given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartitionConfig {
    /// The partition number (1-based); 0 until given.
    pub partition: u32,
}

impl Configure for PartitionConfig {
    /// Takes `partition=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "partition" => {
                self.partition = value
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "partition: partition: invalid partition number '{value}'"
                        ))
                    })?
            }
            _ => return Err(unknown("partition", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(window(&*next, self)?, next))
    }
}

impl PartitionConfig {
    /// Checks that the parameters are complete.
    pub fn check(&self) -> Result<()> {
        if self.partition == 0 {
            return Err(Error::invalid(
                "partition: you must supply the partition parameter on the command line",
            ));
        }
        Ok(())
    }
}

/// Where partition `n` is on a disk of `size` bytes whose sectors `read`
/// gives: (offset, length) in bytes.
pub fn locate(
    read: &dyn Fn(u64, &mut [u8]) -> Result<()>,
    size: u64,
    n: u32,
) -> Result<(u64, u64)> {
    let bad = |why: String| Error::invalid(format!("partition: {why}"));
    if size < 2 * SECTOR {
        return Err(bad(format!(
            "the disk is too small to hold a partition table ({size} bytes)"
        )));
    }
    let mut mbr = [0u8; SECTOR as usize];
    read(0, &mut mbr)?;
    if mbr[510..512] != [0x55, 0xaa] {
        return Err(bad(
            "the disk has no MBR or GPT partition table (no 0x55AA signature)".into(),
        ));
    }
    let entries: Vec<MbrEntry> = (0..4)
        .map(|i| MbrEntry::parse(&mbr[446 + 16 * i..]))
        .collect();
    let (start, len) = if entries.iter().any(|e| e.kind == GPT_PROTECTIVE) {
        gpt(read, size, n)?
    } else if n <= 4 {
        let e = &entries[n as usize - 1];
        if e.kind == 0 || e.sectors == 0 {
            return Err(bad(format!("MBR partition {n} is not in use")));
        }
        if EXTENDED.contains(&e.kind) {
            return Err(bad(format!(
                "MBR partition {n} is an extended partition: choose one of its logical partitions (5 and up)"
            )));
        }
        (u64::from(e.start) * SECTOR, u64::from(e.sectors) * SECTOR)
    } else {
        logical(read, &entries, n)?
    };
    match start.checked_add(len) {
        Some(end) if end <= size && start >= SECTOR => Ok((start, len)),
        _ => Err(bad(format!(
            "partition {n} (bytes {start} to {}) lies outside the disk ({size} bytes)",
            start.saturating_add(len)
        ))),
    }
}

/// One 16-byte MBR or EBR entry.
#[derive(Debug, Clone, Copy)]
struct MbrEntry {
    kind: u8,
    start: u32,
    sectors: u32,
}

impl MbrEntry {
    fn parse(b: &[u8]) -> MbrEntry {
        let u32le = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        MbrEntry {
            kind: b[4],
            start: u32le(8),
            sectors: u32le(12),
        }
    }
}

/// Logical partition `n` (5 and up) of the MBR's extended partition.
fn logical(
    read: &dyn Fn(u64, &mut [u8]) -> Result<()>,
    primary: &[MbrEntry],
    n: u32,
) -> Result<(u64, u64)> {
    let bad = |why: String| Error::invalid(format!("partition: {why}"));
    let ext = primary
        .iter()
        .find(|e| EXTENDED.contains(&e.kind) && e.sectors > 0)
        .ok_or_else(|| {
            bad(format!(
                "partition {n} not found: the MBR has no extended partition"
            ))
        })?;
    let ext_start = u64::from(ext.start);
    let ext_end = ext_start + u64::from(ext.sectors);
    let mut ebr_at = ext_start;
    let mut seen = std::collections::HashSet::new();
    let mut number = 5u32;
    loop {
        if !(ext_start..ext_end).contains(&ebr_at) {
            return Err(bad(format!(
                "the extended partition's chain leaves it (sector {ebr_at}, partition {number})"
            )));
        }
        if !seen.insert(ebr_at) || number - 5 >= MAX_LOGICAL {
            return Err(bad("the extended partition's chain loops".into()));
        }
        let mut ebr = [0u8; SECTOR as usize];
        read(ebr_at * SECTOR, &mut ebr)?;
        if ebr[510..512] != [0x55, 0xaa] {
            return Err(bad(format!("no EBR signature at sector {ebr_at}")));
        }
        let this = MbrEntry::parse(&ebr[446..]);
        let next = MbrEntry::parse(&ebr[462..]);
        if number == n {
            if this.kind == 0 || this.sectors == 0 {
                return Err(bad(format!("logical partition {n} is not in use")));
            }
            let start = ebr_at + u64::from(this.start);
            let end = start + u64::from(this.sectors);
            if end > ext_end {
                return Err(bad(format!(
                    "logical partition {n} runs past the extended partition"
                )));
            }
            return Ok((start * SECTOR, u64::from(this.sectors) * SECTOR));
        }
        if next.kind == 0 || next.sectors == 0 {
            return Err(bad(format!(
                "partition {n} not found: the extended partition holds {} logical partitions",
                number - 4
            )));
        }
        ebr_at = ext_start + u64::from(next.start);
        number += 1;
    }
}

/// Partition `n` of a GPT disk.
fn gpt(read: &dyn Fn(u64, &mut [u8]) -> Result<()>, size: u64, n: u32) -> Result<(u64, u64)> {
    let bad = |why: String| Error::invalid(format!("partition: GPT: {why}"));
    let mut h = [0u8; SECTOR as usize];
    read(SECTOR, &mut h)?;
    if &h[0..8] != b"EFI PART" {
        return Err(bad(
            "no GPT header at sector 1 (the MBR says there is one)".into()
        ));
    }
    let u32le = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
    let u64le = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    let header_size = u32le(12);
    if !(92..=SECTOR as u32).contains(&header_size) {
        return Err(bad(format!("header size {header_size} is out of range")));
    }
    let array_lba = u64le(72);
    let count = u32le(80);
    let entry_size = u32le(84);
    if entry_size < 128 || entry_size % 8 != 0 || entry_size > 4096 {
        return Err(bad(format!("partition entry size {entry_size} is invalid")));
    }
    if n > count {
        return Err(bad(format!(
            "partition {n} not found: the table has {count} entries"
        )));
    }
    let at = array_lba
        .checked_mul(SECTOR)
        .and_then(|a| a.checked_add(u64::from(n - 1) * u64::from(entry_size)))
        .filter(|a| a.checked_add(128).is_some_and(|end| end <= size))
        .ok_or_else(|| {
            bad(format!(
                "the partition array (sector {array_lba}) lies outside the disk"
            ))
        })?;
    let mut e = [0u8; 128];
    read(at, &mut e)?;
    let field = |o: usize| u64::from_le_bytes(e[o..o + 8].try_into().expect("8 bytes"));
    if e[0..16].iter().all(|&b| b == 0) {
        return Err(bad(format!("partition {n} is not in use")));
    }
    let (first, last) = (field(32), field(40));
    if last < first {
        return Err(bad(format!(
            "partition {n} ends (sector {last}) before it starts ({first})"
        )));
    }
    let start = first
        .checked_mul(SECTOR)
        .ok_or_else(|| bad(format!("partition {n} starts past any disk")))?;
    let len = (last - first + 1)
        .checked_mul(SECTOR)
        .ok_or_else(|| bad(format!("partition {n} is larger than any disk")))?;
    Ok((start, len))
}

/// The filter: partition `config.partition` of `next`, found in its table,
/// served as the offset filter serves a window.
pub fn window(next: &dyn BlockDevice, config: &PartitionConfig) -> Result<Offset> {
    config.check()?;
    let read = |offset: u64, buf: &mut [u8]| next.read_at(buf, offset);
    let (offset, range) = locate(&read, next.size(), config.partition)?;
    Ok(Offset::new(
        next,
        &OffsetConfig {
            offset,
            range: Some(range),
        },
    )?
    .named("partition"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A disk in memory with `sectors` sectors.
    struct Disk(Vec<u8>);

    impl Disk {
        fn new(sectors: usize) -> Disk {
            Disk(vec![0; sectors * 512])
        }
        fn mbr_entry(&mut self, sector: usize, slot: usize, kind: u8, start: u32, len: u32) {
            let o = sector * 512 + 446 + 16 * slot;
            self.0[o + 4] = kind;
            self.0[o + 8..o + 12].copy_from_slice(&start.to_le_bytes());
            self.0[o + 12..o + 16].copy_from_slice(&len.to_le_bytes());
            self.0[sector * 512 + 510] = 0x55;
            self.0[sector * 512 + 511] = 0xaa;
        }
        fn locate(&self, n: u32) -> Result<(u64, u64)> {
            let read = |off: u64, buf: &mut [u8]| {
                let o = off as usize;
                buf.copy_from_slice(
                    self.0
                        .get(o..o + buf.len())
                        .ok_or_else(|| Error::invalid("read past the end"))?,
                );
                Ok(())
            };
            locate(&read, self.0.len() as u64, n)
        }
    }

    #[test]
    fn mbr_primary_and_logical_partitions() {
        let mut d = Disk::new(4096);
        d.mbr_entry(0, 0, 0x83, 2048, 100);
        d.mbr_entry(0, 1, 0x05, 3000, 1000);
        // Logical 5 at 3000+10, next EBR at 3000+200; logical 6 at 3200+5.
        d.mbr_entry(3000, 0, 0x83, 10, 50);
        d.mbr_entry(3000, 1, 0x05, 200, 100);
        d.mbr_entry(3200, 0, 0x07, 5, 60);
        assert_eq!(d.locate(1).unwrap(), (2048 * 512, 100 * 512));
        assert_eq!(d.locate(5).unwrap(), (3010 * 512, 50 * 512));
        assert_eq!(d.locate(6).unwrap(), (3205 * 512, 60 * 512));
        for (n, want) in [
            (2, "extended partition"),
            (3, "not in use"),
            (7, "holds 2 logical partitions"),
        ] {
            let e = d.locate(n).unwrap_err().to_string();
            assert!(e.contains(want), "{n}: {e}");
        }
    }

    #[test]
    fn hostile_tables_are_refused_by_name() {
        let mut d = Disk::new(64);
        assert!(
            d.locate(1)
                .unwrap_err()
                .to_string()
                .contains("no MBR or GPT")
        );
        // Past the end of the disk, and overflowing.
        d.mbr_entry(0, 0, 0x83, 60, 10);
        d.mbr_entry(0, 1, 0x83, u32::MAX, u32::MAX);
        assert!(
            d.locate(1)
                .unwrap_err()
                .to_string()
                .contains("outside the disk")
        );
        assert!(
            d.locate(2)
                .unwrap_err()
                .to_string()
                .contains("outside the disk")
        );
        // An extended chain that loops, and one that leaves its partition.
        let mut d = Disk::new(64);
        d.mbr_entry(0, 0, 0x0f, 10, 20);
        d.mbr_entry(10, 0, 0x83, 1, 1);
        d.mbr_entry(10, 1, 0x05, 0, 5);
        assert!(d.locate(9).unwrap_err().to_string().contains("loops"));
        d.mbr_entry(10, 1, 0x05, 40, 5);
        assert!(d.locate(6).unwrap_err().to_string().contains("leaves it"));
        // GPT with a broken header, a huge array, an inverted entry.
        let mut d = Disk::new(64);
        d.mbr_entry(0, 0, 0xee, 1, 63);
        assert!(
            d.locate(1)
                .unwrap_err()
                .to_string()
                .contains("no GPT header")
        );
        let h = 512;
        d.0[h..h + 8].copy_from_slice(b"EFI PART");
        d.0[h + 12..h + 16].copy_from_slice(&92u32.to_le_bytes());
        d.0[h + 72..h + 80].copy_from_slice(&2u64.to_le_bytes());
        d.0[h + 80..h + 84].copy_from_slice(&u32::MAX.to_le_bytes());
        d.0[h + 84..h + 88].copy_from_slice(&128u32.to_le_bytes());
        let e = d.locate(1_000_000).unwrap_err().to_string();
        assert!(e.contains("outside the disk"), "{e}");
        let entry = 2 * 512;
        d.0[entry] = 1; // a type GUID
        d.0[entry + 32..entry + 40].copy_from_slice(&40u64.to_le_bytes());
        d.0[entry + 40..entry + 48].copy_from_slice(&30u64.to_le_bytes());
        assert!(
            d.locate(1)
                .unwrap_err()
                .to_string()
                .contains("before it starts")
        );
        d.0[entry + 40..entry + 48].copy_from_slice(&49u64.to_le_bytes());
        assert_eq!(d.locate(1).unwrap(), (40 * 512, 10 * 512));
        assert!(d.locate(2).unwrap_err().to_string().contains("not in use"));
        d.0[h + 84..h + 88].copy_from_slice(&100u32.to_le_bytes());
        assert!(d.locate(1).unwrap_err().to_string().contains("entry size"));
    }

    #[test]
    fn the_number_is_required_and_positive() {
        assert!(PartitionConfig::default().check().is_err());
        for v in ["0", "-1", "one", ""] {
            let e = PartitionConfig::from_params(&[("partition".into(), v.into())]).unwrap_err();
            assert!(e.to_string().contains("invalid partition number"), "{e}");
        }
    }
}
