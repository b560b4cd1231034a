//! The xz filter (nbdkit-xz-filter): serves the uncompressed contents of
//! an .xz file, read-only, seeking by block.
//!
//! - `xz-max-block=SIZE`: the largest block accepted, uncompressed
//!   (default 512M): a file with a larger one is refused.
//! - `xz-max-depth=N`: how many decompressed blocks are kept (default 8).
//!
//! The map of the file (its streams, indexes and blocks, see [`index`])
//! is read when the filter is stacked, and checked whole: a file that is
//! not .xz, a broken index or a block over `xz-max-block` is an error
//! before anything is served. A read decompresses the blocks it falls in
//! ([`block`]), which are kept, shared by every connection, and
//! decompressed ahead of sequential readers on several threads
//! ([`blocks`]); a read inside one block is sent from the decompressed
//! block without a copy. Like nbdkit's, the filter is read-only, offers
//! multi-conn and cache (which decompresses) and no extents.

pub mod block;
pub mod blocks;
pub mod index;

use std::sync::Arc;

use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Error, ErrorKind, Extent, Filter, Lent, Result,
    WriteFlags, ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};
use blocks::Blocks;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["xz-max-block", "xz-max-depth"];

/// The parameters, as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XzConfig {
    /// The largest uncompressed block accepted.
    pub max_block: u64,
    /// Decompressed blocks kept.
    pub max_depth: u32,
}

impl Default for XzConfig {
    fn default() -> Self {
        XzConfig {
            max_block: 512 << 20,
            max_depth: 8,
        }
    }
}

impl Configure for XzConfig {
    /// Takes `xz-max-block=` and `xz-max-depth=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "xz-max-block" => self.max_block = params::size("xz", key, value)?,
            "xz-max-depth" => {
                self.max_depth = value.parse().map_err(|_| {
                    Error::invalid(format!(
                        "xz: xz-max-depth: could not parse number '{value}'"
                    ))
                })?;
                if self.max_depth == 0 {
                    return Err(Error::invalid("xz: 'xz-max-depth' parameter must be >= 1"));
                }
            }
            _ => return Err(unknown("xz", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        let size = next.size();
        let read = |off: u64, buf: &mut [u8]| next.read_at(buf, off);
        let index = index::parse(&read, size)?;
        let largest = index.largest_block();
        if largest > self.max_block {
            return Err(Error::invalid(format!(
                "xz: the largest block in the xz file ({largest} bytes) is bigger than \
                 xz-max-block ({} bytes): recompress it with smaller blocks \
                 (xz --block-size=16MiB) or raise xz-max-block",
                self.max_block
            )));
        }
        // The decoder's dictionary may exceed the block (xz -9 uses 64 MiB).
        let memlimit = self.max_block.max(64 << 20) + (16 << 20);
        let blocks = Blocks::new(index, next.clone(), memlimit, self.max_depth as usize);
        Ok(over(
            Xz {
                blocks: Arc::new(blocks),
            },
            next,
        ))
    }
}

/// The refusal of a write through read-only filter `filter`.
pub(crate) fn read_only(filter: &str) -> Error {
    Error::new(
        ErrorKind::PermissionDenied,
        format!("{filter}: the filter is read-only"),
    )
}

/// What a decompressing filter offers over `next`: read-only, with
/// cache (it decompresses) and flush passed through, as nbdkit's;
/// extents when `extents`.
pub(crate) fn decompressed(next: &dyn BlockDevice, extents: bool) -> Capabilities {
    Capabilities {
        can_cache: true,
        can_extents: extents,
        can_flush: next.capabilities().can_flush,
        ..Capabilities::READ_ONLY
    }
}

/// The uncompressed contents of an .xz file.
pub struct Xz {
    blocks: Arc<Blocks>,
}

impl Xz {
    /// Calls `each` with every piece of `offset..offset+len` as (block
    /// number, offset in the block, length), in order.
    fn pieces(
        &self,
        offset: u64,
        len: u64,
        mut each: impl FnMut(usize, u64, u64) -> Result<()>,
    ) -> Result<()> {
        let index = self.blocks.index();
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let i = index
                .find(at)
                .ok_or_else(|| Error::invalid(format!("xz: offset {at} is past the end")))?;
            let b = index.blocks[i];
            let n = (b.start + b.size).min(end) - at;
            each(i, at - b.start, n)?;
            at += n;
        }
        Ok(())
    }
}

impl Filter for Xz {
    fn name(&self) -> &str {
        "xz"
    }
    fn size(&self, _next: &dyn BlockDevice) -> u64 {
        self.blocks.index().size
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        decompressed(next, false)
    }
    fn is_known_zero(&self, _next: &dyn BlockDevice) -> bool {
        false
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        if let Some(last) = self.blocks.index().find((offset + len).saturating_sub(1)) {
            self.note(last, offset, buf.len());
        }
        let mut done = 0;
        self.pieces(offset, len, |i, at, n| {
            let data = self.blocks.get(i, next)?;
            let (at, n) = (at as usize, n as usize);
            buf[done..done + n].copy_from_slice(&data[at..at + n]);
            done += n;
            Ok(())
        })
    }
    fn read_or_lend(
        &self,
        next: &dyn BlockDevice,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<Option<Lent>> {
        let index = self.blocks.index();
        let len = buf.len() as u64;
        let Some(i) = index.find(offset) else {
            return self.read_at(next, buf, offset).map(|()| None);
        };
        let b = index.blocks[i];
        if offset + len > b.start + b.size {
            return self.read_at(next, buf, offset).map(|()| None);
        }
        self.note(i, offset, buf.len());
        let data = self.blocks.get(i, next)?;
        let at = (offset - b.start) as usize;
        Ok(Lent::new(data, at..at + buf.len()))
    }
    fn write_at(&self, _: &dyn BlockDevice, _: &[u8], _: u64, _: WriteFlags) -> Result<()> {
        Err(read_only("xz"))
    }
    fn write_zeroes(&self, _: &dyn BlockDevice, _: u64, _: u64, _: ZeroFlags) -> Result<()> {
        Err(read_only("xz"))
    }
    fn trim(&self, _: &dyn BlockDevice, _: u64, _: u64, _: WriteFlags) -> Result<()> {
        Err(read_only("xz"))
    }
    /// Decompresses the blocks of the range (nbdkit emulates cache with
    /// reads).
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.pieces(offset, len, |i, _, _| self.blocks.get(i, next).map(drop))
    }
    fn extents(&self, _next: &dyn BlockDevice, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::data(len)])
    }
}

impl Xz {
    /// Notes a read of `len` bytes at `offset` that uses block `i` (see
    /// [`Blocks::note_read`]).
    fn note(&self, i: usize, offset: u64, len: usize) {
        self.blocks.note_read(i, offset, offset + len as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::WriteFlags;

    /// `data` compressed by liblzma in pieces of `block` bytes, each its
    /// own stream (one block each), with stream padding between them.
    fn xz(data: &[u8], block: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in data.chunks(block) {
            out.extend_from_slice(&liblzma::encode_all(piece, 1).unwrap());
            out.extend_from_slice(&[0; 8]);
        }
        out
    }

    fn served(file: &[u8], params: &[(&str, &str)]) -> Result<DeviceRef> {
        let mem = Arc::new(MemoryDevice::new(file.len() as u64));
        mem.write_at(file, 0, WriteFlags::NONE).unwrap();
        let c = XzConfig::from_params(&crate::testing::kv(params))?;
        c.stack(mem)
    }

    fn sample(len: usize) -> Vec<u8> {
        let mut x = 0x9e3779b97f4a7c15u64;
        (0..len)
            .map(|i| {
                if i % 3000 < 1000 {
                    0
                } else {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 16) as u8 + b'a'
                }
            })
            .collect()
    }

    #[test]
    fn blocks_read_back_whole_and_across_their_edges() {
        let data = sample(300_000);
        let d = served(&xz(&data, 64 << 10), &[("xz-max-depth", "2")]).unwrap();
        assert_eq!(d.size(), data.len() as u64);
        assert!(!d.capabilities().can_write);
        for (off, len) in [
            (0, 300_000),
            (65_000, 2_000),
            (1, 1),
            (299_999, 1),
            (10, 200_000),
        ] {
            let mut buf = vec![0u8; len];
            d.read_at(&mut buf, off).unwrap();
            assert!(buf == data[off as usize..off as usize + len], "{off}+{len}");
        }
        // Sequential reads, lent from the block where they fit.
        for off in (0..300_000u64).step_by(4096) {
            let len = 4096.min(300_000 - off) as usize;
            let mut buf = vec![0u8; len];
            match d.read_or_lend(&mut buf, off).unwrap() {
                Some(lent) => assert!(lent.bytes() == &data[off as usize..][..len]),
                None => assert!(buf == data[off as usize..][..len]),
            }
        }
        assert!(d.write_at(b"x", 0, WriteFlags::NONE).is_err());
        assert!(d.read_at(&mut [0u8; 2], 299_999).is_err());
    }

    #[test]
    fn bad_files_and_parameters_are_refused_in_one_line() {
        let data = sample(200_000);
        let file = xz(&data, 64 << 10);
        let e = served(&file, &[("xz-max-block", "32k")])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("bigger than xz-max-block"), "{e}");
        assert!(!e.contains('\n'));
        assert!(served(b"not xz at all!!!not xz at all!!!", &[]).is_err());
        // A byte changed in the first block's data: the index is fine,
        // the block is not.
        let mut bad = file.clone();
        bad[100] ^= 0x55;
        let d = served(&bad, &[]).unwrap();
        let mut buf = vec![0u8; data.len()];
        let e = d.read_at(&mut buf, 0).unwrap_err().to_string();
        assert!(e.starts_with("xz: block "), "{e}");
        // Truncated: the footer is gone.
        assert!(served(&file[..file.len() - 12], &[]).is_err());
        for (k, v) in [
            ("xz-max-depth", "0"),
            ("xz-max-depth", "x"),
            ("xz-max-block", "1Q"),
        ] {
            assert!(XzConfig::from_params(&crate::testing::kv(&[(k, v)])).is_err());
        }
    }
}
