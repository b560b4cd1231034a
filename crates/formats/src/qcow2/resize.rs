//! Growing and shrinking a qcow2 image.

use std::sync::atomic::Ordering;

use diskit_core::{BlockDevice, Error, ErrorKind, Result};

use super::Qcow2;
use super::layout::Geometry;

impl Qcow2 {
    /// Changes the virtual size. Growing may move the L1 table; shrinking
    /// (only with `shrink`) drops every cluster past the new end.
    pub fn resize(&self, new_size: u64, shrink: bool) -> Result<()> {
        if !self.writable {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        if !new_size.is_multiple_of(512) {
            return Err(Error::invalid("The new size must be a multiple of 512"));
        }
        let header = self.header();
        if header.nb_snapshots > 0 && (header.version < 3 || new_size < self.size()) {
            return Err(Error::unsupported(
                "Can't resize an image which has snapshots",
            ));
        }
        self.before_change()?;
        let old = self.size();
        let geo = Geometry {
            size: new_size,
            ..self.geometry()
        };
        let needed = geo.l1_entries_needed();
        if needed > i32::MAX as u64 / 8 {
            return Err(Error::invalid("The image size is too large"));
        }
        if new_size < old {
            if !shrink {
                return Err(Error::invalid(
                    "Use the --shrink option to perform a shrink operation.",
                ));
            }
            // Whole clusters past the new end go (the partial last one stays).
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
            meta.write_back()?;
            meta.write_back()?;
        }
        self.file.flush()?;
        self.file.write_extend(&new_size.to_be_bytes(), 24)?;
        self.file.flush()?;
        self.size.store(new_size, Ordering::Release);
        if self.keeps_bitmaps() {
            self.resize_bitmaps(old)?;
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
