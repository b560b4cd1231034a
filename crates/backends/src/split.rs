//! nbdkit's split plugin: several files end to end as one disk, each
//! file's holes reported as holes. Offered as nbdkit offers it: writable
//! (unless served read-only), no flush, FUA or trim, write-zeroes by
//! writing zeros, one connection's writes not promised to others
//! (no multi-conn).
//!
//! nbdkit 1.32's plugin writes a request at its offset in the whole disk
//! instead of in the file that holds it; here writes land where reads
//! find them.

use diskit_core::concat::Concat;
use diskit_core::{BlockDevice, Capabilities, DeviceRef, Extent, Result, WriteFlags};

/// Files served as one disk.
pub struct SplitDevice {
    files: Concat,
    writable: bool,
}

impl SplitDevice {
    /// `files` end to end; `writable` when they were opened for writing.
    pub fn new(files: Vec<DeviceRef>, writable: bool) -> Result<SplitDevice> {
        Ok(SplitDevice {
            files: Concat::new(files)?,
            writable,
        })
    }
}

impl BlockDevice for SplitDevice {
    fn size(&self) -> u64 {
        self.files.size()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            can_extents: true,
            can_cache: true,
            ..crate::zeroes_by_writing(self.writable)
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.files.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        self.files.write_at(buf, offset, WriteFlags::NONE)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.files.cache(offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // Where the bytes lie in their files means nothing to a client.
        Ok(self
            .files
            .extents(offset, len)?
            .into_iter()
            .map(|e| Extent {
                host_offset: None,
                ..e
            })
            .collect())
    }
    fn describe(&self) -> String {
        format!("split({})", self.files.describe())
    }
    fn close(&self) -> Result<()> {
        self.files.close()
    }
}
