//! Persistent dirty bitmaps of an image open for writing: they track every
//! write, and are stored again when the image closes.
//!
//! As QEMU does, the enabled bitmaps are marked in use (inconsistent) on
//! disk before the first change, and stored with the new dirty bits and
//! the mark cleared on close: a crash in between leaves them marked in
//! use, never silently stale. Storing writes each changed bitmap afresh
//! (data clusters, table), then a new directory, then the header, and
//! only then frees what the old ones used: a crash leaks at worst.

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use diskit_core::{BlockDevice, Error, Result};

use super::bitmap::{self, Bitmap, BitmapsExt, BitmapsState, flags};
use super::bitmap_bits::{Bits, DirtyRanges, ENTRY_OFFSET_MASK, bytes_for, read_bits};
use super::device::Qcow2Format;
use super::header::{HeaderExtension, autoclear, ext};
use super::layout::{HostCluster, HostOffset};
use super::meta::Meta;
use super::open::read_header;
use super::table::{read_u64_table, u64_table_bytes};
use crate::image_ops::NewBitmap;

/// The bitmaps of an image open for writing.
#[derive(Debug, Default)]
pub struct Tracker {
    /// The directory as on disk.
    list: Vec<Bitmap>,
    /// Where the directory lives (0: no bitmaps).
    dir_offset: u64,
    /// Which bitmaps this open marked in use (they track writes).
    marked: Vec<bool>,
    /// Guest ranges changed since they were marked.
    dirty: DirtyRanges,
}

/// The tracker's slot in an image.
pub type TrackerSlot = Mutex<Option<Tracker>>;

/// What becomes of one bitmap when the set is stored.
pub enum Plan {
    /// Stays exactly as it is on disk.
    Keep(Bitmap),
    /// Read from its table (covering `read_size` bytes of disk), changed by
    /// `dirty`, and written afresh with `flags` for the current disk size.
    Rewrite {
        /// The bitmap as on disk.
        old: Bitmap,
        /// The disk size its bits cover.
        read_size: u64,
        /// Flags to store.
        flags: u32,
        /// Whether the writes of this open are added to it.
        track: bool,
    },
    /// A new bitmap.
    New {
        /// Name.
        name: Vec<u8>,
        /// Flags ([`flags::AUTO`] to track writes).
        flags: u32,
        /// Its bits (granularity and size included).
        bits: Bits,
    },
}

impl Qcow2Format {
    /// Loads the bitmap directory of an image opened for writing, so that
    /// writes are tracked (see the module documentation).
    pub(super) fn track_bitmaps(&self) -> Result<()> {
        let (state, list) = bitmap::read(&self.file, self.header())?;
        if let BitmapsState::Present(x) = state {
            let n = list.len();
            self.has_bitmaps.store(true, Ordering::Release);
            *self.tracker() = Some(Tracker {
                list,
                dir_offset: x.directory_offset,
                marked: vec![false; n],
                dirty: DirtyRanges::default(),
            });
        }
        Ok(())
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, Option<Tracker>> {
        diskit_core::sync::lock(&self.bitmaps)
    }

    /// Whether the image has a consistent bitmaps extension being kept.
    pub(super) fn keeps_bitmaps(&self) -> bool {
        self.tracker().is_some()
    }

    /// The image's bitmaps (as of the last store).
    pub fn bitmaps(&self) -> Vec<Bitmap> {
        self.tracker()
            .as_ref()
            .map(|t| t.list.clone())
            .unwrap_or_default()
    }

    /// Marks the enabled bitmaps in use on disk, before the first change.
    pub(super) fn mark_bitmaps_in_use(&self) -> Result<()> {
        let mut guard = self.tracker();
        let Some(t) = guard.as_mut() else {
            return Ok(());
        };
        let mut any = false;
        for (b, marked) in t.list.iter_mut().zip(t.marked.iter_mut()) {
            if b.auto() && !b.in_use() {
                b.flags |= flags::IN_USE;
                *marked = true;
                any = true;
            }
        }
        if any {
            // Only flags change: the directory keeps its size and place.
            self.file
                .write_extend(&bitmap::directory_bytes(&t.list), t.dir_offset)?;
            self.file.flush()?;
        }
        Ok(())
    }

    /// Records that guest bytes `[start, end)` changed.
    pub(super) fn note_dirty(&self, start: u64, end: u64) {
        if !self.has_bitmaps.load(Ordering::Acquire) {
            return;
        }
        if let Some(t) = self.tracker().as_mut()
            && t.marked.iter().any(|&m| m)
        {
            t.dirty.add(start, end);
        }
    }

    /// Stores the bitmaps this open marked in use, with their new dirty
    /// bits and the mark cleared (on close).
    pub(super) fn persist_bitmaps(&self) -> Result<()> {
        self.rewrite_tracked(self.size(), false)
    }

    /// Adds bitmaps (as `qemu-img convert --bitmaps` does on its target).
    /// Names must be new.
    pub fn add_bitmaps(&self, new: Vec<NewBitmap>) -> Result<()> {
        if new.is_empty() {
            return Ok(());
        }
        if self.header().version < 3 {
            return Err(Error::unsupported(
                "Cannot store dirty bitmaps in qcow2 v2 files",
            ));
        }
        // What earlier writes of this open changed is stored first.
        self.persist_bitmaps()?;
        let existing = self.bitmaps();
        let mut plans: Vec<Plan> = existing.iter().cloned().map(Plan::Keep).collect();
        for n in new {
            if existing.iter().any(|b| b.display_name() == n.name) {
                return Err(Error::invalid(format!("Bitmap already exists: {}", n.name)));
            }
            if n.bits.size() != self.size() {
                return Err(Error::invalid("bitmap size differs from the disk size"));
            }
            plans.push(Plan::New {
                name: n.name.into_bytes(),
                flags: if n.enabled { flags::AUTO } else { 0 },
                bits: n.bits,
            });
        }
        self.store_bitmaps(plans, &DirtyRanges::default(), Vec::new())
    }

    /// Applies `edits` in order to the stored bitmaps, then stores the
    /// result at once: nothing is stored if one fails.
    pub fn edit_bitmaps(&self, edits: Vec<crate::image_ops::BitmapEdit>) -> Result<()> {
        use crate::image_ops::BitmapEdit as E;
        /// A bitmap as the edits leave it.
        struct Work {
            name: Vec<u8>,
            flags: u32,
            old: Option<Bitmap>,
            bits: Option<Bits>,
        }
        if self.header().version < 3 {
            return Err(Error::unsupported(
                "Cannot store dirty bitmaps in qcow2 v2 files",
            ));
        }
        self.persist_bitmaps()?;
        let size = self.size();
        let cs = self.geometry().cluster_size();
        let mut dropped: Vec<Bitmap> = Vec::new();
        let mut work: Vec<Work> = self
            .bitmaps()
            .into_iter()
            .map(|b| Work {
                name: b.name.clone(),
                flags: b.flags,
                old: Some(b),
                bits: None,
            })
            .collect();
        for edit in edits {
            let failed = |msg: String| {
                Error::invalid(format!(
                    "Operation {} on bitmap {} failed: {msg}",
                    edit.op(),
                    edit.name()
                ))
            };
            let find = |work: &[Work]| {
                work.iter()
                    .position(|w| w.name == edit.name().as_bytes())
                    .ok_or_else(|| failed(format!("Dirty bitmap '{}' not found", edit.name())))
            };
            let usable = |w: &Work| {
                if w.flags & flags::IN_USE != 0 {
                    Err(failed(format!(
                        "Bitmap '{}' is inconsistent and cannot be used",
                        edit.name()
                    )))
                } else {
                    Ok(())
                }
            };
            match &edit {
                E::Add { name, granularity } => {
                    if work.iter().any(|w| w.name == name.as_bytes()) {
                        return Err(failed(format!("Bitmap already exists: {name}")));
                    }
                    let g = granularity.unwrap_or(cs);
                    if !g.is_power_of_two() || g < 512 {
                        return Err(failed(
                            "Granularity must be power of 2 and at least 512".into(),
                        ));
                    }
                    if g > 1 << 31 {
                        return Err(failed("Granularity must not exceed 2147483648".into()));
                    }
                    work.push(Work {
                        name: name.clone().into_bytes(),
                        flags: flags::AUTO,
                        old: None,
                        bits: Some(Bits::new(size, g.trailing_zeros() as u8)),
                    });
                }
                E::Remove(_) => {
                    let i = find(&work)?;
                    if let Some(old) = work.remove(i).old {
                        dropped.push(old);
                    }
                }
                E::Clear(_) => {
                    let i = find(&work)?;
                    usable(&work[i])?;
                    let g = match (&work[i].bits, &work[i].old) {
                        (Some(b), _) => b.granularity_bits(),
                        (None, Some(o)) => o.granularity_bits,
                        (None, None) => unreachable!("a bitmap has bits or is stored"),
                    };
                    work[i].bits = Some(Bits::new(size, g));
                }
                E::Enable(_) | E::Disable(_) => {
                    let i = find(&work)?;
                    usable(&work[i])?;
                    if matches!(edit, E::Enable(_)) {
                        work[i].flags |= flags::AUTO;
                    } else {
                        work[i].flags &= !flags::AUTO;
                    }
                }
                E::Merge { bits, .. } => {
                    let i = find(&work)?;
                    usable(&work[i])?;
                    if work[i].bits.is_none() {
                        let old = work[i].old.as_ref().expect("stored");
                        work[i].bits = Some(read_bits(&self.file, cs, old, size)?);
                    }
                    let target = work[i].bits.as_mut().expect("read above");
                    for (start, end) in bits.dirty_ranges() {
                        target.set_range(start, end.min(size));
                    }
                }
            }
        }
        let plans = work
            .into_iter()
            .map(|w| match (w.bits, w.old) {
                (Some(bits), old) => {
                    dropped.extend(old);
                    Plan::New {
                        name: w.name,
                        flags: w.flags,
                        bits,
                    }
                }
                (None, Some(old)) if old.flags == w.flags => Plan::Keep(old),
                (None, Some(old)) => Plan::Rewrite {
                    old,
                    read_size: size,
                    flags: w.flags,
                    track: false,
                },
                (None, None) => unreachable!("a bitmap has bits or is stored"),
            })
            .collect();
        self.store_bitmaps(plans, &DirtyRanges::default(), dropped)
    }

    /// Fits every consistent bitmap to a disk resized from `old_size` (and
    /// stores what this open's writes changed).
    pub(super) fn resize_bitmaps(&self, old_size: u64) -> Result<()> {
        self.rewrite_tracked(old_size.min(self.size()), true)
    }

    /// Stores the tracked set: the bitmaps this open marked in use get its
    /// dirty ranges and lose the mark; with `refit`, every other consistent
    /// bitmap is rewritten too (for a new disk size). `read_size` is the
    /// disk size their current bits are read for. Nothing happens when
    /// nothing needs rewriting.
    fn rewrite_tracked(&self, read_size: u64, refit: bool) -> Result<()> {
        let Some(t) = self.tracker().take() else {
            return Ok(());
        };
        let rewrite = |b: &Bitmap, marked: bool| marked || (refit && !b.in_use());
        if !t.list.iter().zip(&t.marked).any(|(b, &m)| rewrite(b, m)) {
            *self.tracker() = Some(t);
            return Ok(());
        }
        let plans = t
            .list
            .iter()
            .zip(&t.marked)
            .map(|(b, &marked)| {
                if rewrite(b, marked) {
                    Plan::Rewrite {
                        old: b.clone(),
                        read_size,
                        flags: b.flags & !flags::IN_USE,
                        track: marked,
                    }
                } else {
                    Plan::Keep(b.clone())
                }
            })
            .collect();
        self.store_bitmaps(plans, &t.dirty, Vec::new())
    }

    /// Writes the bitmap set `plans` (every bitmap of the image, in
    /// directory order) and frees what the replaced ones used.
    fn store_bitmaps(
        &self,
        plans: Vec<Plan>,
        dirty: &DirtyRanges,
        dropped: Vec<Bitmap>,
    ) -> Result<()> {
        let size = self.size();
        let cs = self.geometry().cluster_size();
        let old_ext = match BitmapsExt::of(&read_header(&self.file)?)? {
            BitmapsState::Present(x) => Some(x),
            _ => None,
        };
        let mut meta = self.lock();
        let mut list = Vec::with_capacity(plans.len());
        // Bitmaps gone, or replaced by new bits, free their clusters.
        let mut freed: Vec<Bitmap> = dropped;
        for plan in plans {
            let (name, flags, bits) = match plan {
                Plan::Keep(b) => {
                    list.push(b);
                    continue;
                }
                Plan::Rewrite {
                    old,
                    read_size,
                    flags,
                    track,
                } => {
                    let mut bits = read_bits(&self.file, cs, &old, read_size)?;
                    bits.resize(size);
                    if track {
                        for (s, e) in dirty.iter() {
                            bits.set_range(s, e);
                        }
                    }
                    let name = old.name.clone();
                    freed.push(old);
                    (name, flags, bits)
                }
                Plan::New { name, flags, bits } => (name, flags, bits),
            };
            let (table_offset, table_size) = self.write_bits(&mut meta, &bits)?;
            list.push(Bitmap {
                table_offset,
                table_size,
                flags,
                kind: bitmap::TYPE_DIRTY_TRACKING,
                granularity_bits: bits.granularity_bits(),
                name,
            });
        }
        let dir = bitmap::directory_bytes(&list);
        let dir_offset = if list.is_empty() {
            0
        } else {
            let at = self.alloc_clusters(&mut meta, (dir.len() as u64).div_ceil(cs))?;
            self.file.write_extend(&dir, at.0)?;
            at.0
        };
        // The new structures and their refcounts are on disk before the
        // header points at them.
        meta.write_back()?;
        self.file.flush()?;
        let new_ext = (!list.is_empty()).then_some(BitmapsExt {
            nb_bitmaps: list.len() as u32,
            directory_size: dir.len() as u64,
            directory_offset: dir_offset,
        });
        self.write_bitmaps_ext(new_ext)?;
        // Then the old ones go.
        let refs = meta.refs()?;
        if let Some(x) = old_ext {
            for c in 0..x.directory_size.div_ceil(cs) {
                refs.adjust(HostCluster(x.directory_offset / cs + c), -1)?;
            }
        }
        for b in &freed {
            let table = read_u64_table(&self.file, b.table_offset, b.table_size as u64)?;
            for e in table {
                let off = e & ENTRY_OFFSET_MASK;
                if off != 0 {
                    refs.adjust(HostCluster(off / cs), -1)?;
                }
            }
            for c in 0..(b.table_size as u64 * 8).div_ceil(cs) {
                refs.adjust(HostCluster(b.table_offset / cs + c), -1)?;
            }
        }
        meta.write_back()?;
        drop(meta);
        self.file.flush()?;
        let n = list.len();
        let tracked = (n > 0).then(|| Tracker {
            list,
            dir_offset,
            marked: vec![false; n],
            dirty: DirtyRanges::default(),
        });
        self.has_bitmaps.store(tracked.is_some(), Ordering::Release);
        *self.tracker() = tracked;
        // The next change marks the enabled ones in use again.
        self.autoclear_pending.store(true, Ordering::Release);
        Ok(())
    }

    /// Writes `bits` into new data clusters (all-zero ones stay
    /// unallocated) and a new table; returns the table's place and entries.
    fn write_bits(&self, meta: &mut Meta, bits: &Bits) -> Result<(u64, u32)> {
        let cs = self.geometry().cluster_size();
        let bytes = bits.bytes();
        let entries = bytes_for(bits.size(), bits.granularity_bits()).div_ceil(cs);
        let mut table = Vec::with_capacity(entries as usize);
        for chunk in bytes.chunks(cs as usize) {
            if chunk.iter().all(|&b| b == 0) {
                table.push(0);
                continue;
            }
            let at = self.alloc_clusters(meta, 1)?;
            let mut data = chunk.to_vec();
            data.resize(cs as usize, 0);
            self.file.write_extend(&data, at.0)?;
            table.push(at.0);
        }
        let table_bytes = u64_table_bytes(&table, 0);
        let at = self.alloc_clusters(meta, (table_bytes.len() as u64).div_ceil(cs))?;
        self.file.write_extend(&table_bytes, at.0)?;
        Ok((at.0, table.len() as u32))
    }

    fn alloc_clusters(&self, meta: &mut Meta, n: u64) -> Result<HostOffset> {
        let (c, _) = meta.refs()?.alloc(n.max(1))?;
        Ok(self.geometry().host_offset(c))
    }

    /// Rewrites the header with the bitmaps extension `x` (none: removed)
    /// and autoclear bit 0 to match.
    fn write_bitmaps_ext(&self, x: Option<BitmapsExt>) -> Result<()> {
        let mut h = read_header(&self.file)?;
        match x {
            Some(x) => {
                let data = x.to_bytes();
                if let Some(e) = h.extensions.iter_mut().find(|e| e.kind == ext::BITMAPS) {
                    e.data = data;
                } else {
                    // Where QEMU writes it: after the extensions it knows,
                    // before unknown ones.
                    let known = [
                        ext::BACKING_FORMAT,
                        ext::DATA_FILE,
                        ext::CRYPTO,
                        ext::FEATURE_TABLE,
                    ];
                    let at = h
                        .extensions
                        .iter()
                        .rposition(|e| known.contains(&e.kind))
                        .map_or(0, |i| i + 1);
                    h.extensions.insert(
                        at,
                        HeaderExtension {
                            kind: ext::BITMAPS,
                            data,
                        },
                    );
                }
                h.autoclear_features |= autoclear::BITMAPS;
            }
            None => {
                h.extensions.retain(|e| e.kind != ext::BITMAPS);
                h.autoclear_features &= !autoclear::BITMAPS;
            }
        }
        self.file.write_extend(&h.to_bytes()?, 0)?;
        self.file.flush()
    }
}
