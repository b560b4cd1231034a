//! The NBD client: an export of any NBD server as a [`BlockDevice`] (and as
//! [`Storage`], so that a format can sit on it).
//!
//! [`NbdClient::connect`] takes an NBD URI ([`uri`]); the handshake
//! ([`handshake`]) asks for structured replies and the `base:allocation`
//! context, then NBD_OPT_GO. Requests from any number of threads are in
//! flight at once on the one connection ([`conn`]); requests longer than
//! the server's maximum are split. Capabilities come from the export's
//! transmission flags, extents from block status.

pub mod conn;
pub mod handshake;
pub mod uri;

use std::os::unix::net::UnixStream;

use diskit_core::device::{check_range, split_fua, write_zero_buffer};
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, Result, Storage,
    WriteFlags, ZeroFlags,
};

use crate::proto::consts::*;
use conn::{Connection, Stream};
use handshake::Negotiated;
use uri::{Address, NbdUri};

/// The largest request sent when the server gives no block sizes (the
/// protocol's advice: 32 MiB).
const DEFAULT_MAX: u32 = 32 << 20;
/// The metadata context extents come from.
const BASE_ALLOCATION: &str = "base:allocation";

/// An NBD export, connected.
pub struct NbdClient {
    conn: Connection,
    uri: String,
    export: Negotiated,
    /// The id of `base:allocation`, when the server offers it.
    allocation: Option<u32>,
}

/// Connects a socket to where `uri` points (no handshake).
pub fn connect_stream(uri: &NbdUri) -> Result<Stream> {
    match &uri.address {
        Address::Unix(path) => UnixStream::connect(path)
            .map(Stream::Unix)
            .map_err(|e| Error::from(e).context(format!("connecting to '{path}'"))),
        Address::Tcp { host, port } => std::net::TcpStream::connect((host.as_str(), *port))
            .map(|s| {
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            })
            .map_err(|e| Error::from(e).context(format!("connecting to {host}:{port}"))),
    }
}

impl NbdClient {
    /// Connects to the export an NBD URI names.
    pub fn connect(uri: &str) -> Result<NbdClient> {
        Self::connect_with(uri, &[BASE_ALLOCATION])
    }

    /// Connects asking for the metadata contexts `contexts` (extents come
    /// from `base:allocation` when it is among them).
    pub fn connect_with(uri: &str, contexts: &[&str]) -> Result<NbdClient> {
        let parsed = NbdUri::parse(uri)?;
        if parsed.tls {
            return Err(Error::unsupported(format!(
                "'{uri}': TLS (nbds) is not supported by diskit's NBD client yet"
            )));
        }
        let stream = connect_stream(&parsed)?;
        Self::over_with(stream, &parsed.canonical(), &parsed.export, contexts)
    }

    /// Negotiates `export` over a connected stream and starts transmission;
    /// `uri` names the export in messages and as its storage location.
    pub fn over(stream: Stream, uri: &str, export: &str) -> Result<NbdClient> {
        Self::over_with(stream, uri, export, &[BASE_ALLOCATION])
    }

    fn over_with(
        mut stream: Stream,
        uri: &str,
        export: &str,
        contexts: &[&str],
    ) -> Result<NbdClient> {
        let negotiated = handshake::negotiate(&mut stream, export, contexts)
            .map_err(|e| e.context(format!("'{uri}'")))?;
        let allocation = negotiated.contexts.get(BASE_ALLOCATION).copied();
        let conn = Connection::start(stream, negotiated.structured)?;
        Ok(NbdClient {
            conn,
            uri: uri.to_string(),
            export: negotiated,
            allocation,
        })
    }

    /// The raw block status descriptors (length, flags) of `context` for a
    /// prefix of `offset..offset+len`, as the server sends them.
    pub fn block_status(&self, context: &str, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        check_range(self.size(), offset, len)?;
        let id = *self.export.contexts.get(context).ok_or_else(|| {
            Error::unsupported(format!(
                "'{}' does not offer the context '{context}'",
                self.uri
            ))
        })?;
        self.status_of(id, offset, len)
    }

    /// Block status of context `id` for a prefix of the range (in range),
    /// clipped to what was asked; an empty answer is an error.
    fn status_of(&self, id: u32, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        let n = len.min(u64::from(u32::MAX));
        let answer = self.conn.request(CMD_BLOCK_STATUS, 0, offset, n, None)?;
        let mut left = n;
        let out: Vec<(u64, u32)> = answer
            .status
            .into_iter()
            .filter(|(c, _)| *c == id)
            .flat_map(|(_, d)| d)
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

    /// Sends `command` over `offset..offset+len` in pieces the server takes.
    fn in_pieces(
        &self,
        command: u16,
        offset: u64,
        len: u64,
        mut each: impl FnMut(u64, u64) -> Result<()>,
    ) -> Result<()> {
        // Commands without a payload may be longer (up to 4 GiB - 1).
        let step = if command == CMD_READ || command == CMD_WRITE {
            self.max_request()
        } else {
            u64::from(u32::MAX) / self.max_request() * self.max_request()
        };
        let mut done = 0;
        while done < len {
            let n = (len - done).min(step);
            each(offset + done, n)?;
            done += n;
        }
        Ok(())
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
        check_range(self.size(), offset, buf.len() as u64)?;
        self.in_pieces(CMD_READ, offset, buf.len() as u64, |at, n| {
            let answer = self.conn.request(CMD_READ, 0, at, n, None)?;
            let from = (at - offset) as usize;
            buf[from..from + n as usize].copy_from_slice(&answer.data);
            Ok(())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.writable()?;
        check_range(self.size(), offset, buf.len() as u64)?;
        let (fua, flush) = self.fua_plan(flags.fua, buf.len() as u64, self.max_request());
        self.in_pieces(CMD_WRITE, offset, buf.len() as u64, |at, n| {
            let from = (at - offset) as usize;
            let data = &buf[from..from + n as usize];
            self.conn
                .request(CMD_WRITE, fua, at, n, Some(data))
                .map(drop)
        })?;
        if flush {
            self.flush()?;
        }
        Ok(())
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
        let (fua, flush) = self.fua_plan(flags.fua, len, u64::from(u32::MAX));
        let mut cmd_flags = fua;
        if !flags.may_trim {
            cmd_flags |= CMD_FLAG_NO_HOLE;
        }
        if flags.fast {
            cmd_flags |= CMD_FLAG_FAST_ZERO;
        }
        self.in_pieces(CMD_WRITE_ZEROES, offset, len, |at, n| {
            self.conn
                .request(CMD_WRITE_ZEROES, cmd_flags, at, n, None)
                .map(drop)
        })?;
        if flush {
            self.flush()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.writable()?;
        check_range(self.size(), offset, len)?;
        if self.has(TFLAG_SEND_TRIM) && len > 0 {
            let (fua, flush) = self.fua_plan(flags.fua, len, u64::from(u32::MAX));
            self.in_pieces(CMD_TRIM, offset, len, |at, n| {
                self.conn.request(CMD_TRIM, fua, at, n, None).map(drop)
            })?;
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
            self.conn.request(CMD_FLUSH, 0, 0, 0, None)?;
        }
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size(), offset, len)?;
        if self.has(TFLAG_SEND_CACHE) && len > 0 {
            self.in_pieces(CMD_CACHE, offset, len, |at, n| {
                self.conn.request(CMD_CACHE, 0, at, n, None).map(drop)
            })?;
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
        for (length, flags) in self.status_of(id, offset, len)? {
            let mut e = if flags & STATE_HOLE != 0 {
                Extent::hole(length)
            } else {
                Extent::data(length)
            };
            e.flags.zero = flags & STATE_ZERO != 0;
            diskit_core::extent::push_merged(&mut out, e.at_host(pos));
            pos += length;
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        self.uri.clone()
    }

    fn close(&self) -> Result<()> {
        self.conn.close();
        Ok(())
    }
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
