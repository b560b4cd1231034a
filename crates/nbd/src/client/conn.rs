//! Transmission on one connection: any number of threads send requests
//! (one writer lock, held only to send), one reader thread takes the
//! replies and hands each to the request it answers, by cookie, in any
//! order. Read data goes straight from the socket into the request's
//! buffer.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use diskit_core::buffer::AlignedBuf;
use diskit_core::sync::lock;
use diskit_core::{Completion, CompletionQueue, Error, ErrorKind, ReadSink, Result};

use super::splice::Discarder;
use super::watchdog::{self, Heard, Watched};
use crate::proto::consts::*;
use crate::proto::reply::{Chunk, ReplyHeader};
use crate::proto::request::RequestHeader;
use crate::tls::TlsStream;
use crate::transport::Transport;

/// The reader's buffer, for headers and small payloads; read data goes
/// past it, straight into the request's buffer.
const READ_BUFFER: usize = 16 << 10;
/// Error chunks and other non-data payloads longer than this are refused.
const MAX_SMALL_PAYLOAD: u64 = 1 << 20;
/// Block status payloads longer than this are refused.
const MAX_STATUS_PAYLOAD: u64 = 16 << 20;

/// A connected socket, or a TLS session over one.
pub enum Stream {
    /// A Unix domain socket.
    Unix(UnixStream),
    /// A TCP connection.
    Tcp(TcpStream),
    /// TLS over either, after NBD_OPT_STARTTLS ([`super::tls`]).
    Tls(Box<TlsStream>),
}

/// A stream's read half, write half, what shuts it down both ways, and
/// the socket the read half reads when it is a plain one (not TLS): data
/// can be moved from it without passing through memory.
type Split = (
    Box<dyn Read + Send>,
    Box<dyn Write + Send>,
    Box<dyn Fn() + Send + Sync>,
    Option<RawFd>,
);

/// An integer option of socket `fd` at the SOL_SOCKET level (SO_TYPE,
/// SO_DOMAIN): what an inherited descriptor is checked by.
pub fn socket_option(fd: RawFd, name: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `value`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(value)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Stream {
    /// Splits the stream for transmission: the reader thread reads one
    /// half while writers write the other.
    fn split(self) -> std::io::Result<Split> {
        fn halves<S: Read + Write + std::os::fd::AsRawFd + Send + Sync + 'static>(
            s: S,
            clone: impl Fn(&S) -> std::io::Result<S>,
            shutdown: fn(&S),
        ) -> std::io::Result<Split> {
            let reader = clone(&s)?;
            let closer = clone(&s)?;
            let fd = reader.as_raw_fd();
            Ok((
                Box::new(reader),
                Box::new(crate::transport::NoSigPipe(s)),
                Box::new(move || shutdown(&closer)),
                Some(fd),
            ))
        }
        match self {
            Stream::Unix(s) => halves(s, UnixStream::try_clone, |s| {
                let _ = s.shutdown(Shutdown::Both);
            }),
            Stream::Tcp(s) => halves(s, TcpStream::try_clone, |s| {
                let _ = s.shutdown(Shutdown::Both);
            }),
            Stream::Tls(t) => {
                let h = Transport::split(t)?;
                Ok((h.reader, h.writer, h.shutdown, None))
            }
        }
    }

    /// Ends the connection (politely over TLS: close_notify first). Used
    /// after a negotiation that does not go on to transmission.
    pub fn close(self) {
        match self {
            Stream::Unix(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Stream::Tcp(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Stream::Tls(t) => t.close(),
        }
    }

    /// Whether the stream is encrypted.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let one = [std::io::IoSlice::new(buf)];
        match self {
            Stream::Unix(s) => crate::transport::NoSigPipe::send(s, &one),
            Stream::Tcp(s) => crate::transport::NoSigPipe::send(s, &one),
            Stream::Tls(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => crate::transport::NoSigPipe::send(s, bufs),
            Stream::Tcp(s) => crate::transport::NoSigPipe::send(s, bufs),
            Stream::Tls(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tls(s) => s.flush(),
            _ => Ok(()),
        }
    }
}

/// What a finished request gives back besides its buffer.
#[derive(Debug, Default)]
pub struct Answer {
    /// Block status descriptors (length, flags) per context id.
    pub status: Vec<(u32, Vec<(u64, u64)>)>,
}

/// One request as its caller sees it, sent as one or more pieces (a
/// request longer than the server takes is split). It owns the request's
/// buffer while the request is in flight; reads land in it straight from
/// the socket. It is done when every piece has its reply and the sender
/// has let go of it; then it wakes its waiter or posts its completion.
pub struct Group {
    state: Mutex<GroupState>,
    cond: Condvar,
    /// Who takes a read's data as it arrives, in the reader thread.
    sink: Option<Arc<dyn ReadSink>>,
}

struct GroupState {
    /// Pieces without a reply, plus one for the sender until it is done.
    left: usize,
    error: Option<Error>,
    buf: Option<AlignedBuf>,
    answer: Answer,
    /// Where the completion goes, for submitted requests.
    notify: Option<(CompletionQueue, u64)>,
    done: bool,
}

impl Group {
    /// A request of `pieces` pieces, reading into `buf` if it reads, whose
    /// completion goes to `notify` (or to [`Group::wait`]).
    pub fn new(
        pieces: usize,
        buf: Option<AlignedBuf>,
        notify: Option<(CompletionQueue, u64)>,
    ) -> Arc<Group> {
        Self::with_sink(pieces, buf, notify, None)
    }

    /// Like [`new`](Self::new), for a read whose data goes on to `sink`
    /// from the reader thread as it arrives (after landing in `buf`,
    /// unless the sink discards it).
    pub fn with_sink(
        pieces: usize,
        buf: Option<AlignedBuf>,
        notify: Option<(CompletionQueue, u64)>,
        sink: Option<Arc<dyn ReadSink>>,
    ) -> Arc<Group> {
        Arc::new(Group {
            sink,
            state: Mutex::new(GroupState {
                left: pieces + 1,
                error: None,
                buf,
                answer: Answer::default(),
                notify,
                done: false,
            }),
            cond: Condvar::new(),
        })
    }

    /// Records an error; the first one is what the request reports.
    fn fail(&self, error: Error) {
        let mut st = lock(&self.state);
        if st.error.is_none() {
            st.error = Some(error);
        }
    }

    /// Counts `n` pieces as finished, with an error or not.
    fn finish(&self, n: usize, error: Option<Error>) {
        let mut st = lock(&self.state);
        if st.error.is_none() {
            st.error = error;
        }
        st.left = st.left.saturating_sub(n);
        if st.left > 0 {
            return;
        }
        st.done = true;
        if let Some((cq, tag)) = st.notify.take() {
            let c = Completion {
                tag,
                result: st.error.take().map_or(Ok(()), Err),
                buf: st.buf.take(),
            };
            drop(st);
            cq.push(c);
        } else {
            self.cond.notify_all();
        }
    }

    /// The sender is done with the request: gives back the buffer a write
    /// was sent from, which the completion returns.
    pub fn release(&self, buf: Option<AlignedBuf>) {
        if buf.is_some() {
            lock(&self.state).buf = buf;
        }
        self.finish(1, None);
    }

    /// Waits for a request without a completion queue; returns its buffer
    /// and answer.
    pub fn wait(&self) -> Result<(Option<AlignedBuf>, Answer)> {
        let mut st = lock(&self.state);
        while !st.done {
            st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match st.error.take() {
            Some(e) => Err(e),
            None => Ok((st.buf.take(), std::mem::take(&mut st.answer))),
        }
    }
}

/// One piece of a request on the wire.
#[derive(Debug, Clone, Copy)]
pub struct Piece {
    /// `CMD_*`.
    pub command: u16,
    /// `CMD_FLAG_*`.
    pub flags: u16,
    /// Export offset.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// Where the piece's bytes are in the request's buffer (reads) or
    /// payload (writes).
    pub at: usize,
}

/// A piece waiting for its reply.
struct Slot {
    group: Arc<Group>,
    /// A READ's range (offset, length, position in the buffer): its data
    /// chunks must lie inside and cover it.
    read: Option<(u64, u64, usize)>,
    /// Bytes of a structured READ that data and hole chunks covered.
    covered: AtomicU64,
    /// The piece is a streaming read of this many bytes: its reply makes
    /// room on the wire for the next one ([`Connection::send_streaming`]).
    streamed: Option<u64>,
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
    /// The last sign of life from the server, for the watchdog.
    heard: Heard,
    /// Shuts the stream down both ways (ends the reader's wait).
    shutdown: Box<dyn Fn() + Send + Sync>,
    /// The write half: requests go out under this lock, from any thread
    /// (the reader's too, for streaming reads).
    writer: Mutex<Box<dyn Write + Send>>,
    next_cookie: AtomicU64,
    /// Requests go out with extended headers.
    extended: bool,
    /// Streaming reads waiting for room on the wire.
    streaming: Mutex<Streaming>,
}

/// Streaming reads ([`Connection::send_streaming`]) on the wire and
/// waiting to go.
#[derive(Default)]
struct Streaming {
    /// Bytes of streaming reads sent whose replies have not come.
    on_wire: u64,
    /// Reads waiting, with their pieces.
    waiting: VecDeque<(Arc<Group>, Vec<Piece>)>,
}

impl Streaming {
    /// Counts `pieces` as on the wire if they fit there (anything fits
    /// on an empty wire); whether they did.
    fn make_room(&mut self, pieces: &[Piece]) -> bool {
        let bytes: u64 = pieces.iter().map(|p| p.length).sum();
        if self.on_wire > 0 && self.on_wire + bytes > STREAMING_WIRE_BYTES {
            return false;
        }
        self.on_wire += bytes;
        true
    }
}

/// Bytes of streaming reads kept on the wire per connection: enough to
/// keep the server busy, few enough that replies come back while the
/// next ones are still queued in the client.
const STREAMING_WIRE_BYTES: u64 = 8 << 20;

impl Watched for Shared {
    fn busy(&self) -> bool {
        let p = lock(&self.pending);
        p.dead.is_none() && !p.slots.is_empty()
    }

    fn last_heard(&self) -> u64 {
        self.heard.get()
    }

    fn time_out(&self, why: String) {
        {
            let mut p = lock(&self.pending);
            if p.dead.is_none() {
                p.dead = Some(why);
            }
        }
        // The reader, woken by the shutdown, fails the requests with the
        // reason above (it cannot be done here: the reader may hold a
        // request's buffer while it waits for its data).
        (self.shutdown)();
    }
}

impl Shared {
    /// Why the connection ended, if it has, else `fallback`.
    fn reason_or(&self, fallback: String) -> String {
        lock(&self.pending).dead.clone().unwrap_or(fallback)
    }

    /// Ends the connection: every request waiting fails with the first
    /// reason given (a timeout's, say, rather than the error it caused).
    fn kill(&self, why: String) {
        let mut p = lock(&self.pending);
        let why = p.dead.get_or_insert(why).clone();
        let slots: Vec<_> = p.slots.drain().map(|(_, s)| s).collect();
        drop(p);
        for slot in slots {
            slot.group
                .finish(1, Some(Error::new(ErrorKind::Io, why.clone())));
        }
        let waiting = std::mem::take(&mut lock(&self.streaming).waiting);
        for (group, pieces) in waiting {
            group.finish(pieces.len(), Some(Error::new(ErrorKind::Io, why.clone())));
        }
    }

    /// Sends the pieces of `group` (WRITE pieces with their bytes from
    /// `payload`); `streamed`: they are streaming reads. Pieces that could
    /// not be sent finish at once with the error.
    fn send(&self, group: &Arc<Group>, pieces: &[Piece], payload: Option<&[u8]>, streamed: bool) {
        for (i, p) in pieces.iter().enumerate() {
            if let Err(e) = self.send_piece(group, p, payload, streamed) {
                group.finish(pieces.len() - i, Some(e));
                return;
            }
        }
    }

    fn send_piece(
        &self,
        group: &Arc<Group>,
        p: &Piece,
        payload: Option<&[u8]>,
        streamed: bool,
    ) -> Result<()> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let data = if p.command == CMD_WRITE {
            let data = payload
                .and_then(|d| d.get(p.at..p.at + p.length as usize))
                .ok_or_else(|| Error::invalid("write piece outside its payload"))?;
            Some(data)
        } else if p.flags & CMD_FLAG_PAYLOAD_LEN != 0 {
            // Another command's payload (BLOCK_STATUS's), whole: the
            // header's length is its length.
            let data = payload
                .filter(|d| d.len() as u64 == p.length)
                .ok_or_else(|| Error::invalid("a request's payload of another length"))?;
            Some(data)
        } else {
            None
        };
        let slot = Arc::new(Slot {
            group: group.clone(),
            read: (p.command == CMD_READ).then_some((p.offset, p.length, p.at)),
            covered: AtomicU64::new(0),
            streamed: streamed.then_some(p.length),
        });
        {
            let mut pending = lock(&self.pending);
            if let Some(why) = &pending.dead {
                return Err(Error::new(ErrorKind::Io, why.clone()));
            }
            if pending.slots.is_empty() {
                // The server's silence counts from the first request.
                self.heard.touch();
            }
            pending.slots.insert(cookie, slot);
        }
        let header = RequestHeader {
            flags: p.flags,
            command: p.command,
            cookie,
            offset: p.offset,
            length: p.length,
            extended: self.extended,
        }
        .encode();
        let sent = {
            let mut w = lock(&self.writer);
            // Header and data in one go: one system call, and over TLS
            // the same records.
            let mut slices = [IoSlice::new(&header), IoSlice::new(data.unwrap_or(&[]))];
            write_all_vectored(&mut **w, &mut slices).and_then(|()| w.flush())
        };
        if let Err(e) = sent {
            let err = Error::from(e).context("NBD request");
            // The piece's slot goes with the others, finished by kill.
            self.kill(err.to_string());
        }
        Ok(())
    }

    /// A streaming read's reply of `len` bytes is in: the reads waiting
    /// that now fit on the wire go out, from the thread that took the
    /// reply (no other thread need wake for it).
    fn streamed(&self, len: u64) {
        let mut go = Vec::new();
        {
            let mut st = lock(&self.streaming);
            st.on_wire = st.on_wire.saturating_sub(len);
            while let Some((group, pieces)) = st.waiting.pop_front() {
                if !st.make_room(&pieces) {
                    st.waiting.push_front((group, pieces));
                    break;
                }
                go.push((group, pieces));
            }
        }
        for (group, pieces) in go {
            self.send(&group, &pieces, None, true);
        }
    }

    fn is_dead(&self) -> bool {
        lock(&self.pending).dead.is_some()
    }
}

/// One NBD connection in transmission.
pub struct Connection {
    shared: Arc<Shared>,
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Connection {
    /// Starts transmission on `stream`, whose handshake is done, with
    /// compact headers (and structured replies if negotiated).
    pub fn start(stream: Stream, structured: bool) -> Result<Connection> {
        Self::start_with(stream, structured, false)
    }

    /// Starts transmission with `extended` headers (64-bit lengths, which
    /// imply structured replies) or compact ones.
    pub fn start_with(stream: Stream, structured: bool, extended: bool) -> Result<Connection> {
        let structured = structured || extended;
        let (reader_stream, writer, shutdown, fd) = stream.split()?;
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
            heard: Heard::new(),
            shutdown,
            writer: Mutex::new(writer),
            next_cookie: AtomicU64::new(1),
            extended,
            streaming: Mutex::new(Streaming::default()),
        });
        let watched: Arc<dyn Watched> = shared.clone();
        watchdog::watch(Arc::downgrade(&watched));
        let s2 = shared.clone();
        let reader = std::thread::Builder::new()
            .name("nbd-client-reader".into())
            .spawn(move || {
                let mut r = Reader {
                    r: std::io::BufReader::with_capacity(READ_BUFFER, reader_stream),
                    discarder: Discarder::new(fd),
                    staging: Vec::new(),
                };
                let why = match read_replies(&mut r, &s2, structured, extended) {
                    Ok(()) => "the server closed the connection".to_string(),
                    Err(e) => e.to_string(),
                };
                s2.kill(why);
            })?;
        Ok(Connection {
            shared,
            reader: Mutex::new(Some(reader)),
        })
    }

    /// Sends the pieces of `group` (WRITE pieces with their bytes from
    /// `payload`). Each piece finishes in `group` when its reply comes;
    /// pieces that could not be sent finish at once with the error. The
    /// caller then calls [`Group::release`].
    pub fn send(&self, group: &Arc<Group>, pieces: &[Piece], payload: Option<&[u8]>) {
        self.shared.send(group, pieces, payload, false);
    }

    /// Sends the READ pieces of `group` as a streaming read: at once if
    /// the connection has fewer than [`STREAMING_WIRE_BYTES`] of streaming
    /// reads on the wire, else when replies to earlier ones make room,
    /// from the reader thread that took them. A copy queues many reads
    /// this way and the connection keeps itself busy, without a thread
    /// waking up to send each next one.
    pub fn send_streaming(&self, group: &Arc<Group>, pieces: &[Piece]) {
        {
            let mut st = lock(&self.shared.streaming);
            // Reads go out in the order they came: none before those waiting.
            if !st.waiting.is_empty() || !st.make_room(pieces) {
                st.waiting.push_back((group.clone(), pieces.to_vec()));
                drop(st);
                // The connection may have died meanwhile: nobody would
                // send these then.
                if self.shared.is_dead() {
                    self.shared.kill(String::new());
                }
                return;
            }
        }
        self.shared.send(group, pieces, None, true);
    }

    /// Sends one request and waits for it; `payload` is a WRITE's data.
    pub fn request(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        payload: Option<&[u8]>,
    ) -> Result<Answer> {
        let group = Group::new(1, None, None);
        let piece = Piece {
            command,
            flags,
            offset,
            length,
            at: 0,
        };
        self.send(&group, &[piece], payload);
        group.release(None);
        group.wait().map(|(_, answer)| answer)
    }

    /// Ends the connection: NBD_CMD_DISC, then the socket is shut down and
    /// the reader joined.
    pub fn close(&self) {
        if !self.shared.is_dead() {
            let header = RequestHeader {
                flags: 0,
                command: CMD_DISC,
                cookie: self.shared.next_cookie.fetch_add(1, Ordering::Relaxed),
                offset: 0,
                length: 0,
                extended: self.shared.extended,
            }
            .encode();
            let mut w = lock(&self.shared.writer);
            let _ = w.write_all(&header).and_then(|()| w.flush());
        }
        (self.shared.shutdown)();
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

/// Writes every byte of `slices`, vectored (`Write::write_all_vectored` is
/// not stable yet).
fn write_all_vectored(w: &mut dyn Write, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn proto_err(msg: impl Into<String>) -> Error {
    Error::new(
        ErrorKind::Io,
        format!("NBD protocol error from the server: {}", msg.into()),
    )
}

/// After the last reply to a streaming read: the next ones go out.
fn made_room(shared: &Shared, slot: &Slot) {
    if let Some(len) = slot.streamed {
        shared.streamed(len);
    }
}

/// The reader thread's side of the connection: the buffered stream, and
/// what drops unwanted read data straight from the socket.
struct Reader<R> {
    r: BufReader<R>,
    discarder: Discarder,
    /// Where data for a sink lands: one buffer, reused, stays in this
    /// thread's cache (the requests' own buffers would each be cold).
    staging: Vec<u8>,
}

/// Data chunks for a sink up to this long go through the reader's own
/// buffer; longer ones through the request's buffer.
const MAX_STAGING: u64 = 4 << 20;

/// The reader thread's loop: one reply (or chunk) at a time.
fn read_replies<R: Read>(
    reader: &mut Reader<R>,
    shared: &Shared,
    structured: bool,
    extended: bool,
) -> Result<()> {
    let mut head = [0u8; 32];
    loop {
        let r = &mut reader.r;
        match r.read(&mut head[..4]) {
            Ok(0) => return Ok(()),
            Ok(n) => r.read_exact(&mut head[n..4])?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
        shared.heard.touch();
        let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
        // With extended headers every reply is an extended chunk.
        let len = match magic {
            SIMPLE_REPLY_MAGIC if !extended => 16,
            STRUCTURED_REPLY_MAGIC if structured && !extended => 20,
            EXTENDED_REPLY_MAGIC if extended => 32,
            _ => return Err(proto_err(format!("bad reply magic {magic:#x}"))),
        };
        r.read_exact(&mut head[4..len])?;
        let (header, _) = ReplyHeader::parse(&head[..len])
            .map_err(|e| proto_err(format!("bad reply header: {e}")))?;
        match header {
            ReplyHeader::Simple { error, cookie } => {
                let slot = lock(&shared.pending)
                    .slots
                    .remove(&cookie)
                    .ok_or_else(|| proto_err(format!("reply to unknown cookie {cookie}")))?;
                if error != 0 {
                    // Said as the errno it stands for ("Input/output
                    // error"), as QEMU's client says it.
                    let e = Error::from_kind(ErrorKind::from_nbd_code(error));
                    slot.group.finish(1, Some(e));
                    made_room(shared, &slot);
                    continue;
                }
                if let Some((offset, len, at)) = slot.read {
                    // The slot is out of the table: end it here, or its
                    // waiter would wait forever.
                    if let Err(e) = deliver(reader, &slot.group, offset, at, len) {
                        let why = shared.reason_or(e.to_string());
                        slot.group.finish(1, Some(Error::new(ErrorKind::Io, why)));
                        return Err(e);
                    }
                }
                slot.group.finish(1, None);
                made_room(shared, &slot);
            }
            ReplyHeader::Chunk(c) => {
                let slot = lock(&shared.pending)
                    .slots
                    .get(&c.cookie)
                    .cloned()
                    .ok_or_else(|| proto_err(format!("reply to unknown cookie {}", c.cookie)))?;
                read_chunk(reader, &slot, c.kind, c.length)?;
                if c.flags & REPLY_FLAG_DONE != 0 {
                    lock(&shared.pending).slots.remove(&c.cookie);
                    let short = slot
                        .read
                        .is_some_and(|(_, len, _)| slot.covered.load(Ordering::Relaxed) != len);
                    let err =
                        short.then(|| proto_err("a read reply that does not cover the request"));
                    // An error chunk explains a short read better.
                    slot.group.finish(1, err);
                    made_room(shared, &slot);
                }
            }
        }
    }
}

/// Takes `len` bytes of reply data, the export's at `offset`, for the
/// request: into its buffer at `at`, and on to its sink if it has one
/// (or dropped from the socket unseen, if the sink discards them). A
/// sink's error fails the request, not the connection.
fn deliver<R: Read>(
    reader: &mut Reader<R>,
    group: &Group,
    offset: u64,
    at: usize,
    len: u64,
) -> Result<()> {
    let Some(sink) = &group.sink else {
        return read_into(&mut reader.r, group, at, len);
    };
    if sink.discards() {
        return reader.discarder.discard(&mut reader.r, len);
    }
    // Handed over as soon as they are read, while the bytes are in this
    // thread's cache.
    let handed = if len <= MAX_STAGING {
        let n = len as usize;
        if reader.staging.len() < n {
            reader.staging.resize(n, 0);
        }
        let data = fill(&mut reader.r, &mut reader.staging, 0, len)?;
        sink.data(offset, data)
    } else {
        with_buffer(group, |buf| {
            let data = fill(&mut reader.r, buf, at, len)?;
            Ok(sink.data(offset, data))
        })?
    };
    if let Err(e) = handed {
        group.fail(e);
    }
    Ok(())
}

/// Reads `len` bytes of reply data into the request's buffer at `at`.
fn read_into<R: Read>(r: &mut BufReader<R>, group: &Group, at: usize, len: u64) -> Result<()> {
    with_buffer(group, |buf| fill(r, buf, at, len).map(drop))
}

/// Runs `f` on the request's buffer, taken out of the group meanwhile:
/// the group's lock is not held across reads from the socket (and
/// writes by a sink), where the sender would wait for it.
fn with_buffer<T>(group: &Group, f: impl FnOnce(&mut AlignedBuf) -> Result<T>) -> Result<T> {
    let mut buf = lock(&group.state)
        .buf
        .take()
        .ok_or_else(|| Error::invalid("a read without a buffer"))?;
    let out = f(&mut buf);
    lock(&group.state).buf = Some(buf);
    out
}

/// Reads `len` bytes of reply data into `buf` at `at`; returns them.
fn fill<'b, R: Read>(
    r: &mut BufReader<R>,
    buf: &'b mut [u8],
    at: usize,
    len: u64,
) -> Result<&'b [u8]> {
    let dest = buf
        .get_mut(at..at + len as usize)
        .ok_or_else(|| Error::invalid("a read without a buffer"))?;
    // What the reader's buffer holds already, then the rest from the
    // socket itself: through the buffer, every byte would be copied twice.
    let have = r.buffer().len().min(dest.len());
    dest[..have].copy_from_slice(&r.buffer()[..have]);
    r.consume(have);
    r.get_mut().read_exact(&mut dest[have..])?;
    Ok(dest)
}

/// Reads one chunk's payload into its request.
fn read_chunk<R: Read>(reader: &mut Reader<R>, slot: &Slot, kind: u16, length: u64) -> Result<()> {
    let r = &mut reader.r;
    if kind == REPLY_TYPE_OFFSET_DATA {
        if length < 9 {
            return Err(proto_err("short data chunk"));
        }
        let mut off = [0u8; 8];
        r.read_exact(&mut off)?;
        let at = u64::from_be_bytes(off);
        let n = length - 8;
        let Some((start, len, pos)) = slot.read else {
            return Err(proto_err("data chunk for a request that reads nothing"));
        };
        if at < start || at.checked_add(n).is_none_or(|end| end > start + len) {
            return Err(proto_err("data chunk outside the request"));
        }
        slot.covered.fetch_add(n, Ordering::Relaxed);
        return deliver(reader, &slot.group, at, pos + (at - start) as usize, n);
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
            let Some((start, rlen, pos)) = slot.read else {
                return Err(proto_err("hole chunk for a request that reads nothing"));
            };
            let len = u64::from(len);
            if offset < start || offset.checked_add(len).is_none_or(|e| e > start + rlen) {
                return Err(proto_err("hole chunk outside the request"));
            }
            slot.covered.fetch_add(len, Ordering::Relaxed);
            let from = pos + (offset - start) as usize;
            match &slot.group.sink {
                Some(sink) if sink.discards() => {}
                Some(sink) => {
                    if let Err(e) = sink.zeros(offset, len) {
                        slot.group.fail(e);
                    }
                }
                None => {
                    let mut st = lock(&slot.group.state);
                    if let Some(b) = st
                        .buf
                        .as_mut()
                        .and_then(|b| b.get_mut(from..from + len as usize))
                    {
                        b.fill(0);
                    }
                }
            }
        }
        Chunk::BlockStatus { context, extents } => {
            lock(&slot.group.state)
                .answer
                .status
                .push((context, extents));
        }
        Chunk::Error { error, message, .. } => {
            let kind = ErrorKind::from_nbd_code(error);
            slot.group.fail(if message.is_empty() {
                Error::from_kind(kind)
            } else {
                Error::new(kind, message)
            });
        }
    }
    Ok(())
}
