//! A map of small states (two bits) per block, read and updated without
//! locks: the block maps of the cow and cache filters.

use std::sync::atomic::{AtomicU64, Ordering};

use diskit_core::{BlockDevice, BlockSizeLimits, Error, ErrorKind, Result};

/// Two bits per block.
pub(crate) struct BlockMap(Vec<AtomicU64>);

impl BlockMap {
    /// `blocks` blocks, all in state 0; `filter` names the error.
    pub(crate) fn new(filter: &str, blocks: u64) -> Result<BlockMap> {
        let words = usize::try_from(blocks.div_ceil(32)).map_err(|_| {
            Error::new(ErrorKind::OutOfMemory, format!("{filter}: too many blocks"))
        })?;
        let mut v = Vec::new();
        v.try_reserve_exact(words).map_err(|_| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("{filter}: cannot allocate the block map"),
            )
        })?;
        v.resize_with(words, || AtomicU64::new(0));
        Ok(BlockMap(v))
    }

    /// Block `b`'s state (0 to 3).
    pub(crate) fn get(&self, b: u64) -> u8 {
        ((self.0[(b / 32) as usize].load(Ordering::Acquire) >> ((b % 32) * 2)) & 3) as u8
    }

    /// Where the run of blocks of `block` bytes in `state` from block `b`
    /// ends, in bytes, at most `end`.
    pub(crate) fn run_end(&self, b: u64, state: u8, block: u64, end: u64) -> u64 {
        let mut next = b + 1;
        while next * block < end && self.get(next) == state {
            next += 1;
        }
        (next * block).min(end)
    }

    /// Sets block `b`'s state (0 to 3).
    pub(crate) fn set(&self, b: u64, state: u8) {
        let shift = (b % 32) * 2;
        let v = u64::from(state & 3) << shift;
        let _ = self.0[(b / 32) as usize].fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            Some((w & !(3 << shift)) | v)
        });
    }
}

/// The block sizes a filter keeping blocks of `block` bytes advertises
/// over `below`'s, as nbdkit's cow and cache filters do: without limits
/// below, any size with `block` preferred; else `block` preferred where
/// the maximum allows.
/// Reads `buf.len()` bytes at `offset` of `next`, a device of `size`
/// bytes: zeros past its end (a filter's last block may run past it).
pub(crate) fn read_below(
    next: &dyn BlockDevice,
    size: u64,
    buf: &mut [u8],
    offset: u64,
) -> Result<()> {
    let inside = size.saturating_sub(offset).min(buf.len() as u64) as usize;
    next.read_at(&mut buf[..inside], offset)?;
    buf[inside..].fill(0);
    Ok(())
}

pub(crate) fn block_limits(below: BlockSizeLimits, block: u64) -> BlockSizeLimits {
    let block = u32::try_from(block).unwrap_or(u32::MAX);
    if below.minimum <= 1 {
        BlockSizeLimits {
            minimum: 1,
            preferred: block,
            maximum: u32::MAX,
        }
    } else if below.maximum >= block {
        BlockSizeLimits {
            preferred: below.preferred.max(block),
            ..below
        }
    } else {
        below
    }
}

/// For each block of `first..last` (of `block` bytes, on a device of
/// `size` bytes), whether `next` reports all of it (up to the device's
/// end) as reading zeros. Unknown (no extents, or an error asking)
/// counts as not: the cow and cache filters then read the block.
pub(crate) fn zero_blocks_below(
    next: &dyn BlockDevice,
    block: u64,
    size: u64,
    first: u64,
    last: u64,
) -> Vec<bool> {
    let mut out = vec![false; (last - first) as usize];
    if !next.capabilities().can_extents {
        return out;
    }
    let end = (last * block).min(size);
    let mut pos = first * block;
    while pos < end {
        let Ok(extents) = next.extents(pos, end - pos) else {
            return out;
        };
        if extents.iter().all(|e| e.length == 0) {
            return out;
        }
        for e in extents {
            let e_end = (pos + e.length).min(end);
            if e.flags.zero {
                // Blocks wholly inside [pos, e_end), the last one counting
                // as whole up to the device's end.
                let mut k = pos.div_ceil(block);
                while k < last && ((k + 1) * block).min(size) <= e_end {
                    out[(k - first) as usize] = true;
                    k += 1;
                }
            }
            pos = e_end;
            if pos >= end {
                break;
            }
        }
    }
    out
}
