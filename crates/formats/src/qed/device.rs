//! An open QED image: two levels of tables say where each cluster lives
//! (0: not here, the backing file answers; 1: zeros; else the cluster's
//! offset in the file); the generic mapped layer moves the bytes.
//! Allocating writes run one at a time, as in QEMU: data clusters at the
//! end of the file (the copy-on-write around the data filled from what
//! the range read as before), then a new L2 table if one is needed, then
//! the table entries. Without a backing file the image is marked as
//! needing a check while allocations may be in flight, and unmarked at
//! flush and close; with one, the data is flushed before any table
//! points at it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use diskit_core::device::check_range;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, FileView, Result,
    StorageRef, WriteFlags, ZeroFlags,
};

use super::header::{F_NEED_CHECK, Header};
use crate::mapped::{self, Backing, MappedFormat, Place};

/// An L2 entry for a cluster that reads as zeros.
pub const ZERO_CLUSTER: u64 = 1;

/// An open QED image.
pub struct Qed {
    file: StorageRef,
    header: Mutex<Header>,
    l1: RwLock<Vec<u64>>,
    l2: Mutex<HashMap<u64, Arc<Vec<u64>>>>,
    backing: Option<Backing>,
    writable: bool,
    /// Allocating writes run one at a time.
    alloc: Mutex<()>,
    /// Where the next cluster goes (the end of the file, whole clusters).
    file_end: AtomicU64,
}

fn read_table(file: &StorageRef, offset: u64, h: &Header) -> Result<Vec<u64>> {
    let mut raw = vec![0u8; h.table_bytes() as usize];
    file.read_at(&mut raw, offset)?;
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
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
    ) -> Result<Qed> {
        let l1 = read_table(&file, header.l1_table_offset, &header)
            .map_err(|e| e.context("Failed to read L1 table"))?;
        let cs = header.cluster_size as u64;
        let file_end = file.file_len()? / cs * cs;
        Ok(Qed {
            file,
            header: Mutex::new(header),
            l1: RwLock::new(l1),
            l2: Mutex::new(HashMap::new()),
            backing,
            writable,
            alloc: Mutex::new(()),
            file_end: AtomicU64::new(file_end),
        })
    }

    /// The header as it is now.
    pub fn header(&self) -> Header {
        self.header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn file_size(&self) -> u64 {
        self.file_end.load(Ordering::Acquire)
    }

    /// The L2 table at `offset` (cached).
    fn l2_table(&self, offset: u64, h: &Header) -> Result<Arc<Vec<u64>>> {
        if let Some(t) = self
            .l2
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&offset)
        {
            return Ok(t.clone());
        }
        let t = Arc::new(read_table(&self.file, offset, h)?);
        let mut cache = self.l2.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= 64 {
            cache.clear();
        }
        cache.insert(offset, t.clone());
        Ok(t)
    }

    /// The L2 entry of guest `g`: None when its L2 table is not allocated.
    fn l2_entry(&self, g: u64, h: &Header) -> Result<(Option<Arc<Vec<u64>>>, u64)> {
        let span = h.l2_span();
        let l1e = self.l1.read().unwrap_or_else(|p| p.into_inner())[(g / span) as usize];
        let idx = (g % span) / h.cluster_size as u64;
        if l1e == 0 {
            return Ok((None, idx));
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
        let mut h = self.header.lock().unwrap_or_else(|p| p.into_inner());
        h.image_size = size;
        self.file.write_at(&h.to_bytes(), 0, WriteFlags::NONE)?;
        self.file.flush()
    }

    fn set_need_check(&self, on: bool) -> Result<()> {
        let mut h = self.header.lock().unwrap_or_else(|p| p.into_inner());
        let has = h.features & F_NEED_CHECK != 0;
        if has == on {
            return Ok(());
        }
        if on {
            h.features |= F_NEED_CHECK;
        } else {
            self.file.flush()?;
            h.features &= !F_NEED_CHECK;
        }
        self.file.write_at(&h.to_bytes(), 0, WriteFlags::NONE)?;
        if !on {
            self.file.flush()?;
        }
        Ok(())
    }

    /// Writes `buf` at `g` inside one L2 table's range.
    fn write_in_table(&self, buf: &[u8], g: u64) -> Result<()> {
        let h = self.header();
        let cs = h.cluster_size as u64;
        // Clusters already allocated take the data in place.
        let (t, idx) = self.l2_entry(g, &h)?;
        if let Some(t) = t {
            let e = t[idx as usize];
            if e > ZERO_CLUSTER
                && let Place::Data(at) = self.place_of(e, g % cs, &h)?
            {
                let first = (cs - g % cs).min(buf.len() as u64) as usize;
                self.file.write_at(&buf[..first], at, WriteFlags::NONE)?;
                if first < buf.len() {
                    return self.write_in_table(&buf[first..], g + first as u64);
                }
                return Ok(());
            }
        }
        self.allocating_write(g, buf.len() as u64, Some(buf), &h)
    }

    /// An allocating write of `data` at `g` (`None`: whole clusters made
    /// zero clusters), `len` bytes inside one L2 table's range.
    fn allocating_write(&self, g: u64, len: u64, data: Option<&[u8]>, h: &Header) -> Result<()> {
        let zero = data.is_none();
        let cs = h.cluster_size as u64;
        let _one_at_a_time = self.alloc.lock().unwrap_or_else(|p| p.into_inner());
        // Look again under the allocation lock.
        let (table, idx0) = self.l2_entry(g, h)?;
        let mut table: Vec<u64> = match &table {
            Some(t) => t.as_ref().clone(),
            None => vec![0; h.table_entries() as usize],
        };
        let had_table =
            self.l1.read().unwrap_or_else(|p| p.into_inner())[(g / h.l2_span()) as usize];
        if self.backing.is_none() {
            self.set_need_check(true)?;
        }
        let start = g - g % cs;
        let end = (g + len).div_ceil(cs) * cs;
        let n = ((end - start) / cs) as usize;
        let old: Vec<u64> = (0..n).map(|i| table[idx0 as usize + i]).collect();
        let mut changed = Vec::new();
        if zero {
            for (i, &e) in old.iter().enumerate() {
                if e == ZERO_CLUSTER {
                    continue;
                }
                if e > ZERO_CLUSTER {
                    // Allocated: zeros in place, the cluster stays.
                    let zeros = vec![0u8; cs as usize];
                    self.file.write_at(&zeros, e, WriteFlags::NONE)?;
                    continue;
                }
                table[idx0 as usize + i] = ZERO_CLUSTER;
                changed.push(idx0 as usize + i);
            }
        } else if let Some(buf) = data {
            // The clusters assembled: what they read as before, the data
            // over it.
            let mut region = vec![0u8; (end - start) as usize];
            for (i, &e) in old.iter().enumerate() {
                let at = i * cs as usize;
                let piece = &mut region[at..at + cs as usize];
                let pg = start + i as u64 * cs;
                let head_or_tail = pg < g || pg + cs > g + len;
                if head_or_tail && e != ZERO_CLUSTER {
                    let place = self.place_of(e, 0, h)?;
                    mapped::read_place(self, place, pg, piece)?;
                }
            }
            let d = (g - start) as usize;
            region[d..d + buf.len()].copy_from_slice(buf);
            let at = self.file_size();
            self.file.write_extend(&region, at)?;
            self.file_end.store(at + n as u64 * cs, Ordering::Release);
            if self.backing.is_some() {
                self.file.flush()?;
            }
            for i in 0..n {
                table[idx0 as usize + i] = at + i as u64 * cs;
                changed.push(idx0 as usize + i);
            }
        }
        if changed.is_empty() {
            return Ok(());
        }
        let l1_index = (g / h.l2_span()) as usize;
        let table_at = if had_table == 0 {
            // A new L2 table after the data, written whole, then the L1
            // sector that points at it.
            let at = self.file_size();
            self.file.write_extend(&table_bytes(&table), at)?;
            self.file_end.store(at + h.table_bytes(), Ordering::Release);
            self.file.flush()?;
            let mut l1 = self.l1.write().unwrap_or_else(|p| p.into_inner());
            l1[l1_index] = at;
            let first = l1_index / 64 * 64;
            let sector: Vec<u64> = l1.iter().skip(first).take(64).copied().collect();
            self.file.write_at(
                &table_bytes(&sector),
                h.l1_table_offset + first as u64 * 8,
                WriteFlags::NONE,
            )?;
            at
        } else {
            // The sectors of the table holding the changed entries.
            let lo = changed[0] / 64 * 64;
            let hi = (changed[changed.len() - 1] / 64 + 1) * 64;
            let hi = hi.min(table.len());
            self.file.write_at(
                &table_bytes(&table[lo..hi]),
                had_table + lo as u64 * 8,
                WriteFlags::NONE,
            )?;
            had_table
        };
        self.l2
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(table_at, Arc::new(table));
        Ok(())
    }

    fn each_table<F>(&self, offset: u64, len: u64, mut f: F) -> Result<()>
    where
        F: FnMut(u64, u64) -> Result<()>,
    {
        let span = self.header().l2_span();
        let mut pos = offset;
        while pos < offset + len {
            let n = (span - pos % span).min(offset + len - pos);
            f(pos, n)?;
            pos += n;
        }
        Ok(())
    }
}

impl Drop for Qed {
    fn drop(&mut self) {
        if self.writable {
            let _ = self.set_need_check(false);
        }
    }
}

impl MappedFormat for Qed {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .image_size
    }

    fn data(&self) -> &StorageRef {
        &self.file
    }

    fn backing(&self) -> Option<&Backing> {
        self.backing.as_ref()
    }

    fn mappings_change(&self) -> bool {
        self.writable
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

    fn read_compressed(&self, _o: u64, _s: u64, _k: u64, _b: &mut [u8]) -> Result<()> {
        Err(Error::io("QED has no compressed clusters"))
    }
}

impl BlockDevice for Qed {
    fn size(&self) -> u64 {
        self.guest_size()
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.writable, true, false)
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: self.header().cluster_size.min(64 << 10),
            maximum: 32 << 20,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        mapped::read(self, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        if !self.writable {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        check_range(self.size(), offset, buf.len() as u64)?;
        self.each_table(offset, buf.len() as u64, |pos, n| {
            let a = (pos - offset) as usize;
            self.write_in_table(&buf[a..a + n as usize], pos)
        })?;
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if !self.writable {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        check_range(self.size(), offset, len)?;
        let cs = self.header().cluster_size as u64;
        // Whole clusters become zero clusters; the edges get zeros written.
        let a = offset.div_ceil(cs) * cs;
        let b = ((offset + len) / cs * cs).max(a);
        if flags.fast && (a != offset || b != offset + len) {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "partial clusters are written",
            ));
        }
        let edges = [(offset, a.min(offset + len)), (b.max(offset), offset + len)];
        for (s, e) in edges {
            if e > s {
                let zeros = vec![0u8; (e - s) as usize];
                self.write_at(&zeros, s, WriteFlags::NONE)?;
            }
        }
        if b > a {
            self.each_table(a, b - a, |pos, n| {
                self.allocating_write(pos, n, None, &self.header())
            })?;
        }
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.file.flush()?;
        if self.writable {
            self.set_need_check(false)?;
        }
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        mapped::extents(self, offset, len)
    }

    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        mapped::file_view(self, offset, len)
    }

    fn describe(&self) -> String {
        format!("qed {}", self.file.location())
    }
}
