//! nbdkit's ones plugin: every byte reads as one value (0xff unless told
//! otherwise) and writes go nowhere.

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Extent, Result, WriteFlags, ZeroFlags};

/// A device whose every byte is `byte`; writes, zeroes and trims are
/// accepted and dropped.
pub struct OnesDevice {
    size: u64,
    byte: u8,
}

impl OnesDevice {
    /// `size` bytes of `byte`.
    pub fn new(size: u64, byte: u8) -> OnesDevice {
        OnesDevice { size, byte }
    }
}

impl BlockDevice for OnesDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::IN_MEMORY
    }
    fn discards_writes(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        buf.fill(self.byte);
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
        Ok(vec![Extent::data(len)])
    }
    fn describe(&self) -> String {
        format!("ones({}, {:#04x})", self.size, self.byte)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_byte_and_drops_writes() {
        let d = OnesDevice::new(4096, 0x5a);
        d.write_at(&[0; 16], 8, WriteFlags::NONE).unwrap();
        let mut b = [0u8; 32];
        d.read_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a));
        assert!(d.read_at(&mut b, 4090).is_err());
    }
}
