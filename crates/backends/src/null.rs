//! The null device: reads zeros, accepts and discards writes (a sink for
//! benchmarks and a source of an empty disk).

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Extent, Result, WriteFlags, ZeroFlags};

/// A device of a given size that stores nothing.
pub struct NullDevice {
    size: u64,
}

impl NullDevice {
    /// A null device of `size` bytes.
    pub fn new(size: u64) -> NullDevice {
        NullDevice { size }
    }
}

impl BlockDevice for NullDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::IN_MEMORY
    }
    fn is_known_zero(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size, offset, len)
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size, offset, len)?;
        Ok(vec![Extent::hole(len)])
    }
    fn describe(&self) -> String {
        format!("null({})", self.size)
    }
}
