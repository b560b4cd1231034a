//! Growing and shrinking a qcow2 image.

use crate::mapped::MappedFormat;
use std::sync::atomic::Ordering;

use diskit_core::Preallocation;
use diskit_core::{BlockDevice, Error, ErrorKind, Result, ZeroFlags};

use super::Qcow2;
use super::create_layout::Prealloc;
use super::l2::{COPIED, L2Entry};
use super::layout::{Geometry, GuestOffset, HostCluster};

impl Qcow2 {
    /// Changes the virtual size. Growing may move the L1 table; shrinking
    /// (only with `shrink`) drops every cluster past the new end and
    /// truncates the file after the last cluster still in use.
    pub fn resize(&self, new_size: u64, shrink: bool) -> Result<()> {
        self.resize_with(new_size, shrink, Prealloc::Off)
    }

    /// [`Self::resize`], reserving the space of a grown disk as `prealloc`
    /// says (metadata: clusters allocated and mapped; falloc: and reserved
    /// in the file; full: and written with zeros), as `qemu-img resize
    /// --preallocation` does.
    pub fn resize_with(&self, new_size: u64, shrink: bool, prealloc: Prealloc) -> Result<()> {
        if !self.writable() {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        if !new_size.is_multiple_of(512) {
            return Err(Error::invalid("The new size must be a multiple of 512"));
        }
        let header = self.header();
        // Snapshots keep their own L1 tables and sizes (v3 records them);
        // the active layer alone grows or shrinks.
        if header.nb_snapshots > 0 && header.version < 3 {
            return Err(Error::unsupported(
                "Can't resize a v2 image which has snapshots",
            ));
        }
        let old = self.size();
        // As QEMU's block layer (bdrv_co_truncate): an image grown over a
        // backing file longer than it was reads zeros in the grown range,
        // never the backing file's data there. A v2 image cannot say
        // "zeros" over a backing file: refused before anything changes.
        let zero_grown = new_size > old && self.backing().is_some_and(|b| b.size > old);
        if zero_grown && header.version < 3 {
            return Err(Error::unsupported(
                "Failed to zero out new clusters: Operation not supported",
            ));
        }
        self.before_change()?;
        let geo = Geometry {
            size: new_size,
            ..self.geometry()
        };
        let needed = geo.l1_entries_needed();
        if needed > i32::MAX as u64 / 8 {
            return Err(Error::invalid("The image size is too large"));
        }
        if prealloc != Prealloc::Off && new_size <= old {
            return Err(Error::invalid(
                "Preallocation can only be used for growing images",
            ));
        }
        if new_size < old {
            if !shrink {
                return Err(Error::invalid(
                    "Use the --shrink option to perform a shrink operation.",
                ));
            }
            // Whole clusters past the new end go (the partial last one
            // stays), and the space they held goes back to the file system.
            self.lock().refs()?.note_freed();
            let cs = geo.cluster_size();
            let from = new_size.div_ceil(cs) * cs;
            if from < old {
                self.trim_all(from, old - from)?;
            }
            self.lock().drop_l2_tables_from(needed as usize)?;
        }
        {
            let mut meta = self.lock();
            if needed as usize > meta.l1.len() {
                meta.relocate_l1(needed as usize)?;
            }
        }
        if prealloc != Prealloc::Off {
            self.preallocate(old, new_size, prealloc)?;
        }
        {
            let mut meta = self.lock();
            meta.write_back()?;
            meta.write_back()?;
            self.file.flush()?;
            if new_size < old {
                meta.refs()?.drop_unused_blocks()?;
                meta.write_back()?;
            }
            meta.discard_freed()?;
        }
        self.file.write_extend(&new_size.to_be_bytes(), 24)?;
        self.file.flush()?;
        self.size.store(new_size, Ordering::Release);
        if new_size < old {
            self.truncate_tail()?;
        }
        if self.keeps_bitmaps() {
            self.resize_bitmaps(old)?;
        }
        if zero_grown {
            self.write_zeroes(old, new_size - old, ZeroFlags::default())?;
            self.flush()?;
        }
        Ok(())
    }

    /// Maps every unallocated guest cluster of `[from, to)` to a new host
    /// cluster (contiguous runs), then reserves or zeroes the host space as
    /// `mode` says. The mapping reaches the file after the data space.
    fn preallocate(&self, from: u64, to: u64, mode: Prealloc) -> Result<()> {
        let geo = self.geometry();
        let cs = geo.cluster_size();
        let per = geo.l2_entries();
        let external = self.data_is_external();
        let end = to.div_ceil(cs);
        let mut runs: Vec<(u64, u64)> = Vec::new();
        {
            let mut meta = self.lock();
            let mut c = from / cs;
            while c < end {
                let table_end = end.min((c / per + 1) * per);
                let unallocated = |meta: &mut super::meta::Meta, c: u64| -> Result<bool> {
                    Ok(meta.entry(GuestOffset(c * cs))? == L2Entry::default())
                };
                if !unallocated(&mut meta, c)? {
                    c += 1;
                    continue;
                }
                let mut stop = c + 1;
                while stop < table_end && unallocated(&mut meta, stop)? {
                    stop += 1;
                }
                let host = if external {
                    c * cs
                } else {
                    geo.host_offset(meta.refs()?.alloc(stop - c)?.0).0
                };
                for i in c..stop {
                    let word = (host + (i - c) * cs) | COPIED;
                    meta.set_entry(GuestOffset(i * cs), L2Entry { word, bitmap: 0 })?;
                }
                runs.push((host, (stop - c) * cs));
                c = stop;
            }
        }
        let Some(last_end) = runs.iter().map(|&(h, n)| h + n).max() else {
            return Ok(());
        };
        let data = self.data_file();
        let file_end = data.file_len()?;
        let how = match mode {
            Prealloc::Off | Prealloc::Metadata => Preallocation::Off,
            Prealloc::Falloc => Preallocation::Falloc,
            Prealloc::Full => Preallocation::Full,
        };
        // Runs inside the file (reused free clusters) are reserved in place;
        // the space past its end is added in one go.
        if how != Preallocation::Off {
            for &(h, n) in &runs {
                let n = n.min(file_end.saturating_sub(h));
                if n == 0 {
                    continue;
                }
                if how == Preallocation::Full {
                    diskit_core::device::write_zero_buffer(&**data, h, n, false)?;
                } else {
                    data.write_zeroes(h, n, ZeroFlags::default())?;
                }
            }
        }
        if last_end > file_end {
            data.resize(last_end, how)?;
        }
        data.flush()
    }

    /// Truncates the file after the last cluster in use (after a shrink).
    fn truncate_tail(&self) -> Result<()> {
        let cs = self.geometry().cluster_size();
        let len = self.file.file_len()?;
        let mut meta = self.lock();
        let refs = meta.refs()?;
        let mut last = len.div_ceil(cs);
        while last > 0 && refs.get(HostCluster(last - 1))? == 0 {
            last -= 1;
        }
        drop(meta);
        if last * cs < len {
            self.file.resize(last * cs, Preallocation::Off)?;
        }
        Ok(())
    }

    /// Drops the clusters of `[offset, offset+len)` for good (unallocated,
    /// whatever the backing file holds).
    fn trim_all(&self, offset: u64, len: u64) -> Result<()> {
        // A discard that leaves clusters unallocated: with a backing file
        // they would show it, but they are past the end of the disk.
        self.discard_clusters(offset, len)?;
        self.flush()
    }
}
