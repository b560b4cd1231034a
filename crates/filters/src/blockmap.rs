//! A map of small states (two bits) per block, read and updated without
//! locks: the block map of the cow and cache filters' overlay.

use std::sync::atomic::{AtomicU64, Ordering};

use diskit_core::{Error, ErrorKind, Result};

/// Two bits per block.
#[derive(Debug)]
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
