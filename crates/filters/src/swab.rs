//! The swab filter (nbdkit-swab-filter): swaps the bytes of each 16-,
//! 32- or 64-bit word (disks from the Atari Falcon, a little-endian
//! pattern).
//!
//! `swab-bits=8|16|32|64` (default 16; 8 does nothing). The size is
//! rounded down to a whole word, the minimum block size raised to one
//! word, and requests not aligned to a word fail with EINVAL (stack
//! blocksize above for byte access). Extents are reported by whole
//! words: a word is a hole, or zeros, only if all its bytes are.

use diskit_core::extent::{push_merged, walk};
use diskit_core::params::nbdkit_unsigned;
use diskit_core::{
    BlockDevice, BlockSizeLimits, DeviceRef, Error, Extent, ExtentFlags, Filter, Result,
    WriteFlags, ZeroFlags,
};

use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["swab-bits"];

/// The configuration: the word size in bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Swab {
    /// `swab-bits=`: 8, 16, 32 or 64.
    pub bits: u32,
}

impl Default for Swab {
    fn default() -> Self {
        Swab { bits: 16 }
    }
}

impl Configure for Swab {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "swab-bits" => {
                let bits = nbdkit_unsigned("swab-bits", value, u32::MAX.into())
                    .map_err(|e| e.context("swab"))?;
                if ![8, 16, 32, 64].contains(&bits) {
                    return Err(Error::invalid(
                        "swab: invalid swab-bits, must be 8, 16, 32 or 64",
                    ));
                }
                self.bits = bits as u32;
            }
            _ => return Err(unknown("swab", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(*self, next))
    }
}

impl Swab {
    /// The word size in bytes.
    fn word(&self) -> u64 {
        u64::from(self.bits / 8)
    }

    /// Refuses a request not aligned to a word.
    fn aligned(&self, offset: u64, len: u64) -> Result<()> {
        let w = self.word();
        if !offset.is_multiple_of(w) || !len.is_multiple_of(w) {
            return Err(Error::invalid(
                "swab: requests to this filter must be aligned",
            ));
        }
        Ok(())
    }

    /// Swaps the bytes of each word of `buf` in place.
    fn swap(&self, buf: &mut [u8]) {
        if self.word() > 1 {
            buf.chunks_exact_mut(self.word() as usize)
                .for_each(<[u8]>::reverse);
        }
    }
}

/// The flags of a word made of parts with flags `a` and `b`.
fn both(a: ExtentFlags, b: ExtentFlags) -> ExtentFlags {
    ExtentFlags {
        zero: a.zero && b.zero,
        data: a.data || b.data,
        present: a.present || b.present,
        compressed: a.compressed && b.compressed,
    }
}

/// An extent of `length` bytes with `flags`.
fn extent(length: u64, flags: ExtentFlags) -> Extent {
    Extent {
        flags,
        ..Extent::data(length)
    }
}

impl Filter for Swab {
    fn name(&self) -> &str {
        "swab"
    }
    fn size(&self, next: &dyn BlockDevice) -> u64 {
        next.size() / self.word() * self.word()
    }
    fn block_size(&self, next: &dyn BlockDevice) -> BlockSizeLimits {
        let below = next.block_size();
        let w = self.word() as u32;
        if below == BlockSizeLimits::default() {
            // Nothing set below: nbdkit's defaults for a filter that sets them.
            BlockSizeLimits {
                minimum: w,
                preferred: 512,
                maximum: u32::MAX,
            }
        } else {
            BlockSizeLimits {
                minimum: below.minimum.max(w),
                ..below
            }
        }
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.aligned(offset, buf.len() as u64)?;
        next.read_at(buf, offset)?;
        self.swap(buf);
        Ok(())
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.aligned(offset, buf.len() as u64)?;
        let mut swapped = buf.to_vec();
        self.swap(&mut swapped);
        next.write_at(&swapped, offset, flags)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.aligned(offset, len)?;
        next.write_zeroes(offset, len, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.aligned(offset, len)?;
        next.trim(offset, len, flags)
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.aligned(offset, len)?;
        next.cache(offset, len)
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.aligned(offset, len)?;
        let w = self.word();
        let mut out = Vec::new();
        // A word begun by one extent and not finished: its start, its flags.
        let mut partial: Option<(u64, ExtentFlags)> = None;
        let mut pos = offset;
        for e in walk(next, offset, len) {
            let e = e?;
            let end = pos + e.length;
            if let Some((start, flags)) = partial {
                let flags = both(flags, e.flags);
                pos = end.min(start + w);
                if pos < start + w {
                    partial = Some((start, flags));
                    continue;
                }
                push_merged(&mut out, extent(w, flags));
                partial = None;
            }
            let body_end = end / w * w;
            if body_end > pos {
                push_merged(&mut out, extent(body_end - pos, e.flags));
                pos = body_end;
            }
            if pos < end {
                partial = Some((pos, e.flags));
                pos = end;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;

    #[test]
    fn words_are_swapped_both_ways_and_unaligned_requests_refused() {
        let mem = Arc::new(MemoryDevice::new(4099));
        mem.write_at(&[0, 1, 2, 3, 4, 5, 6, 7], 0, WriteFlags::NONE)
            .unwrap();
        for (bits, want) in [
            (16, [1, 0, 3, 2, 5, 4, 7, 6]),
            (32, [3, 2, 1, 0, 7, 6, 5, 4]),
            (64, [7, 6, 5, 4, 3, 2, 1, 0]),
            (8, [0, 1, 2, 3, 4, 5, 6, 7]),
        ] {
            let d = Filtered::new(Swab { bits }, mem.clone());
            assert_eq!(d.size(), 4099 / (bits as u64 / 8) * (bits as u64 / 8));
            let mut b = [0u8; 8];
            d.read_at(&mut b, 0).unwrap();
            assert_eq!(b, want, "{bits}");
            d.write_at(&want, 8, WriteFlags::NONE).unwrap();
            mem.read_at(&mut b, 8).unwrap();
            assert_eq!(b, [0, 1, 2, 3, 4, 5, 6, 7], "{bits}");
            if bits > 8 {
                assert!(d.read_at(&mut b[..2], 1).is_err());
            }
        }
    }

    #[test]
    fn a_word_is_a_hole_only_when_all_of_it_is() {
        /// Extents with a boundary inside a word.
        struct Odd;
        impl BlockDevice for Odd {
            fn size(&self) -> u64 {
                64
            }
            fn capabilities(&self) -> diskit_core::Capabilities {
                diskit_core::Capabilities::READ_ONLY
            }
            fn read_at(&self, buf: &mut [u8], _: u64) -> Result<()> {
                buf.fill(0);
                Ok(())
            }
            fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
                let all = [Extent::data(10), Extent::hole(3), Extent::hole(51)];
                let mut out = Vec::new();
                let mut pos = 0;
                for e in all {
                    let (a, b) = (pos.max(offset), (pos + e.length).min(offset + len));
                    if a < b {
                        out.push(Extent { length: b - a, ..e });
                    }
                    pos += e.length;
                }
                Ok(out)
            }
        }
        let d = Filtered::new(Swab { bits: 32 }, Arc::new(Odd));
        let got = d.extents(0, 64).unwrap();
        let lens: Vec<_> = got.iter().map(|e| (e.length, e.flags.data)).collect();
        assert_eq!(lens, [(12, true), (52, false)]);
    }
}
