//! The block overlay the cow and cache filters keep: a temporary file,
//! unlinked, in $TMPDIR or else /var/tmp (as nbdkit: /tmp is often
//! memory), sized to hold every block of the device, sparse; and a state
//! per block saying where its bytes are.
//!
//! Only the blocks being filled or changed are held (a [`RangeLock`]),
//! never a lock around all I/O: a block that several requests need from
//! below is read once, by the first, while the others wait for it; a run
//! of missing blocks is one read below, not one per block; blocks the
//! device below reports as zeros are marked so (taking no room) rather
//! than read.
//!
//! When reads below are slow (a remote source), the filters also prefetch
//! (see [`crate::prefetch`]) with [`Busy::Skip`] fills, which fill only
//! the blocks nobody else is filling or changing at the time: a client
//! that needs one of them waits for whoever holds it, never for a second
//! read of it.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diskit_core::extent::walk;
use diskit_core::range_lock::RangeLock;
use diskit_core::{BlockDevice, BlockSizeLimits, Error, Extent, FileView, Result};

use crate::blockmap::BlockMap;
use crate::params;

/// Not held: the bytes are below.
pub(crate) const BELOW: u8 = 0;
/// Held in the file (cow: written by a client; cache: clean).
pub(crate) const HELD: u8 = 1;
/// Held in the file and not yet below (cache: dirty).
pub(crate) const DIRTY: u8 = 2;
/// Reads as zeros, nothing stored (cow: zeroed by a client; cache: the
/// device below reports zeros).
pub(crate) const ZERO: u8 = 3;

/// When reads from below are kept in the overlay (`cow-on-read=`,
/// `cache-on-read=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnRead {
    /// Never (the default).
    Never,
    /// Always.
    Always,
    /// While this file exists.
    WhileExists(PathBuf),
}

impl OnRead {
    /// `true|false|/PATH`, as `key` of `filter`.
    pub fn parse(filter: &str, key: &str, value: &str) -> Result<OnRead> {
        Ok(if value.starts_with('/') {
            OnRead::WhileExists(PathBuf::from(value))
        } else if params::boolean(filter, key, value)? {
            OnRead::Always
        } else {
            OnRead::Never
        })
    }

    /// Whether reads fill the overlay now.
    pub fn now(&self) -> bool {
        match self {
            OnRead::Never => false,
            OnRead::Always => true,
            OnRead::WhileExists(p) => p.exists(),
        }
    }
}

/// An overlay's block size (`cow-block-size=`, `cache-min-block-size=`):
/// a power of 2 from 4 KiB to 64 MiB.
pub(crate) fn block_size(filter: &str, key: &str, value: &str) -> Result<u64> {
    let n = params::size(filter, key, value)?;
    if !n.is_power_of_two() || !(4096..=64 << 20).contains(&n) {
        return Err(Error::invalid(format!(
            "{filter}: {key} must be a power of 2 from 4096 to 64M: '{value}'"
        )));
    }
    Ok(n)
}

/// Bytes read below in one go when filling a run of blocks.
const FILL_CHUNK: u64 = crate::prefetch::PIECE;

/// Reads below that take this long on average are worth prefetching
/// around: a remote source's, not memory's or a local disk's cache.
const SLOW: Duration = Duration::from_millis(1);

/// Whether a block in `state` lies in the file.
pub(crate) fn is_held(state: u8) -> bool {
    state == HELD || state == DIRTY
}

/// What a filter does when a block changes state (the cache counts the
/// blocks it holds): it sets the state, at least.
pub(crate) type Put<'a> = &'a dyn Fn(u64, u8);

/// What a fill does about blocks someone else is filling or changing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Waits for them, then fills what is still below.
    Wait,
    /// Leaves them alone.
    Skip,
}

/// How a filter fills blocks `first..last` from below.
pub(crate) type Fill<'a> = &'a dyn Fn(u64, u64) -> Result<()>;

/// The overlay of a device of `size` bytes, in blocks of `block` bytes.
#[derive(Debug)]
pub(crate) struct Overlay {
    /// The filter's name, for messages.
    filter: &'static str,
    /// Bytes per block.
    pub(crate) block: u64,
    /// The device's size.
    pub(crate) size: u64,
    /// The blocks held, at their own offsets.
    pub(crate) file: File,
    /// A state per block.
    pub(crate) states: BlockMap,
    /// Blocks being filled or changed.
    pub(crate) busy: RangeLock,
    /// How long a client's read below takes, in microseconds (a moving
    /// average).
    latency_us: AtomicU64,
}

impl Overlay {
    /// An empty overlay for `filter` over `size` bytes.
    pub(crate) fn new(filter: &'static str, size: u64, block: u64) -> Result<Overlay> {
        let blocks = size.div_ceil(block);
        Ok(Overlay {
            filter,
            block,
            size,
            file: temp_file(filter, blocks * block)?,
            states: BlockMap::new(filter, blocks)?,
            busy: RangeLock::new(),
            latency_us: AtomicU64::new(0),
        })
    }

    /// Whether the reads below that clients waited for took long enough
    /// (on average, lately) that prefetching pays.
    pub(crate) fn slow(&self) -> bool {
        self.latency_us.load(Ordering::Relaxed) >= SLOW.as_micros() as u64
    }

    /// Counts a read below that a client waited `took`.
    fn waited(&self, took: Duration) {
        let us = took.as_micros().min(u128::from(u32::MAX)) as u64;
        let _ = self
            .latency_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if avg == 0 { us } else { (avg * 3 + us) / 4 })
            });
    }

    /// The blocks `first..last` that `offset..offset+len` touches.
    pub(crate) fn blocks_of(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset / self.block, (offset + len).div_ceil(self.block))
    }

    /// Block `b`'s state.
    pub(crate) fn get(&self, b: u64) -> u8 {
        self.states.get(b)
    }

    /// Sets block `b`'s state (a [`Put`] that does nothing else).
    pub(crate) fn set(&self, b: u64, state: u8) {
        self.states.set(b, state)
    }

    /// The end of the run of blocks in `state` from block `b`, in bytes,
    /// at most `end`.
    pub(crate) fn run_end(&self, b: u64, state: u8, end: u64) -> u64 {
        self.states.run_end(b, state, self.block, end)
    }

    /// The block sizes to advertise over `next`'s, as nbdkit's cow and
    /// cache filters do: without limits below, any size with the block
    /// preferred; else the block preferred where the maximum allows.
    pub(crate) fn block_size(&self, next: &dyn BlockDevice) -> BlockSizeLimits {
        let below = next.block_size();
        let block = u32::try_from(self.block).unwrap_or(u32::MAX);
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

    /// Reads `buf.len()` bytes at `offset` of the device below, zeros past
    /// its end (the last block may run past it).
    pub(crate) fn read_below(
        &self,
        next: &dyn BlockDevice,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<()> {
        let inside = self.size.saturating_sub(offset).min(buf.len() as u64) as usize;
        next.read_at(&mut buf[..inside], offset)?;
        buf[inside..].fill(0);
        Ok(())
    }

    /// For each block of `first..last`, whether `next` reports all of it
    /// (up to the device's end) as reading zeros. Unknown (no extents, or
    /// an error asking) counts as not: the block is read.
    fn zero_blocks_below(&self, next: &dyn BlockDevice, first: u64, last: u64) -> Vec<bool> {
        let (block, size) = (self.block, self.size);
        let mut out = vec![false; (last - first) as usize];
        if !next.capabilities().can_extents {
            return out;
        }
        let mut pos = first * block;
        for e in walk(next, pos, (last * block).min(size) - pos) {
            let Ok(e) = e else { return out };
            let e_end = pos + e.length;
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
        }
        out
    }

    /// Copies blocks `first..last` still below into the overlay, as
    /// [`HELD`] (or [`ZERO`] where the device below reports zeros), one
    /// read below per run of them, the blocks held meanwhile so that other
    /// requests for them wait and then find them filled. Blocks that
    /// someone else fills or changes now are waited for ([`Busy::Wait`]:
    /// a client's read; the time the reads take is counted, see
    /// [`slow`](Self::slow)) or left alone ([`Busy::Skip`]: a cache
    /// request, a prefetch; they will be there when that is done; the
    /// rest is filled in pieces of at most 8 MiB, each held only while it
    /// is filled). The first error is returned; the blocks it concerns
    /// stay below.
    pub(crate) fn fill(
        &self,
        next: &dyn BlockDevice,
        first: u64,
        last: u64,
        put: Put<'_>,
        busy: Busy,
    ) -> Result<()> {
        if busy == Busy::Wait {
            let _held = self.busy.lock(first * self.block, last * self.block, true);
            return self.fill_held(next, first, last, put, true);
        }
        let per_piece = (FILL_CHUNK / self.block).max(1);
        let mut b = first;
        while b < last {
            let end = (b + per_piece).min(last);
            for part in self
                .busy
                .try_lock_free(b * self.block, end * self.block, true)
            {
                let (start, stop) = part.range();
                // Held ranges are whole blocks; inward all the same.
                let (f, l) = (start.div_ceil(self.block), stop / self.block);
                if f < l {
                    self.fill_held(next, f, l, put, false)?;
                }
            }
            b = end;
        }
        Ok(())
    }

    /// [`fill`](Self::fill) with blocks `first..last` held by the caller;
    /// `waited`: a client waits for it.
    fn fill_held(
        &self,
        next: &dyn BlockDevice,
        first: u64,
        last: u64,
        put: Put<'_>,
        waited: bool,
    ) -> Result<()> {
        let mut b = first;
        let mut buf = Vec::new();
        while b < last {
            if self.get(b) != BELOW {
                b += 1;
                continue;
            }
            let mut end = b + 1;
            while end < last && (end - b) * self.block < FILL_CHUNK && self.get(end) == BELOW {
                end += 1;
            }
            let zeros = self.zero_blocks_below(next, b, end);
            let mut i = b;
            while i < end {
                let zero = zeros[(i - b) as usize];
                let mut j = i + 1;
                while j < end && zeros[(j - b) as usize] == zero {
                    j += 1;
                }
                if !zero {
                    let (start, len) = (i * self.block, (j - i) * self.block);
                    buf.resize(len as usize, 0);
                    let t = Instant::now();
                    self.read_below(next, &mut buf, start)?;
                    if waited {
                        self.waited(t.elapsed());
                    }
                    self.file.write_all_at(&buf, start)?;
                }
                for k in i..j {
                    put(k, if zero { ZERO } else { HELD });
                }
                i = j;
            }
            b = end;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`: held blocks from the file
    /// (`used` is told of each run of them), zero blocks as zeros, the
    /// rest from below, or through the overlay when there is a `fill`
    /// (the filter's: blocks `first..last` filled from below).
    pub(crate) fn read(
        &self,
        next: &dyn BlockDevice,
        buf: &mut [u8],
        offset: u64,
        fill: Option<Fill<'_>>,
        used: &dyn Fn(u64, u64),
    ) -> Result<()> {
        let end = offset + buf.len() as u64;
        let mut pos = offset;
        while pos < end {
            let b = pos / self.block;
            let state = self.get(b);
            let run_end = self.run_end(b, state, end);
            let out = &mut buf[(pos - offset) as usize..(run_end - offset) as usize];
            match (state, fill) {
                (ZERO, _) => out.fill(0),
                (BELOW, Some(fill)) => {
                    // Filled, then read from the overlay on the next turn.
                    fill(b, run_end.div_ceil(self.block))?;
                    continue;
                }
                (BELOW, None) => next.read_at(out, pos)?,
                _ => {
                    self.file.read_exact_at(out, pos)?;
                    used(b, run_end.div_ceil(self.block));
                }
            }
            pos = run_end;
        }
        Ok(())
    }

    /// Puts `data` at `offset` within block `b` (all of the block or part
    /// of it; the rest read from below first if it is there) as `state`,
    /// or as [`DIRTY`] if it is so already. The block is held meanwhile.
    pub(crate) fn store(
        &self,
        next: &dyn BlockDevice,
        b: u64,
        data: &[u8],
        offset: u64,
        state: u8,
        put: Put<'_>,
    ) -> Result<()> {
        let start = b * self.block;
        let _held = self.busy.lock(start, start + self.block, true);
        let whole = offset == start
            && (data.len() as u64 == self.block || offset + data.len() as u64 == self.size);
        let now = self.get(b);
        if !is_held(now) && !whole {
            let mut block = vec![0u8; self.block as usize];
            if now == BELOW {
                self.read_below(next, &mut block, start)?;
            }
            let at = (offset - start) as usize;
            block[at..at + data.len()].copy_from_slice(data);
            self.file.write_all_at(&block, start)?;
        } else {
            self.file.write_all_at(data, offset)?;
        }
        put(b, if self.get(b) == DIRTY { DIRTY } else { state });
        Ok(())
    }

    /// The extents of `offset..offset+len`: a run of blocks in a state
    /// `own` answers for (given the state and the run's length) as it
    /// says, the rest as the device below describes it.
    pub(crate) fn extents(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        own: impl Fn(u8, u64) -> Option<Extent>,
    ) -> Result<Vec<Extent>> {
        let end = offset + len;
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let b = pos / self.block;
            let state = self.get(b);
            let run_end = self.run_end(b, state, end);
            match own(state, run_end - pos) {
                Some(e) => out.push(e),
                None => {
                    for e in walk(next, pos, run_end - pos) {
                        out.push(e.map_err(|e| e.context(self.filter))?);
                    }
                }
            }
            pos = run_end;
        }
        Ok(out)
    }

    /// A view of `offset..offset+len` in the file, when every block of it
    /// is held there (at its own offset), so that the server sends it
    /// without copying.
    pub(crate) fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        let end = offset.checked_add(len)?;
        if len == 0 || end > self.size {
            return None;
        }
        let mut b = offset / self.block;
        while b * self.block < end {
            if !is_held(self.get(b)) {
                return None;
            }
            b += 1;
        }
        Some(FileView {
            fd: self.file.as_fd(),
            offset,
        })
    }

    /// Frees the file's space for blocks `first..last` (best effort: the
    /// states say what the blocks hold whatever happens here).
    pub(crate) fn punch(&self, first: u64, last: u64) {
        let (offset, len) = (first * self.block, (last - first) * self.block);
        // SAFETY: fallocate on a file the overlay owns.
        unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            );
        }
    }
}

/// A new unlinked file of `len` bytes for `filter`.
pub(crate) fn temp_file(filter: &str, len: u64) -> Result<File> {
    let dir = std::env::var_os("TMPDIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let f = tempfile::tempfile_in(&dir).map_err(|e| {
        Error::from(e).context(format!(
            "{filter}: cannot create a temporary file in {} (set TMPDIR)",
            dir.display()
        ))
    })?;
    f.set_len(len)
        .map_err(|e| Error::from(e).context(format!("{filter}: cannot size the temporary file")))?;
    Ok(f)
}
