//! The transmission phase of one connection, served as nbdkit does: a pool
//! of workers takes turns reading one request each (under the reader
//! lock), executes it at once on the same thread, and writes its reply
//! under the writer lock. Replies go out as requests complete, out of
//! order, and no request is handed from thread to thread.

use std::io::{self, BufReader, BufWriter, IoSlice, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::budget::Budget;
use super::export::MetaContext;
use super::handshake::Negotiated;
use super::lock;
use super::ops::{self, Conn, Part, Reply};
use super::splice::ZeroCopy;
use super::stats::Stats;
use super::transport::Halves;
use crate::proto::consts::{
    CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN, EINVAL, TFLAG_BLOCK_STATUS_PAYLOAD,
};
use crate::proto::request::{BlockStatusPayload, Limits, Rejection, RequestHeader, validate};
use crate::proto::{Command, ReplyStyle};

/// A payload larger than the maximum payload but at most this long is read
/// and thrown away (the request fails with EINVAL and the connection
/// lives on); a longer one ends the connection.
pub const MAX_DISCARD: u64 = 128 << 20;
/// What every request in flight counts against the budget besides its data.
const REQUEST_OVERHEAD: u64 = 1024;
/// A worker keeps its buffer between requests up to this size: the
/// largest request clients commonly send (4 MiB: nbdcopy asks for the
/// preferred block size, an RBD or S3 object's size), with room for its
/// headers, so that such a stream does not allocate and clear a buffer
/// for every request; a bigger one is freed once the reply is sent.
const KEEP_BUF: usize = (4 << 20) + (64 << 10);

/// Requests one worker runs in a row while holding the reader.
const MAX_BATCH: usize = 64;
/// Reads and writes up to this long may run in a row (see [`Shared::cheap`]).
const CHEAP_LEN: u64 = 64 << 10;
/// Requests taking less than this (on average, recently) are cheap: about
/// what handing one to another thread costs, several times over.
const CHEAP_NS: u64 = 20_000;

/// A running average of how long requests take to execute.
#[derive(Default)]
struct Cost {
    /// Nanoseconds, an exponentially weighted average (weight 1/8).
    avg_ns: AtomicU64,
}

impl Cost {
    fn note(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let old = self.avg_ns.load(Ordering::Relaxed);
        // Races lose a sample now and then, which an average can spare.
        let new = old - old / 8 + ns / 8;
        self.avg_ns.store(new, Ordering::Relaxed);
    }

    fn is_cheap(&self) -> bool {
        self.avg_ns.load(Ordering::Relaxed) < CHEAP_NS
    }
}

/// Whether `buffered` holds a whole request (header and payload), so that
/// reading it needs no system call. A header that does not parse counts:
/// the reader reports it.
fn request_buffered(buffered: &[u8], extended: bool) -> bool {
    let hlen = RequestHeader::wire_len(extended);
    if buffered.len() < hlen {
        return false;
    }
    match RequestHeader::parse(&buffered[..hlen], extended) {
        Ok(h) => (buffered.len() - hlen) as u64 >= h.payload_len(),
        Err(_) => true,
    }
}

/// How the transmission phase ended.
#[derive(Debug)]
pub enum End {
    /// The client sent NBD_CMD_DISC.
    Disconnect,
    /// The client closed the connection between requests.
    Closed,
    /// The client broke the protocol (bad magic, oversized payload).
    Protocol(String),
    /// The stream failed.
    Io(io::Error),
    /// A layer of the export asked for the connection to close (see
    /// [`diskit_core::Hangup`]).
    HungUp,
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Disconnect => f.write_str("client disconnected"),
            End::Closed => f.write_str("client closed the connection"),
            End::Protocol(m) => write!(f, "protocol violation: {m}"),
            End::Io(e) => write!(f, "I/O error: {e}"),
            End::HungUp => f.write_str("closed at the export's request"),
        }
    }
}

/// Tunables of the transmission phase.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Requests executed at once per connection (0 counts as 1): the
    /// connection's thread and `threads - 1` more.
    pub threads: usize,
    /// Bytes of request and reply data in flight per connection.
    pub max_in_flight: u64,
}

/// A request read off the wire and ready to execute; its payload, if any,
/// is in the worker's buffer.
struct Job {
    cookie: u64,
    offset: u64,
    command: u16,
    cmd: Command,
    payload_len: usize,
    taken: u64,
}

/// What the next turn at the reader gave a worker.
enum Turn {
    /// A request to execute.
    Job(Job),
    /// A request refused at validation, to answer.
    Refused(Reply, u16),
    /// The connection is over for readers.
    End(End),
}

struct Shared<'a> {
    conn: Conn,
    limits: Limits,
    reader: Mutex<BufReader<Box<dyn Read + Send>>>,
    /// Set once a worker has read the end of the request stream: the
    /// others finish what they hold and stop.
    stopped: AtomicBool,
    end: Mutex<Option<End>>,
    writer: Mutex<BufWriter<Box<dyn Write + Send>>>,
    /// The socket under `writer`, for zero-copy reads (plain sockets only).
    splice_to: Option<OwnedFd>,
    /// Replies waiting for the writer lock.
    waiting: AtomicUsize,
    broken: AtomicBool,
    shutdown: &'a (dyn Fn() + Send + Sync),
    /// Raised by a layer of the export: the connection closes.
    hangup: diskit_core::Hangup,
    budget: Budget,
    conn_stats: &'a Stats,
    cost: Cost,
}

impl Shared<'_> {
    /// Writes a reply. With `hold`, the bytes may wait in the buffer for
    /// the reply that the caller is about to send next.
    fn send(&self, reply: &Reply, buf: &[u8], zc: &mut ZeroCopy, hold: bool) {
        if self.broken.load(Ordering::Relaxed) {
            zc.reset();
            return;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let mut w = lock(&self.writer);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        let result = (|| {
            // One vectored write per run of parts in memory: a reply bigger
            // than the buffer goes out in one system call, headers and data
            // together, so that the client is woken once per reply, not
            // once for the header and again for the data.
            let mut parts = reply.parts.as_slice();
            while !parts.is_empty() {
                let n = parts
                    .iter()
                    .position(|p| matches!(p, Part::Piped(_)))
                    .unwrap_or(parts.len());
                let mut slices: Vec<IoSlice<'_>> = parts[..n]
                    .iter()
                    .map(|p| match p {
                        Part::Bytes(b) => IoSlice::new(b),
                        Part::Data(r) => IoSlice::new(&buf[r.clone()]),
                        Part::Lent(l) => IoSlice::new(l.bytes()),
                        Part::Piped(_) => unreachable!("split off above"),
                    })
                    .collect();
                write_all_vectored(&mut *w, &mut slices)?;
                if let Some(Part::Piped(len)) = parts.get(n) {
                    // What is buffered goes first, then the pipe's pages.
                    w.flush()?;
                    let (Some(sock), Some(pipe)) = (&self.splice_to, zc.pipe()) else {
                        return Err(io::Error::other("spliced reply without a pipe"));
                    };
                    pipe.drain(sock.as_fd(), *len)?;
                    parts = &parts[n + 1..];
                } else {
                    parts = &parts[n..];
                }
            }
            // A reply waiting for the lock flushes this one with its own:
            // one syscall for a burst of small replies. The last always
            // flushes.
            if !hold && self.waiting.load(Ordering::Acquire) == 0 {
                w.flush()?;
            }
            Ok::<(), io::Error>(())
        })();
        if result.is_err() {
            zc.reset();
            // The client is gone: stop the readers too. Requests already
            // received still run (their writes must land).
            self.broken.store(true, Ordering::Relaxed);
            (self.shutdown)();
        }
    }

    /// Sends whatever replies wait in the buffer.
    fn flush(&self) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        if lock(&self.writer).flush().is_err() {
            self.broken.store(true, Ordering::Relaxed);
            (self.shutdown)();
        }
    }

    fn record(&self, command: u16, reply: &Reply, read: u64, written: u64) {
        // Bytes served to reads count whole, whether they went as data or
        // as hole chunks.
        let read = if reply.ok { read } else { 0 };
        self.conn_stats.record(command, reply.ok, read, written);
        self.conn
            .export
            .stats()
            .record(command, reply.ok, read, written);
    }

    fn execute(&self, job: Job, buf: &mut Vec<u8>, zc: &mut ZeroCopy, hold: bool) {
        let start = Instant::now();
        let written = if matches!(job.cmd, Command::Write { .. }) {
            job.payload_len as u64
        } else {
            0
        };
        let read = match job.cmd {
            Command::Read { len, .. } => u64::from(len),
            _ => 0,
        };
        let reply = ops::execute(
            &self.conn,
            job.cookie,
            job.offset,
            job.cmd,
            buf,
            job.payload_len,
            self.splice_to.is_some().then_some(&mut *zc),
        );
        self.cost.note(start.elapsed());
        self.record(job.command, &reply, read, written);
        self.send(&reply, buf, zc, hold);
        drop(reply);
        self.budget.release(job.taken);
    }

    /// Whether `job` may run while its worker holds the reader: a small
    /// request of a kind that is quick on this device so far (flushes and
    /// FUA writes wait for the disk; big transfers are worth a thread).
    fn cheap(&self, job: &Job) -> bool {
        let small = |len: u32| u64::from(len) <= CHEAP_LEN;
        let kind = match job.cmd {
            Command::Read { len, .. } => small(len),
            Command::Write { len, fua, .. } => small(len) && !fua,
            Command::BlockStatus { .. } | Command::Cache { .. } => true,
            Command::Trim { fua, .. } | Command::WriteZeroes { fua, .. } => !fua,
            Command::Flush | Command::Disconnect => false,
        };
        kind && self.cost.is_cheap()
    }

    /// One worker: takes turns at the reader until the request stream ends.
    /// Closes the connection a layer asked to close, once the replies so
    /// far are out: the other workers, waiting for a request, wake.
    fn hang_up(&self) {
        self.flush();
        self.stopped.store(true, Ordering::Release);
        lock(&self.end).get_or_insert(End::HungUp);
        (self.shutdown)();
    }

    fn work(&self) {
        let mut buf = Vec::new();
        let mut zc = ZeroCopy::default();
        loop {
            let turn = {
                let mut reader = lock(&self.reader);
                if self.stopped.load(Ordering::Acquire) {
                    return;
                }
                let mut turn = next_request(&mut *reader, self, &mut buf);
                // A cheap request runs here, the reader lock held, and its
                // worker reads on: handing the next request to another
                // thread would cost more (a wakeup, a context switch) than
                // running them in turn. While more requests are buffered
                // the replies wait, to go out together.
                let mut batch = 0;
                let mut cheap = matches!(&turn, Turn::Job(job) if self.cheap(job));
                while batch < MAX_BATCH && cheap {
                    let more = request_buffered(reader.buffer(), self.limits.extended);
                    let Turn::Job(job) = turn else { unreachable!() };
                    self.execute(job, &mut buf, &mut zc, more);
                    batch += 1;
                    // A layer asked to close the connection: no request
                    // after this one is read.
                    if self.hangup.raised() {
                        self.hang_up();
                        return;
                    }
                    turn = next_request(&mut *reader, self, &mut buf);
                    cheap = matches!(&turn, Turn::Job(job) if self.cheap(job));
                }
                // The batch's replies wait for the next one only if that
                // one is quick too.
                if batch > 0 && !cheap {
                    self.flush();
                }
                if matches!(turn, Turn::End(_)) {
                    self.stopped.store(true, Ordering::Release);
                }
                turn
            };
            match turn {
                Turn::Job(job) => self.execute(job, &mut buf, &mut zc, false),
                Turn::Refused(reply, command) => {
                    self.record(command, &reply, 0, 0);
                    self.send(&reply, &[], &mut zc, false);
                }
                Turn::End(end) => {
                    *lock(&self.end) = Some(end);
                    return;
                }
            }
            if self.hangup.raised() {
                self.hang_up();
                return;
            }
            if buf.len() > KEEP_BUF {
                buf = Vec::new();
            }
        }
    }
}

/// Writes every byte of `slices`, vectored (`Write::write_all_vectored` is
/// not stable yet).
fn write_all_vectored(w: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and discards `n` bytes.
fn discard(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on a clean end of stream
/// before the first byte.
fn read_header(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Serves requests until the client disconnects or breaks the protocol.
/// Every request already received is executed and answered before this
/// returns, whatever ended the connection.
pub fn run(neg: Negotiated, halves: Halves, tuning: Tuning, conn_stats: &Stats) -> End {
    let export = neg.export.clone();
    let style = if neg.extended {
        ReplyStyle::Extended
    } else if neg.structured {
        ReplyStyle::Structured
    } else {
        ReplyStyle::Simple
    };
    let bs = export.block_size_of(&*neg.device);
    let limits = Limits {
        size: neg.device.size(),
        tflags: neg.tflags,
        min_block: bs.minimum,
        max_payload: export.max_payload_of(&*neg.device),
        structured: neg.structured,
        extended: neg.extended,
        meta_contexts: !neg.contexts.is_empty(),
    };
    let contexts: Vec<MetaContext> = neg.contexts;
    let Halves {
        reader,
        writer,
        shutdown,
        splice_to,
    } = halves;
    let shared = Shared {
        conn: Conn {
            export,
            device: neg.device,
            style,
            contexts,
        },
        limits,
        reader: Mutex::new(BufReader::with_capacity(256 * 1024, reader)),
        stopped: AtomicBool::new(false),
        end: Mutex::new(None),
        writer: Mutex::new(BufWriter::with_capacity(256 * 1024, writer)),
        splice_to,
        waiting: AtomicUsize::new(0),
        broken: AtomicBool::new(false),
        shutdown: &*shutdown,
        hangup: neg.hangup.clone(),
        budget: Budget::new(tuning.max_in_flight.max(u64::from(limits.max_payload))),
        conn_stats,
        cost: Cost::default(),
    };

    std::thread::scope(|s| {
        for _ in 1..tuning.threads.max(1) {
            let shared = &shared;
            s.spawn(move || shared.work());
        }
        shared.work();
    });
    let _ = lock(&shared.writer).flush();
    (shared.shutdown)();
    lock(&shared.end)
        .take()
        .unwrap_or_else(|| End::Io(io::Error::other("connection ended without a cause")))
}

/// A BLOCK_STATUS request with a payload (NBD_CMD_FLAG_PAYLOAD_LEN): reads
/// the payload into `buf` (or skips one too short or too long to be
/// one), checks it against the connection's contexts, and validates the
/// request with the effect length it gives. Refusals are EINVAL, as
/// qemu-nbd's.
fn status_with_payload(
    reader: &mut impl Read,
    h: &RequestHeader,
    shared: &Shared<'_>,
    buf: &mut Vec<u8>,
) -> io::Result<Result<Command, Rejection>> {
    let ids: Vec<u32> = shared.conn.contexts.iter().map(|c| c.id()).collect();
    if !BlockStatusPayload::plausible_len(h.length, ids.len()) {
        discard(reader, h.length)?;
        return Ok(Err(Rejection {
            error: EINVAL,
            message: format!("block status payload of {} bytes", h.length),
        }));
    }
    // At most 8 bytes and 4 per context: small.
    let len = h.length as usize;
    reader.read_exact(ops::request_buf(buf, len))?;
    Ok(BlockStatusPayload::parse(&buf[..len], &ids).and_then(|p| {
        let effect = RequestHeader {
            length: p.length,
            flags: h.flags & !CMD_FLAG_PAYLOAD_LEN,
            ..*h
        };
        validate(&effect, &shared.limits)
    }))
}

/// Reads the next request: its header, and its payload into `buf`.
fn next_request(reader: &mut impl Read, shared: &Shared<'_>, buf: &mut Vec<u8>) -> Turn {
    let limits = &shared.limits;
    let hlen = RequestHeader::wire_len(limits.extended);
    let mut hbuf = [0u8; 32];
    match read_header(reader, &mut hbuf[..hlen]) {
        Ok(true) => {}
        Ok(false) => return Turn::End(End::Closed),
        Err(e) if shared.broken.load(Ordering::Relaxed) => {
            return Turn::End(End::Io(io::Error::new(e.kind(), "client went away")));
        }
        Err(e) => return Turn::End(End::Io(e)),
    }
    let h = match RequestHeader::parse(&hbuf[..hlen], limits.extended) {
        Ok(h) => h,
        Err(e) => return Turn::End(End::Protocol(format!("request header: {e}"))),
    };
    let plen = h.payload_len();
    if plen > u64::from(limits.max_payload) && (limits.extended || plen > MAX_DISCARD) {
        return Turn::End(End::Protocol(format!("request payload of {plen} bytes")));
    }
    // A BLOCK_STATUS payload is read (or skipped) first: it holds the
    // length the request is validated with.
    let (verdict, unread) = if limits.extended
        && h.command == CMD_BLOCK_STATUS
        && h.flags & CMD_FLAG_PAYLOAD_LEN != 0
        && limits.tflags & TFLAG_BLOCK_STATUS_PAYLOAD != 0
    {
        match status_with_payload(reader, &h, shared, buf) {
            Ok(v) => (v, 0),
            Err(e) => return Turn::End(End::Io(e)),
        }
    } else {
        (validate(&h, limits), plen)
    };
    match verdict {
        Ok(Command::Disconnect) => match discard(reader, plen) {
            Ok(()) => Turn::End(End::Disconnect),
            Err(e) => Turn::End(End::Io(e)),
        },
        Ok(cmd) => {
            let data = match cmd {
                Command::Read { len, .. } | Command::Write { len, .. } => u64::from(len),
                _ => 0,
            };
            let taken = shared.budget.acquire(REQUEST_OVERHEAD + data);
            // Validation bounds a payload by the maximum payload size.
            let payload_len = plen as usize;
            if unread > 0
                && let Err(e) = reader.read_exact(ops::request_buf(buf, payload_len))
            {
                shared.budget.release(taken);
                return Turn::End(End::Io(e));
            }
            Turn::Job(Job {
                cookie: h.cookie,
                offset: h.offset,
                command: h.command,
                cmd,
                payload_len,
                taken,
            })
        }
        Err(rej) => {
            if let Err(e) = discard(reader, unread) {
                return Turn::End(End::Io(e));
            }
            let reply = ops::error_reply(
                shared.conn.style,
                h.cookie,
                h.offset,
                rej.error,
                &rej.message,
            );
            Turn::Refused(reply, h.command)
        }
    }
}
