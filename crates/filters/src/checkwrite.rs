//! The checkwrite filter (nbdkit-checkwrite-filter): turns writes into
//! checks that what is written is already there, to test copying tools
//! (`nbdcopy "$uri" "$uri"`).
//!
//! The device below is opened read-only and never written. Every write
//! is offered (write, flush, FUA, trim, zero, fast zero, multi-conn); a
//! write whose bytes differ from the device's, or a zero or trim over
//! bytes that do not read as zeros, fails with EIO ("data written does
//! not match expected"); a flush does nothing. Zeros are checked by
//! extent where the device reports them (a known-zero extent is not
//! read); a fast zero that would have to read data fails with ENOTSUP.
//! It takes no parameters.

use diskit_core::extent::walk;
use diskit_core::{
    BlockDevice, Capabilities, Error, ErrorKind, Filter, Result, WriteFlags, ZeroFlags,
};

use crate::verify::{Expected, below_holds};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// The filter.
#[derive(Debug, Clone, Copy, Default)]
pub struct Checkwrite;

/// The error of a write that would change something.
fn mismatch() -> Error {
    Error::new(ErrorKind::Io, "data written does not match expected")
}

impl Checkwrite {
    /// Checks that `offset..offset+len` reads as zeros.
    fn check_zeros(&self, next: &dyn BlockDevice, offset: u64, len: u64, fast: bool) -> Result<()> {
        let check = |at: u64, n: u64| {
            if fast {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
            match below_holds(next, at, Expected::Zeros(n))? {
                true => Ok(()),
                false => Err(mismatch()),
            }
        };
        if !next.capabilities().can_extents {
            return check(offset, len);
        }
        let mut at = offset;
        for e in walk(next, offset, len) {
            let e = e?;
            if !e.flags.zero {
                check(at, e.length)?;
            }
            at += e.length;
        }
        Ok(())
    }
}

impl Filter for Checkwrite {
    fn name(&self) -> &str {
        "checkwrite"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        Capabilities {
            can_write: true,
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_write_zeroes: true,
            can_zero: true,
            can_fast_zero: true,
            can_multi_conn: true,
            ..next.capabilities()
        }
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        _: WriteFlags,
    ) -> Result<()> {
        match below_holds(next, offset, Expected::Bytes(buf))? {
            true => Ok(()),
            false => Err(mismatch()),
        }
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.check_zeros(next, offset, len, flags.fast)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, _: WriteFlags) -> Result<()> {
        self.check_zeros(next, offset, len, false)
    }
    fn flush(&self, _next: &dyn BlockDevice) -> Result<()> {
        Ok(())
    }
    fn discards_writes(&self, _next: &dyn BlockDevice) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;

    #[test]
    fn writes_pass_only_where_they_change_nothing() {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        mem.write_at(&[9u8; 4096], 4096, WriteFlags::NONE).unwrap();
        let d = Filtered::new(Checkwrite, mem.clone());
        d.write_at(&[9u8; 100], 5000, WriteFlags::FUA).unwrap();
        let e = d.write_at(&[8u8; 100], 5000, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        d.write_zeroes(0, 4096, ZeroFlags::default()).unwrap();
        assert_eq!(
            d.write_zeroes(0, 8192, ZeroFlags::default())
                .unwrap_err()
                .kind(),
            ErrorKind::Io
        );
        d.trim(8192, 8192, WriteFlags::NONE).unwrap();
        d.flush().unwrap();
        let mut b = [0u8; 1];
        mem.read_at(&mut b, 5000).unwrap();
        assert_eq!(b, [9], "nothing was written below");
    }
}
