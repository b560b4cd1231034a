//! An open QED image: two levels of tables say where each cluster lives
//! (0: not here, the backing file answers; 1: zeros; else the cluster's
//! offset in the file); the generic mapped layer moves the bytes.
//! New data clusters go at the end of the file, written whole (the
//! generic layer copies what the range read as before around the data),
//! then a new L2 table if one is needed, then the table entries (table
//! changes one at a time). Without a backing file the image is marked as
//! needing a check while allocations may be in flight, and unmarked at
//! flush and close; with one, the data is flushed before any table
//! points at it.
//!
//! On storage written front to back (a new S3 object, see
//! [`crate::in_order`]) a table further back cannot be written again: the
//! L2 tables made while writing are held in memory (L2 tables only: their
//! memory is the image's metadata, never its data), and placed after the
//! data at close, the L1 table (in the head the storage keeps) then
//! pointing at them. Metadata after the data, not planned before it: the
//! tables a run of writes needs are known only once it is over.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use diskit_core::sync::{self, lock};
use diskit_core::{
    BlockSizeLimits, Capabilities, Error, ErrorKind, Result, StorageRef, WriteFlags, ZeroFlags,
};

use super::header::{F_NEED_CHECK, Header};
use crate::mapped::{self, Allocation, Backing, Fill, Layers, Mapped, MappedFormat, Place, Zeroed};

/// An L2 entry for a cluster that reads as zeros.
pub const ZERO_CLUSTER: u64 = 1;

/// An open QED image.
pub struct Qed {
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    header: Mutex<Header>,
    l1: RwLock<Vec<u64>>,
    l2: Mutex<HashMap<u64, Arc<Vec<u64>>>>,
    /// Where the next cluster goes (the end of the file, whole clusters).
    file_end: AtomicU64,
    /// Written front to back: the L2 tables made since opening, by L1
    /// index, held until [`Qed::place_held`]; `None` when tables are
    /// placed as they are made.
    held: Option<Mutex<BTreeMap<usize, Arc<Vec<u64>>>>>,
}

fn read_table(file: &StorageRef, offset: u64, h: &Header) -> Result<Vec<u64>> {
    let mut raw = vec![0u8; h.table_bytes() as usize];
    file.read_at(&mut raw, offset)?;
    Ok(crate::bytes::le64s(&raw))
}

/// Where what the image points at ends: its header, L1 table, L2 tables
/// and data clusters. New clusters go there on storage of a fixed size (an
/// NBD export, a block device), whose end says nothing.
fn used_end(file: &StorageRef, h: &Header, l1: &[u64]) -> Result<u64> {
    let cs = h.cluster_size as u64;
    let mut end = (h.header_size as u64 * cs).max(h.l1_table_offset + h.table_bytes());
    for &t in l1.iter().filter(|&&t| t != 0) {
        end = end.max(t + h.table_bytes());
        for &e in read_table(file, t, h)?.iter().filter(|&&e| e > 1) {
            end = end.max(e + cs);
        }
    }
    Ok(end.div_ceil(cs) * cs)
}

fn table_bytes(t: &[u64]) -> Vec<u8> {
    t.iter().flat_map(|e| e.to_le_bytes()).collect()
}

impl Qed {
    /// Opens the image in `file` with `header` (validated) and `backing`.
    pub fn open(
        file: StorageRef,
        header: Header,
        backing: Option<Backing>,
        writable: bool,
    ) -> Result<Mapped<Qed>> {
        let l1 = read_table(&file, header.l1_table_offset, &header)
            .map_err(|e| e.context("Failed to read L1 table"))?;
        let cs = header.cluster_size as u64;
        let file_end = if file.is_fixed_size() {
            used_end(&file, &header, &l1)?
        } else {
            file.file_len()? / cs * cs
        };
        let held = (writable && file.writes_in_order()).then(Default::default);
        if held.is_some() {
            // The header, the L1 table and the L2 tables there are change
            // in place.
            let mut end = header.l1_table_offset + header.table_bytes();
            for &t in l1.iter().filter(|&&t| t != 0) {
                end = end.max(t + header.table_bytes());
            }
            crate::in_order::check_in_place(&*file, "qed", "header, L1 and L2 tables", end)?;
        }
        Ok(Mapped::new(Qed {
            layers: Layers {
                data: file,
                backing,
                writable,
            },
            header: Mutex::new(header),
            l1: RwLock::new(l1),
            l2: Mutex::new(HashMap::new()),
            file_end: AtomicU64::new(file_end),
            held,
        }))
    }

    /// The header as it is now.
    pub fn header(&self) -> Header {
        lock(&self.header).clone()
    }

    fn file_size(&self) -> u64 {
        self.file_end.load(Ordering::Acquire)
    }

    /// The L2 table at `offset` (cached).
    fn l2_table(&self, offset: u64, h: &Header) -> Result<Arc<Vec<u64>>> {
        if let Some(t) = lock(&self.l2).get(&offset) {
            return Ok(t.clone());
        }
        let t = Arc::new(read_table(&self.layers.data, offset, h)?);
        let mut cache = lock(&self.l2);
        if cache.len() >= 64 {
            cache.clear();
        }
        // A table changed meanwhile is newer than the one read.
        Ok(cache.entry(offset).or_insert(t).clone())
    }

    /// The L2 entry of guest `g`: None when its L2 table is not allocated.
    fn l2_entry(&self, g: u64, h: &Header) -> Result<(Option<Arc<Vec<u64>>>, u64)> {
        let span = h.l2_span();
        let l1_index = (g / span) as usize;
        let l1e = sync::read(&self.l1)[l1_index];
        let idx = (g % span) / h.cluster_size as u64;
        if l1e == 0 {
            let held = self
                .held
                .as_ref()
                .and_then(|m| lock(m).get(&l1_index).cloned());
            return Ok((held, idx));
        }
        if !h.table_offset_ok(l1e, self.file_size()) {
            return Err(Error::invalid(format!(
                "QED L2 table offset {l1e:#x} is invalid"
            )));
        }
        Ok((Some(self.l2_table(l1e, h)?), idx))
    }

    /// The place of one L2 entry (checked).
    fn place_of(&self, e: u64, within: u64, h: &Header) -> Result<Place> {
        Ok(match e {
            0 => Place::Unallocated { alloc: None },
            ZERO_CLUSTER => Place::Zero { alloc: None },
            off if h.cluster_offset_ok(off, self.file_size()) => Place::Data(off + within),
            off => {
                return Err(Error::invalid(format!(
                    "QED cluster offset {off:#x} is invalid"
                )));
            }
        })
    }

    /// Grows the virtual size (the header rewritten; the tables already
    /// cover it).
    pub fn set_image_size(&self, size: u64) -> Result<()> {
        let mut h = lock(&self.header);
        h.image_size = size;
        self.layers
            .data
            .write_at(&h.to_bytes(), 0, WriteFlags::NONE)?;
        self.layers.data.flush()
    }

    fn set_need_check(&self, on: bool) -> Result<()> {
        let mut h = lock(&self.header);
        let has = h.features & F_NEED_CHECK != 0;
        if has == on {
            return Ok(());
        }
        if on {
            h.features |= F_NEED_CHECK;
        } else {
            self.layers.data.flush()?;
            h.features &= !F_NEED_CHECK;
        }
        self.layers
            .data
            .write_at(&h.to_bytes(), 0, WriteFlags::NONE)?;
        if !on {
            self.layers.data.flush()?;
        }
        Ok(())
    }

    /// Sets the L2 entries from guest `g` (inside one table) to `entries`
    /// and writes them: the changed sectors of the table, or a new table
    /// after the data and then the L1 sector that points at it. Table
    /// changes run one at a time (under the table cache's lock).
    fn set_entries(&self, g: u64, entries: &[u64], h: &Header) -> Result<()> {
        let mut cache = lock(&self.l2);
        let l1_index = (g / h.l2_span()) as usize;
        let idx0 = ((g % h.l2_span()) / h.cluster_size as u64) as usize;
        let had_table = sync::read(&self.l1)[l1_index];
        if let (0, Some(held)) = (had_table, &self.held) {
            // Held in memory until close.
            let mut held = lock(held);
            let table = held
                .entry(l1_index)
                .or_insert_with(|| Arc::new(vec![0; h.table_entries() as usize]));
            Arc::make_mut(table)[idx0..idx0 + entries.len()].copy_from_slice(entries);
            return Ok(());
        }
        let mut table: Vec<u64> = match (had_table, cache.get(&had_table)) {
            (0, _) => vec![0; h.table_entries() as usize],
            (_, Some(t)) => t.as_ref().clone(),
            (at, None) => read_table(&self.layers.data, at, h)?,
        };
        table[idx0..idx0 + entries.len()].copy_from_slice(entries);
        let table_at = if had_table == 0 {
            // A new L2 table after the data, written whole, then the L1
            // sector that points at it.
            let at = self.file_end.fetch_add(h.table_bytes(), Ordering::AcqRel);
            self.layers.data.write_extend(&table_bytes(&table), at)?;
            self.layers.data.flush()?;
            let mut l1 = sync::write(&self.l1);
            l1[l1_index] = at;
            let first = l1_index / 64 * 64;
            let sector: Vec<u64> = l1.iter().skip(first).take(64).copied().collect();
            self.layers.data.write_at(
                &table_bytes(&sector),
                h.l1_table_offset + first as u64 * 8,
                WriteFlags::NONE,
            )?;
            at
        } else {
            // The sectors of the table holding the changed entries.
            let lo = idx0 / 64 * 64;
            let hi = ((idx0 + entries.len() - 1) / 64 + 1) * 64;
            let hi = hi.min(table.len());
            self.layers.data.write_at(
                &table_bytes(&table[lo..hi]),
                had_table + lo as u64 * 8,
                WriteFlags::NONE,
            )?;
            had_table
        };
        if cache.len() >= 64 {
            cache.clear();
        }
        cache.insert(table_at, Arc::new(table));
        Ok(())
    }
}

impl Qed {
    /// Places the L2 tables held (written front to back) after everything
    /// written, and points the L1 table at them.
    fn place_held(&self) -> Result<()> {
        let Some(held) = &self.held else {
            return Ok(());
        };
        let mut cache = lock(&self.l2);
        let tables = std::mem::take(&mut *lock(held));
        if tables.is_empty() {
            return Ok(());
        }
        let h = self.header();
        let mut l1 = sync::write(&self.l1);
        for (i, t) in tables {
            let at = self.file_end.fetch_add(h.table_bytes(), Ordering::AcqRel);
            self.data().write_extend(&table_bytes(&t), at)?;
            l1[i] = at;
            cache.insert(at, t);
        }
        self.data()
            .write_at(&table_bytes(&l1), h.l1_table_offset, WriteFlags::NONE)
    }
}

impl Drop for Qed {
    fn drop(&mut self) {
        if self.layers.writable {
            let _ = self.set_need_check(false);
        }
    }
}

impl MappedFormat for Qed {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        lock(&self.header).image_size
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        // An entry changes only once its new cluster is written (and a
        // cluster written in place never moves): nothing to hold.
        let h = self.header();
        let cs = h.cluster_size as u64;
        let span = h.l2_span();
        let max = max.min(span - g % span);
        let (table, idx) = self.l2_entry(g, &h)?;
        let Some(t) = table else {
            return Ok((max, Place::Unallocated { alloc: None }, None));
        };
        let first = t[idx as usize];
        let place = self.place_of(first, g % cs, &h)?;
        let mut n = (cs - g % cs).min(max);
        let mut i = idx as usize + 1;
        while n < max && i < t.len() {
            let e = t[i];
            let alike = match (first, e) {
                (0, 0) | (ZERO_CLUSTER, ZERO_CLUSTER) => true,
                (a, b) if a > ZERO_CLUSTER && b > ZERO_CLUSTER => {
                    b == a + (i as u64 - idx) * cs && h.cluster_offset_ok(b, self.file_size())
                }
                _ => false,
            };
            if !alike {
                break;
            }
            n = (n + cs).min(max);
            i += 1;
        }
        Ok((n, place, None))
    }

    fn unit(&self) -> u64 {
        self.header().cluster_size as u64
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.layers.writable, true, false)
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: self.header().cluster_size.min(64 << 10),
            maximum: 32 << 20,
        }
    }

    fn describe(&self) -> String {
        format!("qed {}", self.layers.data.location())
    }

    /// New clusters at the end of the file for the run from `g` (inside
    /// one L2 table), written whole.
    fn allocate(&self, g: u64, data: &[u8]) -> Result<Allocation> {
        let h = self.header();
        let cs = h.cluster_size as u64;
        let span = h.l2_span();
        let start = g / cs * cs;
        let end = (g + data.len() as u64)
            .div_ceil(cs)
            .saturating_mul(cs)
            .min((g / span + 1) * span);
        if self.layers.backing.is_none() {
            self.set_need_check(true)?;
        }
        let len = end - start;
        Ok(Allocation {
            guest: start,
            len,
            host: self.file_end.fetch_add(len, Ordering::AcqRel),
            fill: Fill::Whole,
        })
    }

    /// The table entries, once the data is written (and flushed, with a
    /// backing file).
    fn commit(&self, a: Allocation) -> Result<()> {
        if self.layers.backing.is_some() {
            self.layers.data.flush()?;
        }
        let h = self.header();
        let cs = h.cluster_size as u64;
        let entries: Vec<u64> = (0..a.len / cs).map(|i| a.host + i * cs).collect();
        self.set_entries(a.guest, &entries, &h)
    }

    /// Whole clusters become zero clusters (those allocated get zeros
    /// written in place and stay); partial ones are written.
    fn zero(&self, g: u64, len: u64, flags: ZeroFlags) -> Result<Zeroed> {
        let h = self.header();
        let cs = h.cluster_size as u64;
        if flags.fast && (!g.is_multiple_of(cs) || !(g + len).is_multiple_of(cs)) {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "partial clusters are written",
            ));
        }
        if !g.is_multiple_of(cs) {
            return Ok(Zeroed::Write(len.min(cs - g % cs)));
        }
        if len < cs {
            return Ok(Zeroed::Write(len));
        }
        let span = h.l2_span();
        let n = (len / cs * cs).min(span - g % span);
        let (table, idx) = self.l2_entry(g, &h)?;
        let mut entries = Vec::with_capacity((n / cs) as usize);
        let mut changed = false;
        for i in 0..n / cs {
            let e = table.as_ref().map_or(0, |t| t[(idx + i) as usize]);
            if e > ZERO_CLUSTER {
                // Allocated: zeros in place, the cluster stays.
                if let Place::Data(at) = self.place_of(e, 0, &h)? {
                    self.layers
                        .data
                        .write_at(&vec![0u8; cs as usize], at, WriteFlags::NONE)?;
                }
            } else {
                changed |= e != ZERO_CLUSTER;
            }
            entries.push(e.max(ZERO_CLUSTER));
        }
        if changed {
            if self.layers.backing.is_none() {
                self.set_need_check(true)?;
            }
            self.set_entries(g, &entries, &h)?;
        }
        Ok(Zeroed::Done(n))
    }

    fn flush(&self) -> Result<()> {
        self.layers.data.flush()?;
        if self.layers.writable {
            self.set_need_check(false)?;
        }
        Ok(())
    }

    /// The tables held are placed; the image is marked as needing no
    /// check (as at a drop, but while the storage still takes writes).
    fn close(&self) -> Result<()> {
        if self.writable() {
            self.place_held()?;
            self.set_need_check(false)?;
        }
        Ok(())
    }
}
