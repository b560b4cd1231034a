//! QEMU's allocator, step by step: refcounts (qcow2-refcount.c), then L1
//! and L2 tables and preallocation (qcow2-cluster.c, qcow2.c).

use super::{
    L2Meta, MAX_CLUSTER_OFFSET, MAX_L1_ENTRIES, MAX_REFTABLE_ENTRIES, PResult, Plan, PlanError,
    Prealloc, REQUEST_MAX_BYTES, internal, refcount_metadata_size,
};

impl Plan {
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
    pub(super) fn alloc_clusters(&mut self, size: u64) -> PResult<u64> {
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
    pub(super) fn truncate(&mut self, size: u64, prealloc: Prealloc) -> PResult<()> {
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
}
