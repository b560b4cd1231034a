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

pub mod commit;
mod plan;
pub mod rebase;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use diskit_core::buffer::AlignedBuf;
use diskit_core::sync;
use diskit_core::zero::zero_runs;
use diskit_core::{BlockDevice, Error, Result, WriteFlags, ZeroFlags};

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
    /// Source zero extents count only in whole aligned blocks of this many
    /// bytes (1: any); compressed targets need whole clusters.
    pub zero_alignment: u64,
    /// Leave alone the ranges a layer below the source's top answers: the
    /// destination has the same backing file (`convert -B`). Everything
    /// else, zeros included, is written.
    pub skip_backing: bool,
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
            zero_alignment: 1,
            skip_backing: false,
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
pub fn copy(
    src: &dyn BlockDevice,
    dst: &dyn BlockDevice,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<CopyStats> {
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
    progress.total.store(size, Ordering::Relaxed);
    let mut opts = opts.clone();
    let mut prezeroed = 0;
    if !opts.target_is_zero
        && !opts.skip_backing
        && opts.min_sparse != 0
        && dst.capabilities().can_fast_zero
        && has_holes(src, size)
        && prezero(dst, size)?
    {
        opts.target_is_zero = true;
        prezeroed = size;
    }
    let engine = Engine {
        src,
        dst,
        opts: opts.clone(),
        planner: Mutex::new(
            Planner::new(size, opts.request_size as u64)
                .with_zero_alignment(opts.zero_alignment)
                .skipping_backing(opts.skip_backing),
        ),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        turn: Mutex::new(0),
        turn_changed: Condvar::new(),
        progress,
        stats: Mutex::new(CopyStats::default()),
        max_workers: opts.workers.clamp(1, 64),
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
    stats.prezeroed_bytes = prezeroed;
    Ok(stats)
}

struct Engine<'a> {
    src: &'a dyn BlockDevice,
    dst: &'a dyn BlockDevice,
    opts: CopyOptions,
    planner: Mutex<Planner>,
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

impl Engine<'_> {
    fn worker<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>) {
        let mut buf: Option<AlignedBuf> = None;
        while !self.failed.load(Ordering::Relaxed) {
            let item = {
                let mut planner = sync::lock(&self.planner);
                match planner.next(self.src) {
                    Ok(Some(item)) => item,
                    Ok(None) => return,
                    Err(e) => return self.fail(e),
                }
            };
            if item.skip {
                self.progress.done.fetch_add(item.len, Ordering::Relaxed);
                continue;
            }
            let spawned = self.spawned.load(Ordering::Acquire);
            let handed = self.handed.fetch_add(item.len, Ordering::AcqRel) + item.len;
            if handed >= spawned as u64 * RAMP_BYTES
                && spawned < self.max_workers
                && self
                    .spawned
                    .compare_exchange(spawned, spawned + 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                scope.spawn(move || self.worker(scope));
            }
            let result = self.process(&item, &mut buf);
            if let Err(e) = result {
                return self.fail(e);
            }
            self.progress.done.fetch_add(item.len, Ordering::Relaxed);
        }
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

    fn process(&self, item: &Item, buf: &mut Option<AlignedBuf>) -> Result<()> {
        let mut stats = CopyStats::default();
        let mut writes: Vec<(u64, u64, bool)> = Vec::new(); // (offset, len, zero)
        if item.zero {
            writes.push((item.offset, item.len, true));
        } else {
            let want = item.len as usize;
            if buf.as_ref().is_none_or(|b| b.len() < want) {
                // Grown as items need it (doubling, up to the request
                // size), not allocated whole at once: a zeroed buffer costs
                // a page fault per 4 KiB, which made a worker that copies a
                // few 64 KiB clusters pay for 2 MiB.
                let old = buf.as_ref().map_or(0, |b| b.len());
                let size = want
                    .max((old * 2).min(self.opts.request_size))
                    .next_multiple_of(BUF_STEP);
                *buf = Some(AlignedBuf::new(size, 4096)?);
            }
            let data = &mut buf.as_mut().expect("allocated above")[..item.len as usize];
            self.src
                .read_at(data, item.offset)
                .map_err(|e| e.context(format!("error while reading at byte {}", item.offset)))?;
            if self.opts.min_sparse == 0 {
                writes.push((item.offset, item.len, false));
            } else {
                // Holes are whole blocks of pow2floor(min_sparse) bytes,
                // aligned on the device, as qemu-img makes them.
                let min = self.opts.min_sparse as usize;
                let granularity = 1usize << (usize::BITS - 1 - min.leading_zeros());
                for r in zero_runs(data, item.offset, granularity, min) {
                    writes.push((item.offset + r.start as u64, r.len as u64, r.zero));
                }
            }
        }
        self.wait_turn(item.seq)?;
        let result = self.write_all(item, buf, &writes, &mut stats);
        self.end_turn(item.seq);
        result?;
        let mut total = sync::lock(&self.stats);
        total.data_bytes += stats.data_bytes;
        total.zeroed_bytes += stats.zeroed_bytes;
        total.skipped_bytes += stats.skipped_bytes;
        Ok(())
    }

    fn write_all(
        &self,
        item: &Item,
        buf: &Option<AlignedBuf>,
        writes: &[(u64, u64, bool)],
        stats: &mut CopyStats,
    ) -> Result<()> {
        for &(offset, len, zero) in writes {
            let at = |e: Error| e.context(format!("error while writing at byte {offset}"));
            // With min_sparse 0 every byte must end up allocated, zeros included.
            if zero && self.opts.target_is_zero && self.opts.min_sparse != 0 {
                stats.skipped_bytes += len;
            } else if zero {
                // With -S 0 zeros must end up allocated, so no trimming.
                let flags = ZeroFlags {
                    may_trim: self.opts.min_sparse != 0,
                    ..Default::default()
                };
                self.dst.write_zeroes(offset, len, flags).map_err(at)?;
                stats.zeroed_bytes += len;
            } else {
                let b = buf.as_ref().expect("data items have a buffer");
                let start = (offset - item.offset) as usize;
                self.dst
                    .write_at(&b[start..start + len as usize], offset, WriteFlags::NONE)
                    .map_err(at)?;
                stats.data_bytes += len;
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

    fn end_turn(&self, seq: u64) {
        if self.opts.ordered_writes {
            let mut turn = sync::lock(&self.turn);
            *turn = seq + 1;
            self.turn_changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests;
