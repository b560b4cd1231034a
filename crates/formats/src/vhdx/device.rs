//! An open VHDX image: the BAT says where each payload block lives, the
//! generic mapped layer moves the bytes, and writes to blocks that read
//! as zeros allocate new blocks at the end of the file (1 MiB aligned,
//! as QEMU).
//!
//! Crash safety. A new block's data is written before any BAT entry on
//! disk points at it: the BAT changes wait in memory (reads see them at
//! once) and are committed at the next flush (or when they fill the log):
//! flush the data; write one log entry holding every changed BAT sector
//! and point both headers at it; flush; write the BAT sectors in place;
//! flush; clear the log GUID in both headers. A crash before the entry is
//! live leaves the old BAT (the new blocks are unused space at the end of
//! the file); after, the entry is replayed at the next read-write open
//! (or `check -r all`). This batches what QEMU does per allocation (a log
//! transaction and its flushes for every block).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use diskit_core::sync::{self, lock};
use diskit_core::{Capabilities, Error, ErrorKind, Preallocation, Result, StorageRef, WriteFlags};

use super::header::{
    self, Bat, Block, ENTRIES_PER_SECTOR, Geometry, Guid, HEADER_BLOCK, HEADER_OFFSETS, Header,
    MIB, Metadata, NULL_GUID, PAYLOAD_FULLY_PRESENT, PAYLOAD_NOT_PRESENT, REGION_TABLE_OFFSET,
    RegionTable, Regions, SIGNATURE, TABLE_LEN, entry_offset, entry_state, invalid, reads_as_zero,
};
use super::log::{self, Log};
use crate::mapped::{self, Allocation, Fill, Layers, Mapped, MappedFormat, Place};

/// How an image is opened.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mode {
    /// For writing (a log is replayed).
    pub writable: bool,
    /// For `check`: the BAT entries are not checked at open.
    pub for_check: bool,
    /// Ask the file whether data blocks were ever written.
    pub host_zeros: bool,
}

/// The headers and what is waiting to be committed.
struct State {
    /// The two 4 KiB header blocks as they are on disk.
    slots: [Vec<u8>; 2],
    /// The current one.
    current: usize,
    /// Its fields.
    header: Header,
    /// This session's file write GUID.
    session: Guid,
    /// BAT sectors changed in memory, not yet on disk.
    pending: BTreeSet<u64>,
    /// The next log entry's sequence number.
    next_sequence: u64,
}

impl State {
    /// Updates both headers (each time the other one, as QEMU): a new
    /// sequence number, the session's file write GUID, a new data write
    /// GUID if `new_data`, the log GUID if given.
    fn update_headers(
        &mut self,
        file: &StorageRef,
        log_guid: Option<Guid>,
        new_data: bool,
    ) -> Result<()> {
        for _ in 0..2 {
            let mut h = self.header.clone();
            h.sequence = h.sequence.wrapping_add(1);
            h.file_write_guid = self.session;
            if new_data {
                h.data_write_guid = header::new_guid()?;
            }
            if let Some(g) = log_guid {
                h.log_guid = g;
            }
            let slot = 1 - self.current;
            h.write_into(&mut self.slots[slot]);
            file.write_at(&self.slots[slot], HEADER_OFFSETS[slot], WriteFlags::NONE)?;
            self.current = slot;
            self.header = h;
        }
        Ok(())
    }
}

/// An open VHDX image.
pub struct Vhdx {
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    mode: Mode,
    geo: Geometry,
    md: Metadata,
    rt: RegionTable,
    /// The log, registered regions first (for the BAT checks).
    regions: Regions,
    bat: RwLock<Bat>,
    state: Mutex<State>,
    /// Where the file ends (new blocks go after, 1 MiB aligned).
    file_end: AtomicU64,
    /// BAT sectors one log entry can carry (0: the image cannot be written).
    capacity: u64,
    /// Whether a log was replayed at open.
    replayed: bool,
    /// Whether the headers were updated for this session's first write
    /// (read without the state lock, which a commit holds over flushes).
    written: AtomicBool,
}

/// Refuses a range of `file` past its end (so that hostile sizes never
/// allocate more than the file holds).
fn inside(file: &StorageRef, offset: u64, len: u64, what: &str) -> Result<()> {
    let file_len = file.file_len()?;
    if offset.checked_add(len).is_none_or(|end| end > file_len) {
        return Err(invalid(format!(
            "VHDX {what} ({len} bytes at {offset}) runs past the end of the file ({file_len} bytes)"
        )));
    }
    Ok(())
}

impl Vhdx {
    /// Opens the image in `file`: headers, log (replayed if writable,
    /// refused if not), region table, metadata, BAT.
    pub fn open(file: StorageRef, mode: Mode) -> Result<Mapped<Vhdx>> {
        let mut sig = [0u8; 8];
        file.read_padded(&mut sig, 0)?;
        if &sig != SIGNATURE {
            return Err(invalid("VHDX file identifier 'vhdxfile' not found"));
        }
        let mut slots = [vec![0u8; HEADER_BLOCK], vec![0u8; HEADER_BLOCK]];
        for (s, at) in slots.iter_mut().zip(HEADER_OFFSETS) {
            file.read_padded(s, at)?;
        }
        let (current, h) =
            header::current_header([Header::parse(&slots[0]), Header::parse(&slots[1])])?;
        h.check_log_fields()?;
        let mut st = State {
            slots,
            current,
            header: h.clone(),
            session: header::new_guid()?,
            pending: BTreeSet::new(),
            next_sequence: 1,
        };
        let mut replayed = false;
        if h.has_log() {
            if !(h.log_length as u64).is_multiple_of(MIB) {
                return Err(invalid(format!(
                    "VHDX log length {} is not a multiple of 1 MiB",
                    h.log_length
                )));
            }
            inside(&file, h.log_offset, h.log_length as u64, "log")?;
            let mut bytes = vec![0u8; h.log_length as usize];
            file.read_at(&mut bytes, h.log_offset)?;
            let run = Log::new(&bytes, h.log_guid).active()?;
            if let Some(last) = run.last() {
                if !mode.writable {
                    let name = file.location();
                    return Err(Error::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "VHDX image file '{name}' opened read-only, but contains a log that needs to be replayed\n\
                             To replay the log, run:\nqemu-img check -r all '{name}'"
                        ),
                    ));
                }
                st.next_sequence = last.sequence.wrapping_add(1);
                log::check_replay(&*file, &run)?;
                st.update_headers(&file, None, true)?;
                log::replay(&*file, &run)?;
                st.update_headers(&file, Some(NULL_GUID), false)?;
                file.flush()?;
                replayed = true;
            }
        }
        let mut regions = Regions::default();
        regions.add(h.log_offset, h.log_length as u64);
        let mut table = vec![0u8; TABLE_LEN];
        file.read_padded(&mut table, REGION_TABLE_OFFSET)?;
        let rt = RegionTable::parse(&table, &mut regions)?;
        let mut mdt = vec![0u8; TABLE_LEN];
        file.read_padded(&mut mdt, rt.metadata.offset)?;
        let md = Metadata::parse(&mdt, rt.metadata.length, &mut |it| {
            let mut b = vec![0u8; it.length as usize];
            file.read_padded(&mut b, rt.metadata.offset.saturating_add(it.offset as u64))?;
            Ok(b)
        })?;
        let geo = Geometry::new(md.virtual_size, md.block_size as u64)?;
        if geo.bat_entries * 8 > rt.bat.length as u64 {
            return Err(invalid(format!(
                "VHDX BAT region ({} bytes) is too small for {} entries",
                rt.bat.length, geo.bat_entries
            )));
        }
        // The entries that matter, in whole sectors where the region has
        // them.
        let used = geo.used_entries();
        let held = used.next_multiple_of(ENTRIES_PER_SECTOR);
        let from_file = (held * 8).min(rt.bat.length as u64);
        inside(&file, rt.bat.offset, used * 8, "BAT")?;
        let mut raw = vec![0u8; from_file as usize];
        file.read_padded(&mut raw, rt.bat.offset)?;
        let bat = Bat::new(&raw, held);
        // Writes go through the log, whole BAT sectors at a time.
        let capacity = if rt.bat.offset.is_multiple_of(log::SECTOR)
            && held * 8 <= rt.bat.length as u64
            && h.log_offset.saturating_add(h.log_length as u64) <= file.file_len()?
        {
            log::capacity(h.log_length as u64)
        } else {
            0
        };
        if mode.writable && capacity == 0 {
            return Err(invalid(
                "VHDX image cannot be written: its log is too small or its BAT is not in whole 4 KiB sectors",
            ));
        }
        if mode.writable {
            // The headers, the log and the BAT change in place.
            let end = (rt.bat.offset + used * 8).max(h.log_offset + h.log_length as u64);
            crate::in_order::check_in_place(&*file, "vhdx", "headers, log and BAT", end)?;
        }
        let v = Vhdx {
            // On storage of a fixed size (an NBD export, a block device)
            // the end of the storage says nothing: new blocks go after the
            // regions and blocks the image points at.
            file_end: AtomicU64::new(if file.is_fixed_size() {
                bat.entries()
                    .iter()
                    .map(|&e| (e >> 20) << 20)
                    .filter(|&o| o != 0)
                    .map(|o| o + geo.block_size)
                    .chain(std::iter::once(regions.end()))
                    .max()
                    .unwrap_or(0)
                    .next_multiple_of(1 << 20)
            } else {
                file.file_len()?
            }),
            layers: Layers {
                data: file,
                backing: None,
                writable: mode.writable,
            },
            mode,
            geo,
            md,
            rt,
            regions,
            bat: RwLock::new(bat),
            state: Mutex::new(st),
            capacity,
            replayed,
            written: AtomicBool::new(false),
        };
        if !mode.for_check {
            let errors = v.bat_errors(true)?;
            if !errors.is_empty() {
                return Err(invalid(errors.join("\n")));
            }
        }
        Ok(Mapped::new(v))
    }

    /// Whether a log was replayed when the image was opened.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.md
    }

    /// The BAT's geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    /// The region table.
    pub fn regions(&self) -> &RegionTable {
        &self.rt
    }

    /// The problems of the payload blocks' BAT entries, one line each as
    /// QEMU prints them: blocks past the end of the file or over the log,
    /// BAT or metadata (`first_only`: the first, as an open stops there).
    pub fn bat_errors(&self, first_only: bool) -> Result<Vec<String>> {
        let file_len = self.layers.data.file_len()?;
        let bat = sync::read(&self.bat);
        let bs = self.geo.block_size;
        let mut out = Vec::new();
        for b in 0..self.geo.blocks {
            let i = self.geo.bat_index(Block(b));
            let e = bat[i];
            if entry_state(e) != PAYLOAD_FULLY_PRESENT {
                continue;
            }
            let off = entry_offset(e);
            // QEMU sizes the last block from the raw BAT index.
            let len = bs.min(self.geo.virtual_size.saturating_sub(i.0.saturating_mul(bs)));
            if off >= file_len {
                out.push(format!(
                    "VHDX BAT entry {i} start offset {off} points after end of file ({file_len}). Image has probably been truncated."
                ));
            } else if off.checked_add(len).is_none() {
                out.push(format!("VHDX BAT entry {i} offset overflow."));
                if first_only {
                    break;
                }
                continue;
            } else if len > 0 && off + len > file_len {
                out.push(format!(
                    "VHDX BAT entry {i} end offset {} points after end of file ({file_len}). Image has probably been truncated.",
                    off + len - 1
                ));
            }
            if first_only && !out.is_empty() {
                break;
            }
            if let Err(e) = self.regions.check(off, len) {
                out.push(e.detail());
            }
            if first_only && !out.is_empty() {
                break;
            }
        }
        Ok(out)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn bad_state(&self, b: Block, e: u64) -> Error {
        Error::io(format!(
            "VHDX payload block {} (BAT entry {}) is in state {}, which cannot be read or written",
            b.0,
            self.geo.bat_index(b),
            entry_state(e)
        ))
    }

    /// The headers' first update of a session, before its first write.
    fn begin_write(&self) -> Result<()> {
        if self.written.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut st = self.lock();
        if !self.written.load(Ordering::Acquire) {
            st.update_headers(&self.layers.data, None, true)?;
            self.layers.data.flush()?;
            self.written.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// The new block for guest `g`: at the end of the file, 1 MiB
    /// aligned, the file grown over it (it reads as zeros).
    fn new_block(&self) -> Result<u64> {
        let bs = self.geo.block_size;
        let _st = self.lock();
        let at = self
            .file_end
            .load(Ordering::Acquire)
            .checked_next_multiple_of(MIB)
            .filter(|a| a.checked_add(bs).is_some())
            .ok_or_else(|| Error::new(ErrorKind::NoSpace, "VHDX file offsets overflow"))?;
        self.layers.data.resize(at + bs, Preallocation::Off)?;
        self.file_end.store(at + bs, Ordering::Release);
        Ok(at)
    }

    /// Puts the BAT changes waiting in memory on disk through the log.
    fn commit_log(&self, st: &mut State) -> Result<()> {
        if st.pending.is_empty() {
            return Ok(());
        }
        let file_len = self.layers.data.file_len()?;
        // The data the new entries point at first.
        self.layers.data.flush()?;
        let sectors: Vec<u64> = st.pending.iter().copied().collect();
        let h = st.header.clone();
        for chunk in sectors.chunks(self.capacity as usize) {
            let contents: Vec<(u64, Vec<u8>)> = {
                let bat = sync::read(&self.bat);
                chunk
                    .iter()
                    .map(|&s| (self.rt.bat.offset + s * log::SECTOR, bat.sector(s)))
                    .collect()
            };
            let guid = header::new_guid()?;
            let entry = log::build_entry(&guid, st.next_sequence, 0, file_len, &contents);
            st.next_sequence = st.next_sequence.wrapping_add(1).max(1);
            log::write(&*self.layers.data, &entry, h.log_offset)?;
            st.update_headers(&self.layers.data, Some(guid), false)?;
            self.layers.data.flush()?;
            for (off, bytes) in &contents {
                self.layers.data.write_at(bytes, *off, WriteFlags::NONE)?;
            }
            self.layers.data.flush()?;
            st.update_headers(&self.layers.data, Some(NULL_GUID), false)?;
        }
        st.pending.clear();
        Ok(())
    }
}

impl Drop for Vhdx {
    fn drop(&mut self) {
        if self.layers.writable {
            let mut st = self.lock();
            let _ = self.commit_log(&mut st);
            drop(st);
            let _ = self.layers.data.flush();
        }
    }
}

impl MappedFormat for Vhdx {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.geo.virtual_size
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        // An entry changes only from zeros to a block whose data is
        // written, and a block never moves: nothing to hold.
        let bat = sync::read(&self.bat);
        let bs = self.geo.block_size;
        let b = g / bs;
        let first = bat[self.geo.bat_index(Block(b))];
        let kind = |e: u64| match entry_state(e) {
            PAYLOAD_FULLY_PRESENT => Some(1),
            PAYLOAD_NOT_PRESENT => Some(2),
            s if reads_as_zero(s) => Some(3),
            _ => None,
        };
        let Some(k) = kind(first) else {
            return Err(self.bad_state(Block(b), first));
        };
        let mut n = (bs - g % bs).min(max);
        let mut next = b + 1;
        while n < max && next < self.geo.blocks {
            let e = bat[self.geo.bat_index(Block(next))];
            let alike = kind(e) == Some(k)
                && (k != 1 || entry_offset(e) == entry_offset(first) + (next - b) * bs);
            if !alike {
                break;
            }
            n = (n + bs).min(max);
            next += 1;
        }
        let place = match k {
            1 => Place::Data(entry_offset(first) + g % bs),
            2 => Place::Unallocated { alloc: None },
            _ => Place::Zero { alloc: None },
        };
        Ok((n, place, None))
    }

    fn data_may_be_sparse(&self) -> bool {
        // Fixed images are preallocated sparse; convert asks about every
        // block.
        self.md.leave_allocated || self.mode.host_zeros
    }

    fn unit(&self) -> u64 {
        self.geo.block_size
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.layers.writable, true, true)
    }

    fn describe(&self) -> String {
        format!("vhdx {}", self.layers.data.location())
    }

    fn before_change(&self, _g: u64, _len: u64) -> Result<()> {
        self.begin_write()
    }

    fn write_in_place(&self, g: u64, len: u64, place: Place) -> Result<Option<(u64, u64)>> {
        let Place::Data(h) = place else {
            return Ok(None);
        };
        let off = h - g % self.geo.block_size;
        if off < MIB {
            return Err(Error::io(format!(
                "VHDX payload block {} is at offset {off}, inside the file header: not written",
                g / self.geo.block_size
            )));
        }
        Ok(Some((h, len)))
    }

    /// A new block at the end of the file; the data alone is written.
    fn allocate(&self, g: u64, _data: &[u8]) -> Result<Allocation> {
        let bs = self.geo.block_size;
        Ok(Allocation {
            guest: g / bs * bs,
            len: bs,
            host: self.new_block()?,
            fill: Fill::DataOnly,
        })
    }

    /// The BAT entry changes in memory and waits for the next commit.
    fn commit(&self, a: Allocation) -> Result<()> {
        let i = self.geo.bat_index(Block(a.guest / self.geo.block_size));
        let mut st = self.lock();
        sync::write(&self.bat).set(i, a.host | PAYLOAD_FULLY_PRESENT);
        st.pending.insert(i.0 / ENTRIES_PER_SECTOR);
        if st.pending.len() as u64 >= self.capacity {
            self.commit_log(&mut st)?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if self.layers.writable {
            let mut st = self.lock();
            self.commit_log(&mut st)?;
        }
        self.layers.data.flush()
    }

    fn close(&self) -> Result<()> {
        MappedFormat::flush(self)
    }
}
