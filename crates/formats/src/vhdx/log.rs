//! The VHDX log: a circular journal of metadata updates. An entry is
//! descriptor sectors (a 64-byte header, then 32-byte descriptors) and
//! one data sector per data descriptor; it applies when its log GUID is
//! the current header's.
//!
//! Finding the entries to replay follows QEMU 10: scan the log 4 KiB at a
//! time; from each valid entry chain the ones that follow (the second
//! with any sequence number, later ones each the previous + 1); keep the
//! run whose first entry has the highest sequence number. A position
//! that fails is skipped a sector at a time, the failed position of a
//! run's end included.

use diskit_core::{Result, Storage, WriteFlags, ZeroFlags};

use super::header::{Guid, MIB, crc32c, guid_at, invalid, le32, le64};

/// The log's unit.
pub const SECTOR: u64 = 4096;

/// What a descriptor says to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write a 4 KiB sector: its first 8 bytes, bytes 8..4092 from the
    /// data sector, its last 4 bytes.
    Data {
        /// Bytes 0..8 of the sector.
        leading: u64,
        /// Bytes 4092..4096 of the sector.
        trailing: u32,
        /// Which data sector of the entry holds the rest.
        data_sector: usize,
    },
    /// Write `length` zero bytes.
    Zero {
        /// Bytes (whole sectors).
        length: u64,
    },
}

/// One descriptor of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// What to write.
    pub action: Action,
    /// Where in the file (4 KiB aligned).
    pub file_offset: u64,
}

/// A valid log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its sequence number.
    pub sequence: u64,
    /// Bytes it takes in the log.
    pub length: u64,
    /// The file must be at least this long for the entry to apply.
    pub flushed_file_offset: u64,
    /// The file is grown to this length (whole MiB) when replayed.
    pub last_file_offset: u64,
    /// Its descriptors.
    pub descriptors: Vec<Descriptor>,
    /// Its whole bytes (descriptor sectors, then data sectors).
    bytes: Vec<u8>,
}

/// The log, read whole.
pub struct Log<'a> {
    bytes: &'a [u8],
    guid: Guid,
}

/// Descriptor sectors for `n` descriptors (the header takes the room of
/// two).
pub fn descriptor_sectors(n: u64) -> u64 {
    (n + 2).div_ceil(128).max(1)
}

/// The most sectors one entry can update in a log of `log_len` bytes.
pub fn capacity(log_len: u64) -> u64 {
    let sectors = log_len / SECTOR;
    let mut n = sectors.saturating_sub(1);
    while n > 0 && descriptor_sectors(n) + n > sectors {
        n -= 1;
    }
    n
}

impl<'a> Log<'a> {
    /// The log in `bytes` (whole sectors), whose entries carry `guid`.
    pub fn new(bytes: &'a [u8], guid: Guid) -> Log<'a> {
        Log { bytes, guid }
    }

    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// `len` bytes from log offset `at`, wrapping at the end.
    fn read(&self, at: u64, len: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(len as usize);
        let mut pos = at % self.len();
        while (out.len() as u64) < len {
            let n = (self.len() - pos).min(len - out.len() as u64);
            out.extend_from_slice(&self.bytes[pos as usize..(pos + n) as usize]);
            pos = (pos + n) % self.len();
        }
        out
    }

    /// The entry at log offset `at`, if there is a valid one (with
    /// sequence number `after + 1` when `after` is given). A descriptor
    /// that is not one, in an entry of this log, is an error.
    pub fn entry_at(&self, at: u64, after: Option<u64>) -> Result<Option<Entry>> {
        let h = self.read(at, 64);
        if &h[..4] != b"loge" {
            return Ok(None);
        }
        let length = le32(&h, 8) as u64;
        let sequence = le64(&h, 16);
        let count = le32(&h, 24) as u64;
        if length == 0 || length > self.len() || !length.is_multiple_of(SECTOR) || sequence == 0 {
            return Ok(None);
        }
        if after.is_some_and(|p| sequence != p.wrapping_add(1)) {
            return Ok(None);
        }
        if guid_at(&h, 32) != self.guid || 64 + count * 32 > length {
            return Ok(None);
        }
        let bytes = self.read(at, length);
        let mut descriptors = Vec::new();
        let mut data_sectors = 0usize;
        for i in 0..count as usize {
            let d = &bytes[64 + i * 32..96 + i * 32];
            let file_offset = le64(d, 16);
            if le64(d, 24) != sequence || !file_offset.is_multiple_of(SECTOR) {
                return Err(invalid(format!(
                    "VHDX log entry {sequence} at log offset {at}: descriptor {i} is corrupt"
                )));
            }
            let action = match &d[..4] {
                b"desc" => {
                    data_sectors += 1;
                    Action::Data {
                        leading: le64(d, 8),
                        trailing: le32(d, 4),
                        data_sector: data_sectors - 1,
                    }
                }
                b"zero" if le64(d, 8).is_multiple_of(SECTOR) => Action::Zero { length: le64(d, 8) },
                _ => {
                    return Err(invalid(format!(
                        "VHDX log entry {sequence} at log offset {at}: descriptor {i} is corrupt"
                    )));
                }
            };
            descriptors.push(Descriptor {
                action,
                file_offset,
            });
        }
        let mut zeroed = bytes.clone();
        zeroed[4..8].fill(0);
        if crc32c(&zeroed) != le32(&bytes, 4) {
            return Ok(None);
        }
        if (descriptor_sectors(count) + data_sectors as u64) * SECTOR > length {
            return Err(invalid(format!(
                "VHDX log entry {sequence} at log offset {at} is too short for its {data_sectors} data sectors"
            )));
        }
        Ok(Some(Entry {
            sequence,
            length,
            flushed_file_offset: le64(&h, 48),
            last_file_offset: le64(&h, 56),
            descriptors,
            bytes,
        }))
    }

    /// The run of entries to replay (empty: none).
    pub fn active(&self) -> Result<Vec<Entry>> {
        if self.len() < SECTOR {
            return Ok(Vec::new());
        }
        let sectors = self.len() / SECTOR;
        let mut best: Vec<Entry> = Vec::new();
        let mut p = 0u64;
        while p < sectors {
            let Some(first) = self.entry_at(p * SECTOR, None)? else {
                p += 1;
                continue;
            };
            let mut pos = p * SECTOR + first.length;
            let mut run = vec![first];
            let mut after = None;
            loop {
                // A run cannot hold more entries than the log has sectors.
                if run.len() as u64 > sectors {
                    break;
                }
                match self.entry_at(pos % self.len(), after)? {
                    Some(e) => {
                        after = Some(e.sequence);
                        pos += e.length;
                        run.push(e);
                    }
                    None => {
                        pos += SECTOR;
                        break;
                    }
                }
            }
            if best.is_empty() || run[0].sequence > best[0].sequence {
                best = run;
            }
            p = pos / SECTOR;
        }
        Ok(best)
    }
}

impl Entry {
    /// The 4 KiB sector data descriptor `d` writes.
    fn sector(&self, d: &Descriptor) -> Result<Option<Vec<u8>>> {
        let Action::Data {
            leading,
            trailing,
            data_sector,
        } = d.action
        else {
            return Ok(None);
        };
        let first = descriptor_sectors(self.descriptors.len() as u64) as usize;
        let at = (first + data_sector) * SECTOR as usize;
        let s = &self.bytes[at..at + SECTOR as usize];
        let seq = ((le32(s, 4) as u64) << 32) | le32(s, 4092) as u64;
        if seq != self.sequence {
            return Err(invalid(format!(
                "VHDX log entry {}: data sector {data_sector} has sequence number {seq}",
                self.sequence
            )));
        }
        let mut out = s.to_vec();
        out[..8].copy_from_slice(&leading.to_le_bytes());
        out[4092..].copy_from_slice(&trailing.to_le_bytes());
        Ok(Some(out))
    }
}

/// Checks that `entries` can be replayed into `file` before anything is
/// written: the file is as long as each entry needs, and every data
/// sector carries its entry's sequence number.
pub fn check_replay(file: &dyn Storage, entries: &[Entry]) -> Result<()> {
    let mut len = file.file_len()?;
    for e in entries {
        if e.flushed_file_offset > len {
            return Err(invalid(format!(
                "VHDX log entry {} needs a file of {} bytes; it has {len}",
                e.sequence, e.flushed_file_offset
            )));
        }
        for d in &e.descriptors {
            e.sector(d)?;
        }
        // Replaying it grows the file to its last offset.
        len = len.max(e.last_file_offset.saturating_add(MIB - 1) / MIB * MIB);
    }
    Ok(())
}

/// Applies `entries` to `file` (flushed afterwards).
pub fn replay(file: &dyn Storage, entries: &[Entry]) -> Result<()> {
    for e in entries {
        let len = file.file_len()?;
        if e.flushed_file_offset > len {
            return Err(invalid(format!(
                "VHDX log entry {} needs a file of {} bytes; it has {len}",
                e.sequence, e.flushed_file_offset
            )));
        }
        for d in &e.descriptors {
            match (&d.action, e.sector(d)?) {
                (_, Some(sector)) => file.write_extend(&sector, d.file_offset)?,
                (Action::Zero { length }, None) => {
                    let end = d.file_offset.checked_add(*length).ok_or_else(|| {
                        invalid(format!(
                            "VHDX log entry {}: zero range overflows",
                            e.sequence
                        ))
                    })?;
                    if end > file.size() {
                        file.resize(end, diskit_core::Preallocation::Off)?;
                    }
                    file.write_zeroes(d.file_offset, *length, ZeroFlags::default())?;
                }
                (Action::Data { .. }, None) => unreachable!("data descriptors have a sector"),
            }
        }
        if file.file_len()? < e.last_file_offset {
            let to = e
                .last_file_offset
                .checked_next_multiple_of(MIB)
                .ok_or_else(|| {
                    invalid(format!(
                        "VHDX log entry {}: file offset overflows",
                        e.sequence
                    ))
                })?;
            file.resize(to, diskit_core::Preallocation::Off)?;
        }
    }
    file.flush()
}

/// An entry of sequence number `sequence` for log `guid` that writes each
/// 4 KiB `(file offset, sector)`, for a file of `file_len` bytes; `tail`
/// is where it goes in the log.
pub fn build_entry(
    guid: &Guid,
    sequence: u64,
    tail: u64,
    file_len: u64,
    sectors: &[(u64, Vec<u8>)],
) -> Vec<u8> {
    let n = sectors.len() as u64;
    let ds = descriptor_sectors(n);
    let mut b = vec![0u8; ((ds + n) * SECTOR) as usize];
    let len = b.len() as u32;
    b[..4].copy_from_slice(b"loge");
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b[12..16].copy_from_slice(&(tail as u32).to_le_bytes());
    b[16..24].copy_from_slice(&sequence.to_le_bytes());
    b[24..28].copy_from_slice(&(n as u32).to_le_bytes());
    b[32..48].copy_from_slice(guid);
    b[48..56].copy_from_slice(&file_len.to_le_bytes());
    b[56..64].copy_from_slice(&file_len.to_le_bytes());
    for (i, (off, s)) in sectors.iter().enumerate() {
        let d = 64 + i * 32;
        b[d..d + 4].copy_from_slice(b"desc");
        b[d + 4..d + 8].copy_from_slice(&s[4092..4096]);
        b[d + 8..d + 16].copy_from_slice(&s[..8]);
        b[d + 16..d + 24].copy_from_slice(&off.to_le_bytes());
        b[d + 24..d + 32].copy_from_slice(&sequence.to_le_bytes());
        let at = ((ds as usize) + i) * SECTOR as usize;
        let data = &mut b[at..at + SECTOR as usize];
        data[..4].copy_from_slice(b"data");
        data[4..8].copy_from_slice(&((sequence >> 32) as u32).to_le_bytes());
        data[8..4092].copy_from_slice(&s[8..4092]);
        data[4092..].copy_from_slice(&(sequence as u32).to_le_bytes());
    }
    super::header::set_checksum(&mut b, 4);
    b
}

/// Writes `b` at `offset` of `file` (inside it).
pub fn write(file: &dyn Storage, b: &[u8], offset: u64) -> Result<()> {
    file.write_at(b, offset, WriteFlags::NONE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sector(fill: u8) -> Vec<u8> {
        (0..SECTOR as usize)
            .map(|i| fill.wrapping_add(i as u8))
            .collect()
    }

    #[test]
    fn capacity_fits_the_log() {
        assert_eq!(capacity(MIB), 254);
        assert_eq!(descriptor_sectors(254) + 254, 256);
        assert_eq!(capacity(8192), 1);
        assert_eq!(capacity(4096), 0);
    }

    #[test]
    fn entries_built_are_found_and_chained() {
        let g = [7u8; 16];
        let mut log = vec![0u8; MIB as usize];
        let a = build_entry(&g, 5, 0, 1 << 30, &[(0x200000, sector(1))]);
        let b = build_entry(&g, 9, 0, 1 << 30, &[(0x201000, sector(2))]);
        log[..a.len()].copy_from_slice(&a);
        log[a.len()..a.len() + b.len()].copy_from_slice(&b);
        // The second entry may have any sequence number (QEMU's quirk).
        let run = Log::new(&log, g).active().unwrap();
        assert_eq!(run.iter().map(|e| e.sequence).collect::<Vec<_>>(), [5, 9]);
        assert_eq!(
            run[0].sector(&run[0].descriptors[0]).unwrap(),
            Some(sector(1))
        );
        // Another GUID: nothing.
        assert!(Log::new(&log, [8; 16]).active().unwrap().is_empty());
        // A broken checksum: not an entry.
        log[5000] ^= 1;
        let run = Log::new(&log, g).active().unwrap();
        assert_eq!(run.iter().map(|e| e.sequence).collect::<Vec<_>>(), [9]);
    }

    #[test]
    fn a_run_starting_higher_wins() {
        let g = [7u8; 16];
        let mut log = vec![0u8; MIB as usize];
        for (at, seq) in [(0usize, 5u64), (8192, 6), (65536, 9)] {
            let e = build_entry(&g, seq, 0, 0, &[(0, sector(seq as u8))]);
            log[at..at + e.len()].copy_from_slice(&e);
        }
        let run = Log::new(&log, g).active().unwrap();
        assert_eq!(run.iter().map(|e| e.sequence).collect::<Vec<_>>(), [9]);
    }

    #[test]
    fn a_bad_descriptor_is_an_error() {
        let g = [7u8; 16];
        let mut log = vec![0u8; MIB as usize];
        let e = build_entry(&g, 5, 0, 0, &[(0, sector(1))]);
        log[..e.len()].copy_from_slice(&e);
        log[64] = b'x';
        assert!(Log::new(&log, g).active().is_err());
    }

    #[test]
    fn replay_writes_data_and_zero_descriptors_and_grows_the_file() {
        use diskit_backends::MemoryDevice;
        use diskit_core::BlockDevice;
        let g = [3u8; 16];
        let mut log = vec![0u8; MIB as usize];
        // Entry 1: one data sector at 8 KiB; the file must grow to 3 MiB.
        let mut e1 = build_entry(&g, 7, 0, 4 * SECTOR, &[(2 * SECTOR, sector(9))]);
        e1[56..64].copy_from_slice(&(2 * MIB + 5).to_le_bytes());
        super::super::header::set_checksum(&mut e1, 4);
        // Entry 2: its descriptor turned into zeros over 2 sectors at 0.
        let mut e2 = build_entry(&g, 8, 0, 4 * SECTOR, &[(0, sector(1))]);
        e2[64..68].copy_from_slice(b"zero");
        e2[68..72].fill(0);
        e2[72..80].copy_from_slice(&(2 * SECTOR).to_le_bytes());
        super::super::header::set_checksum(&mut e2, 4);
        log[..e1.len()].copy_from_slice(&e1);
        log[e1.len()..e1.len() + e2.len()].copy_from_slice(&e2);
        let run = Log::new(&log, g).active().unwrap();
        assert_eq!(run.len(), 2);
        let m = MemoryDevice::new(0);
        m.write_extend(&vec![0xee; 4 * SECTOR as usize], 0).unwrap();
        check_replay(&m, &run).unwrap();
        replay(&m, &run).unwrap();
        assert_eq!(m.file_len().unwrap(), 3 * MIB);
        let mut b = vec![0u8; 4 * SECTOR as usize];
        m.read_at(&mut b, 0).unwrap();
        assert!(b[..2 * SECTOR as usize].iter().all(|&x| x == 0));
        assert_eq!(&b[2 * SECTOR as usize..3 * SECTOR as usize], &sector(9)[..]);
        assert!(b[3 * SECTOR as usize..].iter().all(|&x| x == 0xee));
        // A file too short for an entry is refused before anything is written.
        let short = MemoryDevice::new(0);
        short.write_extend(&[1u8; 4096], 0).unwrap();
        assert!(check_replay(&short, &run).is_err());
    }
}
