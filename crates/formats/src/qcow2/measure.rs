//! `qemu-img measure -O qcow2`: the space a qcow2 image needs.
//!
//! The same arithmetic as QEMU's `qcow2_measure` and
//! `qcow2_calc_prealloc_size`: a fully allocated image is one header
//! cluster, the L2 tables for every cluster, the L1 table, the refcount
//! structures for all of that, and the data; "required" drops the data
//! clusters that the source does not have allocated.

use diskit_core::{BlockDevice, Error, Result};

use super::create::{Qcow2CreateOptions, Version, invalid};
use super::create_layout::{Geometry, Prealloc, refcount_metadata_size};

pub use crate::driver::Measurement;

/// Total bytes of a fully allocated image of `size` bytes
/// (`qcow2_calc_prealloc_size`).
pub fn fully_allocated_size(size: u64, geo: Geometry) -> u64 {
    let cs = geo.cluster_size() as u128;
    let esize = geo.l2_entry_size() as u128;
    let aligned = (size as u128).next_multiple_of(cs);
    let mut meta = cs; // header
    let l2_entries = (aligned / cs).next_multiple_of(cs / esize);
    meta += l2_entries * esize;
    let l1_entries = (l2_entries * esize / cs).next_multiple_of(cs / 8);
    meta += l1_entries * 8;
    let clusters = u64::try_from((meta + aligned) / cs).unwrap_or(u64::MAX);
    let (_, refcount_bytes) =
        refcount_metadata_size(clusters, geo.cluster_size(), geo.refcount_order, false);
    let total = meta + refcount_bytes as u128 + aligned;
    u64::try_from(total).unwrap_or(u64::MAX)
}

/// What a source contributes to a measurement.
pub struct Source<'a> {
    /// The guest-visible device (its extents say what is allocated).
    pub device: &'a dyn BlockDevice,
    /// The file under the source when the source is a qcow2 image (whose
    /// persistent bitmaps would be carried over).
    pub qcow2_file: Option<&'a dyn BlockDevice>,
}

/// Measures a qcow2 image made with `opts`, of the source's size (or of
/// `opts.size`), as `qemu-img measure -O qcow2` does.
pub fn measure(opts: &Qcow2CreateOptions, source: Option<Source<'_>>) -> Result<Measurement> {
    // qcow2_measure validates only what it uses, in this order, with its
    // own wording for the compatibility level.
    let extended_l2 = opts.extended_l2.unwrap_or(false);
    let cluster_size = opts.cluster_size_checked(extended_l2)?;
    let version = match opts.compat.as_deref() {
        None | Some("1.1") => Version::V3,
        Some("0.10") => Version::V2,
        Some(other) => return Err(invalid(format!("Invalid compatibility level: '{other}'"))),
    };
    let refcount_bits = opts.refcount_bits_checked()?;
    if version == Version::V2 && refcount_bits != 16 {
        return Err(invalid(
            "Different refcount widths than 16 bits require compatibility level 1.1 \
             or above (use compat=1.1 or greater)",
        ));
    }
    let prealloc = match opts.preallocation.as_deref() {
        None => Prealloc::Off,
        Some(p) => super::create::parse_prealloc(p)
            .ok_or_else(|| invalid(format!("invalid parameter value: {p}")))?,
    };
    if opts.encrypt_format.is_some() {
        return Err(Error::unsupported(
            "Encrypted qcow2 images are not supported by diskit",
        ));
    }
    let geo = Geometry {
        cluster_bits: cluster_size.trailing_zeros(),
        refcount_order: refcount_bits.trailing_zeros(),
        extended_l2,
    };
    let cs = geo.cluster_size();
    let too_large = || invalid("The image size is too large (try using a larger cluster size)");
    let mut virtual_size = opts
        .size
        .unwrap_or(0)
        .checked_next_multiple_of(cs)
        .ok_or_else(too_large)?;
    let l2_tables = (virtual_size / cs).div_ceil(geo.l2_entries());
    if l2_tables * 8 > 32 << 20 {
        return Err(too_large());
    }
    let mut required = 0u64;
    let mut bitmaps = None;
    if let Some(src) = source {
        let ssize = src.device.size();
        virtual_size = ssize.checked_next_multiple_of(cs).ok_or_else(too_large)?;
        if opts.backing_file.is_some() {
            required = virtual_size;
        } else {
            required = allocated_clusters_bytes(src.device, cs)?;
        }
        if version == Version::V3
            && let Some(file) = src.qcow2_file
        {
            bitmaps = source_bitmaps_size(file, ssize, cs)?;
        }
    }
    if matches!(prealloc, Prealloc::Falloc | Prealloc::Full) {
        required = virtual_size;
    }
    let fully_allocated = fully_allocated_size(virtual_size, geo);
    Ok(Measurement {
        required: fully_allocated - virtual_size + required,
        fully_allocated,
        bitmaps,
    })
}

/// Bytes of the clusters holding allocated data, counted as QEMU counts
/// them from block status: zero ranges are skipped, a data range counts
/// from the start of its first cluster to the end of its last.
fn allocated_clusters_bytes(dev: &dyn BlockDevice, cs: u64) -> Result<u64> {
    let size = dev.size();
    let mut required = 0u64;
    let mut offset = 0u64;
    while offset < size {
        let extents = dev.extents(offset, size - offset)?;
        let Some(first) = extents.first() else {
            return Err(Error::io("Unable to get block status"));
        };
        let mut pnum = first.length.min(size - offset);
        if pnum == 0 {
            return Err(Error::io("Unable to get block status"));
        }
        let f = first.flags;
        if !f.zero && f.data {
            pnum = (offset + pnum).next_multiple_of(cs) - offset;
            required += offset % cs + pnum;
        }
        offset += pnum;
    }
    Ok(required)
}

/// Space the persistent bitmaps of a qcow2 source need in a target with
/// `cluster_size` clusters (`qcow2_get_persistent_dirty_bitmap_size`), or
/// None when the source cannot have persistent bitmaps (not qcow2 v3).
/// `file` is the source's file (the qcow2 layer's protocol), `virtual_size`
/// the source's size.
pub fn source_bitmaps_size(
    file: &dyn BlockDevice,
    virtual_size: u64,
    cluster_size: u64,
) -> Result<Option<u64>> {
    use super::header::{Header, autoclear, ext};
    // Only the header cluster: reading more would pull data into the page
    // cache, where file systems then report preallocated-but-unwritten
    // ranges as data to later block-status queries.
    let mut fixed = [0u8; 104];
    let n = fixed.len().min(file.size() as usize);
    file.read_at(&mut fixed[..n], 0)?;
    let cluster_bits = u32::from_be_bytes(fixed[20..24].try_into().expect("4 bytes"));
    if !(9..=21).contains(&cluster_bits) {
        return Err(Error::io(format!(
            "Unsupported cluster size: 2^{cluster_bits}"
        )));
    }
    let mut first = vec![0u8; (1usize << cluster_bits).min(file.size() as usize)];
    file.read_at(&mut first, 0)?;
    let header = Header::parse(&first)?;
    if header.version < 3 {
        return Ok(None);
    }
    let Some(bitmaps) = header.extension(ext::BITMAPS) else {
        return Ok(Some(0));
    };
    // Without the autoclear bit the bitmaps are not loaded at all.
    if header.autoclear_features & autoclear::BITMAPS == 0 || bitmaps.data.len() != 24 {
        return Ok(Some(0));
    }
    use super::table::{be32, be64};
    let count = be32(&bitmaps.data, 0) as usize;
    let dir_size = be64(&bitmaps.data, 8);
    let dir_offset = be64(&bitmaps.data, 16);
    if dir_size > 64 << 20
        || dir_offset
            .checked_add(dir_size)
            .is_none_or(|e| e > file.size())
    {
        return Err(Error::io("bitmaps_ext: invalid bitmap directory"));
    }
    let mut dir = vec![0u8; dir_size as usize];
    file.read_at(&mut dir, dir_offset)?;
    let (mut total, mut dir_bytes, mut at) = (0u64, 0u64, 0usize);
    for _ in 0..count {
        if at + 24 > dir.len() {
            return Err(Error::io("bitmaps_ext: truncated bitmap directory"));
        }
        let granularity_bits = u32::from(dir[at + 17]);
        let name_size = u16::from_be_bytes([dir[at + 18], dir[at + 19]]) as usize;
        let extra = be32(&dir, at + 20) as usize;
        if !(9..=31).contains(&granularity_bits) {
            return Err(Error::io("bitmaps_ext: invalid bitmap granularity"));
        }
        let bits = virtual_size.div_ceil(1 << granularity_bits);
        let clusters = bits.div_ceil(8).div_ceil(cluster_size);
        total += clusters * cluster_size;
        total += (clusters * 8).next_multiple_of(cluster_size);
        dir_bytes += (24 + name_size as u64).next_multiple_of(8);
        at += (24 + extra + name_size).next_multiple_of(8);
    }
    Ok(Some(total + dir_bytes.next_multiple_of(cluster_size)))
}

#[cfg(test)]
mod tests;
