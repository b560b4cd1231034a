//! The transmission phase of one connection: a reader parsing requests, a
//! bounded pool of workers executing them, replies written as they
//! complete (out of order) under one writer lock.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use super::budget::Budget;
use super::export::MetaContext;
use super::handshake::Negotiated;
use super::ops::{self, Conn, Part, Reply};
use super::stats::Stats;
use super::transport::Halves;
use crate::proto::request::{Limits, RequestHeader, validate};
use crate::proto::{Command, ReplyStyle};

/// A payload larger than the maximum payload but at most this long is read
/// and thrown away (the request fails with EINVAL and the connection
/// lives on); a longer one ends the connection.
pub const MAX_DISCARD: u64 = 64 << 20;
/// What every request in flight counts against the budget besides its data.
const REQUEST_OVERHEAD: u64 = 1024;

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
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Disconnect => f.write_str("client disconnected"),
            End::Closed => f.write_str("client closed the connection"),
            End::Protocol(m) => write!(f, "protocol violation: {m}"),
            End::Io(e) => write!(f, "I/O error: {e}"),
        }
    }
}

/// Tunables of the transmission phase.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Worker threads per connection; 0 executes requests in the reader.
    pub threads: usize,
    /// Bytes of request and reply data in flight per connection.
    pub max_in_flight: u64,
}

struct Job {
    cookie: u64,
    offset: u64,
    command: u16,
    cmd: Command,
    payload: Vec<u8>,
    taken: u64,
}

struct Shared<'a> {
    conn: Conn,
    writer: Mutex<BufWriter<Box<dyn Write + Send>>>,
    /// Replies waiting for the writer lock.
    waiting: AtomicUsize,
    broken: AtomicBool,
    shutdown: &'a (dyn Fn() + Send + Sync),
    budget: Budget,
    conn_stats: &'a Stats,
}

impl Shared<'_> {
    fn send(&self, reply: &Reply) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        let result = (|| {
            for p in &reply.parts {
                match p {
                    Part::Bytes(b) => w.write_all(b)?,
                    Part::Data(r) => w.write_all(&reply.data[r.clone()])?,
                }
            }
            // A reply waiting for the lock flushes this one with its own:
            // one syscall for a burst of small replies. The last always
            // flushes.
            if self.waiting.load(Ordering::Acquire) == 0 {
                w.flush()?;
            }
            Ok::<(), io::Error>(())
        })();
        if result.is_err() {
            // The client is gone: stop the reader too. Requests already
            // received still run (their writes must land).
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

    fn run(&self, job: Job) {
        let written = if matches!(job.cmd, Command::Write { .. }) {
            job.payload.len() as u64
        } else {
            0
        };
        let read = match job.cmd {
            Command::Read { len, .. } => u64::from(len),
            _ => 0,
        };
        let reply = ops::execute(&self.conn, job.cookie, job.offset, job.cmd, job.payload);
        self.record(job.command, &reply, read, written);
        self.send(&reply);
        drop(reply);
        self.budget.release(job.taken);
    }
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
    let bs = export.block_size();
    let limits = Limits {
        size: export.device().size(),
        tflags: neg.tflags,
        min_block: bs.minimum,
        max_payload: export.max_payload(),
        structured: neg.structured,
        extended: neg.extended,
        meta_contexts: !neg.contexts.is_empty(),
    };
    let contexts: Vec<MetaContext> = neg.contexts;
    let Halves {
        reader,
        writer,
        shutdown,
    } = halves;
    let shared = Shared {
        conn: Conn {
            export,
            style,
            contexts,
        },
        writer: Mutex::new(BufWriter::with_capacity(256 * 1024, writer)),
        waiting: AtomicUsize::new(0),
        broken: AtomicBool::new(false),
        shutdown: &*shutdown,
        budget: Budget::new(tuning.max_in_flight.max(u64::from(limits.max_payload))),
        conn_stats,
    };
    let mut reader = BufReader::with_capacity(256 * 1024, reader);

    let end = std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..tuning.threads {
            let rx = rx.clone();
            let shared = &shared;
            s.spawn(move || {
                loop {
                    let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    match job {
                        Ok(job) => shared.run(job),
                        Err(_) => break,
                    }
                }
            });
        }
        let end = read_requests(&mut reader, &shared, &limits, |job| {
            if tuning.threads == 0 {
                shared.run(job);
            } else if let Err(mpsc::SendError(job)) = tx.send(job) {
                shared.run(job);
            }
        });
        drop(tx);
        end
    });
    let mut w = shared.writer.lock().unwrap_or_else(|p| p.into_inner());
    let _ = w.flush();
    drop(w);
    (shared.shutdown)();
    end
}

fn read_requests(
    reader: &mut impl Read,
    shared: &Shared<'_>,
    limits: &Limits,
    mut dispatch: impl FnMut(Job),
) -> End {
    let hlen = RequestHeader::wire_len(limits.extended);
    let mut hbuf = [0u8; 32];
    loop {
        match read_header(reader, &mut hbuf[..hlen]) {
            Ok(true) => {}
            Ok(false) => return End::Closed,
            Err(e) if shared.broken.load(Ordering::Relaxed) => {
                return End::Io(io::Error::new(e.kind(), "client went away"));
            }
            Err(e) => return End::Io(e),
        }
        let h = match RequestHeader::parse(&hbuf[..hlen], limits.extended) {
            Ok(h) => h,
            Err(e) => return End::Protocol(format!("request header: {e}")),
        };
        let plen = h.payload_len();
        if plen > u64::from(limits.max_payload) && (limits.extended || plen > MAX_DISCARD) {
            return End::Protocol(format!("request payload of {plen} bytes"));
        }
        match validate(&h, limits) {
            Ok(Command::Disconnect) => {
                if let Err(e) = discard(reader, plen) {
                    return End::Io(e);
                }
                return End::Disconnect;
            }
            Ok(cmd) => {
                let data = match cmd {
                    Command::Read { len, .. } | Command::Write { len, .. } => u64::from(len),
                    _ => 0,
                };
                let taken = shared.budget.acquire(REQUEST_OVERHEAD + data);
                let mut payload = Vec::new();
                if plen > 0 {
                    payload = vec![0u8; plen as usize];
                    if let Err(e) = reader.read_exact(&mut payload) {
                        shared.budget.release(taken);
                        return End::Io(e);
                    }
                }
                dispatch(Job {
                    cookie: h.cookie,
                    offset: h.offset,
                    command: h.command,
                    cmd,
                    payload,
                    taken,
                });
            }
            Err(rej) => {
                if let Err(e) = discard(reader, plen) {
                    return End::Io(e);
                }
                let reply = ops::error_reply(
                    shared.conn.style,
                    h.cookie,
                    h.offset,
                    rej.error,
                    &rej.message,
                );
                shared.record(h.command, &reply, 0, 0);
                shared.send(&reply);
            }
        }
    }
}
