//! Where `qemu-img create -f qcow2` puts everything.
//!
//! QEMU does not compute a qcow2 layout from a formula: it writes a minimal
//! image (header, a one-cluster refcount table, one empty refcount block),
//! opens it, and then *grows* it with its general-purpose allocator: the L1
//! table, refcount blocks allocated on demand (which restarts allocations),
//! refcount tables that are outgrown and replaced (leaving the old table's
//! bytes behind in a freed cluster), L2 tables and data clusters for
//! preallocation. The result is deterministic, so the only way to produce
//! the same bytes is to make the same decisions in the same order.
//!
//! [`Planner`] replays those decisions in memory, compactly: refcounts are
//! a set of cluster ranges (a new image only ever holds refcounts 0 and 1),
//! L2 tables are runs of guest→host mappings. Nothing is written here; the
//! result is a [`Plan`] from which the image and data file contents are
//! generated piece by piece.

use std::collections::BTreeMap;

use super::header::{CompressionType, Header, HeaderExtension, autoclear, compat, ext, incompat};

/// Largest refcount table QEMU creates, in entries (its 8 MiB limit applied
/// to the entry count, as QEMU compares it).
const MAX_REFTABLE_ENTRIES: u64 = 8 << 20;
/// Largest active L1 table, in entries (32 MiB).
const MAX_L1_ENTRIES: u64 = (32 << 20) / 8;
/// Host offsets must stay below 2^56.
const MAX_CLUSTER_OFFSET: u64 = (1 << 56) - 1;
/// The largest request QEMU's block layer passes down (`BDRV_REQUEST_MAX_BYTES`).
const REQUEST_MAX_BYTES: u64 = ((i32::MAX as u64) >> 9) << 9;
/// L1/L2 "refcount is exactly one" flag.
const COPIED: u64 = 1 << 63;
/// Upper bound on allocation retries: QEMU's loops always terminate, this
/// only turns a bug into an error instead of a hang.
const MAX_RETRIES: u64 = 1 << 32;

/// Why a planning step failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// QEMU's -EAGAIN: metadata was allocated, restart the allocation.
    Again,
    /// QEMU's -EFBIG: the image needs tables larger than the format allows.
    TooBig,
    /// A state QEMU would report as corruption or a failed assertion.
    Internal(String),
}

type PResult<T> = std::result::Result<T, PlanError>;

fn internal(msg: impl Into<String>) -> PlanError {
    PlanError::Internal(msg.into())
}

/// How the image's space is reserved (qcow2's `preallocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prealloc {
    /// Nothing beyond the L1 table.
    #[default]
    Off,
    /// L2 tables for the whole disk, data clusters allocated but not written.
    Metadata,
    /// Like metadata, with the data space reserved by fallocate.
    Falloc,
    /// Like metadata, with the data space written with zeros.
    Full,
}

impl Prealloc {
    /// qemu-img's name for the mode.
    pub fn name(self) -> &'static str {
        match self {
            Prealloc::Off => "off",
            Prealloc::Metadata => "metadata",
            Prealloc::Falloc => "falloc",
            Prealloc::Full => "full",
        }
    }
}

/// The on-disk format parameters that shape the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// log2 of the refcount width (0..=6).
    pub refcount_order: u32,
    /// 128-bit L2 entries.
    pub extended_l2: bool,
}

impl Geometry {
    /// Cluster size in bytes.
    pub fn cluster_size(self) -> u64 {
        1 << self.cluster_bits
    }

    /// Bytes per L2 entry.
    pub fn l2_entry_size(self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// Entries per L2 table.
    pub fn l2_entries(self) -> u64 {
        self.cluster_size() / self.l2_entry_size()
    }

    /// Refcounts per refcount block.
    pub fn refblock_entries(self) -> u64 {
        (self.cluster_size() * 8) >> self.refcount_order
    }

    /// L1 entries needed for `size` bytes of guest disk (`size_to_l1`).
    pub fn l1_entries_for(self, size: u64) -> u64 {
        let per_l2 = self.cluster_size() as u128 * self.l2_entries() as u128;
        (size as u128).div_ceil(per_l2) as u64
    }
}

/// The number of refcount blocks and the bytes of refcount metadata (blocks
/// plus table) needed to refcount `clusters` clusters and the metadata
/// itself: QEMU's `qcow2_refcount_metadata_size`, a fixed-point iteration.
/// With `generous`, the table gets room for 50% more blocks.
pub fn refcount_metadata_size(
    clusters: u64,
    cluster_size: u64,
    refcount_order: u32,
    generous: bool,
) -> (u64, u64) {
    let per_table_cluster = (cluster_size / 8) as u128;
    let per_block = ((cluster_size * 8) >> refcount_order) as u128;
    let mut clusters = clusters as u128;
    let mut generous = generous;
    let (mut table, mut blocks, mut n) = (0u128, 0u128, 0u128);
    loop {
        let last = n;
        blocks = (clusters + table + blocks).div_ceil(per_block);
        table = blocks.div_ceil(per_table_cluster);
        n = clusters + blocks + table;
        if n == last && generous {
            clusters += table.div_ceil(2);
            n = 0;
            generous = false;
        }
        if n == last {
            break;
        }
    }
    let bytes = (blocks + table).saturating_mul(cluster_size as u128);
    (
        u64::try_from(blocks).unwrap_or(u64::MAX),
        u64::try_from(bytes).unwrap_or(u64::MAX),
    )
}

/// A set of clusters, as disjoint half-open ranges (start → end).
#[derive(Debug, Clone, Default)]
struct ClusterSet {
    ranges: BTreeMap<u64, u64>,
}

impl ClusterSet {
    /// The range holding `c`, if any.
    fn range_of(&self, c: u64) -> Option<(u64, u64)> {
        self.ranges
            .range(..=c)
            .next_back()
            .filter(|&(_, &e)| e > c)
            .map(|(&s, &e)| (s, e))
    }

    #[cfg(test)]
    fn contains(&self, c: u64) -> bool {
        self.range_of(c).is_some()
    }

    /// The first range intersecting `start..end`.
    fn first_overlap(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        if let Some(r) = self.range_of(start) {
            return Some(r);
        }
        self.ranges.range(start..end).next().map(|(&s, &e)| (s, e))
    }

    /// Adds `start..end`, which must not intersect the set.
    fn insert(&mut self, start: u64, end: u64) -> PResult<()> {
        if start >= end {
            return Ok(());
        }
        if self.first_overlap(start, end).is_some() {
            return Err(internal("refcount of an allocated cluster would exceed 1"));
        }
        let mut s = start;
        let mut e = end;
        if let Some((ps, pe)) = self
            .ranges
            .range(..start)
            .next_back()
            .map(|(&a, &b)| (a, b))
            && pe == start
        {
            self.ranges.remove(&ps);
            s = ps;
        }
        if let Some(ne) = self.ranges.get(&end).copied() {
            self.ranges.remove(&end);
            e = ne;
        }
        self.ranges.insert(s, e);
        Ok(())
    }

    /// Removes `start..end`, which must be wholly in the set.
    fn remove(&mut self, start: u64, end: u64) -> PResult<()> {
        if start >= end {
            return Ok(());
        }
        match self.range_of(start) {
            Some((s, e)) if e >= end => {
                self.ranges.remove(&s);
                if s < start {
                    self.ranges.insert(s, start);
                }
                if end < e {
                    self.ranges.insert(end, e);
                }
                Ok(())
            }
            _ => Err(internal("refcount of a free cluster would drop below 0")),
        }
    }

    /// The parts of the set within `start..end`.
    fn clipped(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let first = self.range_of(start).map(|(s, _)| s).unwrap_or(start);
        self.ranges
            .range(first..end)
            .map(move |(&s, &e)| (s.max(start), e.min(end)))
            .filter(|(s, e)| s < e)
    }
}

/// A write's copy-on-write tail (`cow_end`): bytes after the written range
/// up to the end of its (sub)cluster, read from the image (zeros during
/// creation) and written to the new cluster.
#[derive(Debug, Clone, Copy)]
struct L2Meta {
    /// Guest offset of the first cluster.
    guest: u64,
    /// Host offset of the first cluster.
    host: u64,
    /// Clusters mapped.
    clusters: u64,
    /// Copy-on-write tail: offset from `guest` and length.
    cow_end: (u64, u64),
}

/// Everything `qemu-img create -f qcow2` decides, for one set of options.
#[derive(Debug, Clone)]
pub struct Plan {
    geo: Geometry,
    data_file: bool,
    used: ClusterSet,
    reftable: Vec<u64>,
    reftable_offset: u64,
    max_reftable_index: usize,
    free_cluster_index: u64,
    l1: Vec<u64>,
    l1_offset: u64,
    /// guest cluster → (host offset of that cluster, clusters in the run).
    runs: BTreeMap<u64, (u64, u64)>,
    file_len: u64,
    stale: Vec<(u64, Vec<u8>)>,
    zero_writes: Vec<(u64, u64)>,
    reserved: Option<(u64, u64)>,
    data_len: u64,
    data_zero_writes: Vec<(u64, u64)>,
    data_reserved: Option<(u64, u64)>,
    data_first_block: bool,
    size: u64,
    retries: u64,
}

impl Plan {
    /// The state right after QEMU's `qcow2_co_create` wrote its minimal
    /// image (header cluster, a one-cluster refcount table pointing at an
    /// empty refcount block) and allocated those three clusters.
    fn new(geo: Geometry, data_file: bool) -> PResult<Plan> {
        let cs = geo.cluster_size();
        let mut reftable = vec![0u64; (cs / 8) as usize];
        reftable[0] = 2 * cs;
        let mut p = Plan {
            geo,
            data_file,
            used: ClusterSet::default(),
            reftable,
            reftable_offset: cs,
            max_reftable_index: 0,
            free_cluster_index: 0,
            l1: Vec::new(),
            l1_offset: 0,
            runs: BTreeMap::new(),
            file_len: 3 * cs,
            stale: Vec::new(),
            zero_writes: Vec::new(),
            reserved: None,
            data_len: 0,
            data_zero_writes: Vec::new(),
            data_reserved: None,
            data_first_block: false,
            size: 0,
            retries: 0,
        };
        let first = p.alloc_clusters(3 * cs)?;
        if first != 0 {
            return Err(internal("first cluster in empty image is already in use"));
        }
        Ok(p)
    }

    /// Plans a whole creation: QEMU's `qcow2_co_create` from the minimal
    /// image on, i.e. `qcow2_co_truncate(size, prealloc)` on it. `size` must
    /// be a multiple of 512.
    pub fn create(geo: Geometry, size: u64, prealloc: Prealloc, data_file: bool) -> PResult<Plan> {
        let mut p = Plan::new(geo, data_file)?;
        p.truncate(size, prealloc)?;
        Ok(p)
    }

    fn cs(&self) -> u64 {
        self.geo.cluster_size()
    }

    fn rb_bits(&self) -> u32 {
        self.geo.cluster_bits + 3 - self.geo.refcount_order
    }

    fn written(&mut self, offset: u64, len: u64) {
        self.file_len = self.file_len.max(offset + len);
    }

    fn retry(&mut self) -> PResult<()> {
        self.retries += 1;
        if self.retries > MAX_RETRIES {
            return Err(internal("allocation does not converge"));
        }
        Ok(())
    }

    // ---- refcounts (qcow2-refcount.c) ------------------------------------

    /// `alloc_clusters_noref`: the first run of free clusters at or after
    /// the free cluster index, which moves past it. (A cluster's refcount
    /// is in `used` only while its refcount block exists or is being
    /// created, so `used` alone says what is free.)
    fn alloc_noref(&mut self, size: u64, max: u64) -> PResult<u64> {
        let n = size.div_ceil(self.cs());
        let mut q = self.free_cluster_index;
        while let Some((_, e)) = self.used.first_overlap(q, q + n) {
            q = e;
        }
        self.free_cluster_index = q + n;
        if self.free_cluster_index > 0
            && self.free_cluster_index - 1 > (max >> self.geo.cluster_bits)
        {
            return Err(PlanError::TooBig);
        }
        Ok(q << self.geo.cluster_bits)
    }

    /// `update_refcount` by ±1 over the clusters of `offset..offset+len`,
    /// allocating refcount blocks as needed and undoing a partial update on
    /// failure.
    fn update_refcount(&mut self, offset: u64, len: u64, decrease: bool) -> PResult<()> {
        if len == 0 {
            return Ok(());
        }
        let cb = self.geo.cluster_bits;
        let start = offset >> cb;
        let last = (offset + len - 1) >> cb;
        let rb_bits = self.rb_bits();
        let mut c = start;
        while c <= last {
            let seg_end = (last + 1).min(((c >> rb_bits) + 1) << rb_bits);
            if let Err(e) = self.alloc_refcount_block(c) {
                if e == PlanError::Again {
                    self.free_cluster_index = self.free_cluster_index.min(start);
                }
                if c > start {
                    let _ = self.update_refcount(start << cb, (c - start) << cb, !decrease);
                }
                return Err(e);
            }
            if decrease {
                self.used.remove(c, seg_end)?;
                self.free_cluster_index = self.free_cluster_index.min(c);
            } else {
                self.used.insert(c, seg_end)?;
            }
            c = seg_end;
        }
        Ok(())
    }

    /// `alloc_refcount_block`: makes sure the refcount block for `cluster`
    /// exists. Creating one always ends in [`PlanError::Again`].
    fn alloc_refcount_block(&mut self, cluster: u64) -> PResult<()> {
        let cs = self.cs();
        let rb_bits = self.rb_bits();
        let idx = cluster >> rb_bits;
        if let Some(&b) = self.reftable.get(idx as usize)
            && b != 0
        {
            return Ok(());
        }
        let new_block = self.alloc_noref(cs, i64::MAX as u64)?;
        if new_block == 0 {
            return Err(internal(
                "Preventing invalid allocation of refcount block at offset 0",
            ));
        }
        let nb_cluster = new_block / cs;
        if nb_cluster >> rb_bits == idx {
            // The block describes itself.
            self.used.insert(nb_cluster, nb_cluster + 1)?;
        } else {
            self.update_refcount(new_block, cs, false)?;
        }
        self.written(new_block, cs);
        if (idx as usize) < self.reftable.len() {
            self.reftable[idx as usize] = new_block;
            self.max_reftable_index = self.max_reftable_index.max(idx as usize);
            return Err(PlanError::Again);
        }
        // The table is full: new self-describing refcount structures go
        // after everything that is, or will be, described so far.
        let per_block = self.geo.refblock_entries();
        let blocks_used = (cluster + 1).max(nb_cluster + 1).div_ceil(per_block);
        let meta_offset = blocks_used * per_block * cs;
        self.refcount_area(meta_offset, 0, false, idx as usize, new_block)?;
        Err(PlanError::Again)
    }

    /// `qcow2_refcount_area`: a new refcount table and the refcount blocks
    /// covering themselves and `additional` clusters after them, starting
    /// at `start` (the end of everything in use). Returns where the
    /// additional clusters go.
    fn refcount_area(
        &mut self,
        start: u64,
        additional: u64,
        exact: bool,
        new_index: usize,
        new_block: u64,
    ) -> PResult<u64> {
        let cs = self.cs();
        let per_block = self.geo.refblock_entries();
        let (total, _) =
            refcount_metadata_size(start / cs + additional, cs, self.geo.refcount_order, !exact);
        if total > MAX_REFTABLE_ENTRIES {
            return Err(PlanError::TooBig);
        }
        let area_index = (start / cs) / per_block;
        let mut table_size = if exact {
            total
        } else {
            total + total.div_ceil(2)
        };
        table_size = table_size.next_multiple_of(cs / 8);
        if table_size > MAX_REFTABLE_ENTRIES {
            return Err(PlanError::TooBig);
        }
        let table_clusters = table_size * 8 / cs;
        let mut table = vec![0u64; table_size as usize];
        let keep = if table_size as usize > self.max_reftable_index {
            self.max_reftable_index + 1
        } else {
            table_size as usize
        };
        table[..keep].copy_from_slice(&self.reftable[..keep]);
        if new_block != 0 {
            if new_index as u64 >= total {
                return Err(internal("new refcount block outside the new table"));
            }
            table[new_index] = new_block;
        }
        let new_blocks = table[area_index as usize..total as usize]
            .iter()
            .filter(|&&b| b == 0)
            .count() as u64;
        let table_offset = start + new_blocks * cs;
        let end_offset = table_offset + table_clusters * cs;
        let mut block_offset = start;
        for i in area_index..total {
            if table[i as usize] == 0 {
                table[i as usize] = block_offset;
                self.written(block_offset, cs);
                block_offset += cs;
            }
            let first = i * per_block;
            if first * cs < end_offset {
                let j = if first * cs < start {
                    start / cs - first
                } else {
                    0
                };
                let end_index = (end_offset / cs - first).min(per_block);
                self.used.insert(first + j, first + end_index)?;
            }
        }
        self.written(table_offset, table_size * 8);
        // Switch tables; the old one's bytes stay where they were.
        let old_offset = self.reftable_offset;
        let old_len = self.reftable.len() as u64;
        let old_bytes: Vec<u8> = self.reftable.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.stale.push((old_offset, old_bytes));
        self.reftable = table;
        self.reftable_offset = table_offset;
        self.max_reftable_index = self.reftable.iter().rposition(|&b| b != 0).unwrap_or(0);
        self.free_clusters(old_offset, old_len * 8);
        Ok(end_offset)
    }

    /// `qcow2_alloc_clusters`.
    fn alloc_clusters(&mut self, size: u64) -> PResult<u64> {
        loop {
            let off = self.alloc_noref(size, MAX_CLUSTER_OFFSET)?;
            match self.update_refcount(off, size, false) {
                Ok(()) => return Ok(off),
                Err(PlanError::Again) => self.retry()?,
                Err(e) => return Err(e),
            }
        }
    }

    /// `qcow2_alloc_clusters_at`: allocates up to `n` free clusters at
    /// `offset`, returning how many.
    fn alloc_clusters_at(&mut self, offset: u64, n: u64) -> PResult<u64> {
        if n == 0 {
            return Ok(0);
        }
        let cs = self.cs();
        loop {
            let first = offset / cs;
            let i = match self.used.first_overlap(first, first + n) {
                Some((s, _)) => s.max(first) - first,
                None => n,
            };
            match self.update_refcount(offset, i * cs, false) {
                Ok(()) => return Ok(i),
                Err(PlanError::Again) => self.retry()?,
                Err(e) => return Err(e),
            }
        }
    }

    /// `qcow2_free_clusters` (failures are only reported by QEMU).
    fn free_clusters(&mut self, offset: u64, size: u64) {
        let _ = self.update_refcount(offset, size, true);
    }

    /// `qcow2_get_last_cluster`: the last cluster in use before `size`.
    fn last_cluster(&self, size: u64) -> Option<u64> {
        let n = size.div_ceil(self.cs());
        let (s, e) = self.used.clipped(0, n).last()?;
        (s < e).then(|| e - 1)
    }

    // ---- L1/L2 (qcow2-cluster.c) -----------------------------------------

    /// `qcow2_grow_l1_table` with an exact size.
    fn grow_l1(&mut self, min_size: u64) -> PResult<()> {
        if min_size <= self.l1.len() as u64 {
            return Ok(());
        }
        if min_size > (i32::MAX as u64) / 8 || min_size > MAX_L1_ENTRIES {
            return Err(PlanError::TooBig);
        }
        let off = self.alloc_clusters(min_size * 8)?;
        self.written(off, min_size * 8);
        let (old_off, old_len) = (self.l1_offset, self.l1.len() as u64);
        self.l1.resize(min_size as usize, 0);
        self.l1_offset = off;
        self.free_clusters(old_off, old_len * 8);
        Ok(())
    }

    /// `get_cluster_table`: allocates the L2 table of `guest` if missing.
    fn cluster_table(&mut self, guest: u64) -> PResult<()> {
        let idx = (guest >> self.geo.cluster_bits) / self.geo.l2_entries();
        if idx >= self.l1.len() as u64 {
            return Err(internal("guest offset beyond the L1 table"));
        }
        if self.l1[idx as usize] == 0 {
            let cs = self.cs();
            let l2 = self.alloc_clusters(cs)?;
            if l2 == 0 {
                return Err(internal(
                    "Preventing invalid allocation of L2 table at offset 0",
                ));
            }
            self.written(l2, cs);
            self.l1[idx as usize] = l2;
        }
        Ok(())
    }

    /// `handle_alloc`: allocates host clusters for `guest..guest+bytes`
    /// (up to the end of its L2 table), at `want` if given. Returns the
    /// host offset and the bytes covered, or None if nothing could be
    /// allocated at `want`.
    fn handle_alloc(
        &mut self,
        guest: u64,
        want: Option<u64>,
        bytes: u64,
        metas: &mut Vec<L2Meta>,
    ) -> PResult<Option<(u64, u64)>> {
        let cs = self.cs();
        let cb = self.geo.cluster_bits;
        let in_cluster = guest % cs;
        let l2_index = (guest >> cb) % self.geo.l2_entries();
        let mut n = (in_cluster + bytes)
            .div_ceil(cs)
            .min(self.geo.l2_entries() - l2_index)
            .min(REQUEST_MAX_BYTES >> cb);
        self.cluster_table(guest)?;
        let alloc = if self.data_file {
            guest - in_cluster
        } else {
            match want {
                None => self.alloc_clusters(n * cs)?,
                Some(h) => {
                    let h = h - h % cs;
                    n = self.alloc_clusters_at(h, n)?;
                    h
                }
            }
        };
        if n == 0 {
            return Ok(None);
        }
        let nb_bytes = (bytes + in_cluster).min(n * cs);
        let bytes = bytes.min(nb_bytes - in_cluster);
        // calculate_l2_meta for fresh clusters: copy-on-write up to the end
        // of the (sub)cluster holding the last byte.
        let sub = cs / if self.geo.extended_l2 { 32 } else { 1 };
        let clusters = (in_cluster + bytes).div_ceil(cs);
        let cow_from = in_cluster + bytes;
        let cow_to = cow_from.next_multiple_of(sub);
        metas.push(L2Meta {
            guest: guest - in_cluster,
            host: alloc,
            clusters,
            cow_end: (cow_from, cow_to - cow_from),
        });
        Ok(Some((alloc + in_cluster, bytes)))
    }

    /// `qcow2_alloc_host_offset` on a range that is all unallocated:
    /// allocates as many host-contiguous clusters as possible. Returns the
    /// host offset of `guest` and the bytes covered.
    fn alloc_host_offset(
        &mut self,
        guest: u64,
        bytes: u64,
        metas: &mut Vec<L2Meta>,
    ) -> PResult<(u64, u64)> {
        let mut start = guest;
        let mut remaining = bytes;
        let mut host: Option<u64> = None;
        let mut cluster_offset: Option<u64> = None;
        while remaining > 0 {
            // handle_copied: nothing is allocated yet, but it loads (and so
            // allocates) the L2 table of `start`.
            self.cluster_table(start)?;
            match self.handle_alloc(start, cluster_offset, remaining, metas)? {
                None => break,
                Some((h, cur)) => {
                    host.get_or_insert(h);
                    cluster_offset = Some(h + cur);
                    start += cur;
                    remaining -= cur;
                }
            }
        }
        let host = host.ok_or_else(|| internal("no cluster could be allocated"))?;
        Ok((host, bytes - remaining))
    }

    /// `qcow2_alloc_cluster_link_l2` for preallocation: copy-on-write of
    /// the tail (zeros), then the L2 entries.
    fn link_l2(&mut self, m: L2Meta) -> PResult<()> {
        let (cow_off, cow_len) = m.cow_end;
        if cow_len > 0 {
            let at = m.host + cow_off;
            if self.data_file {
                self.data_zero_writes.push((at, cow_len));
                self.data_len = self.data_len.max(at + cow_len);
            } else {
                self.zero_writes.push((at, cow_len));
                self.written(at, cow_len);
            }
        }
        self.cluster_table(m.guest)?;
        let cs = self.cs();
        self.runs.insert(m.guest / cs, (m.host, m.clusters));
        Ok(())
    }

    /// `preallocate_co` over `0..size`.
    fn preallocate(&mut self, size: u64, mode: Prealloc) -> PResult<()> {
        let cs = self.cs();
        let step = (i32::MAX as u64) / cs * cs;
        let (mut offset, mut bytes) = (0u64, size);
        let (mut host, mut cur) = (0u64, 0u64);
        while bytes > 0 {
            let mut metas = Vec::new();
            (host, cur) = self.alloc_host_offset(offset, bytes.min(step), &mut metas)?;
            // QEMU keeps the list newest first.
            for m in metas.into_iter().rev() {
                self.link_l2(m)?;
            }
            bytes -= cur;
            offset += cur;
        }
        let end = host + cur;
        if self.data_file {
            if end > self.data_len {
                if self.data_len == 0 && mode == Prealloc::Metadata {
                    self.data_first_block = true;
                }
                if matches!(mode, Prealloc::Falloc | Prealloc::Full) {
                    self.data_reserved = Some((self.data_len, end));
                }
                self.data_len = end;
            }
        } else if end > self.file_len {
            self.file_len = end;
        }
        Ok(())
    }

    /// `qcow2_co_truncate` growing the empty image to `size`.
    fn truncate(&mut self, size: u64, prealloc: Prealloc) -> PResult<()> {
        self.size = size;
        self.grow_l1(self.geo.l1_entries_for(size))?;
        match prealloc {
            Prealloc::Off => {
                if self.data_file {
                    self.data_len = size;
                    self.data_first_block = size > 0;
                }
            }
            Prealloc::Metadata => self.preallocate(size, prealloc)?,
            Prealloc::Falloc | Prealloc::Full if self.data_file => {
                self.preallocate(size, prealloc)?
            }
            Prealloc::Falloc | Prealloc::Full => self.preallocate_in_file(size)?,
        }
        Ok(())
    }

    /// The falloc/full branch of `qcow2_co_truncate` without a data file:
    /// refcount structures for everything first, then the data clusters in
    /// one run, then L2 tables wherever the allocator finds room.
    fn preallocate_in_file(&mut self, size: u64) -> PResult<()> {
        let cs = self.cs();
        let old_file_size = match self.last_cluster(self.file_len) {
            Some(last) => (last + 1) * cs,
            None => return Err(internal("There are no references in the refcount table.")),
        };
        let data_clusters = size.div_ceil(cs);
        let l2_tables = data_clusters.div_ceil(self.geo.l2_entries()) + 1;
        let start = self.refcount_area(old_file_size, data_clusters + l2_tables, true, 0, 0)?;
        if self.alloc_clusters_at(start, data_clusters)? != data_clusters {
            return Err(internal("data clusters are not free"));
        }
        let end = start + data_clusters * cs;
        if end > self.file_len {
            self.reserved = Some((self.file_len, end));
            self.file_len = end;
        }
        let (mut guest, mut host, mut left) = (0u64, start, data_clusters);
        while left > 0 {
            let l2_index = (guest / cs) % self.geo.l2_entries();
            let n = left.min(self.geo.l2_entries() - l2_index);
            self.link_l2(L2Meta {
                guest,
                host,
                clusters: n,
                cow_end: (n * cs, 0),
            })?;
            guest += n * cs;
            host += n * cs;
            left -= n;
        }
        Ok(())
    }

    // ---- results ---------------------------------------------------------

    /// The cluster size.
    pub fn cluster_size(&self) -> u64 {
        self.cs()
    }

    /// The image file's final length.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The external data file's final length.
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// Whether QEMU writes zeros over the data file's first block (it does
    /// when it grows an empty file without preallocation).
    pub fn data_first_block(&self) -> bool {
        self.data_first_block
    }

    /// The image file range whose space is reserved (falloc) or written
    /// with zeros (full) for the data clusters.
    pub fn reserved(&self) -> Option<(u64, u64)> {
        self.reserved
    }

    /// The data file range reserved or zero-written.
    pub fn data_reserved(&self) -> Option<(u64, u64)> {
        self.data_reserved
    }

    /// Zeros written to the image file by copy-on-write of a partial last
    /// (sub)cluster.
    pub fn zero_writes(&self) -> &[(u64, u64)] {
        &self.zero_writes
    }

    /// Zeros written to the data file by copy-on-write.
    pub fn data_zero_writes(&self) -> &[(u64, u64)] {
        &self.data_zero_writes
    }

    /// Bytes of outgrown refcount tables, left in freed clusters, oldest
    /// first (later metadata may overwrite them).
    pub fn stale(&self) -> &[(u64, Vec<u8>)] {
        &self.stale
    }

    /// Offset of the refcount table.
    pub fn reftable_offset(&self) -> u64 {
        self.reftable_offset
    }

    /// The refcount table's bytes.
    pub fn reftable_bytes(&self) -> Vec<u8> {
        self.reftable.iter().flat_map(|e| e.to_be_bytes()).collect()
    }

    /// Clusters of the refcount table.
    pub fn reftable_clusters(&self) -> u64 {
        self.reftable.len() as u64 * 8 / self.cs()
    }

    /// Offsets of the refcount blocks and their table indexes.
    pub fn refblocks(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.reftable
            .iter()
            .enumerate()
            .filter(|&(_, &b)| b != 0)
            .map(|(i, &b)| (i, b))
    }

    /// The contents of refcount block number `index`.
    pub fn refblock_bytes(&self, index: usize) -> Vec<u8> {
        let cs = self.cs() as usize;
        let per_block = self.geo.refblock_entries();
        let order = self.geo.refcount_order;
        let first = index as u64 * per_block;
        let mut block = vec![0u8; cs];
        for (s, e) in self.used.clipped(first, first + per_block) {
            for c in s..e {
                let j = (c - first) as usize;
                if order < 3 {
                    let bits = 1usize << order;
                    block[j * bits / 8] |= 1 << ((j * bits) % 8);
                } else {
                    let width = 1usize << (order - 3);
                    block[j * width + width - 1] = 1;
                }
            }
        }
        block
    }

    /// Offset and entries of the L1 table.
    pub fn l1(&self) -> (u64, usize) {
        (self.l1_offset, self.l1.len())
    }

    /// The L1 table's bytes from entry `from`, `count` entries.
    pub fn l1_bytes(&self, from: usize, count: usize) -> Vec<u8> {
        self.l1[from..from + count]
            .iter()
            .flat_map(|&e| if e == 0 { 0 } else { e | COPIED }.to_be_bytes())
            .collect()
    }

    /// The L2 tables: L1 index and offset.
    pub fn l2_tables(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.l1
            .iter()
            .enumerate()
            .filter(|&(_, &o)| o != 0)
            .map(|(i, &o)| (i, o))
    }

    /// The contents of the L2 table at L1 index `index`.
    pub fn l2_bytes(&self, index: usize) -> Vec<u8> {
        let cs = self.cs();
        let per = self.geo.l2_entries();
        let esize = self.geo.l2_entry_size() as usize;
        let first = index as u64 * per;
        let end = first + per;
        let mut table = vec![0u8; cs as usize];
        let start_key = self
            .runs
            .range(..=first)
            .next_back()
            .map(|(&k, _)| k)
            .unwrap_or(first);
        for (&g, &(h, n)) in self.runs.range(start_key..end) {
            for c in g.max(first)..(g + n).min(end) {
                let entry = (h + (c - g) * cs) | COPIED;
                let at = (c - first) as usize * esize;
                table[at..at + 8].copy_from_slice(&entry.to_be_bytes());
            }
        }
        table
    }

    /// The header as QEMU's last `qcow2_update_header` writes it.
    pub fn header(&self, spec: &HeaderSpec) -> Header {
        let mut incompatible = 0;
        if spec.data_file.is_some() {
            incompatible |= incompat::EXTERNAL_DATA;
        }
        if spec.compression == CompressionType::Zstd {
            incompatible |= incompat::COMPRESSION_TYPE;
        }
        if self.geo.extended_l2 {
            incompatible |= incompat::EXTENDED_L2;
        }
        let mut extensions = Vec::new();
        if let Some(f) = &spec.backing_format {
            extensions.push(HeaderExtension {
                kind: ext::BACKING_FORMAT,
                data: f.as_bytes().to_vec(),
            });
        }
        if let Some(d) = &spec.data_file {
            extensions.push(HeaderExtension {
                kind: ext::DATA_FILE,
                data: d.as_bytes().to_vec(),
            });
        }
        if spec.version >= 3 && self.cs() > 4096 {
            extensions.push(feature_table());
        }
        Header {
            version: spec.version,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits: self.geo.cluster_bits,
            size: self.size,
            crypt_method: 0,
            l1_size: self.l1.len() as u32,
            l1_table_offset: self.l1_offset,
            refcount_table_offset: self.reftable_offset,
            refcount_table_clusters: self.reftable_clusters() as u32,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: incompatible,
            compatible_features: if spec.lazy_refcounts {
                compat::LAZY_REFCOUNTS
            } else {
                0
            },
            autoclear_features: if spec.data_file_raw {
                autoclear::RAW_EXTERNAL
            } else {
                0
            },
            refcount_order: self.geo.refcount_order,
            header_length: if spec.version >= 3 { 112 } else { 72 },
            compression_type: spec.compression,
            extra_header: Vec::new(),
            extensions,
            backing_file: spec.backing_file.clone(),
        }
    }
}

/// What the header says beyond the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderSpec {
    /// 2 or 3.
    pub version: u32,
    /// Compression type of compressed clusters.
    pub compression: CompressionType,
    /// Compatible bit "lazy refcounts".
    pub lazy_refcounts: bool,
    /// External data file name, as given.
    pub data_file: Option<String>,
    /// Autoclear bit "raw external data".
    pub data_file_raw: bool,
    /// Backing file name, as given.
    pub backing_file: Option<String>,
    /// Backing file format.
    pub backing_format: Option<String>,
}

/// The feature name table QEMU writes into v3 images with clusters larger
/// than 4 KiB: every feature bit it knows, in its order.
pub fn feature_table() -> HeaderExtension {
    const FEATURES: [(u8, u8, &str); 8] = [
        (0, 0, "dirty bit"),
        (0, 1, "corrupt bit"),
        (0, 2, "external data file"),
        (0, 3, "compression type"),
        (0, 4, "extended L2 entries"),
        (1, 0, "lazy refcounts"),
        (2, 0, "bitmaps"),
        (2, 1, "raw external data"),
    ];
    let mut data = Vec::with_capacity(FEATURES.len() * 48);
    for (kind, bit, name) in FEATURES {
        let mut entry = [0u8; 48];
        entry[0] = kind;
        entry[1] = bit;
        entry[2..2 + name.len()].copy_from_slice(name.as_bytes());
        data.extend_from_slice(&entry);
    }
    HeaderExtension {
        kind: ext::FEATURE_TABLE,
        data,
    }
}

#[cfg(test)]
mod tests;
