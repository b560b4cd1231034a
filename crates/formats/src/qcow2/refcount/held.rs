//! Refcount blocks held in memory for deferred placement (see
//! [`super::super::meta::deferred`]): blocks made while the image is
//! written front to back are not given a cluster until the end, when they
//! are placed past everything in use, with a larger refcount table after
//! them if the table has no entries for them.

use std::collections::BTreeSet;

use diskit_core::{Error, ErrorKind, Result};

use super::{MAX_TABLE_BYTES, Refcounts, get_entry, set_entry};
use crate::qcow2::layout::{HostCluster, HostOffset};
use crate::qcow2::table::u64_table_bytes;

impl Refcounts {
    /// Where the refcount table and the blocks placed so far end in the
    /// file: what deferred placement changes in place.
    pub fn placed_end(&self) -> Result<u64> {
        let cs = self.geo.cluster_size();
        let (at, clusters) = self.table_location();
        let mut end = at.0 + clusters * cs;
        for j in 0..self.table.len() as u64 {
            if let Some(b) = self.block_offset(j)? {
                end = end.max(b.0 + cs);
            }
        }
        Ok(end)
    }

    /// Starts deferred placement: from now on new blocks are held in
    /// memory until [`Self::place_held`], and new clusters are taken at
    /// the end only. The table and the blocks placed already are changed
    /// in place: they must lie where the file can be written again until
    /// the end (see [`Self::placed_end`]).
    pub fn defer(&mut self) {
        self.held.get_or_insert_default();
    }

    /// The held block for table index `j`, if any.
    pub(super) fn held_block(&self, j: u64) -> Option<&Vec<u8>> {
        self.held.as_ref()?.get(&j)
    }

    /// Sets the refcount of a cluster no placed block covers, in the held
    /// block for it (made, of zeros, when there is none and `v` is not 0).
    pub(super) fn set_held(&mut self, c: HostCluster, v: u64) -> Result<()> {
        let epb = self.entries_per_block();
        let cs = self.geo.cluster_size() as usize;
        let order = self.order;
        let held = self.held.as_mut().ok_or_else(|| {
            Error::new(
                ErrorKind::Io,
                "qcow2: no refcount blocks are held in memory",
            )
        })?;
        let j = c.0 / epb;
        if v == 0 && !held.contains_key(&j) {
            return Ok(());
        }
        let block = held.entry(j).or_insert_with(|| vec![0u8; cs]);
        let was = get_entry(block, order, c.0 % epb);
        set_entry(block, order, c.0 % epb, v);
        if v != 0 {
            self.top = self.top.max(c.0 + 1);
        } else if was != 0
            && let Some(freed) = self.freed.as_mut()
        {
            freed.push(c.0);
        }
        Ok(())
    }

    /// Places the held blocks past everything in use (and, when the table
    /// has no entries for them, a table half as large again after them),
    /// every cluster of that area counted once, and writes them in file
    /// order: the blocks, then the new table and the header fields that
    /// point at it, or the new entries of the table where it is. The
    /// blocks are cached from then on, as blocks read from the file.
    pub fn place_held(&mut self) -> Result<()> {
        let Some(held) = self.held.as_ref().filter(|h| !h.is_empty()) else {
            return Ok(());
        };
        let cs = self.geo.cluster_size();
        let epb = self.entries_per_block();
        let per_cluster = cs / 8;
        let old_len = self.table.len() as u64;
        let start = self.top;
        // The blocks to place: those held, and those the area they take
        // needs (blocks count their own clusters), until nothing changes.
        let mut blocks: BTreeSet<u64> = held.keys().copied().collect();
        let mut entries = old_len;
        loop {
            let table_clusters = if entries > old_len {
                (entries * 8).div_ceil(cs)
            } else {
                0
            };
            let end = start + blocks.len() as u64 + table_clusters;
            let mut grew = false;
            for j in start / epb..=(end - 1) / epb {
                if self.block_offset(j)?.is_none() {
                    grew |= blocks.insert(j);
                }
            }
            let last = blocks.last().copied().unwrap_or(0);
            if last >= entries {
                entries = (last + 1).max(old_len + old_len / 2).div_ceil(per_cluster) * per_cluster;
                grew = true;
            }
            if !grew {
                break;
            }
        }
        let moved = entries > old_len;
        let table_clusters = if moved { (entries * 8).div_ceil(cs) } else { 0 };
        if table_clusters * cs > MAX_TABLE_BYTES {
            return Err(Error::new(
                ErrorKind::NoSpace,
                "the refcount table would exceed its 8 MiB limit",
            ));
        }
        let end = start + blocks.len() as u64 + table_clusters;
        if let Some(h) = self.held.as_mut() {
            for &j in &blocks {
                h.entry(j).or_insert_with(|| vec![0u8; cs as usize]);
            }
        }
        for c in start..end {
            self.set(HostCluster(c), 1)?;
        }
        let mut table = self.table.clone();
        table.resize(entries as usize, 0);
        let held = std::mem::take(self.held.as_mut().expect("held blocks"));
        for (k, (j, block)) in held.into_iter().enumerate() {
            let at = HostOffset((start + k as u64) * cs);
            self.file.write_extend(&block, at.0)?;
            table[j as usize] = at.0;
            self.cache.insert(at, block, false);
        }
        if moved {
            let table_at = (start + blocks.len() as u64) * cs;
            self.file.write_extend(
                &u64_table_bytes(&table, (table_clusters * cs) as usize),
                table_at,
            )?;
            let mut hdr = [0u8; 12];
            hdr[..8].copy_from_slice(&table_at.to_be_bytes());
            hdr[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
            self.file.write_extend(&hdr, 48)?;
            let (old_at, old_clusters) = self.table_location();
            self.table = table;
            self.table_offset = HostOffset(table_at);
            // The old table is free now that the header points elsewhere.
            let first = self.geo.host_cluster(old_at).0;
            for c in first..first + old_clusters {
                self.set(HostCluster(c), 0)?;
            }
        } else {
            if let (Some(&lo), Some(&hi)) = (blocks.first(), blocks.last()) {
                let raw = u64_table_bytes(&table[lo as usize..=hi as usize], 0);
                self.file.write_extend(&raw, self.table_offset.0 + lo * 8)?;
            }
            self.table = table;
        }
        Ok(())
    }
}
