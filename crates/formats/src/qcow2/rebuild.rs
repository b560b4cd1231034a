//! Rebuilding a qcow2 image's refcount structure from the references
//! counted by `check` (QEMU's `rebuild_refcount_structure`): what
//! `check -r all` does when a cluster in use has a stored refcount of
//! zero, where setting counts one by one could hand out a cluster that is
//! in use.
//!
//! New refcount blocks go into the first free clusters of the counted
//! references (each counting itself), then the refcount table after them;
//! when placing the table needs another block, the loop goes round again,
//! as in QEMU. The header then points at the new table; the old table and
//! blocks are left as leaks for the caller to free.

use diskit_core::{Error, Result, StorageRef};

use super::header::Header;
use super::layout::Geometry;
use super::refcount::set_entry;

/// References counted per host cluster, as `check` counts them, growing
/// as the rebuild allocates past the end of the image.
struct Counts {
    counts: Vec<u64>,
    /// Where the search for free clusters goes on from.
    first_free: u64,
}

impl Counts {
    /// Allocates `n` contiguous free clusters (QEMU's `alloc_clusters_imrt`):
    /// the first run of `n` zero counts from the last allocation on.
    fn alloc(&mut self, n: u64) -> u64 {
        let mut start = self.first_free;
        loop {
            let end = start + n;
            if end as usize > self.counts.len() {
                self.counts.resize(end as usize, 0);
            }
            match (start..end).find(|&c| self.counts[c as usize] != 0) {
                Some(used) => start = used + 1,
                None => break,
            }
        }
        for c in start..start + n {
            self.counts[c as usize] = 1;
        }
        self.first_free = start + n;
        start
    }

    fn get(&self, c: u64) -> u64 {
        self.counts.get(c as usize).copied().unwrap_or(0)
    }
}

/// The new refcount structure being written.
struct Rebuild<'a> {
    file: &'a StorageRef,
    geo: Geometry,
    order: u32,
    counts: Counts,
    /// Host offsets of the refcount blocks written, by table index.
    table: Vec<u64>,
}

impl Rebuild<'_> {
    fn entries_per_block(&self) -> u64 {
        (self.geo.cluster_size() * 8) >> self.order
    }

    /// Writes the refcount block of every block-sized range in
    /// `[first, end)` that has a cluster in use, allocating the blocks not
    /// yet written (QEMU's `rebuild_refcounts_write_refblocks`). Returns
    /// whether the table grew.
    fn write_blocks(&mut self, first: u64, end: u64) -> Result<bool> {
        let epb = self.entries_per_block();
        let cs = self.geo.cluster_size();
        let mut grew = false;
        let mut c = first;
        while c < end {
            if self.counts.get(c) == 0 {
                c += 1;
                continue;
            }
            let index = c / epb;
            let block_start = index * epb;
            let at = match self.table.get(index as usize) {
                Some(&at) if at != 0 => at,
                _ => {
                    let at = self.counts.alloc(1) * cs;
                    if index as usize >= self.table.len() {
                        self.table.resize(index as usize + 1, 0);
                        grew = true;
                    }
                    self.table[index as usize] = at;
                    // The new block may be in a range already written.
                    if at / cs < c {
                        c = at / cs;
                        continue;
                    }
                    at
                }
            };
            let mut block = vec![0u8; cs as usize];
            for i in 0..epb {
                let v = self.counts.get(block_start + i);
                if v >> (1u32 << self.order).min(63) != 0 {
                    return Err(Error::invalid(format!(
                        "Refcount of cluster {} does not fit its width",
                        block_start + i
                    )));
                }
                set_entry(&mut block, self.order, i, v);
            }
            self.file.write_extend(&block, at)?;
            c = block_start + epb;
        }
        Ok(grew)
    }
}

/// Writes a new refcount structure for the image in `file` from `counts`
/// (references per host cluster) and points the header at it.
pub fn rebuild(file: &StorageRef, header: &Header, counts: &[u32]) -> Result<()> {
    let geo = Geometry::of(header);
    let cs = geo.cluster_size();
    let mut r = Rebuild {
        file,
        geo,
        order: header.refcount_order,
        counts: Counts {
            counts: counts.iter().map(|&c| u64::from(c)).collect(),
            first_free: 0,
        },
        table: Vec::new(),
    };
    let total = r.counts.counts.len() as u64;
    r.write_blocks(0, total)?;
    let (table_at, table_clusters) = loop {
        let clusters = (r.table.len() as u64 * 8).div_ceil(cs).max(1);
        let start = r.counts.alloc(clusters);
        // The table's own clusters need counting in a block too.
        if !r.write_blocks(start, start + clusters)? {
            break (start * cs, clusters);
        }
        // The table grew: its place is too small; free it and go again.
        for c in start..start + clusters {
            r.counts.counts[c as usize] = 0;
        }
        r.counts.first_free = r.counts.first_free.min(start);
    };
    let mut table = vec![0u8; (table_clusters * cs) as usize];
    for (i, &at) in r.table.iter().enumerate() {
        table[i * 8..i * 8 + 8].copy_from_slice(&at.to_be_bytes());
    }
    file.write_extend(&table, table_at)?;
    file.flush()?;
    let mut fields = [0u8; 12];
    fields[..8].copy_from_slice(&table_at.to_be_bytes());
    fields[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
    file.write_extend(&fields, 48)?;
    file.flush()
}

#[cfg(test)]
mod tests {
    use super::Counts;

    #[test]
    fn allocation_takes_the_first_free_run_and_grows_past_the_end() {
        let mut c = Counts {
            counts: vec![1, 1, 0, 1, 0, 0, 1],
            first_free: 0,
        };
        assert_eq!(c.alloc(1), 2);
        assert_eq!(c.alloc(2), 4);
        assert_eq!(c.alloc(3), 7);
        assert_eq!(c.counts.len(), 10);
        assert!(c.counts.iter().all(|&n| n == 1));
    }
}
