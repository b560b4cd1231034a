//! Deferred placement: a qcow2 image written once, front to back, on
//! storage that [writes in order](diskit_core::Storage::writes_in_order)
//! (a new S3 object, uploaded part after part: a byte can be written only
//! until its part goes, except in the first part, which is kept until the
//! end, [`rewritable_head`](diskit_core::Storage::rewritable_head)).
//!
//! In this mode the allocator hands out host clusters at the end only, in
//! the order the writes come (guest order for a convert), so data clusters,
//! compressed ones too, follow each other with no gap and nothing is ever
//! written behind the end, and holes cost nothing. The metadata that writes
//! change — the L2 tables and the refcount blocks made while writing — is
//! held in memory, unplaced, and is placed after the data when the image
//! is closed: the L2 tables, then the refcount blocks (and a larger
//! refcount table, when the one there has no room for their entries). The
//! header, the refcount table and blocks, and the L1 table that creation
//! made lie in the head the storage keeps and are rewritten in place, the
//! header last. Memory is bounded by that metadata (an L2 table for each
//! L1 entry written, a refcount block for each range of clusters they
//! count), never by the data.
//!
//! Why metadata after the data, rather than a layout planned before the
//! first byte (tables first, then data): with `-c` a cluster's size is
//! known only once it is compressed, so where the data ends, and which
//! refcount blocks must count it, is unknown until the last cluster is
//! written. Placed after the data, the tables need no plan: their count
//! is known at the end. Only the mode differs: the format's lookups,
//! allocation and metadata are the same code as for any other storage.

use diskit_core::Result;

use super::{Meta, encode_l2};
use crate::qcow2::l2::COPIED;
use crate::qcow2::layout::HostCluster;

impl Meta {
    /// Enters deferred placement on storage written front to back. What
    /// the image has placed already and changes in place (the L1 table,
    /// the refcount table and blocks, L2 tables) must lie in the head the
    /// storage keeps: an image where it does not is refused, before
    /// anything is written.
    pub fn defer_placement(&mut self) -> Result<()> {
        let cs = self.geo().cluster_size();
        let mut end = self.l1_offset.0 + self.l1.len() as u64 * 8;
        let mut what = "L1 table";
        let refs_end = self.refs()?.placed_end()?;
        if refs_end > end {
            (end, what) = (refs_end, "refcount table and blocks");
        }
        for i in 0..self.l1.len() {
            if let Some(at) = self.l2_offset(i)?
                && at.0 + cs > end
            {
                (end, what) = (at.0 + cs, "L2 tables");
            }
        }
        crate::in_order::check_in_place(&*self.file, "qcow2", what, end)?;
        self.refs()?.defer();
        self.unplaced.get_or_insert_default();
        Ok(())
    }

    /// Places and writes what deferred placement holds, after everything
    /// written so far: the refcount changes that wait, then the L2 tables
    /// held (the L1 entries then point at them), then the refcount blocks
    /// held (see [`Refcounts::place_held`](super::Refcounts::place_held)).
    /// The L1 entries and the placed refcount blocks, in the head, are
    /// written by the next [`Meta::write_back`]. Nothing to do without
    /// deferred placement, or when nothing is held.
    pub fn place_deferred(&mut self) -> Result<()> {
        let Some(unplaced) = self.unplaced.as_mut().map(std::mem::take) else {
            return Ok(());
        };
        let geo = *self.geo();
        for (c, d) in std::mem::take(&mut self.pending) {
            self.refs()?.adjust(c, d)?;
        }
        if !unplaced.is_empty() {
            let (first, _) = self.refs()?.alloc(unplaced.len() as u64)?;
            let ext = geo.extended_l2;
            for (k, (l1i, table)) in unplaced.into_iter().enumerate() {
                let at = geo.host_offset(HostCluster(first.0 + k as u64));
                self.file.write_extend(&encode_l2(&table, ext), at.0)?;
                self.l1[l1i] = at.0 | COPIED;
                self.l1_dirty.insert(l1i);
                // Cached from now on, as a table read from the file (the
                // cache may hold more than it keeps until the next miss).
                self.l2.insert(at, table, false);
            }
        }
        self.refs()?.place_held()
    }
}

#[cfg(test)]
mod tests;
