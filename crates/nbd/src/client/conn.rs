//! Transmission on one connection: any number of threads send requests
//! (one writer lock, held only to send), one reader thread takes the
//! replies and hands each to the request it answers, by cookie, in any
//! order. Read data goes straight from the socket into the request's
//! buffer.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use diskit_core::sync::lock;
use diskit_core::{Error, ErrorKind, Result};

use crate::proto::consts::*;
use crate::proto::reply::{Chunk, ReplyHeader};
use crate::proto::request::RequestHeader;

/// Error chunks and other non-data payloads longer than this are refused.
const MAX_SMALL_PAYLOAD: u64 = 1 << 20;
/// Block status payloads longer than this are refused.
const MAX_STATUS_PAYLOAD: u64 = 16 << 20;

/// A connected socket.
pub enum Stream {
    /// A Unix domain socket.
    Unix(UnixStream),
    /// A TCP connection.
    Tcp(TcpStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a finished request gives back.
#[derive(Debug, Default)]
pub struct Answer {
    /// Data read (READ).
    pub data: Vec<u8>,
    /// Block status descriptors (length, flags) per context id.
    pub status: Vec<(u32, Vec<(u64, u64)>)>,
}

#[derive(Default)]
struct SlotState {
    done: bool,
    error: Option<Error>,
    answer: Answer,
    /// Offset and length of a READ (its data chunks must lie inside).
    read: Option<(u64, u64)>,
    /// Bytes of a structured READ that data and hole chunks covered.
    covered: u64,
}

#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
    cond: Condvar,
}

impl Slot {
    fn finish(&self, error: Option<Error>) {
        let mut st = lock(&self.state);
        if st.error.is_none() {
            st.error = error;
        }
        st.done = true;
        self.cond.notify_all();
    }

    fn fail(&self, error: Error) {
        let mut st = lock(&self.state);
        if st.error.is_none() {
            st.error = Some(error);
        }
    }
}

/// Requests waiting for replies, and why the connection ended once it
/// has: one lock, so that no request is registered after the end was
/// declared (it would wait forever).
#[derive(Default)]
struct Pending {
    slots: HashMap<u64, Arc<Slot>>,
    dead: Option<String>,
}

struct Shared {
    pending: Mutex<Pending>,
}

impl Shared {
    fn kill(&self, why: String) {
        let mut p = lock(&self.pending);
        if p.dead.is_none() {
            p.dead = Some(why.clone());
        }
        let slots: Vec<_> = p.slots.drain().map(|(_, s)| s).collect();
        drop(p);
        for slot in slots {
            slot.finish(Some(Error::new(ErrorKind::Io, why.clone())));
        }
    }

    fn is_dead(&self) -> bool {
        lock(&self.pending).dead.is_some()
    }
}

/// One NBD connection in transmission.
pub struct Connection {
    writer: Mutex<Stream>,
    control: Stream,
    shared: Arc<Shared>,
    next_cookie: AtomicU64,
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Connection {
    /// Starts transmission on `stream`, whose handshake is done.
    pub fn start(stream: Stream, structured: bool) -> Result<Connection> {
        let reader_stream = stream.try_clone()?;
        let control = stream.try_clone()?;
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
        });
        let s2 = shared.clone();
        let reader = std::thread::Builder::new()
            .name("nbd-client-reader".into())
            .spawn(move || {
                let mut r = std::io::BufReader::with_capacity(256 << 10, reader_stream);
                let why = match read_replies(&mut r, &s2, structured) {
                    Ok(()) => "the server closed the connection".to_string(),
                    Err(e) => e.to_string(),
                };
                s2.kill(why);
            })?;
        Ok(Connection {
            writer: Mutex::new(stream),
            control,
            shared,
            next_cookie: AtomicU64::new(1),
            reader: Mutex::new(Some(reader)),
        })
    }

    /// Sends a request (with `payload` for WRITE) and waits for its answer.
    /// `read` is the range a READ asks for.
    pub fn request(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        payload: Option<&[u8]>,
    ) -> Result<Answer> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        if command == CMD_READ {
            let mut st = lock(&slot.state);
            st.read = Some((offset, length));
            st.answer.data = vec![0u8; length as usize];
        }
        {
            let mut p = lock(&self.shared.pending);
            if let Some(why) = &p.dead {
                return Err(Error::new(ErrorKind::Io, why.clone()));
            }
            p.slots.insert(cookie, slot.clone());
        }
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
            extended: false,
        }
        .encode();
        let sent = {
            let mut w = lock(&self.writer);
            let mut r = w.write_all(&header);
            if let (Ok(()), Some(p)) = (&r, payload) {
                r = w.write_all(p);
            }
            r
        };
        if let Err(e) = sent {
            lock(&self.shared.pending).slots.remove(&cookie);
            let err = Error::from(e).context("NBD request");
            self.shared.kill(err.to_string());
            return Err(err);
        }
        if command == CMD_DISC {
            lock(&self.shared.pending).slots.remove(&cookie);
            return Ok(Answer::default());
        }
        let mut st = lock(&slot.state);
        while !st.done {
            st = slot.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match st.error.take() {
            Some(e) => Err(e),
            None => Ok(std::mem::take(&mut st.answer)),
        }
    }

    /// Ends the connection: NBD_CMD_DISC, then the socket is shut down and
    /// the reader joined.
    pub fn close(&self) {
        if !self.shared.is_dead() {
            let _ = self.request(CMD_DISC, 0, 0, 0, None);
        }
        self.control.shutdown();
        if let Some(h) = lock(&self.reader).take() {
            let _ = h.join();
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.close();
    }
}

fn proto_err(msg: impl Into<String>) -> Error {
    Error::new(
        ErrorKind::Io,
        format!("NBD protocol error from the server: {}", msg.into()),
    )
}

/// The reader thread's loop: one reply (or chunk) at a time.
fn read_replies<R: Read>(r: &mut R, shared: &Shared, structured: bool) -> Result<()> {
    let mut head = [0u8; 32];
    loop {
        match r.read(&mut head[..4]) {
            Ok(0) => return Ok(()),
            Ok(n) => r.read_exact(&mut head[n..4])?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
        let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
        let len = match magic {
            SIMPLE_REPLY_MAGIC => 16,
            STRUCTURED_REPLY_MAGIC if structured => 20,
            _ => return Err(proto_err(format!("bad reply magic {magic:#x}"))),
        };
        r.read_exact(&mut head[4..len])?;
        let (header, _) = ReplyHeader::parse(&head[..len])
            .map_err(|e| proto_err(format!("bad reply header: {e}")))?;
        match header {
            ReplyHeader::Simple { error, cookie } => {
                let slot = take_slot(shared, cookie)?;
                let mut st = lock(&slot.state);
                if error != 0 {
                    let kind = ErrorKind::from_nbd_code(error);
                    st.error = Some(Error::new(kind, format!("server error {error}")));
                } else if st.read.is_some() {
                    r.read_exact(&mut st.answer.data)?;
                }
                st.done = true;
                slot.cond.notify_all();
            }
            ReplyHeader::Chunk(c) => {
                let slot = lock(&shared.pending)
                    .slots
                    .get(&c.cookie)
                    .cloned()
                    .ok_or_else(|| proto_err(format!("reply to unknown cookie {}", c.cookie)))?;
                read_chunk(r, &slot, c.kind, c.length)?;
                if c.flags & REPLY_FLAG_DONE != 0 {
                    lock(&shared.pending).slots.remove(&c.cookie);
                    let short = {
                        let st = lock(&slot.state);
                        st.error.is_none() && st.read.is_some_and(|(_, len)| st.covered != len)
                    };
                    slot.finish(
                        short.then(|| proto_err("a read reply that does not cover the request")),
                    );
                }
            }
        }
    }
}

fn take_slot(shared: &Shared, cookie: u64) -> Result<Arc<Slot>> {
    lock(&shared.pending)
        .slots
        .remove(&cookie)
        .ok_or_else(|| proto_err(format!("reply to unknown cookie {cookie}")))
}

/// Reads one chunk's payload into its request.
fn read_chunk<R: Read>(r: &mut R, slot: &Slot, kind: u16, length: u64) -> Result<()> {
    if kind == REPLY_TYPE_OFFSET_DATA {
        if length < 9 {
            return Err(proto_err("short data chunk"));
        }
        let mut off = [0u8; 8];
        r.read_exact(&mut off)?;
        let at = u64::from_be_bytes(off);
        let n = length - 8;
        let mut st = lock(&slot.state);
        let Some((start, len)) = st.read else {
            return Err(proto_err("data chunk for a request that reads nothing"));
        };
        if at < start || at.checked_add(n).is_none_or(|end| end > start + len) {
            return Err(proto_err("data chunk outside the request"));
        }
        let from = (at - start) as usize;
        st.covered += n;
        return Ok(r.read_exact(&mut st.answer.data[from..from + n as usize])?);
    }
    let cap = if kind == REPLY_TYPE_BLOCK_STATUS {
        MAX_STATUS_PAYLOAD
    } else {
        MAX_SMALL_PAYLOAD
    };
    if length > cap {
        return Err(proto_err(format!("chunk of {length} bytes is too long")));
    }
    let mut payload = vec![0u8; length as usize];
    r.read_exact(&mut payload)?;
    let chunk = Chunk::parse(kind, &payload).map_err(|e| proto_err(format!("bad chunk: {e}")))?;
    match chunk {
        Chunk::None | Chunk::Unknown(_) => {}
        Chunk::Data { .. } => unreachable!("data chunks are read above"),
        Chunk::Hole { offset, len } => {
            let mut st = lock(&slot.state);
            let Some((start, rlen)) = st.read else {
                return Err(proto_err("hole chunk for a request that reads nothing"));
            };
            let len = u64::from(len);
            if offset < start || offset.checked_add(len).is_none_or(|e| e > start + rlen) {
                return Err(proto_err("hole chunk outside the request"));
            }
            let from = (offset - start) as usize;
            st.covered += len;
            st.answer.data[from..from + len as usize].fill(0);
        }
        Chunk::BlockStatus { context, extents } => {
            lock(&slot.state).answer.status.push((context, extents));
        }
        Chunk::Error { error, message, .. } => {
            let kind = ErrorKind::from_nbd_code(error);
            let msg = if message.is_empty() {
                format!("server error {error}")
            } else {
                message
            };
            slot.fail(Error::new(kind, msg));
        }
    }
    Ok(())
}
