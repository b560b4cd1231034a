use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use diskit_backends::{MemoryDevice, NullDevice, PatternDevice};
use diskit_core::{BlockDevice, CompletionQueue, Filter, Filtered, Request, WriteFlags, ZeroFlags};

use super::*;

fn assert_same(a: &dyn BlockDevice, b: &dyn BlockDevice) {
    let mut x = vec![0u8; 1 << 20];
    let mut y = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < a.size() {
        let n = (a.size() - off).min(x.len() as u64) as usize;
        a.read_at(&mut x[..n], off).unwrap();
        b.read_at(&mut y[..n], off).unwrap();
        assert!(x[..n] == y[..n], "differ in the MiB at {off}");
        off += n as u64;
    }
}

#[test]
fn copies_pattern_exactly_in_any_mode() {
    let src = PatternDevice::new((8 << 20) + 1234);
    for (workers, ordered, request) in [(1, false, 65536), (8, false, 1 << 20), (4, true, 100_000)]
    {
        let dst = Arc::new(MemoryDevice::new(src.size()));
        let opts = CopyOptions {
            workers,
            ordered_writes: ordered,
            request_size: request,
            ..Default::default()
        };
        let p = Progress::default();
        let stats = copy(&src, &dst, &opts, &p).unwrap();
        assert_same(&src, &dst);
        assert_eq!(p.get(), (src.size(), src.size()));
        // The pattern's first word is offset 0: one zero block at most.
        assert!(stats.data_bytes >= src.size() - 8192);
    }
}

#[test]
fn holes_in_the_source_stay_holes() {
    let src = MemoryDevice::new(64 << 20);
    src.write_at(&[1u8; 65536], 32 << 20, WriteFlags::NONE)
        .unwrap();
    // A written zero block inside data is found by zero detection too.
    src.write_at(&[0u8; 8192], 40 << 20, WriteFlags::NONE)
        .unwrap();
    let dst = Arc::new(MemoryDevice::new(64 << 20));
    let opts = CopyOptions {
        target_is_zero: true,
        ..Default::default()
    };
    let stats = copy(&src, &dst, &opts, &Progress::default()).unwrap();
    assert_eq!(stats.data_bytes, 65536);
    assert_eq!(dst.allocated_bytes(), 65536);
    assert_same(&src, &dst);
}

#[test]
fn a_dirty_destination_gets_zeroed() {
    let src = MemoryDevice::new(4 << 20);
    src.write_at(&[5u8; 4096], 4096, WriteFlags::NONE).unwrap();
    let dst = Arc::new(MemoryDevice::new(4 << 20));
    dst.write_at(&vec![9u8; 4 << 20], 0, WriteFlags::NONE)
        .unwrap();
    let stats = copy(&src, &dst, &CopyOptions::default(), &Progress::default()).unwrap();
    assert_same(&src, &dst);
    // Memory zeroes fast: the whole destination is zeroed first, and the
    // holes are then skipped.
    assert_eq!(stats.prezeroed_bytes, 4 << 20);
    assert_eq!(stats.zeroed_bytes, 0);
    assert_eq!(stats.data_bytes, 4096);

    // Where fast zero is refused (ENOTSUP), the holes are zeroed instead.
    let slow = Arc::new(SlowZero(MemoryDevice::new(4 << 20)));
    slow.0
        .write_at(&vec![9u8; 4 << 20], 0, WriteFlags::NONE)
        .unwrap();
    let stats = copy(&src, &slow, &CopyOptions::default(), &Progress::default()).unwrap();
    assert_same(&src, &slow.0);
    assert_eq!(stats.prezeroed_bytes, 0);
    assert!(stats.zeroed_bytes >= (4 << 20) - 8192);

    // A source without holes is not worth pre-zeroing for.
    let full = Arc::new(MemoryDevice::new(1 << 20));
    full.write_at(&vec![3u8; 1 << 20], 0, WriteFlags::NONE)
        .unwrap();
    let dst = Arc::new(MemoryDevice::new(1 << 20));
    let stats = copy(&full, &dst, &CopyOptions::default(), &Progress::default()).unwrap();
    assert_eq!(stats.prezeroed_bytes, 0);
    assert_same(&full, &dst);
}

/// A device that claims fast zero but refuses it, as an NBD server whose
/// zeroing turns out slow answers ENOTSUP.
struct SlowZero(MemoryDevice);

impl BlockDevice for SlowZero {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn capabilities(&self) -> diskit_core::Capabilities {
        self.0.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> diskit_core::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> diskit_core::Result<()> {
        self.0.write_at(buf, offset, flags)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> diskit_core::Result<()> {
        if flags.fast {
            return Err(diskit_core::Error::from_kind(
                diskit_core::ErrorKind::NotSupported,
            ));
        }
        self.0.write_zeroes(offset, len, flags)
    }
}

#[test]
fn min_sparse_zero_writes_everything() {
    let src = NullDevice::new(1 << 20);
    let dst = Arc::new(MemoryDevice::new(1 << 20));
    let opts = CopyOptions {
        min_sparse: 0,
        ..Default::default()
    };
    copy(&src, &dst, &opts, &Progress::default()).unwrap();
    assert_same(&src, &dst);
}

#[test]
fn small_destination_and_read_errors_are_reported() {
    let src = Arc::new(PatternDevice::new(1 << 20));
    let dst = Arc::new(MemoryDevice::new(1 << 19));
    let e = copy(&*src, &dst, &CopyOptions::default(), &Progress::default()).unwrap_err();
    assert!(e.to_string().contains("smaller"));
    let ro = Arc::new(PatternDevice::new(1 << 20));
    assert!(copy(&*src, &ro, &CopyOptions::default(), &Progress::default()).is_err());
}

/// A small deterministic generator (xorshift), so randomised tests replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Requests waiting in a [`Deferred`], and its signal.
type Queued = Arc<(Mutex<Vec<(u64, Request, CompletionQueue)>>, Condvar)>;

/// A device that completes submitted requests later, on another thread,
/// in a shuffled order: what an NBD connection does.
struct Deferred<D: BlockDevice + 'static> {
    inner: Arc<D>,
    queue: Queued,
    /// Requests submitted and not completed yet, and the most there were.
    in_flight: Arc<(AtomicUsize, AtomicUsize)>,
}

impl<D: BlockDevice + 'static> Deferred<D> {
    fn new(inner: Arc<D>, seed: u64) -> Deferred<D> {
        Self::batched(inner, seed, 1)
    }

    /// Like [`new`](Self::new), but the device waits a little for `batch`
    /// requests to be waiting before it takes one.
    fn batched(inner: Arc<D>, seed: u64, batch: usize) -> Deferred<D> {
        let queue: Queued = Arc::default();
        let in_flight: Arc<(AtomicUsize, AtomicUsize)> = Arc::default();
        let (q, dev, counts) = (queue.clone(), inner.clone(), in_flight.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(seed | 1);
            loop {
                let mut pending = q.0.lock().unwrap();
                while pending.is_empty() {
                    if Arc::strong_count(&q) == 1 {
                        return;
                    }
                    pending =
                        q.1.wait_timeout(pending, std::time::Duration::from_millis(5))
                            .unwrap()
                            .0;
                }
                if pending.len() < batch {
                    pending =
                        q.1.wait_timeout(pending, std::time::Duration::from_millis(5))
                            .unwrap()
                            .0;
                }
                let i = rng.below(pending.len() as u64) as usize;
                let (tag, req, cq) = pending.swap_remove(i);
                drop(pending);
                let done = diskit_core::aio::run(&*dev, tag, req);
                counts.0.fetch_sub(1, Ordering::Relaxed);
                cq.push(done);
            }
        });
        Deferred {
            inner,
            queue,
            in_flight,
        }
    }
}

impl<D: BlockDevice + 'static> BlockDevice for Deferred<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> diskit_core::Capabilities {
        self.inner.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> diskit_core::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> diskit_core::Result<()> {
        self.inner.write_at(buf, offset, flags)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> diskit_core::Result<()> {
        self.inner.write_zeroes(offset, len, flags)
    }
    fn extents(&self, offset: u64, len: u64) -> diskit_core::Result<Vec<diskit_core::Extent>> {
        self.inner.extents(offset, len)
    }
    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        let now = self.in_flight.0.fetch_add(1, Ordering::Relaxed) + 1;
        self.in_flight.1.fetch_max(now, Ordering::Relaxed);
        self.queue.0.lock().unwrap().push((tag, req, cq.clone()));
        self.queue.1.notify_one();
    }
    fn queue_depth(&self) -> usize {
        16
    }
}

#[test]
fn random_layouts_copy_exactly_with_minimal_allocation() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let size = 1 + rng.below(6 << 20);
        let src = MemoryDevice::new(size);
        // Random runs of data, of zeros written as data, and of holes.
        for _ in 0..rng.below(12) {
            let off = rng.below(size);
            let len = 1 + rng.below((size - off).min(300_000));
            let byte = if rng.below(3) == 0 {
                0
            } else {
                1 + rng.below(255) as u8
            };
            src.write_at(&vec![byte; len as usize], off, WriteFlags::NONE)
                .unwrap();
        }
        let dirty = rng.below(2) == 0;
        let dst = Arc::new(MemoryDevice::new(size + rng.below(10_000)));
        if dirty {
            dst.write_at(&vec![0xee; dst.size() as usize], 0, WriteFlags::NONE)
                .unwrap();
        }
        let opts = CopyOptions {
            min_sparse: [0, 512, 4096, 65536][rng.below(4) as usize],
            workers: 1 + rng.below(8) as usize,
            request_size: 512 * (1 + rng.below(2048) as usize),
            target_is_zero: !dirty,
            ordered_writes: rng.below(2) == 0,
            flush: rng.below(2) == 0,
            zero_alignment: [1, 4096, 65536][rng.below(3) as usize],
            skip_backing: false,
            requests: 1 + rng.below(16) as usize,
            ..Default::default()
        };
        let opts = CopyOptions {
            allocated: opts.min_sparse == 0,
            ..opts
        };
        // Either side may complete requests out of order, later.
        let (src, dst) = (Arc::new(src), Arc::new(dst));
        let (dsrc, ddst) = (
            Deferred::new(src.clone(), seed),
            Deferred::new(dst.clone(), !seed),
        );
        let s: &dyn BlockDevice = if seed % 3 == 1 { &dsrc } else { &*src };
        let d: diskit_core::DeviceRef = if seed % 4 >= 2 {
            Arc::new(ddst)
        } else {
            dst.clone()
        };
        let stats =
            copy(s, &d, &opts, &Progress::default()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let mut a = vec![0u8; size as usize];
        let mut b = vec![0u8; size as usize];
        src.read_at(&mut a, 0).unwrap();
        dst.read_at(&mut b, 0).unwrap();
        assert!(a == b, "seed {seed} {opts:?}: content differs");
        // Everything is accounted for exactly once.
        assert_eq!(
            stats.data_bytes + stats.zeroed_bytes + stats.skipped_bytes,
            size,
            "seed {seed}"
        );
        if opts.min_sparse == 0 {
            assert_eq!(stats.skipped_bytes, 0, "seed {seed}: -S 0 skips nothing");
        }
    }
}

/// A two-layer view for the layered operations: `top` answers where `mask`
/// says so (depth 0, data), `below` everywhere else (depth 1).
struct Layered {
    top: MemoryDevice,
    below: MemoryDevice,
    /// Ranges (start, len) the top layer holds; `zero` ones read as zeros.
    mask: Vec<(u64, u64, bool)>,
}

impl Layered {
    fn owner(&self, off: u64) -> Option<(u64, u64, bool)> {
        self.mask
            .iter()
            .copied()
            .find(|&(s, l, _)| off >= s && off < s + l)
    }
}

impl BlockDevice for Layered {
    fn size(&self) -> u64 {
        self.top.size()
    }
    fn capabilities(&self) -> diskit_core::Capabilities {
        diskit_core::Capabilities::IN_MEMORY
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> diskit_core::Result<()> {
        for (i, b) in buf.iter_mut().enumerate() {
            let at = offset + i as u64;
            let mut one = [0u8];
            match self.owner(at) {
                Some((_, _, true)) => {}
                Some(_) => self.top.read_at(&mut one, at)?,
                None => self.below.read_at(&mut one, at)?,
            }
            *b = one[0];
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> diskit_core::Result<()> {
        self.top.write_at(buf, offset, flags)
    }
    fn extents(&self, offset: u64, len: u64) -> diskit_core::Result<Vec<diskit_core::Extent>> {
        let mut e = diskit_core::Extent::data(1);
        let end = offset + len;
        let (run_end, depth, zero) = match self.owner(offset) {
            Some((s, l, z)) => ((s + l).min(end), 0, z),
            None => {
                let next = self
                    .mask
                    .iter()
                    .map(|&(s, _, _)| s)
                    .filter(|&s| s > offset)
                    .min()
                    .unwrap_or(end);
                (next.min(end), 1, false)
            }
        };
        e.length = run_end - offset;
        e.depth = depth;
        e.flags.zero = zero;
        e.flags.data = !zero;
        Ok(vec![e])
    }
}

fn layered() -> Layered {
    let top = MemoryDevice::new(1 << 20);
    let below = MemoryDevice::new(1 << 20);
    below
        .write_at(&[7u8; 1 << 20], 0, WriteFlags::NONE)
        .unwrap();
    top.write_at(&[3u8; 65536], 65536, WriteFlags::NONE)
        .unwrap();
    Layered {
        top,
        below,
        mask: vec![(65536, 65536, false), (262144, 65536, true)],
    }
}

#[test]
fn skip_backing_writes_only_what_the_top_layer_holds() {
    let src = layered();
    let dst = Arc::new(MemoryDevice::new(src.size()));
    dst.write_at(&[9u8; 1 << 20], 0, WriteFlags::NONE).unwrap();
    let opts = CopyOptions {
        skip_backing: true,
        ..Default::default()
    };
    let p = Progress::default();
    let stats = copy(&src, &dst, &opts, &p).unwrap();
    assert_eq!(p.get(), (src.size(), src.size()));
    assert_eq!(stats.data_bytes, 65536);
    assert_eq!(stats.zeroed_bytes, 65536);
    let mut b = vec![0u8; 1 << 20];
    dst.read_at(&mut b, 0).unwrap();
    assert!(b[..65536].iter().all(|&x| x == 9));
    assert!(b[65536..131072].iter().all(|&x| x == 3));
    assert!(b[131072..262144].iter().all(|&x| x == 9));
    assert!(b[262144..327680].iter().all(|&x| x == 0));
    assert!(b[327680..].iter().all(|&x| x == 9));
}

#[test]
fn commit_copies_the_top_layer_into_the_base() {
    let src = layered();
    let p = Progress::default();
    let mut limit = commit::RateLimit::new(None);
    let stats = commit::commit(&src, &src.below, 1, 65536, &p, &mut limit).unwrap();
    assert_eq!(stats.data_bytes, 65536);
    assert_eq!(stats.zeroed_bytes, 65536);
    assert_same(&src, &src.below);
}

#[test]
fn rebase_keeps_what_the_image_shows() {
    let src = layered();
    let new = MemoryDevice::new(1 << 20);
    new.write_at(&[7u8; 131072], 0, WriteFlags::NONE).unwrap();
    new.write_at(&[1u8; 4096], 500_000, WriteFlags::NONE)
        .unwrap();
    let before = MemoryDevice::new(1 << 20);
    let mut b = vec![0u8; 1 << 20];
    src.read_at(&mut b, 0).unwrap();
    before.write_at(&b, 0, WriteFlags::NONE).unwrap();
    let backings = rebase::Backings {
        old: Some(&src.below),
        new: Some(&new),
    };
    rebase::copy_differences(&src, &backings, 65536, &Progress::default()).unwrap();
    // The image now shows top where written, else the new backing file.
    let mut shown = vec![0u8; 1 << 20];
    let mut written = vec![0u8; 1 << 20];
    src.top.read_at(&mut written, 0).unwrap();
    new.read_at(&mut shown, 0).unwrap();
    for (i, s) in shown.iter_mut().enumerate() {
        if written[i] != 0 {
            *s = written[i];
        }
    }
    assert!(shown == b, "content changed by the rebase");
    // Equal blocks were not copied: the first 64 KiB stays unwritten.
    assert!(written[..65536].iter().all(|&x| x == 0));
}

/// Over a destination: its writes fail.
struct FailingWrites;

impl Filter for FailingWrites {
    fn name(&self) -> &str {
        "failing-writes"
    }
    fn write_at(
        &self,
        _next: &dyn BlockDevice,
        _buf: &[u8],
        _offset: u64,
        _flags: WriteFlags,
    ) -> diskit_core::Result<()> {
        Err(diskit_core::Error::io("the disk is on fire"))
    }
}

#[test]
fn a_source_that_reads_on_its_own_threads_writes_from_there() {
    let src = MemoryDevice::new(16 << 20);
    src.write_at(&[1u8; 1 << 20], 2 << 20, WriteFlags::NONE)
        .unwrap();
    // Zeros written inside the data: found by zero detection in the
    // thread that received them.
    src.write_at(&[0u8; 65536], (2 << 20) + 65536, WriteFlags::NONE)
        .unwrap();
    let src = Arc::new(src);
    let deferred = Deferred::new(src.clone(), 7);
    let opts = CopyOptions {
        target_is_zero: true,
        ..Default::default()
    };
    let dst = Arc::new(MemoryDevice::new(16 << 20));
    let p = Progress::default();
    let stats = copy(&deferred, &dst, &opts, &p).unwrap();
    assert_same(&*src, &dst);
    assert_eq!(p.get(), (16 << 20, 16 << 20));
    assert_eq!(stats.data_bytes, (1 << 20) - 65536);
    assert_eq!(dst.allocated_bytes(), (1 << 20) - 65536);
    assert_eq!(stats.data_bytes + stats.skipped_bytes, 16 << 20);

    // Into a destination that drops what it is given: the data is read
    // and counted, not looked at.
    let null = Arc::new(NullDevice::new(16 << 20));
    let stats = copy(&deferred, &null, &opts, &Progress::default()).unwrap();
    assert_eq!(stats.data_bytes, 1 << 20);

    // A write that fails there is reported as the write it is.
    let broken = Arc::new(Filtered::new(
        FailingWrites,
        Arc::new(MemoryDevice::new(16 << 20)),
    ));
    let e = copy(&deferred, &broken, &opts, &Progress::default()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("error while writing at byte 2097152"), "{msg}");
    assert!(msg.contains("on fire"), "{msg}");
}

/// Over a destination: records where each data write starts, and takes
/// away fast zero (the copy zeroes the holes in their turn instead of the
/// whole device first).
#[derive(Default)]
struct Recording(Mutex<Vec<u64>>);

impl Filter for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> diskit_core::Capabilities {
        diskit_core::Capabilities {
            can_fast_zero: false,
            ..next.capabilities()
        }
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> diskit_core::Result<()> {
        self.0.lock().unwrap().push(offset);
        next.write_at(buf, offset, flags)
    }
}

#[test]
fn one_worker_writes_in_source_order_with_many_reads_in_flight() {
    for seed in 1..=8u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let size = 8 << 20;
        let src = MemoryDevice::new(size);
        for _ in 0..6 {
            let off = rng.below(size);
            let len = 1 + rng.below((size - off).min(1 << 20));
            src.write_at(
                &vec![1 + rng.below(255) as u8; len as usize],
                off,
                WriteFlags::NONE,
            )
            .unwrap();
        }
        let src = Arc::new(src);
        // The source completes reads later, in a shuffled order, and waits
        // to have several.
        let deferred = Deferred::batched(src.clone(), seed, 4);
        // A dirty destination: the holes are zeroed, in their turn too.
        let mem = Arc::new(MemoryDevice::new(size));
        mem.write_at(&vec![0xee; size as usize], 0, WriteFlags::NONE)
            .unwrap();
        let dst = Arc::new(Filtered::new(Recording::default(), mem.clone()));
        let opts = CopyOptions {
            workers: 1,
            ordered_writes: true,
            request_size: 64 << 10,
            requests: 16,
            ..Default::default()
        };
        let stats = copy(&deferred, &dst, &opts, &Progress::default())
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_same(&*src, &*mem);
        assert_eq!(stats.data_bytes + stats.zeroed_bytes, size, "seed {seed}");
        let starts = dst.filter().0.lock().unwrap();
        assert!(
            starts.windows(2).all(|w| w[0] < w[1]),
            "seed {seed}: data written out of source order: {starts:?}"
        );
        assert!(
            deferred.in_flight.1.load(Ordering::Relaxed) > 1,
            "seed {seed}: one read at a time"
        );
    }
}

/// Over a source: reads fail where they cover this offset.
struct BadSector(u64);

impl Filter for BadSector {
    fn name(&self) -> &str {
        "bad-sector"
    }
    fn read_at(
        &self,
        next: &dyn BlockDevice,
        buf: &mut [u8],
        offset: u64,
    ) -> diskit_core::Result<()> {
        if (offset..offset + buf.len() as u64).contains(&self.0) {
            return Err(diskit_core::Error::io("bad sector"));
        }
        next.read_at(buf, offset)
    }
}

#[test]
fn a_failed_read_stops_an_ordered_copy_with_reads_parked() {
    let src = MemoryDevice::new(8 << 20);
    src.write_at(&vec![7u8; 8 << 20], 0, WriteFlags::NONE)
        .unwrap();
    // Reads after the bad one come back first and wait for their turn.
    let bad = Arc::new(Filtered::new(BadSector((1 << 20) + 4096), Arc::new(src)));
    let deferred = Deferred::batched(bad, 3, 8);
    let dst = Arc::new(MemoryDevice::new(8 << 20));
    let opts = CopyOptions {
        workers: 1,
        ordered_writes: true,
        request_size: 256 << 10,
        requests: 16,
        ..Default::default()
    };
    let e = copy(&deferred, &dst, &opts, &Progress::default()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("error while reading at byte 1048576"), "{msg}");
    assert!(msg.contains("bad sector"), "{msg}");
    // Nothing past the failed read was written.
    let mut after = vec![0u8; 7 << 20];
    dst.read_at(&mut after, 1 << 20).unwrap();
    assert!(after.iter().all(|&b| b == 0));
}

/// A memory device that records the writes announced to it
/// (`prepare_write`) and the writes made, in order.
struct Announced {
    mem: MemoryDevice,
    prepared: Mutex<Vec<(u64, usize)>>,
    written: Mutex<Vec<(u64, usize, bool)>>,
}

impl BlockDevice for Announced {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn capabilities(&self) -> diskit_core::Capabilities {
        self.mem.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.mem.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        let announced = self.prepared.lock().unwrap().contains(&(offset, buf.len()));
        self.written
            .lock()
            .unwrap()
            .push((offset, buf.len(), announced));
        self.mem.write_at(buf, offset, flags)
    }
    fn prepare_write(&self, buf: &[u8], offset: u64) {
        self.prepared.lock().unwrap().push((offset, buf.len()));
    }
}

#[test]
fn ordered_writes_by_several_workers_are_announced_before_their_turn() {
    let src = PatternDevice::new(40 << 20);
    let dst = Arc::new(Announced {
        mem: MemoryDevice::new(src.size()),
        prepared: Mutex::new(Vec::new()),
        written: Mutex::new(Vec::new()),
    });
    let opts = CopyOptions {
        workers: 4,
        ordered_writes: true,
        request_size: 1 << 20,
        ..Default::default()
    };
    copy(&src, &dst, &opts, &Progress::default()).unwrap();
    assert_same(&src, &dst.mem);
    let written = dst.written.lock().unwrap();
    assert!(written.len() >= 40, "{}", written.len());
    // In source order, each announced (so prepared on its worker's own
    // thread) before it was made.
    assert!(written.windows(2).all(|w| w[0].0 < w[1].0));
    assert!(written.iter().all(|w| w.2), "unannounced writes");
}

/// A memory device whose writes take their place in the order they come
/// (`write_placed`) and then wait, before their bytes move, for the next
/// write to be placed: a copy that keeps writes one at a time would wait
/// each out (`serial` counts those).
struct Placing {
    mem: MemoryDevice,
    placed: Mutex<Vec<u64>>,
    more: Condvar,
    serial: AtomicUsize,
}

impl BlockDevice for Placing {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn capabilities(&self) -> diskit_core::Capabilities {
        self.mem.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.mem.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.write_placed(buf, offset, flags, &mut || {})
    }
    fn write_placed(
        &self,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
        placed: &mut dyn FnMut(),
    ) -> Result<()> {
        let mut list = self.placed.lock().unwrap();
        list.push(offset);
        let mine = list.len();
        self.more.notify_all();
        drop(list);
        placed();
        if offset + (buf.len() as u64) < self.size() {
            let list = self.placed.lock().unwrap();
            let (_list, waited) = self
                .more
                .wait_timeout_while(list, std::time::Duration::from_secs(2), |l| l.len() == mine)
                .unwrap();
            if waited.timed_out() {
                self.serial.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.mem.write_at(buf, offset, flags)
    }
}

#[test]
fn ordered_writes_are_placed_in_order_and_written_side_by_side() {
    // Items of 8 MiB: a worker more starts for each (RAMP_BYTES).
    let src = PatternDevice::new(64 << 20);
    let dst = Arc::new(Placing {
        mem: MemoryDevice::new(src.size()),
        placed: Mutex::new(Vec::new()),
        more: Condvar::new(),
        serial: AtomicUsize::new(0),
    });
    let opts = CopyOptions {
        workers: 4,
        ordered_writes: true,
        request_size: 8 << 20,
        ..Default::default()
    };
    copy(&src, &dst, &opts, &Progress::default()).unwrap();
    assert_same(&src, &dst.mem);
    let placed = dst.placed.lock().unwrap();
    assert_eq!(*placed, (0..8).map(|i| i << 23).collect::<Vec<u64>>());
    // Each write's bytes moved after the next one was placed.
    assert_eq!(dst.serial.load(Ordering::Relaxed), 0);
}

/// The blkhash of `dev`, its bytes read in order and given as data.
fn blkhash_by_reading(dev: &dyn BlockDevice) -> blkhash::Md {
    let h = BlockHash::new(blkhash::Algorithm::default_algorithm(), 65536).unwrap();
    let mut buf = vec![0u8; dev.size() as usize];
    dev.read_at(&mut buf, 0).unwrap();
    h.data(0, &buf);
    h.finish(dev.size()).unwrap()
}

#[test]
fn blkhash_of_the_data_as_it_is_copied_in_every_mode() {
    // Data, holes, zeros written inside data, a short last block.
    let size = (16 << 20) + 5000;
    let src = MemoryDevice::new(size);
    src.write_at(&[1u8; 1 << 20], 2 << 20, WriteFlags::NONE)
        .unwrap();
    src.write_at(&[0u8; 65536], (2 << 20) + 65536, WriteFlags::NONE)
        .unwrap();
    src.write_at(&[7u8; 3000], (5 << 20) + 100, WriteFlags::NONE)
        .unwrap();
    src.write_at(&[9u8; 1000], size - 1000, WriteFlags::NONE)
        .unwrap();
    let src = Arc::new(src);
    let want = blkhash_by_reading(&*src);
    let deferred = Deferred::new(src.clone(), 7);
    let cases: [(&dyn BlockDevice, usize, bool, bool); 6] = [
        (&*src, 1, false, false),
        (&*src, 4, false, false),
        (&*src, 3, true, false),
        (&deferred, 1, false, false),
        (&deferred, 2, false, true),
        (&*src, 2, false, true),
    ];
    for (i, (from, workers, ordered, null)) in cases.into_iter().enumerate() {
        let h = Arc::new(BlockHash::new(blkhash::Algorithm::default_algorithm(), 65536).unwrap());
        let opts = CopyOptions {
            workers,
            ordered_writes: ordered,
            request_size: 100_000,
            blkhash: Some(h.clone()),
            ..Default::default()
        };
        if null {
            copy(
                from,
                &Arc::new(NullDevice::new(size)),
                &opts,
                &Progress::default(),
            )
            .unwrap();
        } else {
            let dst = Arc::new(MemoryDevice::new(size));
            copy(from, &dst, &opts, &Progress::default()).unwrap();
            assert_same(&*src, &dst);
        }
        assert_eq!(
            h.finish(size).unwrap_or_else(|e| panic!("case {i}: {e}")),
            want,
            "case {i}"
        );
    }
    // Not with the backing file's ranges skipped: those are never read.
    let opts = CopyOptions {
        skip_backing: true,
        blkhash: Some(Arc::new(
            BlockHash::new(blkhash::Algorithm::default_algorithm(), 65536).unwrap(),
        )),
        ..Default::default()
    };
    let dst = Arc::new(MemoryDevice::new(size));
    assert!(copy(&*src, &dst, &opts, &Progress::default()).is_err());
}
