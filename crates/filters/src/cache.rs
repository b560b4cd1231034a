//! The cache filter (nbdkit-cache-filter): keeps blocks of the device below
//! in a temporary file, for reads, and for writes until a flush.
//!
//! - `cache=writeback` (default): writes stay in the cache, marked dirty,
//!   until a flush (or a FUA write, or the device's close) writes them
//!   below; `writethrough`: writes go below at once and update the cache;
//!   `unsafe`: as writeback, but flushes and FUA are ignored (dirty blocks
//!   still go below when the device closes, where nbdkit drops them).
//! - `cache-min-block-size=SIZE`: the cache's block (a power of 2, 4 KiB
//!   to 64 MiB, default 64 KiB).
//! - `cache-on-read=true|false|/PATH`: keep what is read from below too
//!   (with a path: while PATH exists).
//! - `cache-max-size=SIZE`, `cache-high-threshold=PERCENT` (default 95),
//!   `cache-low-threshold=PERCENT` (default 80): when the cache holds more
//!   than the high threshold of the maximum, clean blocks not used lately
//!   are dropped (a clock sweep) until it holds less than the low one.
//!   Dirty blocks are never dropped.
//!
//! As in the cow filter, only the blocks being filled or changed are held,
//! a run of missing blocks is one read below, and blocks the device below
//! reports as zeros are marked so (taking no room) rather than read. Extents report dirty blocks as data and
//! ask the device below for the rest.
//!
//! With `cache-on-read`, when reads below are slow (a remote source: a
//! millisecond or more each, on average), the filter prefetches as the
//! readahead filter does (see [`crate::prefetch`]): after each read, a
//! few background threads fill the blocks around it, or ahead of a
//! sequential stream, several reads below in flight at once, so that a
//! client reading one request at a time waits for far fewer of them. Cache
//! requests fill the cache the same way (a readahead filter above sends
//! them, wherever it sits). Prefetching fills only blocks that nobody is
//! filling or changing at the time (a write racing it keeps its data), a
//! failed prefetch costs nothing but the guess (the client's own read of
//! the block fails or not on its own), prefetched blocks count as not yet
//! used (the clock drops them first), and with `cache-max-size` it fills
//! only room below the high threshold: it never makes the cache drop a
//! block.

use std::collections::VecDeque;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, Extent, FileView, Filter, Result,
    WriteFlags, ZeroFlags,
};

pub use crate::overlay::OnRead;
use crate::overlay::{
    self, BELOW as MISSING, Busy, DIRTY, Fill, HELD as CLEAN, Overlay, ZERO, is_held,
};
use crate::params;
use crate::prefetch::{self, Prefetcher, Prefetching};
use crate::registry::{Configure, unknown};
use diskit_core::{DeviceRef, Filtered};

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "cache",
    "cache-min-block-size",
    "cache-on-read",
    "cache-max-size",
    "cache-high-threshold",
    "cache-low-threshold",
];

/// Dirty blocks written below in one go at most.
const WRITE_BACK_CHUNK: u64 = 8 << 20;

/// When writes reach the device below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// At flush.
    Writeback,
    /// At once.
    Writethrough,
    /// At close only.
    Unsafe,
}

/// The parameters, as given.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// When writes go below.
    pub mode: Mode,
    /// The cache's block size.
    pub block_size: u64,
    /// Whether reads fill the cache (a path: while it exists).
    pub on_read: OnRead,
    /// The largest the cache may grow.
    pub max_size: Option<u64>,
    /// Reclaim starts above this share of `max_size`...
    pub high: f64,
    /// ...and stops below this one.
    pub low: f64,
}

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        CacheConfig {
            mode: Mode::Writeback,
            block_size: 64 << 10,
            on_read: OnRead::Never,
            max_size: None,
            high: 0.95,
            low: 0.80,
        }
    }
}

impl Configure for CacheConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "cache" => {
                self.mode = params::choice(
                    "cache",
                    key,
                    value,
                    &[
                        ("writeback", Mode::Writeback),
                        ("writethrough", Mode::Writethrough),
                        ("unsafe", Mode::Unsafe),
                    ],
                )?
            }
            "cache-min-block-size" => self.block_size = overlay::block_size("cache", key, value)?,
            "cache-on-read" => self.on_read = OnRead::parse("cache", key, value)?,
            "cache-max-size" => {
                let n = params::size("cache", key, value)?;
                // As nbdkit: smaller would thrash.
                if n < 1 << 20 {
                    return Err(Error::invalid(format!(
                        "cache: cache-max-size is too small (at least 1M): '{value}'"
                    )));
                }
                self.max_size = Some(n);
            }
            "cache-high-threshold" => self.high = percent(key, value)?,
            "cache-low-threshold" => self.low = percent(key, value)?,
            _ => return Err(unknown("cache", key)),
        }
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        if self.low > self.high {
            return Err(Error::invalid(
                "cache: cache-low-threshold must not be above cache-high-threshold",
            ));
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(Cache::stacked(next, self)?)
    }
}

/// A threshold, `1` to `100` percent (`%` optional), as a share.
fn percent(key: &str, value: &str) -> Result<f64> {
    let n: u32 = value
        .trim()
        .trim_end_matches('%')
        .parse()
        .map_err(|_| Error::invalid(format!("cache: {key}: could not parse '{value}'")))?;
    if !(1..=100).contains(&n) {
        return Err(Error::invalid(format!(
            "cache: {key} must be between 1 and 100"
        )));
    }
    Ok(f64::from(n) / 100.0)
}

/// The filter.
#[derive(Debug)]
pub struct Cache {
    config: CacheConfig,
    /// The blocks: missing, clean, dirty, or zeros below (taking no
    /// room).
    ov: Overlay,
    /// Blocks used since the clock hand last passed (a bit each).
    used: Vec<AtomicU64>,
    /// Blocks held in the cache.
    held: AtomicU64,
    /// The held blocks in the order the clock hand meets them.
    clock: Mutex<VecDeque<u64>>,
    /// A reclaim is running.
    reclaiming: AtomicBool,
    /// Some block may be dirty.
    dirty: AtomicBool,
    /// Blocks reserved by prefetches filling now (with `cache-max-size`).
    prefetching: AtomicU64,
    /// Fills what reads make likely (started by the configuration's
    /// `stack` with `cache-on-read`).
    prefetch: Prefetcher,
}

impl Cache {
    /// An empty cache over `next`.
    pub fn new(next: &dyn BlockDevice, config: &CacheConfig) -> Result<Cache> {
        let blocks = next.size().div_ceil(config.block_size);
        Ok(Cache {
            config: config.clone(),
            ov: Overlay::new("cache", next.size(), config.block_size)?,
            used: (0..blocks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            held: AtomicU64::new(0),
            clock: Mutex::new(VecDeque::new()),
            reclaiming: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            prefetching: AtomicU64::new(0),
            prefetch: Prefetcher::new(),
        })
    }

    /// The filter over `next`, prefetching with `cache-on-read`.
    pub fn stacked(next: DeviceRef, config: &CacheConfig) -> Result<Arc<Filtered<Cache>>> {
        let cache = Cache::new(&*next, config)?;
        prefetch::stacked(cache, next, config.on_read != OnRead::Never)
    }

    /// Marks block `b` used since the clock hand last passed.
    fn touch(&self, b: u64) {
        self.used[(b / 64) as usize].fetch_or(1 << (b % 64), Ordering::Relaxed);
    }

    /// Sets block `b` to `state`, keeping the count of held blocks. The
    /// block does not count as used (a client's read or write marks it).
    fn put(&self, b: u64, state: u8) {
        let was = self.ov.get(b);
        self.ov.set(b, state);
        match (!is_held(was), !is_held(state)) {
            (true, false) => {
                self.held.fetch_add(1, Ordering::Relaxed);
                if self.config.max_size.is_some() {
                    lock(&self.clock).push_back(b);
                }
            }
            (false, true) => {
                self.held.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
        if state == DIRTY {
            self.dirty.store(true, Ordering::Relaxed);
        }
    }

    /// [`put`](Self::put), for a block a client writes.
    fn put_used(&self, b: u64, state: u8) {
        self.put(b, state);
        self.touch(b);
    }

    /// Reads blocks `first..last` still missing into the cache, clean,
    /// one read below per run; the blocks are held meanwhile. Those that
    /// someone else fills or changes now are waited for, or not (`busy`).
    fn fill(&self, next: &dyn BlockDevice, first: u64, last: u64, busy: Busy) -> Result<()> {
        let filled = self
            .ov
            .fill(next, first, last, &|b, s| self.put(b, s), busy);
        self.reclaim();
        filled
    }

    /// Fills what nobody else is filling of `offset..offset+len` (a cache
    /// request).
    fn fill_free(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        let (first, last) = self.ov.blocks_of(offset, len);
        self.fill(next, first, last, Busy::Skip)
    }

    /// Drops clean blocks not used since the clock hand last passed, while
    /// the cache holds more than the high threshold, down to the low one.
    /// The hand goes round the held blocks only (never the whole device),
    /// at most twice; dirty blocks are passed over.
    fn reclaim(&self) {
        let Some(max) = self.config.max_size else {
            return;
        };
        let max_blocks = (max / self.ov.block).max(1);
        let high = (max_blocks as f64 * self.config.high) as u64;
        if self.held.load(Ordering::Relaxed) <= high
            || self.reclaiming.swap(true, Ordering::Acquire)
        {
            return;
        }
        let low = (max_blocks as f64 * self.config.low) as u64;
        let mut steps = 2 * lock(&self.clock).len();
        while self.held.load(Ordering::Relaxed) > low && steps > 0 {
            steps -= 1;
            // The queue's lock is never held while waiting for a block:
            // fills hold blocks and then queue them.
            let Some(b) = lock(&self.clock).pop_front() else {
                break;
            };
            let word = &self.used[(b / 64) as usize];
            let bit = 1u64 << (b % 64);
            let state = self.ov.get(b);
            if state == MISSING {
                continue; // trimmed meanwhile
            }
            if word.fetch_and(!bit, Ordering::Relaxed) & bit != 0 || state == DIRTY {
                lock(&self.clock).push_back(b);
                continue;
            }
            let start = b * self.ov.block;
            let _held = self.ov.busy.lock(start, start + self.ov.block, true);
            if self.ov.get(b) == CLEAN {
                self.put(b, MISSING);
                self.ov.punch(b, b + 1);
            } else if self.ov.get(b) != MISSING {
                lock(&self.clock).push_back(b);
            }
        }
        self.reclaiming.store(false, Ordering::Release);
    }

    /// Writes the dirty blocks below (one write per run), then marks them
    /// clean.
    fn write_back(&self, next: &dyn BlockDevice) -> Result<()> {
        if !self.dirty.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let blocks = self.ov.size.div_ceil(self.ov.block);
        let mut b = 0;
        let mut buf = Vec::new();
        let result = (|| {
            while b < blocks {
                if self.ov.get(b) != DIRTY {
                    b += 1;
                    continue;
                }
                let mut end = b + 1;
                while end < blocks
                    && (end - b) * self.ov.block < WRITE_BACK_CHUNK
                    && self.ov.get(end) == DIRTY
                {
                    end += 1;
                }
                let _held = self
                    .ov
                    .busy
                    .lock(b * self.ov.block, end * self.ov.block, true);
                let start = b * self.ov.block;
                let len = ((end * self.ov.block).min(self.ov.size) - start) as usize;
                buf.resize(len, 0);
                self.ov.file.read_exact_at(&mut buf, start)?;
                next.write_at(&buf, start, WriteFlags::NONE)?;
                for i in b..end {
                    if self.ov.get(i) == DIRTY {
                        self.put(i, CLEAN);
                    }
                }
                b = end;
            }
            Ok(())
        })();
        if result.is_err() {
            // Some blocks are still dirty.
            self.dirty.store(true, Ordering::Release);
        }
        result
    }

    /// Writes `data` at `offset` as the mode says.
    fn write(&self, next: &dyn BlockDevice, data: &[u8], offset: u64, fua: bool) -> Result<()> {
        // unsafe ignores FUA as it ignores flushes.
        let fua = fua && self.config.mode != Mode::Unsafe;
        let through = self.config.mode == Mode::Writethrough || fua;
        if through {
            next.write_at(data, offset, WriteFlags { fua })?;
        }
        let end = offset + data.len() as u64;
        let mut pos = offset;
        while pos < end {
            let b = pos / self.ov.block;
            let n = (((b + 1) * self.ov.block).min(end) - pos) as usize;
            let part = &data[(pos - offset) as usize..][..n];
            if through {
                // Keep cached blocks right; do not cache new ones.
                let start = b * self.ov.block;
                let _held = self.ov.busy.lock(start, start + self.ov.block, true);
                match self.ov.get(b) {
                    CLEAN | DIRTY => {
                        self.ov.file.write_all_at(part, pos)?;
                        self.touch(b);
                    }
                    // No longer zeros below.
                    ZERO => self.put(b, MISSING),
                    _ => {}
                }
            } else {
                self.ov
                    .store(next, b, part, pos, DIRTY, &|b, s| self.put_used(b, s))?;
            }
            pos += n as u64;
        }
        if !through {
            self.reclaim();
        }
        Ok(())
    }
}

impl Prefetching for Cache {
    fn prefetcher(&self) -> &Prefetcher {
        &self.prefetch
    }

    /// A prefetch of `offset..offset+len`: as a cache request, but only
    /// into room the cache has below its high threshold; errors are the
    /// guess's, not a client's.
    fn fetch(&self, next: &dyn BlockDevice, offset: u64, len: u64) {
        let Some(max) = self.config.max_size else {
            let _ = self.fill_free(next, offset, len);
            return;
        };
        // The room is reserved first: prefetches in parallel do not count
        // on the same room.
        let high = ((max / self.ov.block).max(1) as f64 * self.config.high) as u64;
        let blocks = len.div_ceil(self.ov.block) + 1;
        let reserved = self
            .prefetching
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                (self.held.load(Ordering::Acquire) + r + blocks <= high).then_some(r + blocks)
            });
        if reserved.is_ok() {
            let _ = self.fill_free(next, offset, len);
            self.prefetching.fetch_sub(blocks, Ordering::AcqRel);
        }
    }
}

impl Filter for Cache {
    fn name(&self) -> &str {
        "cache"
    }

    /// Held blocks (clean or dirty) lie in the cache file at their own
    /// offsets: a range of them is a view of that file, so that the server
    /// sends it without copying. Not with `cache-max-size`, whose reclaim
    /// could drop a block while it is being sent.
    fn file_view<'a>(
        &'a self,
        _next: &'a dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Option<FileView<'a>> {
        if self.config.max_size.is_some() {
            return None;
        }
        self.ov.file_view(offset, len)
    }

    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        let below = next.capabilities();
        Capabilities {
            can_cache: true,
            can_flush: below.can_write,
            can_fua: below.can_write,
            // Offered, and refused: zeroes are written into the cache as
            // data (as nbdkit does).
            can_fast_zero: below.can_write,
            ..below
        }
    }

    fn block_size(&self, next: &dyn BlockDevice) -> BlockSizeLimits {
        self.ov.block_size(next)
    }

    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let on_read = self.config.on_read.now();
        if on_read && self.ov.slow() {
            self.prefetch
                .after_read(offset, buf.len() as u64, self.ov.size);
        }
        let fill = |first, last| self.fill(next, first, last, Busy::Wait);
        let fill = on_read.then_some(&fill as Fill<'_>);
        self.ov.read(next, buf, offset, fill, &|first, last| {
            (first..last).for_each(|b| self.touch(b))
        })
    }

    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.write(next, buf, offset, flags.fua)
    }

    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        if flags.fast {
            return Err(Error::from_kind(diskit_core::ErrorKind::NotSupported));
        }
        if self.config.mode == Mode::Writethrough || (flags.fua && self.config.mode != Mode::Unsafe)
        {
            next.write_zeroes(offset, len, flags)?;
            // Cached blocks in the range are zeroed too.
            let zeros = vec![0u8; self.ov.block as usize];
            let end = offset + len;
            let mut pos = offset;
            while pos < end {
                let b = pos / self.ov.block;
                let n = ((b + 1) * self.ov.block).min(end) - pos;
                let start = b * self.ov.block;
                let _held = self.ov.busy.lock(start, start + self.ov.block, true);
                if is_held(self.ov.get(b)) {
                    self.ov.file.write_all_at(&zeros[..n as usize], pos)?;
                }
                pos += n;
            }
            return Ok(());
        }
        let zeros = vec![0u8; (self.ov.block as usize).min(len as usize)];
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let b = pos / self.ov.block;
            let n = ((b + 1) * self.ov.block).min(end) - pos;
            self.ov
                .store(next, b, &zeros[..n as usize], pos, DIRTY, &|b, s| {
                    self.put_used(b, s)
                })?;
            pos += n;
        }
        self.reclaim();
        Ok(())
    }

    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        // Trimmed bytes may read as anything: the cache lets go of whole
        // blocks (dirty ones too) and the trim goes below.
        let first = offset.div_ceil(self.ov.block);
        let end = offset + len;
        let mut b = first;
        while (b + 1) * self.ov.block <= end || ((b * self.ov.block) < end && end == self.ov.size) {
            let start = b * self.ov.block;
            let _held = self.ov.busy.lock(start, start + self.ov.block, true);
            if self.ov.get(b) != MISSING {
                self.put(b, MISSING);
                self.ov.punch(b, b + 1);
            }
            b += 1;
            if b * self.ov.block >= self.ov.size {
                break;
            }
        }
        if next.capabilities().can_trim {
            next.trim(offset, len, flags)?;
        }
        Ok(())
    }

    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        if self.config.mode == Mode::Unsafe {
            return Ok(());
        }
        self.write_back(next)?;
        next.flush()
    }

    /// Fills the blocks of the range that nobody else is filling or
    /// changing (those will be there when that is done).
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.fill_free(next, offset, len)
    }

    /// Dirty blocks are data; below has the rest right.
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.ov.extents(next, offset, len, |state, n| {
            (state == DIRTY).then(|| Extent::data(n))
        })
    }

    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        self.prefetch.stop();
        // Dirty blocks are not lost when the server stops.
        let written = self.write_back(next).and_then(|()| {
            if next.capabilities().can_flush {
                next.flush()
            } else {
                Ok(())
            }
        });
        let closed = next.close();
        written.and(closed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{
        Probe, kv, pattern, read, read_first, slow_source, wait_until, writes_racing_a_prefetch,
    };
    use diskit_core::{DeviceRef, Filtered};
    use std::sync::Arc;

    /// The filter over 4 MiB whose first 2 MiB hold the test pattern.
    fn setup(params: &[(&str, &str)]) -> (Arc<Probe>, Filtered<Cache>) {
        let below = Arc::new(Probe::new(4 << 20).patterned(2 << 20));
        let cfg = CacheConfig::from_params(&kv(params)).unwrap();
        let next: DeviceRef = below.clone();
        let c = Cache::new(&*next, &cfg).unwrap();
        (below, Filtered::new(c, next))
    }

    #[test]
    fn writeback_holds_writes_until_flush() {
        let (below, d) = setup(&[]);
        let mem = &below.mem;
        d.write_at(&[7u8; 5000], 1000, WriteFlags::NONE).unwrap();
        assert_eq!(read(&d, 1000, 5000), vec![7u8; 5000]);
        assert_eq!(
            read(&d, 0, 1000),
            read(mem, 0, 1000),
            "rest of the block from below"
        );
        assert_ne!(read(mem, 1000, 5000), vec![7u8; 5000], "not below yet");
        d.flush().unwrap();
        assert_eq!(read(mem, 1000, 5000), vec![7u8; 5000]);
        // FUA goes through at once.
        d.write_at(&[8u8; 100], 3 << 20, WriteFlags { fua: true })
            .unwrap();
        assert_eq!(read(mem, 3 << 20, 100), vec![8u8; 100]);
        // Close writes back what is dirty.
        d.write_zeroes(0, 512, ZeroFlags::default()).unwrap();
        assert_ne!(read(mem, 0, 512), vec![0u8; 512]);
        d.close().unwrap();
        assert_eq!(read(mem, 0, 512), vec![0u8; 512]);
    }

    #[test]
    fn writethrough_and_unsafe() {
        let (below, d) = setup(&[("cache", "writethrough"), ("cache-on-read", "true")]);
        let mem = &below.mem;
        let before = read(&d, 0, 8192);
        d.write_at(&[9u8; 100], 50, WriteFlags::NONE).unwrap();
        assert_eq!(read(mem, 50, 100), vec![9u8; 100]);
        let mut want = before;
        want[50..150].fill(9);
        assert_eq!(read(&d, 0, 8192), want, "the cached block was updated");
        let (below, d) = setup(&[("cache", "unsafe")]);
        let mem = &below.mem;
        d.write_at(&[5u8; 100], 50, WriteFlags::NONE).unwrap();
        d.flush().unwrap();
        assert_ne!(read(mem, 50, 100), vec![5u8; 100], "unsafe ignores flush");
        d.close().unwrap();
        assert_eq!(read(mem, 50, 100), vec![5u8; 100]);
    }

    #[test]
    fn reclaim_keeps_the_cache_under_its_limit() {
        let (below, d) = setup(&[
            ("cache-on-read", "true"),
            ("cache-max-size", "1M"),
            ("cache-min-block-size", "4K"),
        ]);
        let mem = &below.mem;
        for i in 0..500u64 {
            assert_eq!(read(&d, i * 8192, 4096), read(mem, i * 8192, 4096));
            let held = d.filter().held.load(Ordering::Relaxed) * 4096;
            assert!(held <= 1 << 20, "{held} bytes cached after read {i}");
        }
        // Dirty blocks stay whatever the limit.
        for i in 0..100u64 {
            d.write_at(&[3u8; 4096], i * 4096, WriteFlags::NONE)
                .unwrap();
        }
        d.flush().unwrap();
        assert_eq!(read(mem, 0, 4096), vec![3u8; 4096]);
        assert_eq!(read(mem, 99 * 4096, 4096), vec![3u8; 4096]);
    }

    #[test]
    fn reads_fill_once_and_holes_below_are_not_read() {
        let below = Arc::new(Probe::new(4 << 20));
        below
            .mem
            .write_at(&[1u8; 1 << 20], 0, WriteFlags::NONE)
            .unwrap();
        let next: DeviceRef = below.clone();
        let cfg = CacheConfig::from_params(&[("cache-on-read".into(), "true".into())]).unwrap();
        let d = Filtered::new(Cache::new(&*next, &cfg).unwrap(), next);
        for _ in 0..2 {
            let all = read(&d, 0, 4 << 20);
            assert!(all[..1 << 20].iter().all(|&b| b == 1));
            assert!(all[1 << 20..].iter().all(|&b| b == 0));
        }
        assert_eq!(below.bytes(), 1 << 20, "the data once, the holes never");
        // A write into a block that was zero below reads back right.
        d.write_at(&[4u8; 10], (2 << 20) + 5, WriteFlags::NONE)
            .unwrap();
        let b = read(&d, 2 << 20, 20);
        assert_eq!(&b[..5], &[0; 5]);
        assert_eq!(&b[5..15], &[4; 10]);
        assert_eq!(
            d.filter().held.load(Ordering::Relaxed),
            17,
            "16 data blocks, 1 written"
        );
    }

    /// cache-on-read with `params` over `size` bytes of the test pattern,
    /// each read below taking 2 ms (slow enough to prefetch), made slow by
    /// a first read.
    fn prefetching(size: u64, params: &[(&str, &str)]) -> (Arc<Probe>, Arc<Filtered<Cache>>) {
        let below = slow_source(Probe::new(size), size);
        let mut params = params.to_vec();
        params.push(("cache-on-read", "true"));
        let cfg = CacheConfig::from_params(&kv(&params)).unwrap();
        let d = Cache::stacked(below.clone(), &cfg).unwrap();
        read_first(&*d);
        assert!(d.filter().ov.slow());
        (below, d)
    }

    #[test]
    fn a_write_racing_a_prefetch_of_its_block_keeps_the_write() {
        let size = 8 << 20;
        let (below, d) = prefetching(size, &[]);
        let want = writes_racing_a_prefetch(&(d.clone() as DeviceRef), &below, size);
        wait_until(|| d.filter().prefetch.idle());
        assert_eq!(d.filter().ov.get(16), CLEAN, "prefetched");
        assert!(read(&*d, 0, size as usize) == want, "a write was lost");
        // Dirty until the flush, then below.
        assert_eq!(d.filter().ov.get(20), DIRTY);
        d.flush().unwrap();
        assert!(read(&below.mem, 0, size as usize) == want);
    }

    #[test]
    fn prefetching_stays_within_cache_max_size() {
        let size = 64 << 20;
        let max = 8 << 20;
        let (below, d) = prefetching(
            size,
            &[("cache-max-size", "8M"), ("cache-min-block-size", "4K")],
        );
        let all = pattern(size);
        let held = || d.filter().held.load(Ordering::Relaxed) * 4096;
        let mut used = 0;
        for i in 0..200u64 {
            let off = (i * 7_777_777) % (size - 65536);
            assert!(read(&*d, off, 65536) == all[off as usize..off as usize + 65536]);
            used += 16;
            assert!(held() <= max, "{} bytes cached after read {i}", held());
        }
        wait_until(|| d.filter().prefetch.idle());
        assert!(held() <= max, "{} bytes cached", held());
        // It prefetched: more went below than the reads asked for.
        assert!(below.bytes() > used * 4096, "{} bytes read", below.bytes());
    }

    #[test]
    fn the_thresholds_are_checked_together() {
        let e = CacheConfig::from_params(&[
            ("cache-high-threshold".into(), "50".into()),
            ("cache-low-threshold".into(), "60".into()),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("must not be above"), "{e}");
    }
}
