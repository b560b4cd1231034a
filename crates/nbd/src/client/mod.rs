//! The NBD client: an export of any NBD server as a [`BlockDevice`] (and as
//! [`Storage`], so that a format can sit on it).
//!
//! [`NbdClient::connect`] takes an NBD URI ([`uri`]); the handshake
//! ([`handshake`]) asks for structured replies and the `base:allocation`
//! context, then NBD_OPT_GO. Requests from any number of threads are in
//! flight at once on the one connection ([`conn`]); requests longer than
//! the server's maximum are split. Capabilities come from the export's
//! transmission flags, extents from block status. The `nbds` schemes run
//! all of it over TLS ([`tls`]).

pub mod command;
pub mod conn;
pub mod handshake;
pub mod options;
pub mod probe;
mod splice;
pub mod tls;
pub mod uri;
pub mod watchdog;

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use diskit_core::buffer::AlignedBuf;
use diskit_core::device::{check_range, split_fua, write_zero_buffer};
use diskit_core::range_lock::RangeLock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, CompletionQueue, Error, ErrorKind, Extent, Request,
    Result, Storage, WriteFlags, ZeroFlags,
};

use crate::proto::consts::*;
use crate::proto::request::BlockStatusPayload;
use conn::{Connection, Group, Piece, Stream};
use handshake::Negotiated;
use tls::ClientTls;
use uri::{Address, NbdUri};

/// The largest request sent when the server gives no block sizes (the
/// protocol's advice: 32 MiB).
const DEFAULT_MAX: u32 = 32 << 20;
/// The metadata context extents come from: allocation (holes and zeros).
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Requests worth keeping in flight on one connection.
const REQUESTS_PER_CONNECTION: usize = 64;
/// Connections a client opened by URI uses at most once requests are
/// submitted to a multi-conn export (nbdcopy's default), and no more than
/// there are processors (as nbdcopy: one per thread).
const LAZY_CONNECTIONS: usize = 4;

fn lazy_connections() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, LAZY_CONNECTIONS)
}
/// Zeros written as data (a server without write-zeroes) go out in
/// writes of at most this many bytes, from one shared buffer.
const ZERO_WRITE: usize = 1 << 20;
static ZEROS: [u8; ZERO_WRITE] = [0u8; ZERO_WRITE];

/// An NBD export, connected (over several connections when asked for
/// and the server allows it: multi-conn).
pub struct NbdClient {
    /// The connections, replaced whole by [`BlockDevice::reopen`];
    /// requests in flight keep the ones they went out on.
    links: RwLock<Arc<Links>>,
    /// Where the export is, for more connections.
    reconnect: Option<NbdUri>,
    /// The TLS settings of `reconnect`, for more connections.
    tls: Option<ClientTls>,
    /// The metadata contexts asked for, to ask again on a reopen.
    asked: Vec<String>,
    /// Round-robin position over the connections.
    next: AtomicUsize,
    uri: String,
    export: Negotiated,
    /// The id of `base:allocation`, when the server offers it.
    allocation: Option<u32>,
    /// The server, when the client started it (`[ CMD ]`).
    subprocess: Option<command::Subprocess>,
    /// Writes that read-modify-write whole blocks of the server's minimum
    /// size hold their blocks alone; other writes share theirs.
    rmw: RangeLock,
}

/// The connections requests go over.
struct Links {
    conns: Vec<Connection>,
    /// Connections opened at the first submitted request (multi-conn).
    extra: OnceLock<Vec<Connection>>,
}

impl Links {
    fn new(conns: Vec<Connection>) -> Arc<Links> {
        Arc::new(Links {
            conns,
            extra: OnceLock::new(),
        })
    }

    fn len(&self) -> usize {
        self.conns.len() + self.extra.get().map_or(0, Vec::len)
    }

    fn get(&self, i: usize) -> &Connection {
        let extra = self.extra.get().map_or(&[][..], Vec::as_slice);
        self.conns
            .get(i)
            .unwrap_or_else(|| &extra[i - self.conns.len()])
    }

    fn all(&self) -> impl Iterator<Item = &Connection> {
        self.conns
            .iter()
            .chain(self.extra.get().into_iter().flatten())
    }
}

/// One connection of a [`Links`], kept alive while a request uses it.
struct Link {
    links: Arc<Links>,
    index: usize,
}

impl std::ops::Deref for Link {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.links.get(self.index)
    }
}

/// Connects a socket to where `uri` points (no handshake).
pub fn connect_stream(uri: &NbdUri) -> Result<Stream> {
    match &uri.address {
        Address::Unix(path) => UnixStream::connect(path)
            .map(|s| {
                widen_buffers(&s);
                Stream::Unix(s)
            })
            .map_err(|e| Error::from(e).context(format!("Failed to connect to '{path}'"))),
        Address::Tcp { host, port } => std::net::TcpStream::connect((host.as_str(), *port))
            .map(|s| {
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            })
            .map_err(|e| Error::from(e).context(format!("Failed to connect to '{host}:{port}'"))),
    }
}

/// Bytes a Unix socket may hold each way: with the default (about 200
/// KiB) a 256 KiB write blocks the writer until the server has read most
/// of it, a sleep and a wake-up per request.
const UNIX_SOCKET_BUFFER: libc::c_int = 4 << 20;

/// Asks for larger socket buffers (the kernel caps them at its maximum);
/// a failure leaves the defaults, which work, only slower.
fn widen_buffers(s: &UnixStream) {
    use std::os::fd::AsRawFd;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on a socket we own, with a c_int value of the
        // size given.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&UNIX_SOCKET_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// Negotiates `export` on a fresh connection; with `tls`, STARTTLS comes
/// first (a server without fixed newstyle cannot do it) and the rest goes
/// on over TLS. Returns the stream transmission runs over.
fn negotiate(
    mut stream: Stream,
    export: &str,
    contexts: &[&str],
    tls: Option<&ClientTls>,
) -> Result<(Stream, Negotiated)> {
    let Some(tls) = tls else {
        let negotiated = handshake::negotiate(&mut stream, export, contexts)?;
        return Ok((stream, negotiated));
    };
    let no_zeroes = handshake::greet(&mut stream)
        .map_err(|e| e.context("TLS needs a server that speaks fixed newstyle"))?;
    let mut stream = tls.start(stream)?;
    let negotiated = handshake::negotiate_options(&mut stream, export, contexts, no_zeroes)?;
    Ok((stream, negotiated))
}

impl NbdClient {
    /// Connects to the export an NBD URI names (over TLS for the `nbds`
    /// schemes).
    pub fn connect(uri: &str) -> Result<NbdClient> {
        Self::connect_with(uri, &[BASE_ALLOCATION])
    }

    /// Connects asking for the metadata contexts `contexts` (extents come
    /// from `base:allocation` when it is among them).
    pub fn connect_with(uri: &str, contexts: &[&str]) -> Result<NbdClient> {
        Self::connect_to(NbdUri::parse(uri)?, contexts)
    }

    /// Connects to the export a parsed URI names, asking for `contexts`.
    pub fn connect_to(parsed: NbdUri, contexts: &[&str]) -> Result<NbdClient> {
        let name = parsed.canonical();
        let tls = ClientTls::for_uri(&parsed).map_err(|e| e.context(format!("'{name}'")))?;
        let stream = connect_stream(&parsed)?;
        let mut client = Self::over_with(stream, &name, &parsed.export, contexts, tls.as_ref())?;
        client.reconnect = Some(parsed);
        client.tls = tls;
        client.asked = contexts.iter().map(|c| c.to_string()).collect();
        Ok(client)
    }

    /// Connects to the export a parsed URI names and reports `context`
    /// as its allocation, as QEMU's `x-dirty-bitmap` does: the context's
    /// bit 0 is read as NBD_STATE_HOLE and bit 1 as NBD_STATE_ZERO, so
    /// that a dirty bitmap's dirty ranges show as neither data nor zero.
    pub fn connect_reporting(parsed: NbdUri, context: &str) -> Result<NbdClient> {
        let mut client = Self::connect_to(parsed, &[context])?;
        client.allocation = Some(client.context_id(context)?);
        Ok(client)
    }

    /// Connects up to `connections` times to the export `uri` names: more
    /// than one only when the server advertises multi-conn (each
    /// connection then sees the others' writes, and a flush on one covers
    /// all). Requests are spread over the connections.
    pub fn connect_multi(uri: &str, connections: usize) -> Result<NbdClient> {
        Self::connect_multi_to(NbdUri::parse(uri)?, connections)
    }

    /// [`connect_multi`](Self::connect_multi) to a parsed URI.
    pub fn connect_multi_to(parsed: NbdUri, connections: usize) -> Result<NbdClient> {
        let client = Self::connect_to(parsed, &[BASE_ALLOCATION])?;
        let more = client.open_more(connections.saturating_sub(1))?;
        {
            let mut guard = diskit_core::sync::write(&client.links);
            let links = Arc::get_mut(&mut guard).expect("a new client's links are its own");
            links.conns.extend(more);
            // Asked for explicitly: no more connections later.
            let _ = links.extra.set(Vec::new());
        }
        Ok(client)
    }

    /// Opens `n` more connections to the same export, when the server
    /// advertises multi-conn and the client knows its URI.
    fn open_more(&self, n: usize) -> Result<Vec<Connection>> {
        let Some(parsed) = self.reconnect.as_ref() else {
            return Ok(Vec::new());
        };
        if n == 0 || !self.has(TFLAG_CAN_MULTI_CONN) {
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let stream = connect_stream(parsed)?;
            let (stream, neg) = negotiate(
                stream,
                &parsed.export,
                &[BASE_ALLOCATION],
                self.tls.as_ref(),
            )
            .map_err(|e| e.context(format!("'{}'", self.uri)))?;
            if neg.size != self.export.size || neg.flags != self.export.flags {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "'{}': another connection to the export sees another size or flags",
                        self.uri
                    ),
                ));
            }
            out.push(Connection::start_with(
                stream,
                neg.structured,
                neg.extended,
            )?);
        }
        Ok(out)
    }

    /// Runs `argv` as a server with socket activation (nbdcopy's
    /// `[ CMD ARGS ... ]`) and connects to its default export; the server
    /// is stopped when the client closes.
    pub fn connect_command(argv: &[String]) -> Result<NbdClient> {
        Self::connect_command_export(argv, "")
    }

    /// Runs `argv` as a server as [`connect_command`](Self::connect_command)
    /// does, and connects to its export `export`.
    pub fn connect_command_export(argv: &[String], export: &str) -> Result<NbdClient> {
        Self::connect_command_to(argv, export, &[BASE_ALLOCATION])
    }

    /// Runs `argv` as a server as [`connect_command`](Self::connect_command)
    /// does, and connects to its export `export` asking for `contexts`.
    pub fn connect_command_to(
        argv: &[String],
        export: &str,
        contexts: &[&str],
    ) -> Result<NbdClient> {
        let (sub, stream) = command::spawn(argv)?;
        Self::over_subprocess(sub, stream, export, contexts)
    }

    /// Runs `argv` as a server on its standard input and output, as
    /// libnbd's `nbd_connect_command` does (`nbdkit -s ...`), and connects
    /// to its export `export` asking for `contexts`; the server is stopped
    /// when the client closes.
    pub fn connect_stdio_command(
        argv: &[String],
        export: &str,
        contexts: &[&str],
    ) -> Result<NbdClient> {
        let (sub, stream) = command::spawn_stdio(argv)?;
        Self::over_subprocess(sub, stream, export, contexts)
    }

    /// A client over the socket of a server this client runs.
    fn over_subprocess(
        sub: command::Subprocess,
        stream: std::os::unix::net::UnixStream,
        export: &str,
        contexts: &[&str],
    ) -> Result<NbdClient> {
        let name = format!("[ {} ]", sub.name);
        let mut client = Self::over_with(Stream::Unix(stream), &name, export, contexts, None)?;
        client.subprocess = Some(sub);
        client.asked = contexts.iter().map(|c| c.to_string()).collect();
        Ok(client)
    }

    /// How many connections requests go over.
    pub fn connections(&self) -> usize {
        self.links().len()
    }

    /// The connections there are now.
    fn links(&self) -> Arc<Links> {
        diskit_core::sync::read(&self.links).clone()
    }

    /// The next connection, round robin.
    fn conn(&self) -> Link {
        let links = self.links();
        let index = self.next.fetch_add(1, Ordering::Relaxed) % links.len();
        Link { links, index }
    }

    /// The first connection (the one whose context ids are known).
    fn first(&self) -> Link {
        Link {
            links: self.links(),
            index: 0,
        }
    }

    /// Opens the extra connections of a multi-conn export the first time
    /// requests are submitted (a copy keeps many in flight); a failure
    /// leaves the client on the connections it has.
    fn spread(&self) {
        self.links()
            .extra
            .get_or_init(|| self.open_more(lazy_connections() - 1).unwrap_or_default());
    }

    /// Negotiates `export` over a connected stream and starts transmission;
    /// `uri` names the export in messages and as its storage location.
    pub fn over(stream: Stream, uri: &str, export: &str) -> Result<NbdClient> {
        Self::over_with(stream, uri, export, &[BASE_ALLOCATION], None)
    }

    /// Like [`over`](Self::over), over TLS with `tls`: STARTTLS after the
    /// greeting, the rest of the negotiation and transmission encrypted.
    pub fn over_tls(stream: Stream, uri: &str, export: &str, tls: &ClientTls) -> Result<NbdClient> {
        Self::over_with(stream, uri, export, &[BASE_ALLOCATION], Some(tls))
    }

    fn over_with(
        stream: Stream,
        uri: &str,
        export: &str,
        contexts: &[&str],
        tls: Option<&ClientTls>,
    ) -> Result<NbdClient> {
        let (stream, negotiated) =
            negotiate(stream, export, contexts, tls).map_err(|e| e.context(format!("'{uri}'")))?;
        Self::transmitting(stream, negotiated, uri)
    }

    /// A client over `stream`, whose handshake settled `negotiated`:
    /// transmission starts.
    fn transmitting(stream: Stream, negotiated: Negotiated, uri: &str) -> Result<NbdClient> {
        let allocation = negotiated.contexts.get(BASE_ALLOCATION).copied();
        let conn = Connection::start_with(stream, negotiated.structured, negotiated.extended)?;
        Ok(NbdClient {
            links: RwLock::new(Links::new(vec![conn])),
            reconnect: None,
            tls: None,
            asked: Vec::new(),
            next: AtomicUsize::new(0),
            uri: uri.to_string(),
            export: negotiated,
            allocation,
            subprocess: None,
            rmw: RangeLock::new(),
        })
    }

    /// The raw block status descriptors (length, flags) of `context` for a
    /// prefix of `offset..offset+len`, as the server sends them.
    pub fn block_status(&self, context: &str, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        check_range(self.size(), offset, len)?;
        self.status_of(self.context_id(context)?, offset, len, 0)
    }

    /// Whether the server agreed to the metadata context `context` when
    /// the client asked for it.
    pub fn offers_context(&self, context: &str) -> bool {
        self.export.contexts.contains_key(context)
    }

    /// The id the server gave `context`.
    fn context_id(&self, context: &str) -> Result<u32> {
        self.export.contexts.get(context).copied().ok_or_else(|| {
            Error::unsupported(format!(
                "'{}' does not offer the context '{context}'",
                self.uri
            ))
        })
    }

    /// Like [`block_status`](Self::block_status) with NBD_CMD_FLAG_REQ_ONE:
    /// the server answers with one extent only (the first).
    pub fn block_status_one(&self, context: &str, offset: u64, len: u64) -> Result<(u64, u32)> {
        check_range(self.size(), offset, len)?;
        Ok(self.status_of(self.context_id(context)?, offset, len, CMD_FLAG_REQ_ONE)?[0])
    }

    /// Reads with NBD_CMD_FLAG_DF (don't fragment: the server answers each
    /// piece in one chunk), when the server offers it; a plain read
    /// otherwise.
    pub fn read_df(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self.size(), offset, len)?;
        let (a, e) = self.outer(offset, len);
        if len == 0
            || !self.has(TFLAG_SEND_DF)
            || !self.export.structured
            || (a, e) != (offset, offset + len)
        {
            return self.read_at(buf, offset);
        }
        let pieces = self.pieces(CMD_READ, CMD_FLAG_DF, offset, len);
        let data = self.run(&pieces, Some(AlignedBuf::new(buf.len(), 8)?), None)?;
        buf.copy_from_slice(&data.expect("a read gives its buffer back")[..buf.len()]);
        Ok(())
    }

    /// Block status of context `id` for a prefix of the range (in range),
    /// clipped to what was asked; an empty answer is an error.
    /// The server's answer to one BLOCK_STATUS request for `context`, as
    /// it sent it (libnbd's `nbd_block_status`): (length, flags) from
    /// `offset`, the last extent possibly reaching past the request;
    /// `flags` are the command's (NBD_CMD_FLAG_REQ_ONE).
    pub fn block_status_as_sent(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        flags: u16,
    ) -> Result<Vec<(u64, u32)>> {
        check_range(self.size(), offset, len)?;
        let id = self.context_id(context)?;
        let answer = self
            .first()
            .request(CMD_BLOCK_STATUS, flags, offset, len, None)?;
        Ok(answer
            .status
            .into_iter()
            .filter(|(c, _)| *c == id)
            .flat_map(|(_, d)| d)
            .map(|(l, f)| (l, f as u32))
            .collect())
    }

    fn status_of(&self, id: u32, offset: u64, len: u64, flags: u16) -> Result<Vec<(u64, u32)>> {
        // Asked in whole blocks of the server's minimum; what precedes
        // `offset` is dropped from the answer.
        let (a, e) = self.outer(offset, len.min(u64::from(u32::MAX) / 2));
        let n = (e - a).min(u64::from(u32::MAX) / self.min_block() * self.min_block());
        // Context ids belong to the connection that negotiated them.
        let answer = if self.export.contexts.len() > 1
            && self.export.extended
            && self.has(TFLAG_BLOCK_STATUS_PAYLOAD)
        {
            // Only this context, where the server takes a payload that
            // says so: it need not work out the others.
            let payload = BlockStatusPayload {
                length: n,
                ids: vec![id],
            }
            .encode();
            self.first().request(
                CMD_BLOCK_STATUS,
                flags | CMD_FLAG_PAYLOAD_LEN,
                a,
                payload.len() as u64,
                Some(&payload),
            )?
        } else {
            self.first().request(CMD_BLOCK_STATUS, flags, a, n, None)?
        };
        let mut skip = offset - a;
        let mut left = len.min(n - skip);
        let out: Vec<(u64, u32)> = answer
            .status
            .into_iter()
            .filter(|(c, _)| *c == id)
            .flat_map(|(_, d)| d)
            .filter_map(|(l, f)| {
                let cut = l.min(skip);
                skip -= cut;
                (l > cut).then_some((l - cut, f))
            })
            .map_while(|(l, f)| {
                let l = l.min(left);
                left -= l;
                (l > 0).then_some((l, f as u32))
            })
            .collect();
        if out.is_empty() {
            return Err(Error::new(
                ErrorKind::Io,
                format!("'{}' answered block status with no extents", self.uri),
            ));
        }
        Ok(out)
    }

    /// The server's minimum block size (1 when it gave none).
    fn min_block(&self) -> u64 {
        self.export.block_size.map_or(1, |b| u64::from(b.0).max(1))
    }

    /// The whole blocks of the minimum size around a range, the last one
    /// cut at the end of the export.
    fn outer(&self, offset: u64, len: u64) -> (u64, u64) {
        let m = self.min_block();
        let a = offset / m * m;
        let e = (offset + len)
            .next_multiple_of(m)
            .min(self.size().max(offset + len));
        (a, e)
    }

    /// Reads `len` bytes at `offset` as they are (aligned by the caller).
    fn read_raw(&self, offset: u64, len: u64) -> Result<AlignedBuf> {
        let pieces = self.pieces(CMD_READ, 0, offset, len);
        let buf = self.run(&pieces, Some(AlignedBuf::new(len as usize, 8)?), None)?;
        Ok(buf.expect("a read gives its buffer back"))
    }

    /// Writes `buf` at `offset` as it is (aligned by the caller), keeping
    /// the promise of `fua`.
    fn write_raw(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let len = buf.len() as u64;
        let (fua, flush) = self.fua_plan(fua, len, self.max_request());
        let pieces = self.pieces(CMD_WRITE, fua, offset, len);
        self.run(&pieces, None, Some(buf))?;
        if flush {
            self.flush()?;
        }
        Ok(())
    }

    /// Whether a request can go out as it is: the server gave no minimum
    /// block size above 1 (then reads must be aligned and writes take
    /// the range lock, which the synchronous path does).
    fn plain_blocks(&self) -> bool {
        self.min_block() == 1
    }

    /// Whether replies are structured (negotiated, or with extended headers).
    pub fn structured_replies(&self) -> bool {
        self.export.structured
    }

    /// Whether the connection uses extended headers (64-bit lengths).
    pub fn extended_headers(&self) -> bool {
        self.export.extended
    }

    /// The export's transmission flags.
    pub fn flags(&self) -> u16 {
        self.export.flags
    }

    fn has(&self, flag: u16) -> bool {
        self.export.flags & flag != 0
    }

    fn max_request(&self) -> u64 {
        u64::from(
            self.export
                .block_size
                .map_or(DEFAULT_MAX, |b| b.2.min(DEFAULT_MAX)),
        )
    }

    fn writable(&self) -> Result<()> {
        if self.has(TFLAG_READ_ONLY) {
            Err(Error::new(
                ErrorKind::PermissionDenied,
                format!("'{}' is read-only", self.uri),
            ))
        } else {
            Ok(())
        }
    }

    /// The pieces of `command` over `offset..offset+len` that the server
    /// takes, each with its position from `offset`.
    fn pieces(&self, command: u16, flags: u16, offset: u64, len: u64) -> Vec<Piece> {
        // Commands without a payload may be longer (up to 4 GiB - 1).
        let max = self.max_request();
        let step = if command == CMD_READ || command == CMD_WRITE {
            max
        } else {
            u64::from(u32::MAX) / max * max
        };
        let mut out = Vec::with_capacity(len.div_ceil(step).max(1) as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(step);
            out.push(Piece {
                command,
                flags,
                offset: offset + done,
                length: n,
                at: done as usize,
            });
            done += n;
        }
        out
    }

    /// Sends all pieces of a request on one connection, then waits for them.
    fn run(
        &self,
        pieces: &[Piece],
        buf: Option<AlignedBuf>,
        payload: Option<&[u8]>,
    ) -> Result<Option<AlignedBuf>> {
        let group = Group::new(pieces.len(), buf, None);
        self.conn().send(&group, pieces, payload);
        group.release(None);
        group.wait().map(|(buf, _)| buf)
    }

    /// Sends a request without waiting; its completion goes to `cq`.
    fn start(
        &self,
        tag: u64,
        pieces: &[Piece],
        buf: Option<AlignedBuf>,
        payload_buf: Option<(AlignedBuf, std::ops::Range<usize>)>,
        cq: &CompletionQueue,
    ) {
        let group = Group::new(pieces.len(), buf, Some((cq.clone(), tag)));
        let conn = self.conn();
        match payload_buf {
            Some((b, range)) => {
                conn.send(&group, pieces, b.get(range));
                group.release(Some(b));
            }
            None => {
                conn.send(&group, pieces, None);
                group.release(None);
            }
        }
    }

    /// FUA for a request of `pieces` pieces: native when the server has it
    /// (on each piece, or a flush after several), else a flush after.
    fn fua_plan(&self, fua: bool, len: u64, step: u64) -> (u16, bool) {
        if !fua {
            return (0, false);
        }
        if !self.has(TFLAG_SEND_FUA) {
            return (0, self.has(TFLAG_SEND_FLUSH));
        }
        let (native, flush) = split_fua(self, true, len.div_ceil(step).max(1));
        (if native { CMD_FLAG_FUA } else { 0 }, flush)
    }
}

impl BlockDevice for NbdClient {
    fn size(&self) -> u64 {
        self.export.size
    }

    fn capabilities(&self) -> Capabilities {
        let w = !self.has(TFLAG_READ_ONLY);
        Capabilities {
            can_write: w,
            can_flush: w && self.has(TFLAG_SEND_FLUSH),
            can_fua: w && (self.has(TFLAG_SEND_FUA) || self.has(TFLAG_SEND_FLUSH)),
            can_trim: w && self.has(TFLAG_SEND_TRIM),
            can_write_zeroes: w,
            can_zero: w && self.has(TFLAG_SEND_WRITE_ZEROES),
            can_fast_zero: w && self.has(TFLAG_SEND_WRITE_ZEROES) && self.has(TFLAG_SEND_FAST_ZERO),
            can_extents: self.allocation.is_some(),
            can_multi_conn: self.has(TFLAG_CAN_MULTI_CONN),
            can_cache: self.has(TFLAG_SEND_CACHE),
            is_rotational: self.has(TFLAG_ROTATIONAL),
        }
    }

    fn block_size(&self) -> BlockSizeLimits {
        match self.export.block_size {
            Some((minimum, preferred, maximum)) => BlockSizeLimits {
                minimum,
                preferred,
                maximum,
            },
            None => BlockSizeLimits::default(),
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self.size(), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // The server's minimum block size is obeyed: an unaligned read
        // reads the whole blocks around it.
        let (a, e) = self.outer(offset, len);
        let data = self.read_raw(a, e - a)?;
        let from = (offset - a) as usize;
        buf.copy_from_slice(&data[from..from + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.writable()?;
        let len = buf.len() as u64;
        check_range(self.size(), offset, len)?;
        if len == 0 {
            return if flags.fua { self.flush() } else { Ok(()) };
        }
        let (a, e) = self.outer(offset, len);
        if (a, e) == (offset, offset + len) {
            let _shared = (self.min_block() > 1).then(|| self.rmw.lock(a, e, false));
            return self.write_raw(buf, offset, flags.fua);
        }
        // Read-modify-write of the whole blocks around it, which no other
        // write touches meanwhile.
        let _whole = self.rmw.lock(a, e, true);
        let m = self.min_block();
        let mut block = if e - a <= 2 * m {
            self.read_raw(a, e - a)?
        } else {
            let mut b = AlignedBuf::new((e - a) as usize, 8)?;
            let head = self.read_raw(a, m)?;
            b[..m as usize].copy_from_slice(&head[..m as usize]);
            let tail_at = (e - a - m) as usize;
            let tail = self.read_raw(e - m, m)?;
            b[tail_at..].copy_from_slice(&tail[..m as usize]);
            b
        };
        let from = (offset - a) as usize;
        block[from..from + buf.len()].copy_from_slice(buf);
        self.write_raw(&block[..(e - a) as usize], a, flags.fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.writable()?;
        check_range(self.size(), offset, len)?;
        if !self.has(TFLAG_SEND_WRITE_ZEROES) || (flags.fast && !self.has(TFLAG_SEND_FAST_ZERO)) {
            if flags.fast {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
            return write_zero_buffer(self, offset, len, flags.fua);
        }
        let m = self.min_block();
        let end = offset + len;
        let (inner_a, inner_e) = (offset.next_multiple_of(m), end / m * m);
        if m > 1 && (inner_a != offset || inner_e != end) {
            // Partial blocks at the edges are written as zeros; zeroing
            // that needs a read-modify-write is not fast.
            if flags.fast {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
            if inner_a >= inner_e {
                return write_zero_buffer(self, offset, len, flags.fua);
            }
            write_zero_buffer(self, offset, inner_a - offset, false)?;
            self.write_zeroes(
                inner_a,
                inner_e - inner_a,
                ZeroFlags {
                    fua: false,
                    ..flags
                },
            )?;
            write_zero_buffer(self, inner_e, end - inner_e, false)?;
            return if flags.fua { self.flush() } else { Ok(()) };
        }
        let _shared = (m > 1).then(|| self.rmw.lock(offset, end, false));
        let (fua, flush) = self.fua_plan(flags.fua, len, u64::from(u32::MAX));
        let pieces = self.pieces(CMD_WRITE_ZEROES, zero_flags(fua, flags), offset, len);
        if !pieces.is_empty() {
            self.run(&pieces, None, None)?;
        }
        if flush {
            self.flush()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.writable()?;
        check_range(self.size(), offset, len)?;
        // A trim may do less than asked: only the whole blocks inside.
        let m = self.min_block();
        let (offset, len) = {
            let (a, e) = (offset.next_multiple_of(m), (offset + len) / m * m);
            (a, e.saturating_sub(a))
        };
        if self.has(TFLAG_SEND_TRIM) && len > 0 {
            let _shared = (m > 1).then(|| self.rmw.lock(offset, offset + len, false));
            let (fua, flush) = self.fua_plan(flags.fua, len, u64::from(u32::MAX));
            self.run(&self.pieces(CMD_TRIM, fua, offset, len), None, None)?;
            if flush {
                self.flush()?;
            }
        } else if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if self.has(TFLAG_SEND_FLUSH) {
            self.conn().request(CMD_FLUSH, 0, 0, 0, None)?;
        }
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size(), offset, len)?;
        if self.has(TFLAG_SEND_CACHE) && len > 0 {
            let (a, e) = self.outer(offset, len);
            self.run(&self.pieces(CMD_CACHE, 0, a, e - a), None, None)?;
        }
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size(), offset, len)?;
        let Some(id) = self.allocation else {
            return Ok(vec![Extent::data(len)]);
        };
        // Like a file, an export holds its bytes at their own offsets
        // (QEMU's nbd driver reports them so).
        let mut out = Vec::new();
        let mut pos = offset;
        for (length, flags) in self.status_of(id, offset, len, 0)? {
            let mut e = if flags & STATE_HOLE != 0 {
                Extent::hole(length)
            } else {
                Extent::data(length)
            };
            e.flags.zero = flags & STATE_ZERO != 0;
            // Neither data nor zero says nothing of the bytes: not
            // allocated and at no place, as QEMU's nbd driver reports it.
            e.flags.present = e.flags.data || e.flags.zero;
            if e.flags.present {
                e = e.at_host(pos);
            }
            diskit_core::extent::push_merged(&mut out, e);
            pos += length;
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        self.uri.clone()
    }

    /// Connects again (one connection; multi-conn ones are added again at
    /// the next submitted request) and sends new requests over it. The
    /// export must look as it did: same size, flags and context ids.
    /// Requests in flight finish (or fail) on the old connections.
    fn reopen(&self) -> Result<()> {
        let Some(parsed) = &self.reconnect else {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!("'{}': no address to connect to again", self.uri),
            ));
        };
        let asked: Vec<&str> = self.asked.iter().map(String::as_str).collect();
        let stream = connect_stream(parsed)?;
        let (stream, neg) = negotiate(stream, &parsed.export, &asked, self.tls.as_ref())
            .map_err(|e| e.context(format!("'{}'", self.uri)))?;
        if neg.size != self.export.size
            || neg.flags != self.export.flags
            || neg.contexts != self.export.contexts
            || neg.block_size != self.export.block_size
            || neg.structured != self.export.structured
            || neg.extended != self.export.extended
        {
            return Err(Error::new(
                ErrorKind::Io,
                format!(
                    "'{}': the export is not what it was (size, flags, block sizes, reply style or metadata contexts changed)",
                    self.uri
                ),
            ));
        }
        let conn = Connection::start_with(stream, neg.structured, neg.extended)?;
        *diskit_core::sync::write(&self.links) = Links::new(vec![conn]);
        Ok(())
    }

    fn close(&self) -> Result<()> {
        for c in self.links().all() {
            c.close();
        }
        if let Some(s) = &self.subprocess {
            s.stop();
        }
        Ok(())
    }

    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        self.spread();
        // What cannot go out as it is (out of range, read-only, zeroing the
        // server lacks, FUA that needs a flush after) runs synchronously,
        // which reports the error or does the fallback.
        match req {
            Request::Read { offset, buf, len }
                if len > 0
                    && (self.plain_blocks()
                        || self.outer(offset, len as u64) == (offset, offset + len as u64))
                    && len <= buf.len()
                    && check_range(self.size(), offset, len as u64).is_ok() =>
            {
                let pieces = self.pieces(CMD_READ, 0, offset, len as u64);
                self.start(tag, &pieces, Some(buf), None, cq);
            }
            Request::ReadTo {
                offset,
                buf,
                len,
                sink,
            } if len > 0
                && (self.plain_blocks()
                    || self.outer(offset, len as u64) == (offset, offset + len as u64))
                && len <= buf.len()
                && check_range(self.size(), offset, len as u64).is_ok() =>
            {
                let pieces = self.pieces(CMD_READ, 0, offset, len as u64);
                let group =
                    Group::with_sink(pieces.len(), Some(buf), Some((cq.clone(), tag)), Some(sink));
                // A copy queues many: the connection sends each as the
                // replies to earlier ones make room.
                self.conn().send_streaming(&group, &pieces);
                group.release(None);
            }
            Request::Write {
                offset,
                buf,
                range,
                flags,
            } if !range.is_empty()
                && self.plain_blocks()
                && range.end <= buf.len()
                && self.writable().is_ok()
                && check_range(self.size(), offset, range.len() as u64).is_ok()
                && !self
                    .fua_plan(flags.fua, range.len() as u64, self.max_request())
                    .1 =>
            {
                let len = range.len() as u64;
                let (fua, _) = self.fua_plan(flags.fua, len, self.max_request());
                let pieces = self.pieces(CMD_WRITE, fua, offset, len);
                self.start(tag, &pieces, None, Some((buf, range)), cq);
            }
            Request::Zero { offset, len, flags }
                if len > 0
                    && self.plain_blocks()
                    && self.writable().is_ok()
                    && check_range(self.size(), offset, len).is_ok()
                    && self.has(TFLAG_SEND_WRITE_ZEROES)
                    && (!flags.fast || self.has(TFLAG_SEND_FAST_ZERO))
                    && !self.fua_plan(flags.fua, len, u64::from(u32::MAX)).1 =>
            {
                let (fua, _) = self.fua_plan(flags.fua, len, u64::from(u32::MAX));
                let pieces = self.pieces(CMD_WRITE_ZEROES, zero_flags(fua, flags), offset, len);
                self.start(tag, &pieces, None, None, cq);
            }
            // A server without write-zeroes gets the zeros as writes, all
            // in flight at once.
            Request::Zero { offset, len, flags }
                if len > 0
                    && !flags.fast
                    && self.plain_blocks()
                    && !self.has(TFLAG_SEND_WRITE_ZEROES)
                    && self.writable().is_ok()
                    && check_range(self.size(), offset, len).is_ok()
                    && !self.fua_plan(flags.fua, len, ZERO_WRITE as u64).1 =>
            {
                let step = self.max_request().min(ZERO_WRITE as u64);
                let (fua, _) = self.fua_plan(flags.fua, len, step);
                let pieces: Vec<Piece> = (0..len.div_ceil(step))
                    .map(|i| Piece {
                        command: CMD_WRITE,
                        flags: fua,
                        offset: offset + i * step,
                        length: step.min(len - i * step),
                        at: 0,
                    })
                    .collect();
                let group = Group::new(pieces.len(), None, Some((cq.clone(), tag)));
                self.conn().send(&group, &pieces, Some(&ZEROS[..]));
                group.release(None);
            }
            req => cq.push(diskit_core::aio::run(self, tag, req)),
        }
    }

    fn queue_depth(&self) -> usize {
        let conns = if self.links().extra.get().is_none()
            && self.reconnect.is_some()
            && self.has(TFLAG_CAN_MULTI_CONN)
        {
            lazy_connections()
        } else {
            self.connections()
        };
        REQUESTS_PER_CONNECTION * conns
    }
}

/// The NBD flags of a write-zeroes request.
fn zero_flags(fua: u16, flags: ZeroFlags) -> u16 {
    let mut f = fua;
    if !flags.may_trim {
        f |= CMD_FLAG_NO_HOLE;
    }
    if flags.fast {
        f |= CMD_FLAG_FAST_ZERO;
    }
    f
}

/// An export as storage under an image format: of a fixed size.
impl Storage for NbdClient {
    fn location(&self) -> &str {
        &self.uri
    }

    fn protocol(&self) -> &'static str {
        "nbd"
    }
}
