//! TLS (NBD_OPT_STARTTLS) over any [`Transport`], with rustls.
//!
//! STARTTLS splits the plain transport into its halves and runs one rustls
//! server connection over them. The connection sits behind a mutex that is
//! only ever held for CPU work (feeding ciphertext in, taking plaintext
//! out, encrypting): the reader thread blocks on the socket without it, and
//! a writer encrypts under it, then takes the socket's write lock before
//! letting go of it, so records reach the socket in the order they were
//! sealed while the reader keeps decrypting. The result is one more
//! [`Transport`]: the handshake goes on over it and transmission splits it
//! like any other stream.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConnection};

use super::transport::{Halves, Transport};

/// When clients must use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// TLS is offered; plain-text clients are served too (`--tls=on`).
    Allow,
    /// Nothing is served before STARTTLS (`--tls=require`): every other
    /// option is refused with NBD_REP_ERR_TLS_REQD.
    Require,
}

/// A server's TLS settings: the mode and the rustls configuration.
#[derive(Clone)]
pub struct TlsConfig {
    mode: TlsMode,
    rustls: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// TLS in `mode` with a ready rustls configuration.
    pub fn new(mode: TlsMode, rustls: Arc<rustls::ServerConfig>) -> TlsConfig {
        TlsConfig { mode, rustls }
    }

    /// X.509 certificates from a directory laid out like nbdkit's and
    /// qemu's: `server-cert.pem` (the certificate, chain after it),
    /// `server-key.pem`, and with `verify_peer` `ca-cert.pem`, against
    /// which every client must present a valid certificate.
    pub fn from_dir(mode: TlsMode, dir: &Path, verify_peer: bool) -> io::Result<TlsConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = read_certs(&dir.join("server-cert.pem"))?;
        let key_path = dir.join("server-key.pem");
        let key = PrivateKeyDer::from_pem_file(&key_path)
            .map_err(|e| invalid(&key_path, format!("no usable private key: {e}")))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| io::Error::other(format!("TLS setup: {e}")))?;
        let builder = if verify_peer {
            let ca_path = dir.join("ca-cert.pem");
            let mut roots = RootCertStore::empty();
            for cert in read_certs(&ca_path)? {
                roots
                    .add(cert)
                    .map_err(|e| invalid(&ca_path, format!("bad CA certificate: {e}")))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid(&ca_path, e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder
            .with_single_cert(certs, key)
            .map_err(|e| invalid(&dir.join("server-cert.pem"), e.to_string()))?;
        Ok(TlsConfig::new(mode, Arc::new(config)))
    }

    /// The mode.
    pub fn mode(&self) -> TlsMode {
        self.mode
    }
}

fn invalid(path: &Path, message: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: {message}", path.display()),
    )
}

fn read_certs(path: &PathBuf) -> io::Result<Vec<CertificateDer<'static>>> {
    let pem =
        fs::read(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(path, format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "no certificate".into()));
    }
    Ok(certs)
}

/// Runs the server side of a TLS handshake over `plain` (right after the
/// STARTTLS acknowledgement) and returns the encrypted transport.
pub fn upgrade(plain: Box<dyn Transport>, config: &TlsConfig) -> io::Result<Box<dyn Transport>> {
    let peer = format!("{} (TLS)", plain.peer());
    let Halves {
        mut reader,
        mut writer,
        shutdown,
    } = plain.split()?;
    let mut conn = ServerConnection::new(config.rustls.clone())
        .map_err(|e| io::Error::other(format!("TLS setup: {e}")))?;
    handshake(&mut conn, &mut reader, &mut writer)?;
    let shared = Arc::new(Shared {
        conn: Mutex::new(conn),
        out: Mutex::new(writer),
    });
    Ok(Box::new(TlsStream {
        reader: TlsReader {
            shared: shared.clone(),
            socket: reader,
            buf: vec![0; 64 * 1024],
            start: 0,
            end: 0,
            eof: false,
        },
        writer: TlsWriter {
            shared,
            sealed: Vec::new(),
        },
        shutdown,
        peer,
    }))
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

/// Drives the handshake to its end, blocking.
fn handshake(
    conn: &mut ServerConnection,
    reader: &mut dyn Read,
    writer: &mut dyn Write,
) -> io::Result<()> {
    loop {
        while conn.wants_write() {
            conn.write_tls(writer)?;
        }
        writer.flush()?;
        if !conn.is_handshaking() {
            return Ok(());
        }
        if conn.read_tls(reader)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "client closed the connection during the TLS handshake",
            ));
        }
        if let Err(e) = conn.process_new_packets() {
            // Tell the client why (an alert), then give up.
            let _ = conn.write_tls(writer);
            let _ = writer.flush();
            return Err(tls_error(e));
        }
    }
}

/// The rustls connection and the socket's write half, shared by the two
/// halves of a [`TlsStream`]. Lock order: `conn`, then `out`.
struct Shared {
    conn: Mutex<ServerConnection>,
    out: Mutex<Box<dyn Write + Send>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Seals whatever the connection wants to send into `sealed`, then
    /// writes it out, holding `out` before `conn` is released so that
    /// records keep their order.
    fn send_pending(
        &self,
        mut conn: MutexGuard<'_, ServerConnection>,
        sealed: &mut Vec<u8>,
    ) -> io::Result<()> {
        sealed.clear();
        while conn.wants_write() {
            conn.write_tls(sealed)?;
        }
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
    socket: Box<dyn Read + Send>,
    /// Ciphertext read from the socket; `start..end` not yet given to
    /// rustls.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    eof: bool,
}

impl Read for TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let mut alerts = Vec::new();
        loop {
            let mut conn = lock(&self.shared.conn);
            match conn.reader().read(out) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if self.start == self.end {
                if self.eof {
                    // rustls has seen the end and still has nothing.
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                drop(conn);
                let n = loop {
                    match self.socket.read(&mut self.buf) {
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        r => break r?,
                    }
                };
                self.start = 0;
                self.end = n;
                self.eof = n == 0;
                conn = lock(&self.shared.conn);
            }
            let mut pending = &self.buf[self.start..self.end];
            // Plaintext was drained above, so rustls takes some of it (or
            // notes the end of the stream when `pending` is empty).
            let taken = conn.read_tls(&mut pending)?;
            self.start += taken;
            let processed = conn.process_new_packets();
            // Alerts, key update answers: out they go, in order.
            self.shared.send_pending(conn, &mut alerts)?;
            processed.map_err(tls_error)?;
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
        let n = conn.writer().write(buf)?;
        self.shared.send_pending(conn, &mut self.sealed)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        lock(&self.shared.out).flush()
    }
}

/// A TLS session over a plain transport.
struct TlsStream {
    reader: TlsReader,
    writer: TlsWriter,
    shutdown: Box<dyn Fn() + Send + Sync>,
    peer: String,
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
    conn.send_close_notify();
    let mut sealed = Vec::new();
    while conn.wants_write() {
        if conn.write_tls(&mut sealed).is_err() {
            return;
        }
    }
    if let Ok(mut out) = shared.out.try_lock() {
        let _ = out.write_all(&sealed);
        let _ = out.flush();
    }
}
