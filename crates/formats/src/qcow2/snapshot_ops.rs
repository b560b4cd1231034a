//! Creating, applying and deleting internal snapshots, as
//! `qemu-img snapshot -c/-a/-d` do.
//!
//! Every operation is ordered so that a crash at any moment leaves at worst
//! leaked clusters: references are counted before anything points at them
//! (a new snapshot's clusters gain their references before the snapshot
//! table lists it), and dropped only once nothing points at them any more
//! (a deleted snapshot leaves the table before its clusters lose their
//! references). The new snapshot table is written to new clusters and the
//! header switched to it in one write.

use crate::mapped::MappedFormat;
use std::sync::atomic::Ordering;

use diskit_core::{BlockDevice, Error, ErrorKind, Result};

use super::device::Qcow2Format;
use super::header::{Header, incompat};
use super::layout::{Geometry, HostCluster};
use super::meta::Meta;
use super::open::read_header;
use super::snapshot::{self, MAX_SNAPSHOTS, Snapshot};
use super::snapshot_refs;
use super::table::{read_u64_table, u64_table_bytes};

/// Bytes of a snapshot name QEMU keeps (`name[256]`, NUL included).
const MAX_NAME_BYTES: usize = 255;

/// The number at the start of an id, as C's strtoul reads it (0 if none).
fn id_number(id: &[u8]) -> u64 {
    id.iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take_while(|b| b.is_ascii_digit())
        .fold(0u64, |n, &d| {
            n.saturating_mul(10).saturating_add((d - b'0') as u64)
        })
}

/// The id QEMU gives a new snapshot: one more than the largest in use.
pub fn next_id(snaps: &[Snapshot]) -> String {
    let max = snaps.iter().map(|s| id_number(&s.id)).max().unwrap_or(0);
    max.saturating_add(1).to_string()
}

/// Writes `new` as the snapshot table in newly allocated clusters (every
/// entry completed as QEMU writes it), points the header at it, then frees
/// the clusters of the table `old` was.
fn write_table(meta: &mut Meta, header: &Header, old: &[Snapshot], new: &[Snapshot]) -> Result<()> {
    // Everything the table points at is stable before the table is.
    meta.write_back()?;
    let geo = meta.cx.geo;
    let file = meta.file.clone();
    let old_len = if header.nb_snapshots > 0 {
        snapshot::table_len(old)
    } else {
        0
    };
    let disk_size = geo.size / 512 * 512;
    snapshot::place_table(
        &file,
        meta.refs()?,
        geo.cluster_size(),
        (header.snapshots_offset, old_len),
        new,
        disk_size,
    )
}

/// Drops one reference from each of `n` clusters from `first` on.
fn free_clusters(meta: &mut Meta, first: u64, n: u64) -> Result<()> {
    for c in first..first + n {
        meta.refs()?.adjust(HostCluster(c), -1)?;
    }
    Ok(())
}

/// Writes everything back twice (so that deferred decrements land too) and syncs.
fn settle(meta: &mut Meta) -> Result<()> {
    meta.write_back()?;
    meta.write_back()?;
    meta.file.flush()
}

/// Recomputes the COPIED flags of the active tables.
fn fix_active_copied(meta: &mut Meta) -> Result<()> {
    let l1 = meta.l1.clone();
    let fixed = snapshot_refs::update(meta, &l1, 0)?;
    meta.replace_l1(&fixed);
    Ok(())
}

/// Reads a snapshot's L1 table.
fn read_l1(meta: &Meta, sn: &Snapshot) -> Result<Vec<u64>> {
    read_u64_table(&meta.file, sn.l1_table_offset, sn.l1_size as u64)
}

impl Qcow2Format {
    fn snapshot_state(&self) -> Result<(Header, Vec<Snapshot>)> {
        if !self.writable() {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        let header = read_header(&self.file)?;
        if header.incompatible_features & incompat::EXTERNAL_DATA != 0 {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        let snaps = snapshot::read_checked(&self.file, &header)?;
        Ok((header, snaps))
    }

    /// The size QEMU records for a snapshot (whole sectors).
    fn disk_size(&self) -> u64 {
        self.size() / 512 * 512
    }

    /// Creates an internal snapshot of the active disk named `name` (cut to
    /// the 255 bytes QEMU keeps), taken at `date_sec`/`date_nsec`, with the
    /// next free id; returns it. Names need not be unique (as in QEMU).
    pub fn create_snapshot(&self, name: &str, date_sec: u32, date_nsec: u32) -> Result<Snapshot> {
        let (header, snaps) = self.snapshot_state()?;
        if snaps.len() >= MAX_SNAPSHOTS as usize {
            return Err(Error::new(ErrorKind::NoSpace, "File too large"));
        }
        let name = &name.as_bytes()[..name.len().min(MAX_NAME_BYTES)];
        let mut meta = self.lock();
        settle(&mut meta)?;
        let l1 = meta.l1.clone();
        snapshot_refs::validate(&mut meta, &l1, true)?;
        // The copy of the active L1 table.
        let geo = meta.cx.geo;
        let cs = geo.cluster_size();
        let l1_offset = if l1.is_empty() {
            0
        } else {
            let clusters = (l1.len() as u64 * 8).div_ceil(cs);
            let (c, _) = meta.refs()?.alloc(clusters)?;
            let at = geo.host_offset(c);
            meta.file
                .write_extend(&u64_table_bytes(&l1, (clusters * cs) as usize), at.0)?;
            at.0
        };
        // Every cluster it maps gains a reference; the active tables lose COPIED.
        let active = snapshot_refs::update(&mut meta, &l1, 1)?;
        meta.replace_l1(&active);
        settle(&mut meta)?;
        let sn = Snapshot {
            l1_table_offset: l1_offset,
            l1_size: l1.len() as u32,
            id: next_id(&snaps).into_bytes(),
            name: name.to_vec(),
            date_sec,
            date_nsec,
            vm_clock_nsec: 0,
            vm_state_size_32: 0,
            // qemu-img leaves the icount at 0.
            extra: snapshot::known_extra(0, self.disk_size(), Some(0)),
        };
        let mut new = snaps.clone();
        new.push(sn.clone());
        write_table(&mut meta, &header, &snaps, &new)?;
        settle(&mut meta)?;
        Ok(sn)
    }

    /// Reverts the active disk to the snapshot with id `id_or_name`, or
    /// else the first one named so; the virtual size follows the
    /// snapshot's.
    pub fn apply_snapshot(&self, id_or_name: &str) -> Result<()> {
        let (header, snaps) = self.snapshot_state()?;
        let want = id_or_name.as_bytes();
        let sn = snaps
            .iter()
            .find(|s| s.id == want)
            .or_else(|| snaps.iter().find(|s| s.name == want))
            .ok_or_else(|| Error::from_kind(ErrorKind::NotFound))?
            .clone();
        let cur_size = self.disk_size();
        let new_size = sn.disk_size().unwrap_or(cur_size);
        if new_size != cur_size && header.version < 3 {
            return Err(Error::unsupported(
                "Can't resize a v2 image which has snapshots",
            ));
        }
        self.before_change()?;
        let mut meta = self.lock();
        settle(&mut meta)?;
        let sn_l1 = read_l1(&meta, &sn)?;
        let old = meta.l1.clone();
        snapshot_refs::validate(&mut meta, &sn_l1, true)?;
        snapshot_refs::validate(&mut meta, &old, false)?;
        let needed = Geometry {
            size: new_size,
            ..meta.cx.geo
        }
        .l1_entries_needed() as usize;
        let len = old.len().max(sn_l1.len()).max(needed);
        if len > old.len() {
            meta.relocate_l1(len)?;
        }
        // The snapshot's clusters gain the references of the new active disk.
        let counted = snapshot_refs::update(&mut meta, &sn_l1, 1)?;
        settle(&mut meta)?;
        if counted != sn_l1 {
            meta.file
                .write_extend(&u64_table_bytes(&counted, 0), sn.l1_table_offset)?;
            meta.file.flush()?;
        }
        // The active L1 table becomes the snapshot's, then the clusters of
        // the old one lose their references.
        let mut active = counted;
        active.resize(len, 0);
        let old = meta.l1.clone();
        meta.replace_l1(&active);
        settle(&mut meta)?;
        snapshot_refs::update(&mut meta, &old, -1)?;
        settle(&mut meta)?;
        fix_active_copied(&mut meta)?;
        settle(&mut meta)?;
        drop(meta);
        if new_size != self.size() {
            self.file.write_extend(&new_size.to_be_bytes(), 24)?;
            self.file.flush()?;
            self.size.store(new_size, Ordering::Release);
        }
        Ok(())
    }

    /// Deletes the first snapshot named `name` (qemu-img snapshot -d looks
    /// snapshots up by name only; images with an external data file have
    /// none).
    pub fn delete_snapshot(&self, name: &str) -> Result<()> {
        let not_found = || Error::new(ErrorKind::NotFound, "snapshot not found");
        // QEMU lists no snapshots with an external data file.
        let (header, snaps) = self.snapshot_state().map_err(|e| match e.kind() {
            ErrorKind::NotSupported => not_found(),
            _ => e,
        })?;
        let index = snaps
            .iter()
            .position(|s| s.name == name.as_bytes())
            .ok_or_else(not_found)?;
        let mut meta = self.lock();
        settle(&mut meta)?;
        let sn = snaps[index].clone();
        let sn_l1 = read_l1(&meta, &sn)?;
        snapshot_refs::validate(&mut meta, &sn_l1, false)?;
        // The clusters freed from here on (the old snapshot table's, and
        // the snapshot's own) go back to the file system at the end.
        meta.refs()?.note_freed();
        let mut new = snaps.clone();
        new.remove(index);
        write_table(&mut meta, &header, &snaps, &new)?;
        settle(&mut meta)?;
        // Nothing points at the snapshot any more: its clusters lose a
        // reference.
        snapshot_refs::update(&mut meta, &sn_l1, -1)?;
        let cs = meta.cx.geo.cluster_size();
        if sn.l1_size > 0 {
            let first = sn.l1_table_offset / cs;
            free_clusters(&mut meta, first, (sn.l1_size as u64 * 8).div_ceil(cs))?;
        }
        settle(&mut meta)?;
        fix_active_copied(&mut meta)?;
        settle(&mut meta)?;
        meta.discard_freed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sn(id: &str) -> Snapshot {
        Snapshot {
            l1_table_offset: 0,
            l1_size: 0,
            id: id.as_bytes().to_vec(),
            name: Vec::new(),
            date_sec: 0,
            date_nsec: 0,
            vm_clock_nsec: 0,
            vm_state_size_32: 0,
            extra: Vec::new(),
        }
    }

    #[test]
    fn ids_follow_the_largest_number_like_strtoul() {
        assert_eq!(next_id(&[]), "1");
        assert_eq!(next_id(&[sn("1"), sn("7"), sn("3")]), "8");
        // Non-numeric ids count as 0, leading digits count.
        assert_eq!(next_id(&[sn("abc")]), "1");
        assert_eq!(next_id(&[sn("12x"), sn(" 4")]), "13");
    }
}
