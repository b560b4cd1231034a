//! nbdkit's full plugin: a disk that reads as zeros and is always full:
//! every write and trim fails with ENOSPC.

use diskit_core::device::check_range;
use diskit_core::{
    BlockDevice, Capabilities, Error, ErrorKind, Extent, Result, WriteFlags, ZeroFlags,
};

/// A device of zeros on which nothing fits.
pub struct FullDevice {
    size: u64,
}

impl FullDevice {
    /// A full device of `size` bytes.
    pub fn new(size: u64) -> FullDevice {
        FullDevice { size }
    }

    fn full(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size, offset, len)?;
        Err(Error::from_kind(ErrorKind::NoSpace))
    }
}

impl BlockDevice for FullDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        // nbdkit's plugin: writable, no flush or FUA, write-zeroes emulated
        // by writing (so a fast zero is refused at once).
        Capabilities {
            can_flush: false,
            can_fua: false,
            can_zero: false,
            ..Capabilities::IN_MEMORY
        }
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
        self.full(offset, buf.len() as u64)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast {
            check_range(self.size, offset, len)?;
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        self.full(offset, len)
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        self.full(offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size, offset, len)?;
        Ok(vec![Extent::hole(len)])
    }
    fn describe(&self) -> String {
        format!("full({})", self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_zeros_and_refuses_everything_else() {
        let d = FullDevice::new(1 << 20);
        let mut b = [1u8; 16];
        d.read_at(&mut b, 100).unwrap();
        assert_eq!(b, [0; 16]);
        let kind = |r: Result<()>| r.unwrap_err().kind();
        assert_eq!(
            kind(d.write_at(&b, 0, WriteFlags::NONE)),
            ErrorKind::NoSpace
        );
        assert_eq!(kind(d.trim(0, 512, WriteFlags::NONE)), ErrorKind::NoSpace);
        let fast = ZeroFlags {
            fast: true,
            ..ZeroFlags::default()
        };
        assert_eq!(kind(d.write_zeroes(0, 512, fast)), ErrorKind::NotSupported);
        assert_eq!(
            kind(d.write_zeroes(0, 512, ZeroFlags::default())),
            ErrorKind::NoSpace
        );
    }
}
