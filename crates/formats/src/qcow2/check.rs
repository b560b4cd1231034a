//! `check`: rebuild the reference counts from everything the image's
//! metadata points at, compare them with the stored refcounts and the
//! COPIED flags, and optionally repair (qemu-img check -r leaks|all).

use diskit_core::{BlockDevice, Error, Result};
use diskit_core::{Storage, StorageRef};

use super::header::{Header, incompat};
use super::l2::{COMPRESSED, COPIED, Compressed, L1E_OFFSET_MASK, L2E_OFFSET_MASK, ZERO};
use super::layout::{Geometry, HostCluster, HostOffset};
use super::meta::decode_l2;
use super::refcount::Refcounts;

pub use crate::check::{CheckReport, Repair};

/// References counted from the metadata, one per host cluster of the file.
struct Counted {
    geo: Geometry,
    counts: Vec<u32>,
    file_clusters: u64,
    /// The file's length in bytes.
    file_len: u64,
}

impl Counted {
    fn inc_range(&mut self, r: &mut CheckReport, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let cs = self.geo.cluster_size();
        let file_len = self.file_len;
        // As QEMU: a range ending a cluster or more past the end of the
        // file is one error and counts nothing (its clusters then show as
        // leaked); one ending less than a cluster past it counts.
        let end = start.saturating_add(len);
        if end.saturating_sub(file_len) >= cs {
            r.messages.push(format!(
                "ERROR: counting reference for region exceeding the end of the file by one cluster or more: offset {start:#x} size {len:#x}"
            ));
            r.corruptions += 1;
            return;
        }
        let first = start >> self.geo.cluster_bits;
        let last = (end - 1) >> self.geo.cluster_bits;
        for c in first..=last.min(self.file_clusters.saturating_sub(1)) {
            let v = &mut self.counts[c as usize];
            *v = v.saturating_add(1);
        }
    }
}

/// Checks (and with `repair`, fixes) the image in `file`.
pub fn check(file: &StorageRef, repair: Repair) -> Result<CheckReport> {
    let header = super::open::read_header(file)?;
    let geo = Geometry::of(&header);
    let cs = geo.cluster_size();
    let file_len = file.file_len()?;
    let mut r = CheckReport {
        total_clusters: header.size.div_ceil(cs),
        ..Default::default()
    };
    let file_clusters = file_len.div_ceil(cs);
    let mut counted = Counted {
        geo,
        counts: vec![0; file_clusters as usize],
        file_clusters,
        file_len,
    };
    let external = header.incompatible_features & incompat::EXTERNAL_DATA != 0;
    if external {
        data_file_opens(file, &header)?;
    }
    // The header, the LUKS header and key slots of an encrypted image, the
    // active L1 table and everything below it.
    counted.inc_range(&mut r, 0, cs);
    if header.crypt_method == super::crypt::LUKS {
        match super::crypt::luks_area(&header) {
            Ok((offset, length)) => counted.inc_range(&mut r, offset, length),
            Err(e) => {
                r.messages.push(format!("ERROR encryption header: {e}"));
                r.corruptions += 1;
            }
        }
    }
    let l1 = read_table(file, header.l1_table_offset, header.l1_size as u64)?;
    counted.inc_range(&mut r, header.l1_table_offset, header.l1_size as u64 * 8);
    let mut copied_checks: Vec<CopiedCheck> = Vec::new();
    walk_l1(
        file,
        &header,
        &l1,
        &mut counted,
        &mut r,
        true,
        external,
        repair == Repair::All,
        &mut copied_checks,
    )?;
    // Internal snapshots: their table, their L1 tables and what those reach.
    // A v3 entry without the extra data v3 requires is a corruption; with
    // -r all the table is written again, completed (after the refcounts).
    let mut incomplete_snapshots: Option<Vec<super::snapshot::Snapshot>> = None;
    if header.nb_snapshots > 0 {
        match super::snapshot::read(file, &header) {
            Ok(snapshots) => {
                for (i, sn) in snapshots.iter().enumerate() {
                    if sn.incomplete(header.version) {
                        let fix = repair == Repair::All;
                        let what = if fix { "Repairing" } else { "ERROR" };
                        r.messages
                            .push(format!("{what} snapshot table entry {i} is incomplete"));
                        if fix {
                            r.corruptions_fixed += 1;
                            incomplete_snapshots = Some(snapshots.clone());
                        } else {
                            r.corruptions += 1;
                        }
                    }
                }
                let len = super::snapshot::table_len(&snapshots);
                counted.inc_range(&mut r, header.snapshots_offset, len);
                for sn in &snapshots {
                    let bytes = sn.l1_size as u64 * 8;
                    counted.inc_range(&mut r, sn.l1_table_offset, bytes);
                    // A table outside the file reads as zeros: nothing
                    // below it to count (as QEMU, which reports it above).
                    if sn.l1_table_offset.saturating_add(bytes) > file_len {
                        continue;
                    }
                    let sl1 = read_table(file, sn.l1_table_offset, sn.l1_size as u64)?;
                    walk_l1(
                        file,
                        &header,
                        &sl1,
                        &mut counted,
                        &mut r,
                        false,
                        external,
                        repair == Repair::All,
                        &mut Vec::new(),
                    )?;
                }
            }
            Err(e) => {
                r.messages.push(format!("ERROR snapshot table: {e}"));
                r.corruptions += 1;
            }
        }
    }
    // Persistent bitmaps: the directory, each bitmap's table and its data.
    match super::bitmap::read(file, &header) {
        Ok((super::bitmap::BitmapsState::Present(x), bitmaps)) => {
            counted.inc_range(&mut r, x.directory_offset, x.directory_size);
            for b in &bitmaps {
                let table = read_table(file, b.table_offset, b.table_size as u64)?;
                counted.inc_range(&mut r, b.table_offset, b.table_size as u64 * 8);
                for e in table {
                    let off = e & L2E_OFFSET_MASK;
                    if off != 0 {
                        counted.inc_range(&mut r, off, cs);
                    }
                }
            }
        }
        Ok(_) => {}
        // QEMU cannot open such an image, to check it or otherwise.
        Err(e) => return Err(e),
    }
    // The refcount structures count themselves.
    let mut refs = Refcounts::load(file.clone(), &header, 64)?;
    let (table_at, table_clusters) = refs.table_location();
    counted.inc_range(&mut r, table_at.0, table_clusters * cs);
    for (j, &e) in refs.table().to_vec().iter().enumerate() {
        if e == 0 {
            continue;
        }
        let off = e & !0x1ff;
        if e & 0x1ff != 0 || off & (cs - 1) != 0 {
            r.messages.push(format!(
                "ERROR refcount block {j} is not cluster aligned; refcount table entry corrupted"
            ));
            r.corruptions += 1;
        } else if off >= file_len {
            r.messages
                .push(format!("ERROR refcount block {j} is outside image"));
            r.corruptions += 1;
        } else {
            counted.inc_range(&mut r, off, cs);
        }
    }
    // Compare the stored refcounts with what was counted, as QEMU does: a
    // first pass says what differs; a cluster in use with a stored count
    // of zero needs the whole structure rebuilt (setting counts one by
    // one could hand out clusters in use); otherwise a second pass
    // repairs what the repair mode allows.
    let max_refcount = refs.max_refcount();
    let mut fix_failed = false;
    let mut mismatches: Vec<(u64, u64, u64)> = Vec::new();
    let mut rebuild = false;
    // Clusters whose count drops to zero go back to the file system, as
    // QEMU discards them.
    let mut freed: Vec<HostCluster> = Vec::new();
    for c in 0..file_clusters {
        let stored: u64 = refs.get(HostCluster(c)).unwrap_or_default();
        let made = counted.counts[c as usize] as u64;
        if stored > 0 || made > 0 {
            r.image_end_offset = (c + 1) * cs;
        }
        if stored == made {
            continue;
        }
        let label = if stored > made {
            "Leaked cluster"
        } else {
            "ERROR cluster"
        };
        r.messages
            .push(format!("{label} {c} refcount={stored} reference={made}"));
        rebuild |= stored == 0;
        mismatches.push((c, stored, made));
    }
    let errors = mismatches.iter().filter(|m| m.1 < m.2).count() as u64;
    let leaks = mismatches.len() as u64 - errors;
    if rebuild && repair == Repair::All {
        r.messages.push("Rebuilding refcount structure".into());
        super::rebuild::rebuild(file, &header, &counted.counts)?;
        // The old table and blocks are leaks now: freed as leaks are
        // (only the repairs are said), then the new structure is read.
        let after = check(file, Repair::Leaks)?;
        r.messages.extend(
            after
                .messages
                .into_iter()
                .filter(|m| m.starts_with("Repairing") || m.starts_with("ERROR")),
        );
        r.corruptions_fixed += errors;
        r.leaks_fixed += leaks;
        r.leaks += after.leaks;
        r.image_end_offset = after.image_end_offset;
        refs = Refcounts::load(file.clone(), &super::open::read_header(file)?, 64)?;
    } else if rebuild && repair == Repair::Leaks {
        r.messages
            .push("ERROR need to rebuild refcount structures".into());
        r.check_errors += 1;
        r.failed = Some("Check failed: Input/output error".into());
        return Ok(r);
    } else {
        for &(c, stored, made) in &mismatches {
            let leak = stored > made;
            let fix = match repair {
                Repair::All => true,
                Repair::Leaks => leak,
                Repair::None => false,
            };
            if fix && made <= max_refcount && stored != 0 {
                if repair != Repair::None {
                    r.messages.push(format!(
                        "Repairing cluster {c} refcount={stored} reference={made}"
                    ));
                }
                if refs.set(HostCluster(c), made).is_ok() {
                    if made == 0 {
                        freed.push(HostCluster(c));
                    }
                    if leak {
                        r.leaks_fixed += 1;
                    } else {
                        r.corruptions_fixed += 1;
                    }
                    continue;
                }
                fix_failed = true;
            } else if repair != Repair::None {
                let label = if leak {
                    "Leaked cluster"
                } else {
                    "ERROR cluster"
                };
                r.messages
                    .push(format!("{label} {c} refcount={stored} reference={made}"));
            }
            if leak {
                r.leaks += 1;
            } else {
                r.corruptions += 1;
            }
        }
    }
    if repair != Repair::None {
        refs.write_dirty()?;
        file.flush()?;
        super::meta::discard_clusters(file, cs, std::mem::take(&mut freed))?;
    }
    // COPIED must say exactly whether the refcount is one.
    for cc in copied_checks {
        let rc = refs.get(cc.cluster).unwrap_or(0);
        if (rc == 1) == cc.copied {
            continue;
        }
        // QEMU says "Repairing" instead of "ERROR" when it repairs.
        let what = if repair == Repair::All {
            "Repairing"
        } else {
            "ERROR"
        };
        r.messages.push(match cc.l1_index {
            Some(i) => format!(
                "{what} OFLAG_COPIED L2 cluster: l1_index={i} l1_entry={:x} refcount={rc}",
                cc.entry
            ),
            None => format!(
                "{what} OFLAG_COPIED data cluster: l2_entry={:x} refcount={rc}",
                cc.entry
            ),
        });
        if repair == Repair::All {
            let fixed = if rc == 1 {
                cc.entry | COPIED
            } else {
                cc.entry & !COPIED
            };
            file.write_extend(&fixed.to_be_bytes(), cc.at.0)?;
            r.corruptions_fixed += 1;
        } else {
            r.corruptions += 1;
        }
    }
    if let Some(snapshots) = incomplete_snapshots {
        let old_len = super::snapshot::table_len(&snapshots);
        super::snapshot::place_table(
            file,
            &mut refs,
            cs,
            (header.snapshots_offset, old_len),
            &snapshots,
            header.size / 512 * 512,
        )?;
        refs.write_dirty()?;
    }
    // Repairing opens the image for writing, which in QEMU clears the
    // autoclear bits it does not know.
    if repair != Repair::None
        && header.version >= 3
        && header.autoclear_features & !super::header::autoclear::KNOWN != 0
    {
        let bits = header.autoclear_features & super::header::autoclear::KNOWN;
        file.write_extend(&bits.to_be_bytes(), 88)?;
    }
    if repair != Repair::None {
        file.flush()?;
        // A repaired image is consistent again: drop the dirty and corrupt bits.
        let clean = r.corruptions == 0 && r.check_errors == 0 && !fix_failed;
        let bits = header.incompatible_features & !(incompat::DIRTY | incompat::CORRUPT);
        if clean && header.version >= 3 && bits != header.incompatible_features {
            file.write_extend(&bits.to_be_bytes(), 72)?;
            file.flush()?;
        }
    }
    Ok(r)
}

/// A COPIED flag to verify once the refcounts are known.
struct CopiedCheck {
    cluster: HostCluster,
    copied: bool,
    entry: u64,
    /// Where the entry lives (for repair).
    at: HostOffset,
    /// Set for L1 entries.
    l1_index: Option<usize>,
}

/// The checks QEMU makes of an extended L2 entry's subcluster bitmap: an
/// allocated cluster with a subcluster both allocated and zero, an
/// unallocated one with allocated subclusters, a compressed one with any
/// bit set.
fn bitmap_problem(r: &mut CheckReport, entry: &super::l2::L2Entry, w: u64) {
    let (alloc, zero) = (entry.bitmap & 0xffff_ffff, entry.bitmap >> 32);
    let off = w & L2E_OFFSET_MASK;
    let message = if w & COMPRESSED != 0 {
        (entry.bitmap != 0).then(|| {
            format!(
                "ERROR compressed cluster {:#x}: non-zero subcluster allocation bitmap, entry={w:#x}",
                w & !(COPIED | COMPRESSED)
            )
        })
    } else if off != 0 {
        (alloc & zero != 0).then(|| {
            format!(
                "ERROR offset={off:x}: Allocated cluster has corrupted subcluster allocation bitmap"
            )
        })
    } else {
        (alloc != 0).then(|| {
            "ERROR: Unallocated cluster has non-zero subcluster allocation bitmap".to_string()
        })
    };
    if let Some(m) = message {
        r.messages.push(m);
        r.corruptions += 1;
    }
}

/// Fails as QEMU's open does when the image's external data file cannot
/// be opened (a local file that is missing or unreadable); names with a
/// protocol are left to the opener.
fn data_file_opens(file: &StorageRef, header: &Header) -> Result<()> {
    let Some(e) = header.extension(super::header::ext::DATA_FILE) else {
        return Err(Error::invalid(
            "Could not open data file: no data file name in the image",
        ));
    };
    let name = String::from_utf8_lossy(&e.data).into_owned();
    if diskit_core::storage::has_protocol(&name) {
        return Ok(());
    }
    let path = file.resolve(&name);
    std::fs::File::open(&path)
        .map(|_| ())
        .map_err(|err| Error::from(err).context(format!("Could not open '{name}'")))
}

fn read_table(file: &dyn Storage, offset: u64, entries: u64) -> Result<Vec<u64>> {
    if entries > (32 << 20) / 8 {
        return Err(Error::invalid("table too large"));
    }
    super::table::read_u64_table(file, offset, entries)
}

#[allow(clippy::too_many_arguments)]
fn walk_l1(
    file: &dyn Storage,
    header: &Header,
    l1: &[u64],
    counted: &mut Counted,
    r: &mut CheckReport,
    active: bool,
    external: bool,
    fix_errors: bool,
    copied: &mut Vec<CopiedCheck>,
) -> Result<()> {
    let geo = counted.geo;
    let cs = geo.cluster_size();
    let file_len = counted.file_clusters * cs;
    for (i, &e) in l1.iter().enumerate() {
        let l2_off = e & L1E_OFFSET_MASK;
        if l2_off == 0 {
            continue;
        }
        if l2_off & (cs - 1) != 0 {
            r.messages.push(format!(
                "ERROR l2_offset={l2_off:x}: Table is not cluster aligned; L1 entry corrupted"
            ));
            r.corruptions += 1;
            continue;
        }
        if l2_off >= file_len {
            r.messages.push(format!(
                "ERROR l2_offset={l2_off:x}: L2 table is outside the image file; L1 entry corrupted"
            ));
            r.corruptions += 1;
            continue;
        }
        counted.inc_range(r, l2_off, cs);
        if active {
            copied.push(CopiedCheck {
                cluster: geo.host_cluster(HostOffset(l2_off)),
                copied: e & COPIED != 0,
                entry: e,
                at: HostOffset(header.l1_table_offset + i as u64 * 8),
                l1_index: Some(i),
            });
        }
        let mut raw = vec![0u8; cs as usize];
        file.read_padded(&mut raw, l2_off)?;
        let table = decode_l2(&raw, geo.extended_l2);
        let mut next_contiguous = 0u64;
        for (k, entry) in table.iter().enumerate() {
            let w = entry.word;
            let at = HostOffset(l2_off + k as u64 * geo.l2_entry_bytes());
            if geo.extended_l2 {
                bitmap_problem(r, entry, w);
            }
            if w & COMPRESSED != 0 {
                if w & COPIED != 0 {
                    r.messages.push(format!(
                        "ERROR: coffset={:#x}: Compressed cluster entry has the COPIED flag set",
                        w & !(COPIED | COMPRESSED)
                    ));
                    r.corruptions += 1;
                }
                let c = Compressed::decode(&geo, w & !COMPRESSED);
                let (start, end) = c.sector_range();
                counted.inc_range(r, start, end - start);
                if active {
                    r.allocated_clusters += 1;
                    r.compressed_clusters += 1;
                    r.fragmented_clusters += 1;
                }
                continue;
            }
            let off = w & L2E_OFFSET_MASK;
            if off == 0 {
                continue;
            }
            if off & (cs - 1) != 0 {
                // As QEMU: a preallocated (zero) cluster's entry is made
                // a plain zero cluster with -r all; a data cluster's is
                // reported, and its bytes still counted where it points.
                let contains_data = if geo.extended_l2 {
                    entry.bitmap & 0xffff_ffff != 0
                } else {
                    w & ZERO == 0
                };
                r.corruptions += 1;
                if contains_data {
                    r.messages.push(format!(
                        "ERROR offset={off:x}: Data cluster is not properly aligned; L2 entry corrupted."
                    ));
                } else {
                    let what = if fix_errors { "Repairing" } else { "ERROR" };
                    r.messages.push(format!(
                        "{what} offset={off:x}: Preallocated cluster is not properly aligned; L2 entry corrupted."
                    ));
                    if fix_errors {
                        let zero: u64 = if geo.extended_l2 { 0 } else { ZERO };
                        file.write_extend(&zero.to_be_bytes(), at.0)?;
                        file.flush()?;
                        r.corruptions -= 1;
                        r.corruptions_fixed += 1;
                        continue;
                    }
                }
            }
            if active {
                r.allocated_clusters += 1;
                if next_contiguous != 0 && off != next_contiguous {
                    r.fragmented_clusters += 1;
                }
                next_contiguous = off + cs;
            }
            if external {
                continue;
            }
            counted.inc_range(r, off, cs);
            if active {
                copied.push(CopiedCheck {
                    cluster: geo.host_cluster(HostOffset(off)),
                    copied: w & COPIED != 0,
                    entry: w,
                    at,
                    l1_index: None,
                });
            }
        }
    }
    Ok(())
}
