//! The internal snapshot table: parsed and validated in one place, and
//! written back byte for byte.
//!
//! The table sits at `snapshots_offset` and holds `nb_snapshots` entries,
//! each padded to 8 bytes: a 40-byte fixed part (L1 table offset and size,
//! id and name lengths, date, VM clock, legacy 32-bit VM state size, extra
//! data size), the extra data (64-bit VM state size, disk size and icount
//! when long enough; anything past that is kept verbatim), the id and the
//! name. Every length is checked against QEMU's limits and against the
//! file before it is used, so hostile tables give errors, never panics or
//! unbounded allocations.

use diskit_core::Storage;
use diskit_core::{Error, Result};

use super::header::Header;
use super::table::{be16, be32, be64};

/// At most this many snapshots (QEMU's QCOW_MAX_SNAPSHOTS).
pub const MAX_SNAPSHOTS: u32 = 65536;

/// At most this much extra data per entry (QCOW_MAX_SNAPSHOT_EXTRA_DATA).
pub const MAX_EXTRA_DATA: u32 = 1024;

/// At most this many bytes of entries, padding not counted
/// (QCOW_MAX_SNAPSHOTS_SIZE).
pub const MAX_TABLE_BYTES: u64 = 64 << 20;

/// A snapshot's L1 table is at most this large (QCOW_MAX_L1_SIZE).
pub const MAX_L1_BYTES: u64 = 32 << 20;

/// Bytes of the fixed part of an entry.
pub const ENTRY_HEADER_BYTES: usize = 40;

/// Bytes of the extra data QEMU knows (and writes): 64-bit VM state size,
/// disk size, icount.
pub const KNOWN_EXTRA_BYTES: usize = 24;

/// One internal snapshot, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Offset of the snapshot's L1 table.
    pub l1_table_offset: u64,
    /// Entries of the snapshot's L1 table.
    pub l1_size: u32,
    /// The unique id ("1", "2", ...), as stored.
    pub id: Vec<u8>,
    /// The user's name for the snapshot, as stored.
    pub name: Vec<u8>,
    /// Creation time, seconds since the epoch (UTC).
    pub date_sec: u32,
    /// Nanoseconds of the creation time.
    pub date_nsec: u32,
    /// Guest clock at the snapshot, in nanoseconds since boot.
    pub vm_clock_nsec: u64,
    /// The legacy 32-bit VM state size field (superseded by the extra data).
    pub vm_state_size_32: u32,
    /// The extra data, verbatim (see [`Snapshot::vm_state_size`] and friends).
    pub extra: Vec<u8>,
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::io(msg)
}

/// The extra data QEMU writes for a new snapshot.
pub fn known_extra(vm_state_size: u64, disk_size: u64, icount: Option<u64>) -> Vec<u8> {
    let mut e = Vec::with_capacity(KNOWN_EXTRA_BYTES);
    e.extend_from_slice(&vm_state_size.to_be_bytes());
    e.extend_from_slice(&disk_size.to_be_bytes());
    e.extend_from_slice(&icount.unwrap_or(u64::MAX).to_be_bytes());
    e
}

impl Snapshot {
    /// The entry as QEMU writes every entry of a table it writes: the
    /// extra data QEMU knows in full (the 64-bit VM state size, the disk
    /// size, `disk_size` where the entry has none, and the icount, -1
    /// where it has none), then whatever extra data follows it.
    pub fn completed(&self, disk_size: u64) -> Snapshot {
        if self.extra.len() >= KNOWN_EXTRA_BYTES {
            return self.clone();
        }
        let mut extra = known_extra(
            self.vm_state_size(),
            self.disk_size().unwrap_or(disk_size),
            self.extra_u64(16),
        );
        // An icount field that is present stays as it is (-1 included).
        if let Some(raw) = self.extra_u64(16) {
            extra[16..24].copy_from_slice(&raw.to_be_bytes());
        }
        Snapshot {
            extra,
            ..self.clone()
        }
    }

    fn extra_u64(&self, at: usize) -> Option<u64> {
        self.extra.get(at..at + 8).map(|b| be64(b, 0))
    }

    /// Bytes of saved VM state (the 64-bit field when the extra data has
    /// it, the legacy 32-bit one otherwise).
    pub fn vm_state_size(&self) -> u64 {
        self.extra_u64(0).unwrap_or(self.vm_state_size_32 as u64)
    }

    /// The virtual disk size when the snapshot was taken, if recorded
    /// (QEMU assumes the current size otherwise).
    pub fn disk_size(&self) -> Option<u64> {
        self.extra_u64(8)
    }

    /// The record/replay instruction count, if recorded and enabled.
    pub fn icount(&self) -> Option<u64> {
        self.extra_u64(16).filter(|&n| n != u64::MAX)
    }

    /// A string field as QEMU shows it: a C string (cut at the first NUL)
    /// of at most `max - 1` bytes (the size of QEMUSnapshotInfo's buffers).
    fn c_string(bytes: &[u8], max: usize) -> String {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end.min(max - 1)]).into_owned()
    }

    /// The id as QEMU reports it (`id_str[128]`).
    pub fn display_id(&self) -> String {
        Self::c_string(&self.id, 128)
    }

    /// The name as QEMU reports it (`name[256]`).
    pub fn display_name(&self) -> String {
        Self::c_string(&self.name, 256)
    }

    /// Whether a v3 image's entry lacks the extra data v3 requires (the
    /// 64-bit VM state size and the disk size): QEMU opens such images but
    /// `qemu-img check` reports the entry as incomplete.
    pub fn incomplete(&self, version: u32) -> bool {
        version >= 3 && self.extra.len() < 16
    }

    /// Bytes of this entry in the table, padding not counted.
    pub fn entry_bytes(&self) -> usize {
        ENTRY_HEADER_BYTES + self.extra.len() + self.id.len() + self.name.len()
    }
}

/// What a table is checked against besides its own bytes.
#[derive(Debug, Clone, Copy)]
pub struct TableContext {
    /// The image's cluster size.
    pub cluster_size: u64,
    /// The length of the image file: L1 tables must lie inside it.
    pub file_len: u64,
}

/// The outcome of scanning a buffer that may hold only part of the table.
enum Scan {
    /// The whole table.
    Done(Vec<Snapshot>),
    /// The buffer ends inside entry `entry`, which needs `need` bytes of
    /// table in all.
    Short { entry: u32, need: usize },
}

/// Scans `count` entries from the start of `bytes`.
fn scan(bytes: &[u8], count: u32, _cx: &TableContext) -> Result<Scan> {
    if count > MAX_SNAPSHOTS {
        return Err(corrupt(format!(
            "Too many snapshots ({count}, at most {MAX_SNAPSHOTS})"
        )));
    }
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut table_bytes = 0u64;
    for i in 0..count {
        at = at.next_multiple_of(8);
        let Some(h) = bytes.get(at..at + ENTRY_HEADER_BYTES) else {
            return Ok(Scan::Short {
                entry: i,
                need: at + ENTRY_HEADER_BYTES,
            });
        };
        let l1_table_offset = be64(h, 0);
        let l1_size = be32(h, 8);
        let id_len = be16(h, 12) as usize;
        let name_len = be16(h, 14) as usize;
        let extra_len = be32(h, 36);
        if extra_len > MAX_EXTRA_DATA {
            return Err(corrupt(format!(
                "Too much extra metadata in snapshot table entry {i} \
                 ({extra_len} bytes, at most {MAX_EXTRA_DATA})"
            )));
        }
        let entry = ENTRY_HEADER_BYTES + extra_len as usize + id_len + name_len;
        table_bytes += entry as u64;
        if table_bytes > MAX_TABLE_BYTES {
            return Err(corrupt(format!(
                "Snapshot table is too big (more than {MAX_TABLE_BYTES} bytes)"
            )));
        }
        let Some(body) = bytes.get(at + ENTRY_HEADER_BYTES..at + entry) else {
            return Ok(Scan::Short {
                entry: i,
                need: at + entry,
            });
        };
        let (extra, rest) = body.split_at(extra_len as usize);
        let (id, name) = rest.split_at(id_len);
        let sn = Snapshot {
            l1_table_offset,
            l1_size,
            id: id.to_vec(),
            name: name.to_vec(),
            date_sec: be32(h, 16),
            date_nsec: be32(h, 20),
            vm_clock_nsec: be64(h, 24),
            vm_state_size_32: be32(h, 32),
            extra: extra.to_vec(),
        };
        check_l1_size(&sn, i)?;
        out.push(sn);
        at += entry;
    }
    Ok(Scan::Done(out))
}

/// How a snapshot table entry is named in messages.
fn entry_name(sn: &Snapshot, i: u32) -> String {
    format!(
        "Snapshot table entry {i} (id '{}', name '{}')",
        sn.display_id(),
        sn.display_name()
    )
}

/// What QEMU checks of a snapshot's L1 table when it reads the table:
/// its size. Where it lies is checked when it is used
/// ([`check_placement`]), so that `info` lists, and `check` reports, an
/// image whose snapshot tables are damaged, as qemu-img does.
fn check_l1_size(sn: &Snapshot, i: u32) -> Result<()> {
    if sn.l1_size as u64 * 8 > MAX_L1_BYTES {
        return Err(corrupt(format!(
            "{}: L1 table is too large ({} entries)",
            entry_name(sn, i),
            sn.l1_size
        )));
    }
    Ok(())
}

/// A snapshot's L1 table, before it is used: cluster aligned, of a size
/// QEMU accepts, inside the file and clear of the header. `i` is its
/// index in the table, for the message.
pub fn check_placement(sn: &Snapshot, i: u32, cx: &TableContext) -> Result<()> {
    let what = || entry_name(sn, i);
    let off = sn.l1_table_offset;
    let bytes = sn.l1_size as u64 * 8;
    if !off.is_multiple_of(cx.cluster_size) {
        return Err(corrupt(format!(
            "{}: L1 table offset {off:#x} is not cluster-aligned",
            what()
        )));
    }
    if bytes > MAX_L1_BYTES {
        return Err(corrupt(format!(
            "{}: L1 table is too large ({} entries)",
            what(),
            sn.l1_size
        )));
    }
    if bytes > 0 && off == 0 {
        return Err(corrupt(format!("{}: L1 table overlaps the header", what())));
    }
    if off.checked_add(bytes).is_none_or(|end| end > cx.file_len) && bytes > 0 {
        return Err(corrupt(format!(
            "{}: L1 table extends past the end of the file",
            what()
        )));
    }
    Ok(())
}

/// Parses and validates a table of `count` entries from `bytes`, which
/// must hold the whole table (from `snapshots_offset` on), the L1 tables
/// where they lie included.
pub fn parse(bytes: &[u8], count: u32, cx: &TableContext) -> Result<Vec<Snapshot>> {
    let list = match scan(bytes, count, cx)? {
        Scan::Done(v) => v,
        Scan::Short { entry, .. } => return Err(truncated(entry)),
    };
    for (i, sn) in list.iter().enumerate() {
        check_placement(sn, i as u32, cx)?;
    }
    Ok(list)
}

/// [`read`], with every snapshot's L1 table checked where it lies: for
/// what changes snapshots or reads all of them.
pub fn read_checked(file: &dyn Storage, header: &Header) -> Result<Vec<Snapshot>> {
    let list = read(file, header)?;
    let cx = TableContext {
        cluster_size: header.cluster_size(),
        file_len: file.file_len()?,
    };
    for (i, sn) in list.iter().enumerate() {
        check_placement(sn, i as u32, &cx)?;
    }
    Ok(list)
}

fn truncated(entry: u32) -> Error {
    corrupt(format!(
        "Snapshot table entry {entry} extends past the end of the file"
    ))
}

/// Reads and validates the snapshot table of an image (the L1 tables'
/// size, not where they lie: see [`read_checked`]). Reads only as much
/// of the file as the table needs (growing the read as entries demand),
/// never more than QEMU's limits allow.
pub fn read(file: &dyn Storage, header: &Header) -> Result<Vec<Snapshot>> {
    let count = header.nb_snapshots;
    if count == 0 {
        return Ok(Vec::new());
    }
    let cx = TableContext {
        cluster_size: header.cluster_size(),
        file_len: file.file_len()?,
    };
    let off = header.snapshots_offset;
    if count > MAX_SNAPSHOTS {
        return Err(corrupt(format!(
            "Too many snapshots ({count}, at most {MAX_SNAPSHOTS})"
        )));
    }
    if off == 0 || !off.is_multiple_of(cx.cluster_size) {
        return Err(corrupt(format!(
            "Snapshot table offset {off:#x} is invalid"
        )));
    }
    // Entries plus their padding: the most a valid table can take.
    let cap = MAX_TABLE_BYTES + 8 * count as u64;
    let avail = cx.file_len.saturating_sub(off).min(cap) as usize;
    let mut buf = Vec::new();
    let mut want = avail.min(64 << 10);
    loop {
        let have = buf.len();
        buf.resize(want, 0);
        file.read_padded(&mut buf[have..], off + have as u64)?;
        match scan(&buf, count, &cx)? {
            Scan::Done(v) => return Ok(v),
            Scan::Short { entry, need } => {
                if need > avail {
                    return Err(truncated(entry));
                }
                want = need.max(buf.len().saturating_mul(2)).min(avail);
            }
        }
    }
}

/// Writes `new` as the snapshot table in newly allocated clusters, each
/// entry [completed](Snapshot::completed) with `disk_size` as QEMU writes
/// it, points the header at it, then drops a reference from each cluster
/// of the table that was there (`old_offset`, `old_len` bytes). The table
/// and its refcounts are on disk before the header points at it.
pub fn place_table(
    file: &diskit_core::StorageRef,
    refs: &mut super::refcount::Refcounts,
    cluster_size: u64,
    (old_offset, old_len): (u64, u64),
    new: &[Snapshot],
    disk_size: u64,
) -> Result<()> {
    use super::layout::HostCluster;
    let new: Vec<Snapshot> = new.iter().map(|sn| sn.completed(disk_size)).collect();
    let bytes = serialize(&new)?;
    let offset = if new.is_empty() {
        0
    } else {
        let (c, _) = refs.alloc((bytes.len() as u64).div_ceil(cluster_size))?;
        let at = c.0 * cluster_size;
        file.write_extend(&bytes, at)?;
        at
    };
    refs.write_dirty()?;
    file.flush()?;
    let mut hdr = [0u8; 12];
    hdr[..4].copy_from_slice(&(new.len() as u32).to_be_bytes());
    hdr[4..].copy_from_slice(&offset.to_be_bytes());
    file.write_extend(&hdr, 60)?;
    file.flush()?;
    if old_len > 0 {
        let first = old_offset / cluster_size;
        for c in first..first + old_len.div_ceil(cluster_size) {
            refs.adjust(HostCluster(c), -1)?;
        }
    }
    Ok(())
}

/// The table's bytes for `snapshots`, as QEMU lays it out: each entry
/// starting on an 8-byte boundary, padding zero, no padding after the last.
/// Fails if a length does not fit its field or QEMU's limits.
pub fn serialize(snapshots: &[Snapshot]) -> Result<Vec<u8>> {
    check_writable(snapshots)?;
    let mut out = Vec::with_capacity(table_len(snapshots) as usize);
    for sn in snapshots {
        out.resize(out.len().next_multiple_of(8), 0);
        out.extend_from_slice(&sn.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&sn.l1_size.to_be_bytes());
        out.extend_from_slice(&(sn.id.len() as u16).to_be_bytes());
        out.extend_from_slice(&(sn.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&sn.date_sec.to_be_bytes());
        out.extend_from_slice(&sn.date_nsec.to_be_bytes());
        out.extend_from_slice(&sn.vm_clock_nsec.to_be_bytes());
        out.extend_from_slice(&sn.vm_state_size_32.to_be_bytes());
        out.extend_from_slice(&(sn.extra.len() as u32).to_be_bytes());
        out.extend_from_slice(&sn.extra);
        out.extend_from_slice(&sn.id);
        out.extend_from_slice(&sn.name);
    }
    Ok(out)
}

/// Bytes [`serialize`] produces for `snapshots`.
pub fn table_len(snapshots: &[Snapshot]) -> u64 {
    let mut len = 0u64;
    for sn in snapshots {
        len = len.next_multiple_of(8) + sn.entry_bytes() as u64;
    }
    len
}

/// Checks that `snapshots` can be written: every length fits its field and
/// QEMU's limits.
fn check_writable(snapshots: &[Snapshot]) -> Result<()> {
    if snapshots.len() > MAX_SNAPSHOTS as usize {
        return Err(Error::invalid("Too many snapshots"));
    }
    let mut total = 0u64;
    for sn in snapshots {
        if sn.id.len() > u16::MAX as usize || sn.name.len() > u16::MAX as usize {
            return Err(Error::invalid("Snapshot id or name is too long"));
        }
        if sn.extra.len() > MAX_EXTRA_DATA as usize {
            return Err(Error::invalid("Too much snapshot extra data"));
        }
        total += sn.entry_bytes() as u64;
    }
    if total > MAX_TABLE_BYTES {
        return Err(Error::invalid("Snapshot table is too big"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
