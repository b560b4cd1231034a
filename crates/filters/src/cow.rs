//! The cow filter (nbdkit-cow-filter): a writable overlay over a device
//! that is never written. Writes, zeroes and trims go to a temporary file;
//! reads come from it where the client changed the disk and from the
//! device below elsewhere.
//!
//! - `cow-block-size=SIZE`: the overlay's block (a power of 2, 4 KiB to
//!   64 MiB, default 64 KiB). Writes smaller than a block read the rest of
//!   the block from below first.
//! - `cow-on-read=true|false|/PATH`: also keep in the overlay what is read
//!   from below, so that the device below is read at most once per block
//!   (with a path: only while PATH exists).
//! - `cow-on-cache=true|false`: cache requests copy blocks into the
//!   overlay (otherwise they go to the device below, unless
//!   `cow-on-read` keeps what is read: then they copy too).
//!
//! Requests run in parallel. Only the blocks being filled or changed are
//! held, never a lock around all I/O: a block that several requests need
//! from below is read once, by the first, while the others wait for it; a
//! run of missing blocks is one read below, not one per block. Zeroes and
//! trims of whole blocks only mark them (and free their space in the
//! overlay), so they are fast and fast zero is honoured for them; a zero
//! that needs a partial block read from below is refused when fast. Reads
//! of zeroed blocks are zeros without I/O, and extents report them so.
//! With cow-on-read, blocks the device below reports as zeros are marked
//! zero rather than read and stored (nbdkit copies them): they stay holes.
//!
//! With `cow-on-read`, when reads below are slow (a remote source: a
//! millisecond or more each, on average), the filter prefetches as the
//! readahead filter does (see [`crate::prefetch`]): after each read, a few
//! background threads copy the blocks around it, or ahead of a sequential
//! stream, into the overlay, several reads below in flight at once, so
//! that a client reading one request at a time waits for far fewer of
//! them. Prefetching copies only blocks still below that nobody is filling
//! or changing at the time: a client's write racing it keeps its data,
//! and a failed prefetch costs nothing but the guess (the client's own
//! read of the block fails or not on its own).
//!
//! The overlay is an unlinked file in `$TMPDIR` (or /var/tmp), gone when
//! the server stops: flush has nothing to make durable and is a no-op, as
//! in nbdkit. The export is writable, trims, zeroes (fast), caches and
//! allows multi-conn whatever the device below does.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, FileView, Filter, Result,
    WriteFlags, ZeroFlags,
};

pub use crate::overlay::OnRead;
use crate::overlay::{self, BELOW, Busy, Fill, HELD, Overlay, ZERO};
use crate::params;
use crate::prefetch::{self, Prefetcher, Prefetching};
use crate::registry::{Configure, over, unknown};
use diskit_core::{DeviceRef, Filtered};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["cow-block-size", "cow-on-read", "cow-on-cache", "cow-file"];

/// The default overlay block: nbdkit's.
const DEFAULT_BLOCK: u64 = 64 << 10;

/// The parameters, as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CowConfig {
    /// The overlay's block size.
    pub block_size: u64,
    /// Whether reads fill the overlay.
    pub on_read: OnRead,
    /// Whether cache requests fill the overlay.
    pub on_cache: bool,
    /// Keep the overlay as this qcow2 image, backed by the source (see
    /// [`crate::cow_file`]), instead of a temporary file.
    pub file: Option<PathBuf>,
}

impl Default for CowConfig {
    fn default() -> CowConfig {
        CowConfig {
            block_size: DEFAULT_BLOCK,
            on_read: OnRead::Never,
            on_cache: false,
            file: None,
        }
    }
}

impl Configure for CowConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "cow-block-size" => self.block_size = overlay::block_size("cow", key, value)?,
            "cow-on-read" => self.on_read = OnRead::parse("cow", key, value)?,
            "cow-on-cache" => self.on_cache = params::boolean("cow", key, value)?,
            "cow-file" => self.file = Some(PathBuf::from(value)),
            _ => return Err(unknown("cow", key)),
        }
        Ok(())
    }

    /// The overlay in a temporary file, or with `cow-file=` in a qcow2
    /// image (see [`crate::cow_file`]).
    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        if self.file.is_some() {
            return Ok(over(crate::cow_file::CowFile::new(&next, self)?, next));
        }
        Ok(Cow::stacked(next, self)?)
    }
}

/// The filter: the overlay, in which held blocks are the client's
/// data and zero blocks were zeroed or trimmed.
#[derive(Debug)]
pub struct Cow {
    ov: Overlay,
    on_read: OnRead,
    on_cache: bool,
    /// A client has written data (the overlay may hold non-zeros).
    written: AtomicBool,
    /// Copies what reads make likely (started by the configuration's
    /// `stack` with `cow-on-read`).
    prefetch: Prefetcher,
}

impl Cow {
    /// An empty overlay over `next`, in a new temporary file.
    pub fn new(next: &dyn BlockDevice, config: &CowConfig) -> Result<Cow> {
        Ok(Cow {
            ov: Overlay::new("cow", next.size(), config.block_size)?,
            on_read: config.on_read.clone(),
            on_cache: config.on_cache,
            written: AtomicBool::new(false),
            prefetch: Prefetcher::new(),
        })
    }

    /// The filter over `next`, prefetching with `cow-on-read`.
    pub fn stacked(next: DeviceRef, config: &CowConfig) -> Result<Arc<Filtered<Cow>>> {
        let cow = Cow::new(&*next, config)?;
        prefetch::stacked(cow, next, config.on_read != OnRead::Never)
    }

    /// Copies blocks `first..last` still below into the overlay, waiting
    /// for those someone else fills or changes now, or not (`busy`).
    fn fill(&self, next: &dyn BlockDevice, first: u64, last: u64, busy: Busy) -> Result<()> {
        self.ov
            .fill(next, first, last, &|b, s| self.ov.set(b, s), busy)
    }

    /// Copies what nobody else is copying or changing of
    /// `offset..offset+len` into the overlay (a cache request, a
    /// prefetch).
    fn fill_free(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        let (first, last) = self.ov.blocks_of(offset, len);
        self.fill(next, first, last, Busy::Skip)
    }

    /// Puts `data` at `offset`, inside block `b` but not all of it: the rest
    /// of the block comes from what it holds now.
    fn write_partial(
        &self,
        next: &dyn BlockDevice,
        b: u64,
        data: &[u8],
        offset: u64,
    ) -> Result<()> {
        if data.iter().any(|&x| x != 0) {
            self.written.store(true, Ordering::Relaxed);
        }
        self.ov
            .store(next, b, data, offset, HELD, &|b, s| self.ov.set(b, s))
    }

    /// Makes `offset..offset+len` read as zeros: whole blocks are marked,
    /// partial ones rewritten.
    fn zero_range(&self, next: &dyn BlockDevice, offset: u64, len: u64, fast: bool) -> Result<()> {
        let (block, size) = (self.ov.block, self.ov.size);
        let end = offset + len;
        let first_whole = offset.div_ceil(block);
        let last_whole = end / block;
        let partial_head = !offset.is_multiple_of(block);
        let partial_tail = !end.is_multiple_of(block) && end != size;
        if fast && (partial_head || partial_tail || first_whole >= last_whole) {
            // A partial block may need a read below: not fast.
            let cheap = |b: u64| self.ov.get(b) != BELOW;
            let head_ok = !partial_head || cheap(offset / block);
            let tail_ok = !partial_tail || cheap(end / block);
            if !(head_ok && tail_ok) {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
        }
        let mut pos = offset;
        while pos < end {
            let b = pos / block;
            let block_start = b * block;
            let block_end = (block_start + block).min(size);
            if pos == block_start && block_end <= end {
                // Whole blocks (the last one whole up to the device's
                // end): marked, their overlay space freed.
                let mut last = b + 1;
                while last * block < end && (last * block + block).min(size) <= end {
                    last += 1;
                }
                {
                    let _held = self.ov.busy.lock(block_start, last * block, true);
                    for i in b..last {
                        self.ov.set(i, ZERO);
                    }
                }
                self.ov.punch(b, last);
                pos = (last * block).min(size);
            } else {
                let n = block_end.min(end) - pos;
                let zeros = vec![0u8; n as usize];
                self.write_partial(next, b, &zeros, pos)?;
                pos += n;
            }
        }
        Ok(())
    }
}

impl Prefetching for Cow {
    fn prefetcher(&self) -> &Prefetcher {
        &self.prefetch
    }

    fn fetch(&self, next: &dyn BlockDevice, offset: u64, len: u64) {
        let _ = self.fill_free(next, offset, len);
    }
}

impl Filter for Cow {
    fn name(&self) -> &str {
        "cow"
    }

    /// Blocks held in the overlay lie in its file at their own offsets: a
    /// range of them is a view of that file (so that the server sends it
    /// without copying). Blocks are never dropped from the overlay, only
    /// written or zeroed, which a read running at the same time may or may
    /// not see, as with any device.
    fn file_view<'a>(
        &'a self,
        _next: &'a dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Option<FileView<'a>> {
        self.ov.file_view(offset, len)
    }

    fn size(&self, _next: &dyn BlockDevice) -> u64 {
        self.ov.size
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
            can_extents: true,
            can_multi_conn: true,
            can_cache: true,
            ..next.capabilities()
        }
    }

    fn block_size(&self, next: &dyn BlockDevice) -> BlockSizeLimits {
        self.ov.block_size(next)
    }

    fn is_known_zero(&self, next: &dyn BlockDevice) -> bool {
        next.is_known_zero() && !self.written.load(Ordering::Relaxed)
    }

    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let on_read = self.on_read.now();
        if on_read && self.ov.slow() {
            self.prefetch
                .after_read(offset, buf.len() as u64, self.ov.size);
        }
        let fill = |first, last| self.fill(next, first, last, Busy::Wait);
        let fill = on_read.then_some(&fill as Fill<'_>);
        self.ov.read(next, buf, offset, fill, &|_, _| {})
    }

    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        _flags: WriteFlags,
    ) -> Result<()> {
        self.written.store(true, Ordering::Relaxed);
        let block = self.ov.block;
        let end = offset + buf.len() as u64;
        let mut pos = offset;
        while pos < end {
            let b = pos / block;
            let block_start = b * block;
            let data = &buf[(pos - offset) as usize..];
            if pos == block_start && end >= block_start + block {
                // Whole blocks: written as they are.
                let whole = (end - pos) / block * block;
                let _held = self.ov.busy.lock(pos, pos + whole, true);
                self.ov.file.write_all_at(&data[..whole as usize], pos)?;
                for i in b..b + whole / block {
                    self.ov.set(i, HELD);
                }
                pos += whole;
            } else {
                let n = ((block_start + block).min(end) - pos) as usize;
                self.write_partial(next, b, &data[..n], pos)?;
                pos += n as u64;
            }
        }
        Ok(())
    }

    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.zero_range(next, offset, len, flags.fast)
    }

    fn trim(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        _flags: WriteFlags,
    ) -> Result<()> {
        self.zero_range(next, offset, len, false)
    }

    fn flush(&self, _next: &dyn BlockDevice) -> Result<()> {
        // The overlay dies with the server: nothing to make durable.
        Ok(())
    }

    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // With cow-on-read what is read is kept anyway: what a client (a
        // readahead filter) asks to cache is kept too.
        if self.on_cache || self.on_read.now() {
            return self.fill_free(next, offset, len);
        }
        if next.capabilities().can_cache {
            return next.cache(offset, len);
        }
        Ok(())
    }

    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.ov.extents(next, offset, len, |state, n| match state {
            HELD => Some(Extent::data(n)),
            ZERO => Some(Extent::hole(n)),
            _ => None,
        })
    }

    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        self.prefetch.stop();
        next.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{
        FAST, Probe, kv, pattern, read, read_first, slow_source, wait_until,
        writes_racing_a_prefetch,
    };
    use diskit_backends::MemoryDevice;
    use diskit_core::{DeviceRef, Filtered};
    use std::sync::Arc;

    /// The filter over a read-only device of `size` bytes whose first half
    /// holds the test pattern.
    fn setup(size: u64, params: &[(&str, &str)]) -> (Arc<Probe>, Filtered<Cow>) {
        let below = Arc::new(Probe::new(size).patterned(size / 2).caps(|c| c.read_only()));
        let cfg = CowConfig::from_params(&kv(params)).unwrap();
        let next: DeviceRef = below.clone();
        let cow = Cow::new(&*next, &cfg).unwrap();
        (below, Filtered::new(cow, next))
    }

    /// What the device below holds, then what was written over it.
    fn expect(size: u64, writes: &[(u64, Vec<u8>)]) -> Vec<u8> {
        let mut v = pattern(size);
        v[size as usize / 2..].fill(0);
        for (off, data) in writes {
            v[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }
        v
    }

    fn read_all(d: &dyn BlockDevice) -> Vec<u8> {
        let mut v = vec![0u8; d.size() as usize];
        d.read_at(&mut v, 0).unwrap();
        v
    }

    #[test]
    fn writes_land_in_the_overlay_never_below() {
        let size = 1_000_000u64; // not a multiple of the block
        let (below, d) = setup(size, &[("cow-block-size", "4096")]);
        assert!(d.capabilities().can_write);
        let writes = vec![
            (100u64, vec![7u8; 10]),
            (8192, vec![8u8; 8192]),
            (20_000, vec![9u8; 30_000]),
            (size - 5, vec![1u8; 5]),
        ];
        for (off, data) in &writes {
            d.write_at(data, *off, WriteFlags::NONE).unwrap();
        }
        assert_eq!(read_all(&d), expect(size, &writes));
        // The device below is unchanged.
        assert_eq!(read_all(&below.mem), expect(size, &[]));
        // Zero and trim, partial and whole, and a fast zero.
        d.write_zeroes(100, 5, ZeroFlags::default()).unwrap();
        d.trim(8192, 4096, WriteFlags::NONE).unwrap();
        d.write_zeroes(40_960, 8192, FAST).unwrap();
        let mut want = expect(size, &writes);
        want[100..105].fill(0);
        want[8192..12288].fill(0);
        want[40_960..49_152].fill(0);
        assert_eq!(read_all(&d), want);
        let ext = d.extents(8192, 4096).unwrap();
        assert!(ext[0].flags.zero, "{ext:?}");
        // A fast zero that needs a block from below is refused.
        let e = d.write_zeroes(200_001, 10, FAST).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotSupported);
        assert_eq!(read_all(&d), want);
    }

    #[test]
    fn cow_on_read_reads_each_block_below_once() {
        let size = 4 << 20;
        let (below, d) = setup(size, &[("cow-on-read", "true")]);
        let first = read_all(&d);
        let after_first = below.bytes();
        assert_eq!(first, expect(size, &[]));
        // The data half once; the zero half (a hole below) not at all.
        assert_eq!(after_first, size / 2, "one pass reads the data once");
        // A run of missing blocks is one read below.
        assert_eq!(below.reads(), 1);
        let mut b = vec![0u8; 100_000];
        d.read_at(&mut b, 12_345).unwrap();
        assert_eq!(read_all(&d), first);
        assert_eq!(below.bytes(), after_first, "second pass: nothing below");
    }

    #[test]
    fn parallel_readers_of_a_block_fetch_it_once() {
        let size = 8 << 20;
        let (below, d) = setup(size, &[("cow-on-read", "true"), ("cow-block-size", "1M")]);
        let d = Arc::new(d);
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let d = d.clone();
                s.spawn(move || {
                    let mut b = vec![0u8; 4096];
                    for i in 0..64u64 {
                        d.read_at(&mut b, ((i * 7 + t) % 8) << 20).unwrap();
                    }
                });
            }
        });
        assert_eq!(below.bytes(), size / 2);
    }

    #[test]
    fn concurrent_partial_writes_to_one_block_all_land() {
        let size = 1 << 20;
        let (_, d) = setup(size, &[]);
        let d = Arc::new(d);
        std::thread::scope(|s| {
            for t in 0..16u64 {
                let d = d.clone();
                s.spawn(move || {
                    d.write_at(&[t as u8 + 100; 512], t * 512, WriteFlags::NONE)
                        .unwrap();
                });
            }
        });
        let all = read_all(&*d);
        for t in 0..16usize {
            assert!(
                all[t * 512..(t + 1) * 512]
                    .iter()
                    .all(|&x| x == t as u8 + 100),
                "{t}"
            );
        }
        assert_eq!(all[8192..], expect(size, &[])[8192..]);
    }

    #[test]
    fn cow_on_read_path_and_cache() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("keep");
        let size = 1 << 20;
        let (below, d) = setup(size, &[("cow-on-read", flag.to_str().unwrap())]);
        read_all(&d);
        read_all(&d);
        assert_eq!(below.bytes(), 2 * size, "not kept without the file");
        std::fs::write(&flag, b"").unwrap();
        read_all(&d);
        read_all(&d);
        assert_eq!(below.bytes(), 2 * size + size / 2);
        let (below, d) = setup(size, &[("cow-on-cache", "true")]);
        d.cache(0, size).unwrap();
        read_all(&d);
        assert_eq!(below.bytes(), size / 2);
        // Blocks below that read as zeros stay holes in the overlay.
        let e = d.extents(size / 2, size / 2).unwrap();
        assert!(e.iter().all(|e| e.flags.zero), "{e:?}");
    }

    /// cow-on-read over `size` bytes of the test pattern, each read below
    /// taking 2 ms (slow enough to prefetch), made slow by a first read.
    fn prefetching(size: u64, below: Probe) -> (Arc<Probe>, Arc<Filtered<Cow>>) {
        let below = slow_source(below.caps(|c| c.read_only()), size);
        let cfg = CowConfig::from_params(&kv(&[("cow-on-read", "true")])).unwrap();
        let d = Cow::stacked(below.clone(), &cfg).unwrap();
        assert!(!d.filter().ov.slow(), "not before a read below");
        read_first(&*d);
        assert!(d.filter().ov.slow());
        (below, d)
    }

    #[test]
    fn writes_racing_prefetches_of_their_blocks_keep_their_data() {
        let size = 8 << 20;
        let (below, d) = prefetching(size, Probe::new(size));
        let mut want = writes_racing_a_prefetch(&(d.clone() as DeviceRef), &below, size);
        // A write before a prefetch: the prefetch leaves the block alone.
        d.write_at(&[0xcc; 10], 3 << 20, WriteFlags::NONE).unwrap();
        read(&*d, (3 << 20) + 100_000, 10);
        wait_until(|| d.filter().prefetch.idle());
        // Both prefetches filled their blocks around the writes.
        for b in [1, 14, 16, 30, 47, 49, 70] {
            assert_eq!(d.filter().ov.get(b), HELD, "block {b}");
        }
        want[3 << 20..(3 << 20) + 10].fill(0xcc);
        assert!(read_all(&*d) == want, "a write was lost");
    }

    #[test]
    fn a_source_failing_mid_prefetch_fails_only_the_block_asked_for() {
        let size = 8 << 20;
        let (below, d) = prefetching(size, Probe::new(size).failing(5 << 20, 512));
        let reads = below.reads();
        // The prefetch around it covers the bad block and fails.
        assert_eq!(
            read(&*d, 4 << 20, 4096),
            pattern((4 << 20) + 4096)[4 << 20..]
        );
        wait_until(|| d.filter().prefetch.idle());
        assert!(below.reads() > reads + 1, "the prefetch ran");
        let all = pattern(size);
        for off in [3 << 20, (5 << 20) + (64 << 10), 6 << 20, (5 << 20) - 4096] {
            let got = read(&*d, off as u64, 4096);
            assert!(got == all[off..off + 4096], "{off}");
        }
        let mut buf = vec![0u8; 4096];
        let e = d.read_at(&mut buf, (5 << 20) + 100).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        // Asked again, it fails again: nothing pretends it is held.
        assert!(d.read_at(&mut buf, 5 << 20).is_err());
    }

    #[test]
    fn known_zero_only_until_written() {
        let mem: DeviceRef = Arc::new(MemoryDevice::new(1 << 20));
        let d = Filtered::new(Cow::new(&*mem, &CowConfig::default()).unwrap(), mem.clone());
        assert_eq!(d.is_known_zero(), mem.is_known_zero());
        d.write_zeroes(0, 4096, ZeroFlags::default()).unwrap();
        assert_eq!(d.is_known_zero(), mem.is_known_zero());
        d.write_at(&[1], 100, WriteFlags::NONE).unwrap();
        assert!(!d.is_known_zero());
    }
}
