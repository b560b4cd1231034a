//! Walking an L1 table to add or drop one reference to everything it maps,
//! and to set the COPIED flags to what the refcounts then say.
//!
//! Refcounts count references per L1 table: a snapshot adds one to each L2
//! table its L1 table points at and one to each data cluster those tables
//! point at, even when an L2 table is shared. COPIED is set exactly on the
//! entries whose cluster has a refcount of 1 (never on compressed clusters,
//! always on data clusters in an external data file), which is what
//! `qemu-img check` verifies for the active tables.

use std::collections::HashMap;

use diskit_core::{Error, ErrorKind, Result};

use super::l2::{COPIED, ClusterKind, L1E_OFFSET_MASK, L1E_RESERVED, L2Entry};
use super::layout::{HostCluster, HostOffset};
use super::meta::Meta;
use super::table::corrupt;

/// The L2 table an L1 entry points at (validated), or None.
fn l2_offset(meta: &Meta, i: usize, e: u64) -> Result<Option<HostOffset>> {
    let off = e & L1E_OFFSET_MASK;
    if off == 0 {
        return Ok(None);
    }
    let geo = meta.cx.geo;
    if e & L1E_RESERVED != 0 || !geo.is_cluster_aligned(HostOffset(off)) {
        return Err(corrupt(format!("L1 entry {i} ({e:#018x}) is invalid")));
    }
    if off < geo.cluster_size() {
        return Err(corrupt(format!("L1 entry {i} points at the image header")));
    }
    Ok(Some(HostOffset(off)))
}

/// The host clusters whose refcount an L2 entry accounts for.
fn clusters_of(meta: &Meta, kind: ClusterKind) -> Vec<HostCluster> {
    let geo = meta.cx.geo;
    match kind {
        ClusterKind::Normal(h) | ClusterKind::ZeroAlloc(h) if !meta.cx.external_data => {
            vec![geo.host_cluster(h)]
        }
        ClusterKind::Compressed(c) => {
            let (start, end) = c.sector_range();
            ((start >> geo.cluster_bits)..=((end - 1) >> geo.cluster_bits))
                .map(HostCluster)
                .collect()
        }
        _ => Vec::new(),
    }
}

/// Decodes every entry of the L2 tables `l1` points at, so that a walk
/// with [`update`] cannot stop half way on a corrupt entry. With
/// `adding`, also checks that no refcount would overflow (QEMU fails such
/// a snapshot with EINVAL).
pub fn validate(meta: &mut Meta, l1: &[u64], adding: bool) -> Result<()> {
    let geo = meta.cx.geo;
    let cx = meta.cx;
    let mut extra: HashMap<u64, u64> = HashMap::new();
    for (i, &e) in l1.iter().enumerate() {
        let Some(at) = l2_offset(meta, i, e)? else {
            continue;
        };
        *extra.entry(geo.host_cluster(at).0).or_default() += 1;
        let table = meta.l2_table(at)?.clone();
        for (j, entry) in table.iter().enumerate() {
            let guest = ((i as u64 * geo.l2_entries()) + j as u64) << geo.cluster_bits;
            let kind = entry.decode(&cx, guest)?;
            if adding {
                for c in clusters_of(meta, kind) {
                    *extra.entry(c.0).or_default() += 1;
                }
            }
        }
    }
    if adding {
        let refs = meta.refs()?;
        let max = refs.max_refcount();
        for (c, n) in extra {
            if refs
                .get(HostCluster(c))?
                .checked_add(n)
                .is_none_or(|v| v > max)
            {
                return Err(Error::from_kind(ErrorKind::InvalidInput));
            }
        }
    }
    Ok(())
}

/// The entry with COPIED set when `refcount` is 1 and cleared otherwise.
fn with_copied(word: u64, refcount: u64) -> u64 {
    if refcount == 1 {
        word | COPIED
    } else {
        word & !COPIED
    }
}

/// Adds `addend` (-1, 0 or 1) to the refcount of every cluster `l1` maps
/// and updates the COPIED flags of the L2 tables it points at. Returns the
/// L1 entries with their COPIED flags updated. L2 tables whose last
/// reference goes are freed (and left unchanged). Run [`validate`] first.
pub fn update(meta: &mut Meta, l1: &[u64], addend: i64) -> Result<Vec<u64>> {
    let geo = meta.cx.geo;
    let cx = meta.cx;
    let mut out = l1.to_vec();
    for (i, &e) in l1.iter().enumerate() {
        let Some(at) = l2_offset(meta, i, e)? else {
            continue;
        };
        let l2c = geo.host_cluster(at);
        let freed = addend < 0 && meta.refs()?.get(l2c)? == 1;
        let mut table: Vec<L2Entry> = meta.l2_table(at)?.clone();
        let mut changed = false;
        for (j, entry) in table.iter_mut().enumerate() {
            let guest = ((i as u64 * geo.l2_entries()) + j as u64) << geo.cluster_bits;
            let kind = entry.decode(&cx, guest)?;
            let clusters = clusters_of(meta, kind);
            if addend != 0 {
                for &c in &clusters {
                    meta.refs()?.adjust(c, addend)?;
                }
            }
            let refcount = match kind {
                ClusterKind::Normal(_) | ClusterKind::ZeroAlloc(_) if cx.external_data => 1,
                ClusterKind::Normal(_) | ClusterKind::ZeroAlloc(_) => {
                    meta.refs()?.get(clusters[0])?
                }
                // Compressed clusters are never written in place.
                ClusterKind::Compressed(_) => 2,
                ClusterKind::ZeroPlain | ClusterKind::Unallocated => 0,
            };
            let word = with_copied(entry.word, refcount);
            if word != entry.word {
                entry.word = word;
                changed = true;
            }
        }
        if freed {
            meta.refs()?.adjust(l2c, -1)?;
            meta.forget_l2(at);
            out[i] = e & !COPIED;
            continue;
        }
        if changed {
            *meta.l2_table(at)? = table;
            meta.mark_l2_dirty(at);
        }
        if addend != 0 {
            meta.refs()?.adjust(l2c, addend)?;
        }
        let refcount = meta.refs()?.get(l2c)?;
        out[i] = with_copied(e, refcount);
    }
    Ok(out)
}
