//! nbdkit's random plugin: random bytes that are the same on every read.
//! Byte `i` comes from its own generator, seeded with `seed + i`, three
//! draws in (the low byte of the third), exactly as nbdkit computes it, so
//! that any byte reads without running the generator from the start and
//! the same seed gives nbdkit's bytes. Writes are checked against those
//! bytes (a copy back into the disk verifies it); zeroes and trims fail.

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Error, Result, WriteFlags, ZeroFlags};

use crate::nbdkit_random::Xoshiro256;

/// A device of random bytes fixed by a seed.
pub struct RandomDevice {
    size: u64,
    seed: u32,
}

impl RandomDevice {
    /// `size` random bytes drawn from `seed`.
    pub fn new(size: u64, seed: u32) -> RandomDevice {
        RandomDevice { size, seed }
    }

    /// The byte at `offset`.
    pub fn byte_at(&self, offset: u64) -> u8 {
        let mut g = Xoshiro256::seeded(u64::from(self.seed).wrapping_add(offset));
        g.next_u64();
        g.next_u64();
        g.next_u64() as u8
    }

    fn fill(&self, buf: &mut [u8], offset: u64) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.byte_at(offset + i as u64);
        }
    }
}

impl BlockDevice for RandomDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        // As nbdkit's plugin: writes are taken (and checked), zeroes and
        // trims are offered only to fail; everything is data.
        Capabilities {
            can_flush: false,
            can_fua: false,
            can_fast_zero: false,
            can_extents: false,
            ..Capabilities::IN_MEMORY
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        self.fill(buf, offset);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        if buf
            .iter()
            .enumerate()
            .any(|(i, &b)| b != self.byte_at(offset + i as u64))
        {
            return Err(Error::io("data written does not match expected"));
        }
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size, offset, len)?;
        Err(Error::io("attempt to trim or zero non-sparse random disk"))
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, len)?;
        Err(Error::io("attempt to trim or zero non-sparse random disk"))
    }
    fn describe(&self) -> String {
        format!("random({}, seed={})", self.size, self.seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_depend_on_seed_and_offset_only() {
        let d = RandomDevice::new(1 << 20, 7);
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 10];
        d.read_at(&mut a, 1000).unwrap();
        d.read_at(&mut b, 1050).unwrap();
        assert_eq!(&a[50..60], &b[..]);
        // Not constant.
        assert!(a.iter().any(|&x| x != a[0]));
        // seed + offset: seed 8 at 999 is seed 7 at 1000.
        let e = RandomDevice::new(1 << 20, 8);
        assert_eq!(e.byte_at(999), d.byte_at(1000));
        d.write_at(&a, 1000, WriteFlags::NONE).unwrap();
        a[3] ^= 1;
        assert!(d.write_at(&a, 1000, WriteFlags::NONE).is_err());
        assert!(d.trim(0, 1, WriteFlags::NONE).is_err());
    }
}
