//! Emptying a qcow2 image (what `commit` does to the image it committed):
//! afterwards every cluster is unallocated and the backing file shows through.
//!
//! Like QEMU, an image without snapshots, bitmaps, encryption or external
//! data file is reset to its smallest form (header, refcount table, one
//! refcount block, a zeroed L1 table) and the file truncated; any other
//! image has every cluster discarded.

use diskit_core::Result;
use diskit_core::{Preallocation, Storage};

use super::device::Qcow2Format;
use super::header::{Header, ext, incompat};
use super::open::read_header;
use super::refcount::set_entry;

/// Clusters of the L1 table of `header`.
fn l1_clusters(header: &Header) -> u64 {
    (header.l1_size as u64 * 8).div_ceil(header.cluster_size())
}

/// Whether [`empty_completely`] applies to an image with this header.
pub fn can_empty_completely(header: &Header) -> bool {
    let cs = header.cluster_size();
    let refblock_entries = cs * 8 / header.refcount_bits() as u64;
    header.version >= 3
        && header.nb_snapshots == 0
        && header.extension(ext::BITMAPS).is_none()
        && header.crypt_method != 2
        && header.incompatible_features & incompat::EXTERNAL_DATA == 0
        && 3 + l1_clusters(header) <= refblock_entries
}

/// Resets the closed qcow2 image in `file` to header, refcount table (cluster
/// 1), one refcount block (cluster 2) and a zeroed L1 table (from cluster 3),
/// and truncates the file after them. The caller checks
/// [`can_empty_completely`] first.
///
/// The image is marked dirty for the duration: a crash half way leaves at
/// worst stale refcounts, which the next read-write open repairs.
pub fn empty_completely(file: &dyn Storage) -> Result<()> {
    let header = read_header(file)?;
    let cs = header.cluster_size();
    let l1c = l1_clusters(&header);
    let dirty = header.incompatible_features | incompat::DIRTY;
    file.write_extend(&dirty.to_be_bytes(), 72)?;
    file.flush()?;
    // Unreachable data first: the old L1 table, then the new table area.
    if l1c > 0 {
        file.write_extend(&vec![0u8; (l1c * cs) as usize], header.l1_table_offset)?;
    }
    file.write_extend(&vec![0u8; 2 * cs as usize], cs)?;
    file.flush()?;
    let mut fields = Vec::with_capacity(20);
    fields.extend_from_slice(&(3 * cs).to_be_bytes());
    fields.extend_from_slice(&cs.to_be_bytes());
    fields.extend_from_slice(&1u32.to_be_bytes());
    file.write_extend(&fields, 40)?;
    file.flush()?;
    let end = (3 + l1c) * cs;
    file.resize(end, Preallocation::Off)?;
    if l1c > 0 {
        file.write_extend(&vec![0u8; (l1c * cs) as usize], 3 * cs)?;
    }
    file.write_extend(&(2 * cs).to_be_bytes(), cs)?;
    let mut block = vec![0u8; cs as usize];
    for c in 0..3 + l1c {
        set_entry(&mut block, header.refcount_order, c, 1);
    }
    file.write_extend(&block, 2 * cs)?;
    file.flush()?;
    let clean = header.incompatible_features & !incompat::DIRTY;
    file.write_extend(&clean.to_be_bytes(), 72)?;
    file.flush()
}

impl Qcow2Format {
    /// Discards every cluster: all of the image reads from the backing file
    /// (or as zeros without one). Works on any image, with snapshots too.
    pub fn discard_everything(&self) -> Result<()> {
        let size = self.size();
        if size > 0 {
            self.discard_clusters(0, size)?;
        }
        crate::mapped::MappedFormat::flush(self)
    }
}
