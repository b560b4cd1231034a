//! Changing the refcount width of an image (`amend -o refcount_bits=N`).
//!
//! New refcount blocks and a new refcount table, holding every refcount
//! at the new width (their own clusters included), are written past the
//! end of everything in use; one header write switches to them; the old
//! structures are then freed in the new ones. A crash before the header
//! write leaves the old structures in charge (the new clusters are past
//! the end of what they count, so nothing leaks there that check would
//! miss); after it, at worst the old structures leak.

use diskit_core::{BlockDevice, Error, Result};

use super::header::Header;
use super::layout::HostCluster;
use super::meta::Meta;
use super::refcount::{Refcounts, set_entry};
use super::table::u64_table_bytes;

/// The largest refcount `order` can hold.
fn max_refcount(order: u32) -> u64 {
    if order == 6 {
        u64::MAX
    } else {
        (1u64 << (1 << order)) - 1
    }
}

/// Rebuilds the refcount structures of the image with 2^`order`-bit
/// entries and returns the header now on disk.
pub fn change_order(meta: &mut Meta, header: &Header, order: u32) -> Result<Header> {
    meta.write_back()?;
    meta.write_back()?;
    meta.file.flush()?;
    let geo = meta.cx.geo;
    let cs = geo.cluster_size();
    let refs = meta.refs()?;
    let old_table: Vec<u64> = refs.table().to_vec();
    let (old_table_at, old_table_clusters) = refs.table_location();
    let used = refs.top().0.max(meta.file.file_len()?.div_ceil(cs));
    let mut counts = Vec::with_capacity(used as usize);
    let max = max_refcount(order);
    let refs = meta.refs()?;
    for c in 0..used {
        let n = refs.get(HostCluster(c))?;
        if n > max {
            return Err(Error::invalid(format!(
                "Cannot decrease refcount entry width to {} bits: Cluster at offset {:#x} \
                 has a refcount of {n}",
                1u32 << order,
                c * cs
            )));
        }
        counts.push(n);
    }
    // New blocks then the new table, from `used` on; they count themselves.
    let epb = (cs * 8) >> order;
    let (blocks, table_clusters) = {
        let mut blocks = used.div_ceil(epb).max(1);
        loop {
            let table_clusters = (blocks * 8).div_ceil(cs);
            let end = used + blocks + table_clusters;
            let need = end.div_ceil(epb);
            if need <= blocks {
                break (blocks, table_clusters);
            }
            blocks = need;
        }
    };
    let end = used + blocks + table_clusters;
    counts.resize(end as usize, 0);
    for c in used..end {
        counts[c as usize] = 1;
    }
    let table_entries = (table_clusters * cs / 8) as usize;
    let mut table = vec![0u64; table_entries];
    for b in 0..blocks {
        let mut block = vec![0u8; cs as usize];
        let first = b * epb;
        for i in 0..epb.min(end.saturating_sub(first)) {
            set_entry(&mut block, order, i, counts[(first + i) as usize]);
        }
        let at = (used + b) * cs;
        meta.file.write_extend(&block, at)?;
        table[b as usize] = at;
    }
    let table_at = (used + blocks) * cs;
    meta.file.write_extend(
        &u64_table_bytes(&table, (table_clusters * cs) as usize),
        table_at,
    )?;
    meta.file.flush()?;
    let mut h = header.clone();
    h.refcount_order = order;
    h.refcount_table_offset = table_at;
    h.refcount_table_clusters = table_clusters as u32;
    meta.file.write_extend(&h.to_bytes()?, 0)?;
    meta.file.flush()?;
    // The old structures are garbage now.
    let mut refs = Refcounts::load(meta.file.clone(), &h, 256)?;
    let first = geo.host_cluster(old_table_at).0;
    for c in first..first + old_table_clusters {
        refs.adjust(HostCluster(c), -1)?;
    }
    for e in old_table.iter().filter(|&&e| e != 0) {
        refs.adjust(geo.host_cluster(super::layout::HostOffset(e & !0x1ff)), -1)?;
    }
    meta.refs = Some(refs);
    meta.write_back()?;
    meta.file.flush()?;
    Ok(h)
}
