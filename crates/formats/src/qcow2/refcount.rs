//! Refcounts: the two-level table that says how many references each host
//! cluster has, and the allocator built on it.
//!
//! Refcount blocks are cached and written back in [`Refcounts::write_dirty`];
//! the image layer orders that before the L2 tables that depend on them.
//! New refcount blocks (and a grown refcount table) are written at once,
//! before anything points at them; or, on storage written front to back,
//! held in memory and placed after the data at the end (`held`, see
//! [`super::meta::deferred`]).

use std::collections::BTreeMap;

use diskit_core::{BlockDevice, Error, ErrorKind, Result};
use diskit_core::{Storage, StorageRef};

use super::cache::TableCache;
use super::header::Header;
use super::layout::{Geometry, HostCluster, HostOffset};
use super::table::{corrupt, read_u64_table, u64_table_bytes};

mod held;

/// The largest refcount table QEMU accepts (8 MiB).
pub const MAX_TABLE_BYTES: u64 = 8 << 20;

/// The refcount structures of an open image.
pub struct Refcounts {
    file: StorageRef,
    geo: Geometry,
    order: u32,
    table: Vec<u64>,
    table_offset: HostOffset,
    cache: TableCache<Vec<u8>>,
    /// Where the next search for free clusters starts.
    free_hint: u64,
    /// One past the highest cluster that may be in use: everything from
    /// here on is free and reads as zeros.
    top: u64,
    /// Clusters whose refcount dropped to zero since [`Self::note_freed`]
    /// (`None`: not noting).
    freed: Option<Vec<u64>>,
    /// Deferred placement ([`Self::defer`]): the blocks made since, not
    /// placed yet, by table index; `None` when new blocks are placed and
    /// written as they are made.
    held: Option<BTreeMap<u64, Vec<u8>>>,
}

/// Reads a refcount of width 2^order bits at index `i` of a block.
fn get_entry(block: &[u8], order: u32, i: u64) -> u64 {
    let bits = 1u64 << order;
    if bits < 8 {
        let bit = i * bits;
        let byte = block[(bit / 8) as usize];
        ((byte >> (bit % 8)) as u64) & ((1 << bits) - 1)
    } else {
        let w = (bits / 8) as usize;
        let at = i as usize * w;
        block[at..at + w]
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | *b as u64)
    }
}

/// Writes a refcount of width 2^order bits at index `i` of a block.
pub(super) fn set_entry(block: &mut [u8], order: u32, i: u64, v: u64) {
    let bits = 1u64 << order;
    if bits < 8 {
        let bit = i * bits;
        let mask = (((1u16 << bits) - 1) as u8) << (bit % 8);
        let byte = &mut block[(bit / 8) as usize];
        *byte = (*byte & !mask) | (((v as u8) << (bit % 8)) & mask);
    } else {
        let w = (bits / 8) as usize;
        let at = i as usize * w;
        for (k, b) in block[at..at + w].iter_mut().enumerate() {
            *b = (v >> (8 * (w - 1 - k))) as u8;
        }
    }
}

impl Refcounts {
    /// Loads the refcount table of an image.
    pub fn load(file: StorageRef, header: &Header, cache_blocks: usize) -> Result<Refcounts> {
        let geo = Geometry::of(header);
        let cs = geo.cluster_size();
        let file_len = file.file_len()?;
        let offset = header.refcount_table_offset;
        if offset >= file_len.max(1) {
            return Err(corrupt(format!(
                "refcount table offset {offset:#x} is past the end of the file"
            )));
        }
        let table = read_u64_table(
            &file,
            offset,
            header.refcount_table_clusters as u64 * cs / 8,
        )?;
        Ok(Refcounts {
            file,
            geo,
            order: header.refcount_order,
            table,
            table_offset: HostOffset(offset),
            cache: TableCache::new(cache_blocks),
            free_hint: 0,
            top: file_len.div_ceil(cs),
            freed: None,
            held: None,
        })
    }

    /// Bits per refcount.
    pub fn bits(&self) -> u32 {
        1 << self.order
    }

    /// The largest refcount representable.
    pub fn max_refcount(&self) -> u64 {
        if self.order == 6 {
            u64::MAX
        } else {
            (1u64 << self.bits()) - 1
        }
    }

    /// Refcounts per block.
    pub fn entries_per_block(&self) -> u64 {
        (self.geo.cluster_size() * 8) >> self.order
    }

    /// The refcount table entries (refcount block offsets).
    pub fn table(&self) -> &[u64] {
        &self.table
    }

    /// Where the refcount table lives, and its size in clusters.
    pub fn table_location(&self) -> (HostOffset, u64) {
        let cs = self.geo.cluster_size();
        (
            self.table_offset,
            (self.table.len() as u64 * 8).div_ceil(cs),
        )
    }

    /// One past the highest cluster that may be in use.
    pub fn top(&self) -> HostCluster {
        HostCluster(self.top)
    }

    /// Evicts the least recently used block if the cache is full, writing
    /// it first if it is dirty (refcount blocks depend on nothing else).
    fn make_room(&mut self) -> Result<()> {
        if let Some(victim) = self.cache.victim() {
            let slot = self.cache.remove(victim).expect("victim is cached");
            if slot.dirty {
                self.file.write_extend(&slot.table, victim.0)?;
            }
        }
        Ok(())
    }

    /// Makes sure the block at `at` is cached, evicting (and writing) as needed.
    fn load_block(&mut self, at: HostOffset) -> Result<()> {
        if self.cache.contains(at) {
            return Ok(());
        }
        self.make_room()?;
        if at.0 >= self.file.file_len()?.max(self.top << self.geo.cluster_bits) {
            return Err(corrupt(format!(
                "refcount block offset {:#x} is past the end of the file",
                at.0
            )));
        }
        let mut buf = vec![0u8; self.geo.cluster_size() as usize];
        self.file.read_padded(&mut buf, at.0)?;
        self.cache.insert(at, buf, false);
        Ok(())
    }

    /// The block offset for table index `j` (validated), or None.
    fn block_offset(&self, j: u64) -> Result<Option<HostOffset>> {
        let Some(&e) = self.table.get(j as usize) else {
            return Ok(None);
        };
        if e == 0 {
            return Ok(None);
        }
        let off = e & !0x1ff;
        if e & 0x1ff != 0 || !self.geo.is_cluster_aligned(HostOffset(off)) || off == 0 {
            return Err(corrupt(format!(
                "refcount block offset {e:#x} (table entry {j}) is invalid"
            )));
        }
        Ok(Some(HostOffset(off)))
    }

    /// The refcount of a host cluster (0 where no block covers it).
    pub fn get(&mut self, c: HostCluster) -> Result<u64> {
        let epb = self.entries_per_block();
        if let Some(block) = self.held_block(c.0 / epb) {
            return Ok(get_entry(block, self.order, c.0 % epb));
        }
        let Some(at) = self.block_offset(c.0 / epb)? else {
            return Ok(0);
        };
        self.load_block(at)?;
        let slot = self.cache.get(at).expect("just loaded");
        Ok(get_entry(&slot.table, self.order, c.0 % epb))
    }

    /// Sets the refcount of a host cluster, allocating refcount blocks (and
    /// growing the table) when none covers it yet.
    pub fn set(&mut self, c: HostCluster, v: u64) -> Result<()> {
        if v > self.max_refcount() {
            return Err(Error::new(
                ErrorKind::Io,
                format!("refcount overflow for host cluster {:#x}", c.0),
            ));
        }
        let epb = self.entries_per_block();
        let j = c.0 / epb;
        let at = match self.block_offset(j)? {
            Some(at) => at,
            None if self.held.is_some() => return self.set_held(c, v),
            None if v == 0 => return Ok(()),
            None => self.new_block(j)?,
        };
        self.load_block(at)?;
        let order = self.order;
        let slot = self.cache.get(at).expect("just loaded");
        set_entry(&mut slot.table, order, c.0 % epb, v);
        slot.dirty = true;
        if v != 0 {
            self.top = self.top.max(c.0 + 1);
        } else {
            self.free_hint = self.free_hint.min(c.0);
        }
        Ok(())
    }

    /// Adds `delta` to a cluster's refcount.
    pub fn adjust(&mut self, c: HostCluster, delta: i64) -> Result<u64> {
        let old = self.get(c)?;
        let new = old.checked_add_signed(delta).ok_or_else(|| {
            corrupt(format!(
                "refcount of host cluster {:#x} would go from {old} to {}",
                c.0,
                old as i128 + delta as i128
            ))
        })?;
        self.set(c, new)?;
        if new == 0
            && old > 0
            && let Some(freed) = self.freed.as_mut()
        {
            freed.push(c.0);
        }
        Ok(new)
    }

    /// Starts noting the clusters that get freed, for [`Self::take_freed`].
    pub fn note_freed(&mut self) {
        // Afresh: a list left by an operation that failed half way is
        // forgotten (its clusters are free all the same; only their space
        // stays in the file).
        self.freed = Some(Vec::new());
    }

    /// Stops noting freed clusters and returns those still free, sorted.
    pub fn take_freed(&mut self) -> Result<Vec<HostCluster>> {
        let mut freed = self.freed.take().unwrap_or_default();
        freed.sort_unstable();
        freed.dedup();
        let mut out = Vec::with_capacity(freed.len());
        for c in freed {
            if self.get(HostCluster(c))? == 0 {
                out.push(HostCluster(c));
            }
        }
        Ok(out)
    }

    /// Finds `n` contiguous free clusters from the hint on, without taking
    /// them. Also returns the first free cluster seen (the start of a free
    /// run too short for `n`, or the start of the result).
    fn find_free(&mut self, n: u64) -> Result<(u64, u64)> {
        if self.held.is_some() {
            // Written front to back: new clusters only ever go at the end
            // (space freed behind it may be written already).
            let top = self.top.max(1);
            return Ok((top, top));
        }
        let mut start = self.free_hint.max(1);
        let mut first_free = None;
        let mut run = 0;
        while run < n {
            let c = start + run;
            if c >= self.top {
                // Everything from the top on is free.
                return Ok((start, first_free.unwrap_or(start)));
            }
            if self.get(HostCluster(c))? == 0 {
                first_free.get_or_insert(c);
                run += 1;
            } else {
                start = c + 1;
                run = 0;
            }
        }
        Ok((start, first_free.unwrap_or(start)))
    }

    /// Allocates `n` contiguous clusters with refcount 1. Returns the first
    /// and whether they are fresh (past every cluster ever used, so they read
    /// as zeros).
    pub fn alloc(&mut self, n: u64) -> Result<(HostCluster, bool)> {
        let (start, first_free) = self.find_free(n)?;
        let fresh = start >= self.top;
        // Reserve the range before setting refcounts: setting them may need
        // new refcount blocks, which must not land inside it.
        self.free_hint = start + n;
        self.top = self.top.max(start + n);
        for c in start..start + n {
            self.set(HostCluster(c), 1)?;
        }
        if first_free < start {
            // A free run too short for this request remains below it (the
            // scan never goes back over clusters known to be in use).
            self.free_hint = self.free_hint.min(first_free);
        }
        Ok((HostCluster(start), fresh))
    }

    /// Allocates a refcount block for table index `j` and points the table at it.
    fn new_block(&mut self, j: u64) -> Result<HostOffset> {
        if j >= self.table.len() as u64 {
            self.grow_table(j + 1)?;
            if let Some(at) = self.block_offset(j)? {
                return Ok(at);
            }
        }
        let epb = self.entries_per_block();
        let (b, _) = self.find_free(1)?;
        self.free_hint = self.free_hint.max(b + 1);
        self.top = self.top.max(b + 1);
        let at = self.geo.host_offset(HostCluster(b));
        let mut block = vec![0u8; self.geo.cluster_size() as usize];
        if b / epb == j {
            set_entry(&mut block, self.order, b % epb, 1);
        } else {
            self.set(HostCluster(b), 1)?;
        }
        // The block reaches the file before the table entry that points at it.
        self.file.write_extend(&block, at.0)?;
        self.table[j as usize] = at.0;
        self.file
            .write_extend(&at.0.to_be_bytes(), self.table_offset.0 + j * 8)?;
        self.make_room()?;
        self.cache.insert(at, block, false);
        Ok(at)
    }

    /// Moves the refcount table to a bigger one of at least `min_entries`
    /// entries, placed with any new blocks it needs past everything in use.
    fn grow_table(&mut self, min_entries: u64) -> Result<()> {
        let cs = self.geo.cluster_size();
        let per_cluster = cs / 8;
        let epb = self.entries_per_block();
        let old_len = self.table.len() as u64;
        let start = self.top.max(self.file.file_len()?.div_ceil(cs));
        let mut entries =
            min_entries.max(old_len + old_len / 2).div_ceil(per_cluster) * per_cluster;
        let (new_blocks, table_clusters) = loop {
            let table_clusters = (entries * 8).div_ceil(cs);
            let mut blocks: Vec<u64> = Vec::new();
            loop {
                let end = start + blocks.len() as u64 + table_clusters;
                let needed: Vec<u64> = (start / epb..=(end - 1) / epb)
                    .filter(|&j| j >= old_len || self.table[j as usize] == 0)
                    .collect();
                if needed.len() == blocks.len() {
                    break;
                }
                blocks = needed;
            }
            let end = start + blocks.len() as u64 + table_clusters;
            let max_j = (end - 1) / epb;
            if max_j < entries {
                break (blocks, table_clusters);
            }
            entries = (max_j + 1).div_ceil(per_cluster) * per_cluster;
        };
        if table_clusters * cs > MAX_TABLE_BYTES {
            return Err(Error::new(
                ErrorKind::NoSpace,
                "the refcount table would exceed its 8 MiB limit",
            ));
        }
        let area_end = start + new_blocks.len() as u64 + table_clusters;
        let mut table = self.table.clone();
        table.resize(entries as usize, 0);
        let mut blocks: Vec<(u64, Vec<u8>)> = Vec::new();
        for (k, &j) in new_blocks.iter().enumerate() {
            table[j as usize] = (start + k as u64) * cs;
            blocks.push((j, vec![0u8; cs as usize]));
        }
        self.top = self.top.max(area_end);
        for c in start..area_end {
            let j = c / epb;
            if let Some((_, b)) = blocks.iter_mut().find(|(bj, _)| *bj == j) {
                set_entry(b, self.order, c % epb, 1);
            } else {
                self.set(HostCluster(c), 1)?;
            }
        }
        // New blocks, then the new table, then the header that points at it.
        for (k, (_, b)) in blocks.iter().enumerate() {
            self.file.write_extend(b, (start + k as u64) * cs)?;
        }
        let table_at = (start + new_blocks.len() as u64) * cs;
        self.file.write_extend(
            &u64_table_bytes(&table, (table_clusters * cs) as usize),
            table_at,
        )?;
        self.file.flush()?;
        let mut hdr = [0u8; 12];
        hdr[..8].copy_from_slice(&table_at.to_be_bytes());
        hdr[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        self.file.write_extend(&hdr, 48)?;
        self.file.flush()?;
        let (old_at, old_clusters) = self.table_location();
        self.table = table;
        self.table_offset = HostOffset(table_at);
        for (k, (_, b)) in blocks.into_iter().enumerate() {
            let at = HostOffset((start + k as u64) * cs);
            self.make_room()?;
            self.cache.insert(at, b, false);
        }
        // The old table is garbage now that the header points elsewhere.
        let first = self.geo.host_cluster(old_at).0;
        for c in first..first + old_clusters {
            self.set(HostCluster(c), 0)?;
        }
        Ok(())
    }

    /// Drops the refcount blocks that count nothing but, at most, their own
    /// cluster, as QEMU does after a shrink: their table entries are cleared
    /// on disk (and synced) first, then the blocks' clusters are freed.
    pub fn drop_unused_blocks(&mut self) -> Result<()> {
        let epb = self.entries_per_block();
        let mut unused = Vec::new();
        for j in 0..self.table.len() as u64 {
            let Some(at) = self.block_offset(j)? else {
                continue;
            };
            self.load_block(at)?;
            let own = self.geo.host_cluster(at).0;
            let order = self.order;
            let slot = self.cache.get(at).expect("just loaded");
            // Its own entry, if it lies in its own range, does not count.
            let own_entry = (own / epb == j).then_some(own % epb);
            if (0..epb).all(|i| Some(i) == own_entry || get_entry(&slot.table, order, i) == 0) {
                unused.push((j, at));
            }
        }
        if unused.is_empty() {
            return Ok(());
        }
        for &(j, _) in &unused {
            self.table[j as usize] = 0;
            self.file
                .write_extend(&[0u8; 8], self.table_offset.0 + j * 8)?;
        }
        self.file.flush()?;
        for (_, at) in unused {
            self.cache.remove(at);
            let own = self.geo.host_cluster(at);
            if self.block_offset(own.0 / epb)?.is_some() {
                self.adjust(own, -1)?;
            } else {
                // It counted itself, and went with its table entry.
                self.free_hint = self.free_hint.min(own.0);
                if let Some(freed) = self.freed.as_mut() {
                    freed.push(own.0);
                }
            }
        }
        Ok(())
    }

    /// Writes every dirty refcount block. Returns whether anything was written.
    pub fn write_dirty(&mut self) -> Result<bool> {
        let dirty = self.cache.dirty();
        for at in &dirty {
            let slot = self.cache.peek_mut(*at).expect("dirty block is cached");
            self.file.write_extend(&slot.table, at.0)?;
            slot.dirty = false;
        }
        Ok(!dirty.is_empty())
    }

    /// Whether any refcount block awaits writing.
    pub fn is_dirty(&self) -> bool {
        self.cache.any_dirty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_widths_pack_like_qemu() {
        for order in 0..=6u32 {
            let bits = 1u64 << order;
            let max = if bits == 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            };
            let mut block = vec![0u8; 512];
            let n = 512 * 8 / bits;
            for i in 0..n {
                set_entry(&mut block, order, i, (i * 2654435761) & max);
            }
            for i in 0..n {
                assert_eq!(get_entry(&block, order, i), (i * 2654435761) & max);
            }
        }
        // refcount_bits=1 with six used clusters: first byte 0x3f.
        let mut block = vec![0u8; 512];
        for i in 0..6 {
            set_entry(&mut block, 0, i, 1);
        }
        assert_eq!(block[0], 0x3f);
        // 16-bit entries are big-endian.
        let mut block = vec![0u8; 512];
        set_entry(&mut block, 4, 1, 0x0102);
        assert_eq!(&block[2..4], &[1, 2]);
    }
}
