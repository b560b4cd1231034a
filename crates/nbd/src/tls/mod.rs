//! TLS sessions over any [`Transport`], for both ends of a connection: the
//! server after it acknowledges NBD_OPT_STARTTLS
//! ([`crate::server::tls`]), the client of an `nbds://` URI after the
//! server acknowledges it ([`crate::client::tls`]). Two engines: rustls
//! for X.509 certificates ([`x509`]) and the system's OpenSSL 3, loaded
//! at the first use, for pre-shared keys ([`psk`]; rustls has no external
//! PSK key exchange).
//!
//! Both engines do no I/O of their own: they are a `Session` that is fed
//! ciphertext and gives back plaintext, and the other way round. This
//! module owns the I/O. `upgrade` splits the plain transport into its
//! halves and runs one session over them. The session sits behind a mutex
//! that is only ever held for CPU work (feeding ciphertext in, taking
//! plaintext out, encrypting): the reader thread blocks on the socket
//! without it, and a writer encrypts under it, then takes the socket's
//! write lock before letting go of it, so records reach the socket in the
//! order they were sealed while the reader keeps decrypting. The result is
//! one more [`Transport`], a [`TlsStream`]: the handshake goes on over it
//! and transmission splits it like any other stream.

pub mod dn;
pub mod psk;
pub mod x509;

use std::io::{self, IoSlice, Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

use diskit_core::sync::lock;

use crate::transport::{Halves, Transport};

/// One end of one TLS session, doing no I/O: the caller feeds it the
/// peer's ciphertext and sends what it seals.
pub(crate) trait Session: Send {
    /// Whether the handshake is still going on.
    fn is_handshaking(&self) -> bool;

    /// Takes ciphertext from the peer (some or all of `input`; an empty
    /// `input` means the peer's stream ended) and processes it,
    /// advancing the handshake. Returns how many bytes it took.
    fn feed(&mut self, input: &[u8]) -> io::Result<usize>;

    /// Plaintext from the peer: `Ok(0)` once the peer has closed the
    /// session, `WouldBlock` when more ciphertext is needed first.
    fn read_plain(&mut self, out: &mut [u8]) -> io::Result<usize>;

    /// Encrypts (some of) `data` for the peer.
    fn write_plain(&mut self, data: &[u8]) -> io::Result<usize>;

    /// Encrypts (some of) the concatenation of `bufs` for the peer; by
    /// default the first non-empty buffer alone.
    fn write_plain_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match bufs.iter().find(|b| !b.is_empty()) {
            Some(b) => self.write_plain(b),
            None => Ok(0),
        }
    }

    /// Appends the records waiting to go to the peer to `out`.
    fn take_sealed(&mut self, out: &mut Vec<u8>) -> io::Result<()>;

    /// Queues a close_notify alert.
    fn close_notify(&mut self);

    /// What was negotiated (protocol version, cipher suite, the PSK
    /// identity), for logs.
    fn describe(&self) -> String;

    /// The subject of the certificate the peer presented, as QEMU names
    /// it ([`dn`]); `None` without one (pre-shared keys, or a server that
    /// asks for none).
    fn peer_subject(&self) -> Option<String> {
        None
    }
}

/// Runs the TLS handshake of `session` over `plain` (right after the
/// STARTTLS acknowledgement) and returns the encrypted transport. `peer`
/// names the other end in messages ("client" or "server").
pub(crate) fn upgrade(
    plain: Box<dyn Transport>,
    session: Box<dyn Session>,
    peer: &'static str,
) -> io::Result<TlsStream> {
    let name = plain.peer();
    let Halves {
        reader,
        writer,
        shutdown,
        ..
    } = plain.split()?;
    let shared = Arc::new(Shared {
        conn: Mutex::new(session),
        out: Mutex::new(writer),
    });
    let mut reader = TlsReader {
        shared: shared.clone(),
        inbox: Inbox::new(reader),
    };
    reader.handshake(peer)?;
    let negotiated = lock(&shared.conn).describe();
    Ok(TlsStream {
        reader,
        writer: TlsWriter {
            shared,
            sealed: Vec::new(),
        },
        shutdown,
        peer: format!("{name} ({negotiated})"),
        negotiated,
    })
}

/// The session and the socket's write half, shared by the two halves of a
/// [`TlsStream`]. Lock order: `conn`, then `out`.
struct Shared {
    conn: Mutex<Box<dyn Session>>,
    out: Mutex<Box<dyn Write + Send>>,
}

impl Shared {
    /// Seals whatever the session wants to send into `sealed`, then
    /// writes it out, holding `out` before `conn` is released so that
    /// records keep their order.
    fn send_pending(
        &self,
        mut conn: MutexGuard<'_, Box<dyn Session>>,
        sealed: &mut Vec<u8>,
    ) -> io::Result<()> {
        sealed.clear();
        conn.take_sealed(sealed)?;
        if sealed.is_empty() {
            return Ok(());
        }
        let mut out = lock(&self.out);
        drop(conn);
        out.write_all(sealed)?;
        out.flush()
    }
}

/// The read half: decrypts what the socket brings.
struct TlsReader {
    shared: Arc<Shared>,
    inbox: Inbox,
}

/// Ciphertext from the socket on its way into the session.
struct Inbox {
    socket: Box<dyn Read + Send>,
    /// `start..end` is not yet given to the session.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    eof: bool,
}

impl Inbox {
    fn new(socket: Box<dyn Read + Send>) -> Inbox {
        Inbox {
            socket,
            buf: vec![0; 64 * 1024],
            start: 0,
            end: 0,
            eof: false,
        }
    }

    /// Whether everything read so far went to the session.
    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Reads more ciphertext from the socket (the buffer is used up),
    /// without holding the session.
    fn fill(&mut self) -> io::Result<()> {
        let n = loop {
            match self.socket.read(&mut self.buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        self.start = 0;
        self.end = n;
        self.eof = n == 0;
        Ok(())
    }

    /// Gives the session the buffered ciphertext (the end of the stream
    /// when there is none left), then sends what it has to say (alerts,
    /// handshake messages, key update answers).
    fn feed(
        &mut self,
        shared: &Shared,
        mut conn: MutexGuard<'_, Box<dyn Session>>,
    ) -> io::Result<()> {
        let pending = &self.buf[self.start..self.end];
        let fed = conn.feed(pending);
        if let Ok(taken) = fed {
            if taken == 0 && !pending.is_empty() {
                return Err(io::Error::other("TLS: the session took no data"));
            }
            self.start += taken;
        }
        let mut sealed = Vec::new();
        let sent = shared.send_pending(conn, &mut sealed);
        fed?;
        sent
    }
}

impl TlsReader {
    /// Drives the handshake to its end, blocking. Ciphertext the peer
    /// sent after its last handshake message stays buffered for reads.
    fn handshake(&mut self, peer: &str) -> io::Result<()> {
        let mut sealed = Vec::new();
        loop {
            let conn = lock(&self.shared.conn);
            let handshaking = conn.is_handshaking();
            self.shared.send_pending(conn, &mut sealed)?;
            if !handshaking {
                return Ok(());
            }
            if self.inbox.is_empty() {
                if self.inbox.eof {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("{peer} closed the connection during the TLS handshake"),
                    ));
                }
                self.inbox.fill()?;
            }
            self.inbox.feed(&self.shared, lock(&self.shared.conn))?;
        }
    }
}

impl Read for TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            let mut conn = lock(&self.shared.conn);
            match conn.read_plain(out) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                read => {
                    // What reading produced (an alert, a key update
                    // answer) goes out now.
                    let sent = self.shared.send_pending(conn, &mut Vec::new());
                    let n = read?;
                    sent?;
                    return Ok(n);
                }
            }
            if self.inbox.is_empty() {
                if self.inbox.eof {
                    // The session has seen the end and still has nothing.
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                drop(conn);
                self.inbox.fill()?;
                conn = lock(&self.shared.conn);
            }
            // Plaintext was drained above, so the session takes some of
            // the ciphertext (or notes the end of the stream).
            self.inbox.feed(&self.shared, conn)?;
        }
    }
}

/// The write half: encrypts and sends.
struct TlsWriter {
    shared: Arc<Shared>,
    sealed: Vec<u8>,
}

impl Write for TlsWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut conn = lock(&self.shared.conn);
        let n = conn.write_plain(buf)?;
        self.shared.send_pending(conn, &mut self.sealed)?;
        Ok(n)
    }

    /// Several buffers (a request's header and its data) go out in the
    /// same records where the engine allows it.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut conn = lock(&self.shared.conn);
        let n = conn.write_plain_vectored(bufs)?;
        self.shared.send_pending(conn, &mut self.sealed)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        lock(&self.shared.out).flush()
    }
}

/// A TLS session over a plain transport, its handshake done.
pub struct TlsStream {
    reader: TlsReader,
    writer: TlsWriter,
    shutdown: Box<dyn Fn() + Send + Sync>,
    peer: String,
    negotiated: String,
}

impl TlsStream {
    /// What was negotiated (protocol version, cipher suite, and with
    /// pre-shared keys the identity).
    pub fn negotiated(&self) -> &str {
        &self.negotiated
    }

    /// The subject of the certificate the peer presented (see
    /// [`dn`]), if it presented one.
    pub fn peer_subject(&self) -> Option<String> {
        lock(&self.writer.shared.conn).peer_subject()
    }

    /// Ends the session (close_notify) and the connection under it.
    pub fn close(self) {
        close_notify(&self.writer.shared);
        (self.shutdown)();
    }
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.writer.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}

impl Transport for TlsStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        let TlsStream {
            reader,
            writer,
            shutdown,
            ..
        } = *self;
        let shared = writer.shared.clone();
        Ok(Halves {
            reader: Box::new(reader),
            writer: Box::new(writer),
            shutdown: Box::new(move || {
                close_notify(&shared);
                shutdown();
            }),
            // The bytes must be encrypted: no splicing.
            splice_to: None,
        })
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }
}

/// Ends the TLS session politely if nobody is in the middle of using it
/// (never waits: the socket may be stuck).
fn close_notify(shared: &Shared) {
    let Ok(mut conn) = shared.conn.try_lock() else {
        return;
    };
    conn.close_notify();
    let mut sealed = Vec::new();
    if conn.take_sealed(&mut sealed).is_err() {
        return;
    }
    if let Ok(mut out) = shared.out.try_lock() {
        let _ = out.write_all(&sealed);
        let _ = out.flush();
    }
}
