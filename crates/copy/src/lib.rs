//! The copy engine behind `convert`: any source device to any destination.
//!
//! Workers (threads, `-m`) take the next piece of the source under a short
//! lock, guided by the source's extents: a range the source reports as zero
//! becomes one zero item (skipped when the destination already reads as
//! zeros, otherwise one write-zeroes), and data is taken in requests of
//! `request_size` bytes. Data is read, scanned for zero runs of at least
//! `min_sparse` bytes (holes are only made where the destination can have
//! them), and written. Reads and writes of different workers overlap; writes
//! may be kept in source order for destinations whose layout depends on it.
//! An incremental copy sees its source through [`changed::OnlyChanged`].

pub mod blkhash;
pub mod changed;
pub mod commit;
mod plan;
pub mod rebase;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use diskit_core::buffer::AlignedBuf;
use diskit_core::sync;
use diskit_core::zero::zero_runs;
use diskit_core::{
    BlockDevice, Completion, CompletionQueue, Error, ReadSink, Request, Result, WriteFlags,
    ZeroFlags,
};

use blkhash::BlockHash;
use plan::{Item, Planner};

/// How to copy.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Zero runs at least this long become holes; 0 writes every byte as data.
    pub min_sparse: u64,
    /// Worker threads (requests in flight).
    pub workers: usize,
    /// Bytes per data request.
    pub request_size: usize,
    /// The destination is known to read as zeros already.
    pub target_is_zero: bool,
    /// Writes must happen in source order (for destinations whose layout
    /// depends on write order, as qemu-img does without -W).
    pub ordered_writes: bool,
    /// Flush the destination at the end.
    pub flush: bool,
    /// Every byte of the destination must end up allocated: zeros are
    /// written with zero requests that may not make holes, and never
    /// skipped.
    pub allocated: bool,
    /// Bytes of data requests in flight per worker at most, where a device
    /// takes requests without waiting.
    pub queue_size: u64,
    /// Requests in flight per worker at most, where a device takes
    /// requests without waiting (NBD); the bytes in flight are bounded
    /// besides.
    pub requests: usize,
    /// Source zero extents count only in whole aligned blocks of this many
    /// bytes (1: any); compressed targets need whole clusters.
    pub zero_alignment: u64,
    /// Leave alone the ranges a layer below the source's top answers: the
    /// destination has the same backing file (`convert -B`). Everything
    /// else, zeros included, is written.
    pub skip_backing: bool,
    /// The destination reads as zeros from this offset on already (a new
    /// image past the end of its backing file, `convert -B`, as qemu-img
    /// knows it): ranges the source says are zeros are left alone there,
    /// `allocated` or not (zeros found inside data are written).
    pub zeros_from: u64,
    /// The blkhash of the source, computed as its data passes (nbdcopy's
    /// `--blkhash`): what is read is hashed where it arrives, zero ranges
    /// by the zero-block shortcut. Every byte must pass, so it cannot
    /// come with `skip_backing`.
    pub blkhash: Option<Arc<BlockHash>>,
}

/// How much of the zero range at `offset` (`len` bytes) must be written:
/// none where the destination reads as zeros already (`skip`), else the
/// part before `zeros_from`.
fn zeros_to_write(skip: bool, zeros_from: u64, offset: u64, len: u64) -> u64 {
    if skip {
        0
    } else {
        zeros_from.saturating_sub(offset).min(len)
    }
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            min_sparse: 4096,
            workers: 8,
            request_size: 2 << 20,
            target_is_zero: false,
            ordered_writes: false,
            flush: false,
            allocated: false,
            queue_size: 8 << 20,
            requests: 64,
            zero_alignment: 1,
            skip_backing: false,
            zeros_from: u64::MAX,
            blkhash: None,
        }
    }
}

/// Progress of a copy, readable from another thread.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    total: AtomicU64,
}

impl Progress {
    /// Bytes of the source dealt with so far, and the total.
    pub fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }

    /// Starts over for an operation of `total` bytes.
    pub fn start(&self, total: u64) {
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }

    /// Counts `n` more bytes as dealt with.
    pub fn advance(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
}

/// What a copy did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CopyStats {
    /// Bytes written as data.
    pub data_bytes: u64,
    /// Bytes written as zeros (write-zeroes requests).
    pub zeroed_bytes: u64,
    /// Bytes skipped because the destination already reads as zeros.
    pub skipped_bytes: u64,
    /// Bytes zeroed up front with fast-zero requests (0 when the
    /// destination could not zero fast, or pre-zeroing was not worth it).
    pub prezeroed_bytes: u64,
}

/// The largest fast-zero request made when pre-zeroing (NBD takes at most
/// 4 GiB - 1 in one request; the client splits larger ones anyway).
const PREZERO_CHUNK: u64 = 1 << 30;
/// How many extents answers pre-zeroing looks at to find a hole in the
/// source (each may be a network round trip).
const SPARSE_PROBES: usize = 16;

/// Whether the source has a range that reads as zeros among its first
/// answers: pre-zeroing pays only for a source with holes.
fn has_holes(src: &dyn BlockDevice, size: u64) -> bool {
    diskit_core::extent::walk(src, 0, size)
        .take(SPARSE_PROBES * 64)
        .map_while(|e| e.ok())
        .any(|e| e.flags.zero)
}

/// Zeroes all of `dst` up to `size` with fast-zero requests, as the NBD
/// fast-zero proposal intends: only when the destination can zero faster
/// than writing. Returns whether the destination now reads as zeros; the
/// first request refused as not fast (ENOTSUP) stops it at once, and the
/// copy then zeroes the holes itself.
fn prezero(dst: &dyn BlockDevice, size: u64) -> Result<bool> {
    let flags = ZeroFlags {
        fast: true,
        may_trim: true,
        fua: false,
    };
    let mut off = 0;
    while off < size {
        let n = (size - off).min(PREZERO_CHUNK);
        match dst.write_zeroes(off, n, flags) {
            Ok(()) => off += n,
            Err(e) if e.kind() == diskit_core::ErrorKind::NotSupported => return Ok(false),
            Err(e) => return Err(e.context(format!("error while zeroing at byte {off}"))),
        }
    }
    Ok(true)
}

/// Copies all of `src` to the start of `dst`, which must be at least as large.
///
/// The destination is shared (an `Arc`) because a source that reads on
/// threads of its own may write the data to it from there.
pub fn copy<D: BlockDevice + ?Sized + 'static>(
    src: &dyn BlockDevice,
    dst_ref: &Arc<D>,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<CopyStats> {
    let dst: &dyn BlockDevice = dst_ref;
    let size = src.size();
    if dst.size() < size {
        return Err(Error::invalid("output file is smaller than input file"));
    }
    if !dst.capabilities().can_write {
        return Err(Error::new(
            diskit_core::ErrorKind::PermissionDenied,
            "destination is read-only",
        ));
    }
    if opts.blkhash.is_some() && opts.skip_backing {
        return Err(Error::invalid(
            "a blkhash needs every byte of the source, which a copy onto the same backing file skips",
        ));
    }
    progress.total.store(size, Ordering::Relaxed);
    let mut opts = opts.clone();
    let mut prezeroed = 0;
    if !opts.target_is_zero
        && !opts.skip_backing
        && !opts.allocated
        && dst.capabilities().can_fast_zero
        && has_holes(src, size)
        && prezero(dst, size)?
    {
        opts.target_is_zero = true;
        prezeroed = size;
    }
    let max_workers = opts.workers.clamp(1, 64);
    let request = opts.request_size.max(512) as u64;
    // A source that takes requests without waiting (NBD, HTTP) reads on
    // threads of its own, and answers extents over the network.
    let reads_on_own_threads = src.queue_depth() > 1;
    let work = if opts.ordered_writes {
        Work::Ordered(Mutex::new(
            Planner::new(size, request)
                .with_zero_alignment(opts.zero_alignment)
                .skipping_backing(opts.skip_backing),
        ))
    } else {
        Work::Chunks {
            next: AtomicU64::new(0),
            chunk: chunk_size(size, request, max_workers, reads_on_own_threads),
        }
    };
    // A source that reads on threads of its own (NBD) hands the data to
    // the destination there, while it is in that thread's cache, when
    // the destination writes before it returns anyway (a file) or drops
    // what it is given (null): each connection then writes in parallel.
    let sink = (!opts.ordered_writes
        && reads_on_own_threads
        && (dst.queue_depth() <= 1 || dst.discards_writes()))
    .then(|| {
        // Data to hash is wanted even where the destination drops it.
        let state = Arc::new(SinkState {
            discards: dst.discards_writes() && opts.blkhash.is_none(),
            ..SinkState::default()
        });
        let sink: Arc<dyn ReadSink> = Arc::new(CopySink {
            dst: dst_ref.clone(),
            blkhash: opts.blkhash.clone(),
            min_sparse: opts.min_sparse,
            skip_zeros: opts.target_is_zero && !opts.allocated,
            allocated: opts.allocated,
            state: state.clone(),
        });
        (sink, state)
    });
    // Writes in source order from one worker: items whose reads come back
    // early wait in the worker for their turn, so that it can keep many
    // reads in flight (from an NBD source, one at a time would wait a
    // round trip for each).
    let reorder = opts.ordered_writes && max_workers == 1;
    // Requests in flight per worker: one where both sides run requests
    // synchronously (more threads are the parallelism there), and where
    // several workers take turns to write in source order; up to the
    // devices' queue depth otherwise, with the bytes in flight bounded.
    // Reads handed to a sink may be queued deeper: a device that reads on
    // its own threads keeps only some on the wire and sends the next from
    // there (the bytes on the wire stay bounded), and the queue covers the
    // worker's pauses (extents queries, its wake-ups).
    let depth = if opts.ordered_writes && !reorder {
        1
    } else {
        // The one worker of a copy in source order keeps a few reads in
        // flight however large they are (RBD's are whole 4 MiB objects):
        // two would leave the source idle while the worker writes.
        let least = if reorder { REORDER_IN_FLIGHT } else { 1 };
        let by_memory = (opts.queue_size / request).max(least) as usize;
        let queued = if sink.is_some() { 4 } else { 1 };
        src.queue_depth()
            .max(dst.queue_depth())
            .min(opts.requests.max(1))
            .min(by_memory * queued)
    };
    let engine = Engine {
        src,
        dst,
        sink: sink.clone(),
        remote_extents: reads_on_own_threads,
        reorder,
        opts: opts.clone(),
        size,
        request,
        work,
        depth,
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        turn: Mutex::new(0),
        turn_changed: Condvar::new(),
        progress,
        stats: Mutex::new(CopyStats::default()),
        max_workers,
        spawned: AtomicUsize::new(1),
        handed: AtomicU64::new(0),
    };
    std::thread::scope(|s| engine.worker(s));
    if let Some(e) = sync::lock(&engine.error).take() {
        return Err(e);
    }
    if opts.flush {
        dst.flush()?;
    }
    let mut stats = engine.stats.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some((_, state)) = sink {
        stats.add(&sync::lock(&state.stats));
    }
    stats.prezeroed_bytes = prezeroed;
    Ok(stats)
}

impl CopyStats {
    /// Adds what another part of the copy did.
    fn add(&mut self, other: &CopyStats) {
        self.data_bytes += other.data_bytes;
        self.zeroed_bytes += other.zeroed_bytes;
        self.skipped_bytes += other.skipped_bytes;
    }
}

/// The parts of `data` (read at `offset`) to write as data or as zeros:
/// `(offset, length, zero)`. With `min_sparse` 0 it is all data; else
/// zero runs of at least `min_sparse` bytes in whole aligned blocks of
/// pow2floor(min_sparse), as qemu-img makes holes.
fn split_runs(data: &[u8], offset: u64, min_sparse: u64) -> Vec<(u64, u64, bool)> {
    if min_sparse == 0 {
        return vec![(offset, data.len() as u64, false)];
    }
    let min = min_sparse as usize;
    let granularity = 1usize << (usize::BITS - 1 - min.leading_zeros());
    zero_runs(data, offset, granularity, min)
        .into_iter()
        .map(|r| (offset + r.start as u64, r.len as u64, r.zero))
        .collect()
}

/// Takes the data of a source's reads in the thread that received them
/// and writes it to the destination there, as a worker would after the
/// read: zero runs become zero requests (or are skipped where the
/// destination reads as zeros already), the rest is written.
struct CopySink<D: ?Sized> {
    dst: Arc<D>,
    /// Where the data is hashed as it passes.
    blkhash: Option<Arc<BlockHash>>,
    min_sparse: u64,
    /// Zeros need not be written.
    skip_zeros: bool,
    /// Zero requests may not make holes.
    allocated: bool,
    state: Arc<SinkState>,
}

/// What a [`CopySink`] did, shared with the engine.
#[derive(Default)]
struct SinkState {
    /// The destination drops what it is given.
    discards: bool,
    stats: Mutex<CopyStats>,
    /// The first write that failed, reported as a write, not as the read
    /// it failed in.
    error: Mutex<Option<Error>>,
}

impl<D: BlockDevice + ?Sized> CopySink<D> {
    /// Zeroes `len` bytes at `offset` of the destination, or skips them
    /// where it reads as zeros already.
    fn write_zeros(&self, offset: u64, len: u64) -> Result<()> {
        let n = zeros_to_write(self.skip_zeros, u64::MAX, offset, len);
        if n < len {
            sync::lock(&self.state.stats).skipped_bytes += len - n;
        }
        if n == 0 {
            return Ok(());
        }
        let flags = ZeroFlags {
            may_trim: !self.allocated,
            ..Default::default()
        };
        self.dst
            .write_zeroes(offset, n, flags)
            .map_err(|e| self.failed(e, offset))?;
        sync::lock(&self.state.stats).zeroed_bytes += n;
        Ok(())
    }

    fn failed(&self, e: Error, offset: u64) -> Error {
        let e = e.context(format!("error while writing at byte {offset}"));
        let told = Error::new(e.kind(), e.to_string());
        let mut slot = sync::lock(&self.state.error);
        if slot.is_none() {
            *slot = Some(e);
        }
        told
    }
}

impl<D: BlockDevice + ?Sized + 'static> ReadSink for CopySink<D> {
    fn data(&self, offset: u64, data: &[u8]) -> Result<()> {
        if let Some(h) = &self.blkhash {
            h.data(offset, data);
        }
        for (at, len, zero) in split_runs(data, offset, self.min_sparse) {
            if zero {
                self.write_zeros(at, len)?;
                continue;
            }
            let from = (at - offset) as usize;
            self.dst
                .write_at(&data[from..from + len as usize], at, WriteFlags::NONE)
                .map_err(|e| self.failed(e, at))?;
            sync::lock(&self.state.stats).data_bytes += len;
        }
        Ok(())
    }

    fn zeros(&self, offset: u64, len: u64) -> Result<()> {
        if let Some(h) = &self.blkhash {
            h.zeros(offset, len);
        }
        self.write_zeros(offset, len)
    }

    fn discards(&self) -> bool {
        self.state.discards
    }
}

/// Reads a worker that writes in source order keeps in flight at least,
/// whatever the bytes in flight (`queue_size`) allow.
const REORDER_IN_FLIGHT: u64 = 8;

/// The largest range a worker owns at a time (as nbdcopy's threads do).
const MAX_CHUNK: u64 = 128 << 20;
/// The largest range a worker owns at a time when the source answers
/// extents over the network: each question is a round trip, asked ahead
/// while the range before is copied; fewer, larger ones keep the copy
/// from waiting for them.
const MAX_REMOTE_CHUNK: u64 = 1 << 30;

/// The smallest range a worker owns: a hole across two ranges costs two
/// zero requests instead of one.
const MIN_CHUNK: u64 = 8 << 20;

/// How much of the source a worker takes at a time: large enough that a
/// worker's extents queries each serve many requests (and few holes are
/// cut in two), small enough that every worker gets several.
fn chunk_size(size: u64, request: u64, workers: usize, remote: bool) -> u64 {
    let per = size.div_ceil(workers as u64 * 4);
    let max = if remote { MAX_REMOTE_CHUNK } else { MAX_CHUNK };
    per.clamp(MIN_CHUNK.max(request), max.max(request))
        .next_multiple_of(request)
}

/// Where workers take their items from.
enum Work {
    /// One planner in source order, shared under a lock: writes must be
    /// made in source order anyway.
    Ordered(Mutex<Planner>),
    /// Ranges of `chunk` bytes, taken in turn; each worker plans its own
    /// range, asking the source for its extents itself.
    Chunks { next: AtomicU64, chunk: u64 },
}

struct Engine<'a> {
    src: &'a dyn BlockDevice,
    dst: &'a dyn BlockDevice,
    /// Where the source hands its reads' data when it reads on threads of
    /// its own: the writes are made there, not by the workers.
    sink: Option<(Arc<dyn ReadSink>, Arc<SinkState>)>,
    /// The source answers extents over the network: the next range's are
    /// asked for ahead.
    remote_extents: bool,
    /// Writes are made in source order by the one worker, which parks the
    /// items that are ready before their turn.
    reorder: bool,
    opts: CopyOptions,
    size: u64,
    /// Bytes per data request.
    request: u64,
    work: Work,
    /// Requests in flight per worker at most.
    depth: usize,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    /// Sequence number of the next item allowed to write (ordered mode).
    turn: Mutex<u64>,
    turn_changed: Condvar,
    progress: &'a Progress,
    stats: Mutex<CopyStats>,
    /// Workers at most (`CopyOptions::workers`).
    max_workers: usize,
    /// Workers started so far: one, then another per [`RAMP_BYTES`] of
    /// I/O handed out.
    spawned: AtomicUsize,
    /// Bytes of the items handed to workers for I/O so far.
    handed: AtomicU64,
}

/// A worker more is started for every this many bytes of I/O handed out:
/// small or sparse copies stay on few threads, whose start-up would cost
/// more than they bring; big ones reach every worker within a few steps.
const RAMP_BYTES: u64 = 8 << 20;
/// Worker buffers grow in steps of this many bytes.
const BUF_STEP: usize = 64 << 10;

/// An item a worker has requests in flight for.
struct InFlight {
    item: Item,
    /// Requests of the item in flight.
    requests: usize,
    /// Its data is being read (the one request in flight is the read).
    reading: bool,
    /// Data runs (offset, length) still to be written from the buffer,
    /// one at a time as the buffer comes back.
    data: VecDeque<(u64, u64)>,
    /// The item's buffer while no request holds it.
    buf: Option<AlignedBuf>,
}

/// One worker's state: its own range, completion queue, items in flight
/// and buffers.
struct Worker<'s> {
    cq: CompletionQueue,
    planner: Option<Planner>,
    /// The next range's planner, asking the source about it meanwhile.
    ahead: Option<std::thread::ScopedJoinHandle<'s, Result<Planner>>>,
    items: HashMap<u64, InFlight>,
    /// Requests in flight.
    requests: usize,
    /// Completions taken from the queue, being handled.
    done: Vec<Completion>,
    /// Items ready to write before their turn, by sequence number, with
    /// their tags ([`Engine::reorder`]).
    parked: BTreeMap<u64, (u64, InFlight)>,
    next_tag: u64,
    /// Buffers not in use.
    pool: Vec<AlignedBuf>,
    /// The largest buffer made so far.
    buf_size: usize,
    stats: CopyStats,
}

impl Worker<'_> {
    /// A buffer of at least `len` bytes: a free one, or a new one. New
    /// buffers grow (doubling up to the request size) as items need them,
    /// not allocated whole at once: a zeroed buffer costs a page fault per
    /// 4 KiB, which made a worker that copies a few 64 KiB clusters pay
    /// for 2 MiB.
    fn buffer(&mut self, len: usize, request: usize) -> Result<AlignedBuf> {
        if let Some(i) = self.pool.iter().position(|b| b.len() >= len) {
            return Ok(self.pool.swap_remove(i));
        }
        let size = len
            .max((self.buf_size * 2).min(request))
            .next_multiple_of(BUF_STEP);
        self.buf_size = self.buf_size.max(size);
        // Smaller free buffers would only be passed over from now on.
        self.pool.retain(|b| b.len() >= size);
        // Mapped: a read handed to a sink may never touch it.
        AlignedBuf::mapped(size)
    }
}

impl Engine<'_> {
    fn worker<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>) {
        let mut w = Worker {
            cq: CompletionQueue::new(),
            planner: None,
            ahead: None,
            done: Vec::new(),
            parked: BTreeMap::new(),
            items: HashMap::new(),
            requests: 0,
            next_tag: 0,
            pool: Vec::new(),
            buf_size: 0,
            stats: CopyStats::default(),
        };
        if let Err(e) = self.run(scope, &mut w) {
            self.fail(e);
        }
        // Requests still in flight after a failure own their buffers and
        // finish on their own; wait for them all the same, so that the
        // devices are quiet when the copy returns.
        while w.requests > 0 {
            w.cq.wait();
            w.requests -= 1;
        }
        sync::lock(&self.stats).add(&w.stats);
    }

    fn run<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>, w: &mut Worker<'s>) -> Result<()> {
        let mut exhausted = false;
        loop {
            // Parked items hold their buffers: they count as in flight.
            while !exhausted
                && w.requests + w.parked.len() < self.depth
                && !self.failed.load(Ordering::Relaxed)
            {
                let Some(item) = self.next_item(scope, w)? else {
                    exhausted = true;
                    break;
                };
                if item.skip {
                    self.progress.advance(item.len);
                    continue;
                }
                self.ramp(scope, item.len);
                self.start(w, item)?;
                self.resume_parked(w)?;
            }
            if self.failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            if w.requests == 0 {
                // Every item before a parked one has finished by now.
                return match w.parked.first_key_value() {
                    None => Ok(()),
                    Some((seq, _)) => Err(Error::io(format!(
                        "copy stalled: item {seq} waits for a turn that never comes"
                    ))),
                };
            }
            // Reads handed to a sink keep the source busy on their own
            // (it sends queued reads as replies come): the worker wakes
            // when a quarter of its queue is done, not at each read.
            let batch = if self.sink.is_some() && !exhausted {
                (self.depth / 4).clamp(1, w.requests)
            } else {
                1
            };
            let mut done = std::mem::take(&mut w.done);
            w.cq.wait_many(batch, &mut done);
            w.requests -= done.len();
            let mut result = Ok(());
            for c in done.drain(..) {
                // After an error the rest are only counted.
                if result.is_ok() {
                    result = self.complete(w, c);
                }
            }
            w.done = done;
            result?;
            self.resume_parked(w)?;
        }
    }

    /// Whether an item ready to write must wait in the worker for its turn.
    fn must_park(&self, seq: u64) -> bool {
        self.reorder && *sync::lock(&self.turn) != seq
    }

    /// Writes the parked items whose turn has come, in order.
    fn resume_parked(&self, w: &mut Worker<'_>) -> Result<()> {
        if !self.reorder {
            return Ok(());
        }
        loop {
            let turn = *sync::lock(&self.turn);
            let Some((tag, mut f)) = w.parked.remove(&turn) else {
                break;
            };
            if f.item.zero {
                self.zero_item(w, tag, &mut f);
            } else {
                self.plan_writes(w, tag, &mut f)?;
                self.write_next(w, tag, &mut f);
            }
            self.settle(w, tag, f);
        }
        Ok(())
    }

    /// Starts another worker when enough I/O has been handed out.
    fn ramp<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>, len: u64) {
        let spawned = self.spawned.load(Ordering::Acquire);
        let handed = self.handed.fetch_add(len, Ordering::AcqRel) + len;
        if handed >= spawned as u64 * RAMP_BYTES
            && spawned < self.max_workers
            && self
                .spawned
                .compare_exchange(spawned, spawned + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            scope.spawn(move || self.worker(scope));
        }
    }

    /// The worker's next item: from the shared planner, or from its own
    /// range, taking a new range when that one is done.
    fn next_item<'s>(
        &'s self,
        scope: &'s std::thread::Scope<'s, '_>,
        w: &mut Worker<'s>,
    ) -> Result<Option<Item>> {
        match &self.work {
            Work::Ordered(planner) => sync::lock(planner).next(self.src),
            Work::Chunks { next, chunk } => loop {
                if let Some(p) = w.planner.as_mut() {
                    if let Some(item) = p.next(self.src)? {
                        return Ok(Some(item));
                    }
                    w.planner = None;
                }
                let planner = match w.ahead.take() {
                    Some(h) => h
                        .join()
                        .map_err(|_| Error::io("asking the source for its extents failed"))??,
                    None => match self.take_range(next, *chunk) {
                        Some(p) => p,
                        None => return Ok(None),
                    },
                };
                w.planner = Some(planner);
                // A source that answers extents over the network is asked
                // about the next range while this one is copied.
                if self.remote_extents
                    && let Some(p) = self.take_range(next, *chunk)
                {
                    w.ahead = Some(scope.spawn(move || p.prefilled(self.src)));
                }
            },
        }
    }

    /// The planner of the next range not taken yet, if any is left.
    fn take_range(&self, next: &AtomicU64, chunk: u64) -> Option<Planner> {
        let start = next.fetch_add(chunk, Ordering::Relaxed);
        (start < self.size).then(|| {
            Planner::range(self.size, start, start + chunk, self.request)
                .with_zero_alignment(self.opts.zero_alignment)
                .skipping_backing(self.opts.skip_backing)
        })
    }

    fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        let mut slot = sync::lock(&self.error);
        if slot.is_none() {
            *slot = Some(e);
        }
        // Wake ordered writers waiting for a turn that will never come.
        self.turn_changed.notify_all();
    }

    /// Whether zeros are left alone: the destination reads as zeros
    /// already, and need not be allocated.
    fn skip_zeros(&self) -> bool {
        self.opts.target_is_zero && !self.opts.allocated
    }

    /// Starts an item: a read of its data, or the zeroing of its range.
    fn start(&self, w: &mut Worker<'_>, item: Item) -> Result<()> {
        let tag = w.next_tag;
        w.next_tag += 1;
        let mut f = InFlight {
            item,
            requests: 0,
            reading: !item.zero,
            data: VecDeque::new(),
            buf: None,
        };
        if item.zero {
            if let Some(h) = &self.opts.blkhash {
                h.zeros(item.offset, item.len);
            }
            if self.must_park(item.seq) {
                w.parked.insert(item.seq, (tag, f));
                return Ok(());
            }
            self.wait_turn(item.seq)?;
            self.zero_item(w, tag, &mut f);
        } else {
            let buf = w.buffer(item.len as usize, self.opts.request_size)?;
            f.requests += 1;
            w.requests += 1;
            let (offset, len) = (item.offset, item.len as usize);
            let req = match &self.sink {
                Some((sink, state)) => {
                    if state.discards {
                        w.stats.data_bytes += item.len;
                    }
                    Request::ReadTo {
                        offset,
                        buf,
                        len,
                        sink: sink.clone(),
                    }
                }
                None => Request::Read { offset, buf, len },
            };
            self.src.submit(tag, req, &w.cq);
        }
        self.settle(w, tag, f);
        Ok(())
    }

    /// Zeroes a zero item's range, or leaves it where the destination
    /// reads as zeros already.
    fn zero_item(&self, w: &mut Worker<'_>, tag: u64, f: &mut InFlight) {
        let item = f.item;
        self.zero_or_skip(w, tag, f, item.offset, item.len, self.opts.zeros_from);
    }

    /// Zeroes what of a zero range must be written (nothing from
    /// `zeros_from` on), and skips the rest.
    fn zero_or_skip(
        &self,
        w: &mut Worker<'_>,
        tag: u64,
        f: &mut InFlight,
        offset: u64,
        len: u64,
        zeros_from: u64,
    ) {
        let n = zeros_to_write(self.skip_zeros(), zeros_from, offset, len);
        w.stats.skipped_bytes += len - n;
        if n > 0 {
            self.zero(w, tag, f, offset, n);
        }
    }

    fn zero(&self, w: &mut Worker<'_>, tag: u64, f: &mut InFlight, offset: u64, len: u64) {
        let flags = ZeroFlags {
            may_trim: !self.opts.allocated,
            ..Default::default()
        };
        f.requests += 1;
        w.requests += 1;
        w.stats.zeroed_bytes += len;
        self.dst
            .submit(tag, Request::Zero { offset, len, flags }, &w.cq);
    }

    /// Sends the item's next data run from its buffer, if it has one and
    /// the buffer is free.
    fn write_next(&self, w: &mut Worker<'_>, tag: u64, f: &mut InFlight) {
        if let (Some(_), Some(&(offset, len))) = (f.buf.as_ref(), f.data.front()) {
            f.data.pop_front();
            let buf = f.buf.take().expect("checked above");
            let start = (offset - f.item.offset) as usize;
            f.requests += 1;
            w.requests += 1;
            w.stats.data_bytes += len;
            if f.data.is_empty() && self.turn_ends_when_placed() {
                // The item's last write: the next item's turn begins once
                // this one's bytes have their place, and the bytes are
                // written meanwhile (the device writes synchronously: as
                // its submit would, here).
                let seq = f.item.seq;
                let range = start..start + len as usize;
                let result =
                    self.dst
                        .write_placed(&buf[range], offset, WriteFlags::NONE, &mut || {
                            self.end_turn(seq)
                        });
                w.cq.push(Completion {
                    tag,
                    result,
                    buf: Some(buf),
                });
                return;
            }
            self.dst.submit(
                tag,
                Request::Write {
                    offset,
                    buf,
                    range: start..start + len as usize,
                    flags: WriteFlags::NONE,
                },
                &w.cq,
            );
        }
    }

    /// Keeps an item while it has requests in flight (their completions
    /// may be queued already) or data still to write, or finishes it.
    fn settle(&self, w: &mut Worker<'_>, tag: u64, f: InFlight) {
        if f.requests > 0 || !f.data.is_empty() {
            w.items.insert(tag, f);
        } else {
            self.finish(w, f);
        }
    }

    fn finish(&self, w: &mut Worker<'_>, mut f: InFlight) {
        if let Some(b) = f.buf.take() {
            w.pool.push(b);
        }
        self.end_turn(f.item.seq);
        self.progress.advance(f.item.len);
    }

    /// Handles one completion of the worker's requests.
    fn complete(&self, w: &mut Worker<'_>, c: Completion) -> Result<()> {
        let mut f = w
            .items
            .remove(&c.tag)
            .expect("completions answer items in flight");
        f.requests -= 1;
        let at = f.item.offset;
        let was_read = std::mem::replace(&mut f.reading, false);
        if let Some(b) = c.buf {
            f.buf = Some(b);
        }
        if let Err(e) = c.result {
            if let Some(b) = f.buf.take() {
                w.pool.push(b);
            }
            // A write the sink made in the read's thread failed: that is
            // the error, with its own offset.
            if let Some(e) = self
                .sink
                .as_ref()
                .and_then(|(_, s)| sync::lock(&s.error).take())
            {
                return Err(e);
            }
            let what = if was_read { "reading" } else { "writing" };
            return Err(e.context(format!("error while {what} at byte {at}")));
        }
        if was_read && self.sink.is_none() {
            if let (Some(h), Some(buf)) = (&self.opts.blkhash, &f.buf) {
                h.data(f.item.offset, &buf[..f.item.len as usize]);
            }
            if self.must_park(f.item.seq) {
                w.parked.insert(f.item.seq, (c.tag, f));
                return Ok(());
            }
            self.plan_writes(w, c.tag, &mut f)?;
        }
        self.write_next(w, c.tag, &mut f);
        self.settle(w, c.tag, f);
        Ok(())
    }

    /// After an item's read: finds its zero runs, zeroes (or skips) them
    /// and queues its data runs.
    fn plan_writes(&self, w: &mut Worker<'_>, tag: u64, f: &mut InFlight) -> Result<()> {
        let item = f.item;
        let data = &f.buf.as_ref().expect("a read gives its buffer back")[..item.len as usize];
        let runs = split_runs(data, item.offset, self.opts.min_sparse);
        if self.opts.ordered_writes && !self.reorder {
            // Workers take turns to write: what can be done of the writes
            // before the turn (compressing) is done now, in parallel.
            for &(offset, len, zero) in &runs {
                if !zero {
                    let from = (offset - item.offset) as usize;
                    self.dst
                        .prepare_write(&data[from..from + len as usize], offset);
                }
            }
        }
        self.wait_turn(item.seq)?;
        for (offset, len, zero) in runs {
            if !zero {
                f.data.push_back((offset, len));
            } else {
                // Zeros inside data are written wherever they are.
                self.zero_or_skip(w, tag, f, offset, len, u64::MAX);
            }
        }
        Ok(())
    }

    fn wait_turn(&self, seq: u64) -> Result<()> {
        if !self.opts.ordered_writes {
            return Ok(());
        }
        let mut turn = sync::lock(&self.turn);
        while *turn != seq {
            if self.failed.load(Ordering::Relaxed) {
                return Err(Error::io("copy aborted"));
            }
            turn = self
                .turn_changed
                .wait(turn)
                .unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }

    /// Whether workers take turns only to place their writes: the
    /// destination writes synchronously and says when a write's bytes
    /// have their place ([`BlockDevice::write_placed`]), so a layout in
    /// source order does not keep the data writes one at a time.
    fn turn_ends_when_placed(&self) -> bool {
        self.opts.ordered_writes && !self.reorder && self.dst.queue_depth() <= 1
    }

    /// Ends item `seq`'s turn (once: an item whose last write was placed
    /// has ended it already, and a later turn may have begun since).
    fn end_turn(&self, seq: u64) {
        if self.opts.ordered_writes {
            let mut turn = sync::lock(&self.turn);
            if *turn <= seq {
                *turn = seq + 1;
                self.turn_changed.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests;
