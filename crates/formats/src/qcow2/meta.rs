//! The mutable metadata of an open image: the active L1 table, the L2
//! table cache, the refcounts, deferred refcount decrements and the guest
//! ranges that requests in flight are using.
//!
//! All of it sits behind one mutex that is held only to look things up and
//! to change them, never while guest data moves.
//!
//! On storage written front to back the L2 tables made while writing are
//! held in memory, and placed after the data at the end ([`deferred`]).

use std::collections::{BTreeMap, BTreeSet};

use diskit_core::{BlockDevice, Error, ErrorKind, Result, WriteFlags};
use diskit_core::{Storage, StorageRef};

use super::cache::TableCache;
use super::l2::{COPIED, ClusterKind, DecodeContext, L1E_OFFSET_MASK, L1E_RESERVED, L2Entry};
use diskit_core::range_lock::RangeSet;

use super::layout::{Geometry, GuestOffset, HostCluster, HostOffset};
use super::refcount::Refcounts;
use super::table::{corrupt, read_u64_table, u64_table_bytes};

pub use diskit_core::range_lock::RangeTicket;

pub mod deferred;

/// Metadata state of an image.
pub struct Meta {
    /// The image file.
    pub file: StorageRef,
    /// Decoding context (geometry, version, data file).
    pub cx: DecodeContext,
    /// Active L1 table.
    pub l1: Vec<u64>,
    /// Where the active L1 table lives.
    pub l1_offset: HostOffset,
    l1_dirty: BTreeSet<usize>,
    l2: TableCache<Vec<L2Entry>>,
    /// Refcounts (loaded for writable images).
    pub refs: Option<Refcounts>,
    /// Refcount changes that wait until the tables that dropped the
    /// references are on disk.
    pending: Vec<(HostCluster, i64)>,
    /// Guest clusters in use by requests in flight (the core range lock's
    /// bookkeeping, kept under this mutex so that a lookup and taking its
    /// range are one critical section).
    inflight: RangeSet,
    /// Where the next compressed cluster may be packed (inside a partly
    /// used host cluster), as QEMU's free_byte_offset.
    free_byte: u64,
    /// File length when last checked (metadata past it is refused).
    file_len: u64,
    /// Deferred placement ([`deferred`]): the L2 tables made since, not
    /// placed yet, by L1 index; `None` when new tables are placed at once.
    unplaced: Option<BTreeMap<usize, Vec<L2Entry>>>,
}

impl Meta {
    /// Loads and validates the active L1 table.
    pub fn load(
        file: StorageRef,
        cx: DecodeContext,
        l1_offset: u64,
        l1_size: u32,
        l2_cache_tables: usize,
        refs: Option<Refcounts>,
    ) -> Result<Meta> {
        let file_len = file.file_len()?;
        let cs = cx.geo.cluster_size();
        let bytes = l1_size as u64 * 8;
        if l1_size > 0
            && (l1_offset < cs
                || l1_offset
                    .checked_add(bytes)
                    .is_none_or(|end| end > file_len))
        {
            return Err(corrupt(format!(
                "L1 table at {l1_offset:#x} ({l1_size} entries) is outside the file"
            )));
        }
        let l1 = read_u64_table(&file, l1_offset, l1_size as u64)?;
        Ok(Meta {
            file,
            cx,
            l1,
            l1_offset: HostOffset(l1_offset),
            l1_dirty: BTreeSet::new(),
            l2: TableCache::new(l2_cache_tables),
            refs,
            pending: Vec::new(),
            inflight: RangeSet::default(),
            free_byte: 0,
            file_len,
            unplaced: None,
        })
    }

    fn geo(&self) -> &Geometry {
        &self.cx.geo
    }

    /// The L2 table offset for an L1 index (validated), or None when unallocated.
    pub fn l2_offset(&mut self, l1i: usize) -> Result<Option<HostOffset>> {
        let Some(&e) = self.l1.get(l1i) else {
            return Ok(None);
        };
        let off = e & L1E_OFFSET_MASK;
        if off == 0 {
            return Ok(None);
        }
        if e & L1E_RESERVED != 0 || !self.geo().is_cluster_aligned(HostOffset(off)) {
            return Err(corrupt(format!("L1 entry {l1i} ({e:#018x}) is invalid")));
        }
        if off < self.geo().cluster_size() {
            return Err(corrupt(format!(
                "L1 entry {l1i} points at the image header"
            )));
        }
        Ok(Some(HostOffset(off)))
    }

    /// The L2 table for an L1 index (held in memory or loaded), or None
    /// when there is none.
    pub fn l2_of(&mut self, l1i: usize) -> Result<Option<&mut Vec<L2Entry>>> {
        if self.is_unplaced(l1i) {
            return Ok(self.unplaced.as_mut().and_then(|u| u.get_mut(&l1i)));
        }
        match self.l2_offset(l1i)? {
            None => Ok(None),
            Some(at) => self.l2_table(at).map(Some),
        }
    }

    /// Whether the L1 index has an L2 table (placed or held in memory).
    pub fn has_l2(&mut self, l1i: usize) -> Result<bool> {
        Ok(self.is_unplaced(l1i) || self.l2_offset(l1i)?.is_some())
    }

    /// Whether the L2 table of an L1 index is held in memory, not placed.
    fn is_unplaced(&self, l1i: usize) -> bool {
        self.unplaced.as_ref().is_some_and(|u| u.contains_key(&l1i))
    }

    /// Makes room in the L2 cache, writing a dirty victim (after the
    /// refcounts it depends on).
    fn evict_l2(&mut self) -> Result<()> {
        let Some(victim) = self.l2.victim() else {
            return Ok(());
        };
        if self.l2.peek_mut(victim).is_some_and(|s| s.dirty) {
            if let Some(refs) = self.refs.as_mut()
                && refs.write_dirty()?
            {
                self.file.flush()?;
            }
            let slot = self.l2.peek_mut(victim).expect("victim is cached");
            let raw = encode_l2(&slot.table, self.cx.geo.extended_l2);
            self.file.write_extend(&raw, victim.0)?;
        }
        self.l2.remove(victim);
        Ok(())
    }

    /// The L2 table at `at`, loading it on a miss.
    pub fn l2_table(&mut self, at: HostOffset) -> Result<&mut Vec<L2Entry>> {
        if !self.l2.contains(at) {
            if at.0 >= self.file_len {
                self.file_len = self.file.file_len()?;
                if at.0 >= self.file_len {
                    return Err(corrupt(format!(
                        "L2 table offset {at} is past the end of the file"
                    )));
                }
            }
            if self.overlaps_l1(at) {
                return Err(corrupt(format!(
                    "L2 table offset {at} overlaps the L1 table"
                )));
            }
            let mut raw = vec![0u8; self.geo().cluster_size() as usize];
            self.file.read_padded(&mut raw, at.0)?;
            let table = decode_l2(&raw, self.cx.geo.extended_l2);
            self.evict_l2()?;
            self.l2.insert(at, table, false);
        }
        Ok(&mut self.l2.get(at).expect("cached").table)
    }

    fn overlaps_l1(&self, at: HostOffset) -> bool {
        let start = self.l1_offset.0;
        let end = start + self.l1.len() as u64 * 8;
        at.0 < end && at.0 + self.geo().cluster_size() > start
    }

    /// The L2 entry for a guest offset (all zeros when its table is unallocated).
    pub fn entry(&mut self, g: GuestOffset) -> Result<L2Entry> {
        let geo = *self.geo();
        match self.l2_of(geo.l1_index(g))? {
            None => Ok(L2Entry::default()),
            Some(table) => Ok(table[geo.l2_index(g)]),
        }
    }

    /// Decodes the entry for a guest offset.
    pub fn kind(&mut self, g: GuestOffset) -> Result<(L2Entry, ClusterKind)> {
        let e = self.entry(g)?;
        let start = self.geo().cluster_start(g).0;
        let k = e.decode(&self.cx, start)?;
        Ok((e, k))
    }

    /// The refcounts, which writable images always have.
    pub fn refs(&mut self) -> Result<&mut Refcounts> {
        self.refs
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::PermissionDenied, "image is read-only"))
    }

    /// An L2 table for `g` that may be changed: allocated if missing, copied
    /// if shared with a snapshot. Its place, or None for a table held in
    /// memory until deferred placement.
    pub fn l2_for_write(&mut self, g: GuestOffset) -> Result<Option<HostOffset>> {
        let geo = *self.geo();
        let l1i = geo.l1_index(g);
        if l1i >= self.l1.len() {
            return Err(Error::invalid("guest offset beyond the L1 table"));
        }
        if self.is_unplaced(l1i) {
            return Ok(None);
        }
        let e = self.l1[l1i];
        let old = self.l2_offset(l1i)?;
        if let Some(at) = old {
            if e & COPIED != 0 {
                return Ok(Some(at));
            }
            if self.refs()?.get(geo.host_cluster(at))? == 1 {
                self.l1[l1i] = at.0 | COPIED;
                self.l1_dirty.insert(l1i);
                return Ok(Some(at));
            }
        }
        // A new table gets its cluster now, or at the end when deferred.
        let at = match self.unplaced {
            Some(_) => None,
            None => Some(geo.host_offset(self.refs()?.alloc(1)?.0)),
        };
        let table = match old {
            Some(old_at) => {
                let mut t = self.l2_table(old_at)?.clone();
                for entry in t.iter_mut() {
                    entry.word &= !COPIED;
                }
                self.pending.push((geo.host_cluster(old_at), -1));
                t
            }
            None => vec![L2Entry::default(); geo.l2_entries() as usize],
        };
        let Some(at) = at else {
            if let Some(unplaced) = self.unplaced.as_mut() {
                unplaced.insert(l1i, table);
            }
            return Ok(None);
        };
        self.evict_l2()?;
        self.l2.insert(at, table, true);
        self.l1[l1i] = at.0 | COPIED;
        self.l1_dirty.insert(l1i);
        Ok(Some(at))
    }

    /// Sets the L2 entry for `g` (its table must come from [`Self::l2_for_write`]).
    pub fn set_entry(&mut self, g: GuestOffset, e: L2Entry) -> Result<()> {
        let geo = *self.geo();
        let i = geo.l2_index(g);
        match self.l2_for_write(g)? {
            Some(at) => {
                self.l2_table(at)?[i] = e;
                self.l2.get(at).expect("cached").dirty = true;
            }
            None => {
                let table = self.l2_of(geo.l1_index(g))?.ok_or_else(|| {
                    Error::new(ErrorKind::Io, "qcow2: an L2 table held in memory is gone")
                })?;
                table[i] = e;
            }
        }
        Ok(())
    }

    /// Queues a refcount change to apply once the L2/L1 tables are on disk.
    pub fn defer_refcount(&mut self, c: HostCluster, delta: i64) {
        self.pending.push((c, delta));
    }

    /// Releases the host clusters of an entry being dropped (deferred).
    pub fn release(&mut self, kind: ClusterKind) {
        let geo = *self.geo();
        match kind {
            ClusterKind::Normal(h) | ClusterKind::ZeroAlloc(h) if !self.cx.external_data => {
                self.defer_refcount(geo.host_cluster(h), -1);
            }
            ClusterKind::Compressed(c) => {
                let (start, end) = c.sector_range();
                for hc in (start >> geo.cluster_bits)..=((end - 1) >> geo.cluster_bits) {
                    self.defer_refcount(HostCluster(hc), -1);
                }
            }
            _ => {}
        }
    }

    /// Allocates `size` bytes (less than a cluster) for compressed data,
    /// packed after the previous compressed cluster when it fits. Every
    /// host cluster the bytes touch gains one reference.
    pub fn alloc_bytes(&mut self, size: u64) -> Result<HostOffset> {
        let geo = *self.geo();
        let cs = geo.cluster_size();
        let off = self.free_byte;
        // Written front to back, bytes are packed only into the last
        // cluster (one further back may be written already).
        let packable = self.unplaced.is_none()
            || geo.host_cluster(HostOffset(off)).0 + 1 == self.refs()?.top().0;
        if !off.is_multiple_of(cs) && packable {
            let cluster = geo.host_cluster(HostOffset(off));
            let room = cs - off % cs;
            if size <= room {
                self.refs()?.adjust(cluster, 1)?;
                self.free_byte = off + size;
                return Ok(HostOffset(off));
            }
            // Spill into the next cluster when it is free.
            let refs = self.refs()?;
            if refs.get(HostCluster(cluster.0 + 1))? == 0 && refs.top().0 <= cluster.0 + 1 {
                let (c, _) = refs.alloc(1)?;
                if c.0 == cluster.0 + 1 {
                    refs.adjust(cluster, 1)?;
                    self.free_byte = off + size;
                    return Ok(HostOffset(off));
                }
                refs.set(c, 0)?;
            }
        }
        let n = size.div_ceil(cs);
        let (c, _) = self.refs()?.alloc(n)?;
        let at = geo.host_offset(c);
        self.free_byte = at.0 + size;
        Ok(at)
    }

    /// Moves the active L1 table to a new place with `entries` entries
    /// (growing it), written before the header points at it.
    pub fn relocate_l1(&mut self, entries: usize) -> Result<()> {
        let geo = *self.geo();
        let cs = geo.cluster_size();
        if entries as u64 * 8 > 32 << 20 {
            return Err(Error::invalid("Active L1 table too large"));
        }
        // Pending L1 changes land in the old table first.
        self.write_back()?;
        let mut l1 = self.l1.clone();
        l1.resize(entries, 0);
        let clusters = (entries as u64 * 8).div_ceil(cs).max(1);
        let (c, _) = self.refs()?.alloc(clusters)?;
        let at = geo.host_offset(c);
        // Only the table is written, as QEMU does: at the end of the file
        // the file then ends with it.
        self.file
            .write_extend(&u64_table_bytes(&l1, entries * 8), at.0)?;
        self.write_back()?;
        self.file.flush()?;
        let mut hdr = [0u8; 12];
        hdr[..4].copy_from_slice(&(entries as u32).to_be_bytes());
        hdr[4..].copy_from_slice(&at.0.to_be_bytes());
        self.file.write_extend(&hdr, 36)?;
        self.file.flush()?;
        let old_first = geo.host_cluster(self.l1_offset).0;
        let old_clusters = (self.l1.len() as u64 * 8).div_ceil(cs);
        self.l1 = l1;
        self.l1_offset = at;
        for k in 0..old_clusters {
            self.refs()?.adjust(HostCluster(old_first + k), -1)?;
        }
        Ok(())
    }

    /// Drops every L2 table from the L1 entry `first` on (after a shrink).
    pub fn drop_l2_tables_from(&mut self, first: usize) -> Result<()> {
        let geo = *self.geo();
        for i in first..self.l1.len() {
            if let Some(at) = self.l2_offset(i)? {
                if let Some(slot) = self.l2.remove(at) {
                    drop(slot);
                }
                self.l1[i] = 0;
                self.l1_dirty.insert(i);
                self.pending.push((geo.host_cluster(at), -1));
            }
        }
        Ok(())
    }

    /// Marks the cached L2 table at `at` (loaded with [`Self::l2_table`])
    /// as changed, to be written by [`Self::write_back`].
    pub fn mark_l2_dirty(&mut self, at: HostOffset) {
        if let Some(slot) = self.l2.get(at) {
            slot.dirty = true;
        }
    }

    /// Drops the L2 table at `at` from the cache without writing it: its
    /// cluster has just been freed.
    pub fn forget_l2(&mut self, at: HostOffset) {
        self.l2.remove(at);
    }

    /// Replaces the active L1 entries (the table keeps its place and
    /// length), marking the entries that change for write-back.
    pub fn replace_l1(&mut self, l1: &[u64]) {
        debug_assert_eq!(l1.len(), self.l1.len());
        for (i, (old, new)) in self.l1.iter_mut().zip(l1).enumerate() {
            if old != new {
                *old = *new;
                self.l1_dirty.insert(i);
            }
        }
    }

    /// Whether any metadata waits to be written.
    pub fn is_dirty(&self) -> bool {
        !self.l1_dirty.is_empty()
            || self.l2.any_dirty()
            || !self.pending.is_empty()
            || self.refs.as_ref().is_some_and(|r| r.is_dirty())
    }

    /// Writes all metadata in dependency order: refcount blocks, a barrier,
    /// L2 tables, the L1 entries, a barrier; then applies the deferred
    /// refcount decrements (written by the next call).
    pub fn write_back(&mut self) -> Result<()> {
        let tables_dirty = self.l2.any_dirty() || !self.l1_dirty.is_empty();
        if let Some(refs) = self.refs.as_mut()
            && refs.write_dirty()?
            && tables_dirty
        {
            self.file.flush()?;
        }
        let ext = self.cx.geo.extended_l2;
        for at in self.l2.dirty() {
            let slot = self.l2.peek_mut(at).expect("dirty table is cached");
            let raw = encode_l2(&slot.table, ext);
            slot.dirty = false;
            self.file.write_extend(&raw, at.0)?;
        }
        if let (Some(&first), Some(&last)) = (self.l1_dirty.first(), self.l1_dirty.last()) {
            let raw = u64_table_bytes(&self.l1[first..=last], 0);
            self.file
                .write_extend(&raw, self.l1_offset.0 + first as u64 * 8)?;
            self.l1_dirty.clear();
        }
        if tables_dirty {
            self.file.flush()?;
        }
        let pending = std::mem::take(&mut self.pending);
        if !pending.is_empty() {
            let refs = self.refs()?;
            for (c, d) in pending {
                refs.adjust(c, d)?;
            }
        }
        Ok(())
    }

    /// Punches holes in the file where clusters were freed since
    /// [`Refcounts::note_freed`], as QEMU discards the clusters a shrink or
    /// a snapshot deletion frees: the space goes back to the file system.
    /// Call it once the tables that referenced them are on disk; clusters
    /// allocated again meanwhile are left alone.
    pub fn discard_freed(&mut self) -> Result<()> {
        let cs = self.cx.geo.cluster_size();
        let freed = self.refs()?.take_freed()?;
        discard_clusters(&self.file, cs, freed)
    }

    /// Takes guest clusters `first..=last` for a request, shared (data I/O
    /// on clusters whose mapping stays) or exclusive (mapping changes).
    /// Returns None when another request holds a conflicting range.
    pub fn try_take(&mut self, first: u64, last: u64, exclusive: bool) -> Option<RangeTicket> {
        self.inflight.try_take(first, last + 1, exclusive)
    }

    /// Gives back a range taken with [`Self::try_take`].
    pub fn give_back(&mut self, t: RangeTicket) {
        self.inflight.give_back(t);
    }
}

/// Decodes an L2 table from its on-disk bytes.
pub fn decode_l2(raw: &[u8], extended: bool) -> Vec<L2Entry> {
    let be = |c: &[u8]| u64::from_be_bytes(c.try_into().unwrap());
    if extended {
        raw.chunks_exact(16)
            .map(|c| L2Entry {
                word: be(&c[..8]),
                bitmap: be(&c[8..]),
            })
            .collect()
    } else {
        raw.chunks_exact(8)
            .map(|c| L2Entry {
                word: be(c),
                bitmap: 0,
            })
            .collect()
    }
}

/// Encodes an L2 table to its on-disk bytes.
pub fn encode_l2(table: &[L2Entry], extended: bool) -> Vec<u8> {
    let mut raw = Vec::with_capacity(table.len() * if extended { 16 } else { 8 });
    for e in table {
        raw.extend_from_slice(&e.word.to_be_bytes());
        if extended {
            raw.extend_from_slice(&e.bitmap.to_be_bytes());
        }
    }
    raw
}

/// Hands the clusters `freed` back to the file system (punched holes, runs
/// at a time; a file system that cannot punch keeps them), as QEMU
/// discards clusters whose refcount drops to zero.
pub fn discard_clusters(file: &StorageRef, cs: u64, freed: Vec<HostCluster>) -> Result<()> {
    if freed.is_empty() {
        return Ok(());
    }
    let len = file.file_len()?;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for c in freed {
        match runs.last_mut() {
            Some((start, n)) if *start + *n == c.0 => *n += 1,
            _ => runs.push((c.0, 1)),
        }
    }
    for (start, n) in runs {
        let from = start * cs;
        let to = ((start + n) * cs).min(len);
        if from >= to {
            continue;
        }
        match file.trim(from, to - from, WriteFlags::NONE) {
            Err(e) if e.kind() == ErrorKind::NotSupported => {}
            r => r?,
        }
    }
    Ok(())
}
