//! Getting rid of what a v2 image cannot hold before a downgrade: zero
//! clusters become unallocated clusters (nothing below shows through) or
//! clusters of zeros, in the active tables and in every snapshot's.

use diskit_core::{BlockDevice, Result};

use super::l2::{COPIED, ClusterKind, L1E_OFFSET_MASK, L2E_OFFSET_MASK, ZERO};
use super::layout::{HostCluster, HostOffset};
use super::meta::Meta;
use super::snapshot::Snapshot;
use super::table::read_u64_table;

/// Whether the active disk maps any compressed cluster.
pub fn has_compressed(meta: &mut Meta) -> Result<bool> {
    let cx = meta.cx;
    for i in 0..meta.l1.len() {
        let Some(at) = meta.l2_offset(i)? else {
            continue;
        };
        let table = meta.l2_table(at)?.clone();
        for (j, e) in table.iter().enumerate() {
            let guest = (i as u64 * cx.geo.l2_entries() + j as u64) << cx.geo.cluster_bits;
            if matches!(e.decode(&cx, guest)?, ClusterKind::Compressed(_)) {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Replaces every zero cluster in the tables of the active disk (`None`)
/// and of `l1s`' snapshots. A plain zero cluster becomes unallocated when
/// no backing file shows through, a cluster of zeros otherwise; an
/// allocated one is zeroed in place when nothing else uses its cluster,
/// or replaced by a new cluster of zeros.
pub fn expand(meta: &mut Meta, l1s: &[Option<&Snapshot>], has_backing: bool) -> Result<()> {
    let cx = meta.cx;
    let geo = cx.geo;
    let cs = geo.cluster_size();
    let zeros = vec![0u8; cs as usize];
    for which in l1s {
        let l1 = match which {
            None => meta.l1.clone(),
            Some(sn) => read_u64_table(&meta.file, sn.l1_table_offset, sn.l1_size as u64)?,
        };
        for (i, &e) in l1.iter().enumerate() {
            let off = e & L1E_OFFSET_MASK;
            if off == 0 {
                continue;
            }
            let at = HostOffset(off);
            let table_refs = meta.refs()?.get(geo.host_cluster(at))?;
            let mut table = meta.l2_table(at)?.clone();
            let mut changed = false;
            for (j, entry) in table.iter_mut().enumerate() {
                let guest = (i as u64 * geo.l2_entries() + j as u64) << geo.cluster_bits;
                let kind = entry.decode(&cx, guest)?;
                let target = match kind {
                    ClusterKind::ZeroPlain if !has_backing => {
                        entry.word = 0;
                        changed = true;
                        continue;
                    }
                    ClusterKind::ZeroPlain => None,
                    ClusterKind::ZeroAlloc(h) => Some(h),
                    _ => continue,
                };
                let in_place = match target {
                    Some(h) => meta.refs()?.get(geo.host_cluster(h))? == table_refs,
                    None => false,
                };
                let host = if let (true, Some(h)) = (in_place, target) {
                    h
                } else {
                    let (c, _) = meta.refs()?.alloc(1)?;
                    meta.refs()?.set(c, table_refs)?;
                    if let Some(h) = target {
                        let old: HostCluster = geo.host_cluster(h);
                        let n = meta.refs()?.get(old)?;
                        meta.refs()?.set(old, n.saturating_sub(table_refs))?;
                    }
                    geo.host_offset(c)
                };
                meta.file.write_extend(&zeros, host.0)?;
                let mut word = host.0 & L2E_OFFSET_MASK;
                if table_refs == 1 && meta.refs()?.get(geo.host_cluster(host))? == 1 {
                    word |= COPIED;
                }
                entry.word = word & !ZERO;
                changed = true;
            }
            if changed {
                // The zeros are on disk before any table points at them.
                meta.file.flush()?;
                *meta.l2_table(at)? = table;
                meta.mark_l2_dirty(at);
            }
        }
    }
    Ok(())
}
