//! The NBD server: any set of [`BlockDevice`](diskit_core::BlockDevice)s as
//! exports, over any byte stream, one thread per connection plus a bounded
//! pool of workers per connection.

pub mod budget;
pub mod export;
pub mod handshake;
pub mod ops;
pub mod stats;
pub mod tls;
pub mod transmission;
pub mod transport;

use std::io;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use export::{Export, ExportSet, MetaContext};
pub use handshake::HandshakeEnd;
pub use stats::{Stats, StatsSnapshot};
pub use tls::{TlsConfig, TlsMode};
pub use transmission::End;
pub use transport::{Halves, Pipe, Transport};

/// Server settings.
#[derive(Debug, Clone, Copy)]
pub struct ServerConfig {
    /// Worker threads per connection (0: requests run one at a time in the
    /// connection's reader thread).
    pub threads: usize,
    /// Bytes of request data in flight per connection before the reader
    /// waits (at least the maximum payload is always allowed).
    pub max_in_flight: u64,
    /// Log one line per connection to stderr.
    pub verbose: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            threads: 16,
            max_in_flight: 64 << 20,
            verbose: false,
        }
    }
}

/// How a connection ended.
#[derive(Debug)]
pub enum ConnectionEnd {
    /// It ended during the handshake.
    Handshake(HandshakeEnd),
    /// It ended during transmission.
    Transmission(End),
}

impl std::fmt::Display for ConnectionEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectionEnd::Handshake(HandshakeEnd::Aborted) => {
                f.write_str("client aborted the handshake")
            }
            ConnectionEnd::Handshake(HandshakeEnd::Protocol(m)) => {
                write!(f, "handshake protocol violation: {m}")
            }
            ConnectionEnd::Handshake(HandshakeEnd::Io(e)) => write!(f, "handshake I/O error: {e}"),
            ConnectionEnd::Transmission(e) => e.fmt(f),
        }
    }
}

/// An NBD server.
pub struct Server {
    exports: ExportSet,
    config: ServerConfig,
    next_id: AtomicU64,
    active: AtomicUsize,
    tls: Option<TlsConfig>,
}

/// Counts a connection as active while it lives.
struct ActiveGuard<'a>(&'a AtomicUsize);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Server {
    /// A server for `exports`.
    pub fn new(exports: ExportSet, config: ServerConfig) -> Server {
        Server {
            exports,
            config,
            next_id: AtomicU64::new(1),
            active: AtomicUsize::new(0),
            tls: None,
        }
    }

    /// Offers (or requires) TLS through NBD_OPT_STARTTLS.
    pub fn with_tls(mut self, tls: TlsConfig) -> Server {
        self.tls = Some(tls);
        self
    }

    /// The exports served.
    pub fn exports(&self) -> &ExportSet {
        &self.exports
    }

    /// Connections being served right now.
    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Waits until no connection is active, for at most `timeout`;
    /// returns whether the server went idle.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.active_connections() > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Serves one connection to its end: handshake, then transmission.
    pub fn serve(&self, mut transport: Box<dyn Transport>) -> ConnectionEnd {
        self.active.fetch_add(1, Ordering::SeqCst);
        let _active = ActiveGuard(&self.active);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let peer = transport.peer();
        let start = Instant::now();
        let neg = match self.handshake(&mut transport) {
            Ok(n) => n,
            Err(e) => {
                let end = ConnectionEnd::Handshake(e);
                if self.config.verbose {
                    eprintln!("diskit: connection {id} ({peer}): {end}");
                }
                return end;
            }
        };
        // After STARTTLS the peer's name says so.
        let peer = transport.peer();
        let halves = match transport.split() {
            Ok(h) => h,
            Err(e) => return ConnectionEnd::Transmission(End::Io(e)),
        };
        let export = neg.export.clone();
        export.stats().connected();
        let headers = if neg.extended {
            "extended headers"
        } else if neg.structured {
            "structured replies"
        } else {
            "simple replies"
        };
        let conn_stats = Stats::default();
        let tuning = transmission::Tuning {
            threads: self.config.threads,
            max_in_flight: self.config.max_in_flight,
        };
        let end = transmission::run(neg, halves, tuning, &conn_stats);
        if self.config.verbose {
            eprintln!(
                "diskit: connection {id} ({peer}): export '{}', {headers}: {}; {end} after {:.3}s",
                export.name(),
                conn_stats.snapshot().summary(),
                start.elapsed().as_secs_f64()
            );
        }
        ConnectionEnd::Transmission(end)
    }

    /// The handshake, STARTTLS included: after a TLS handshake `transport`
    /// is the encrypted stream and option haggling starts over.
    fn handshake(
        &self,
        transport: &mut Box<dyn Transport>,
    ) -> Result<handshake::Negotiated, HandshakeEnd> {
        let flags = handshake::greet(&mut **transport)?;
        let mut state = match self.tls.as_ref().map(TlsConfig::mode) {
            None => handshake::TlsState::Unavailable,
            Some(TlsMode::Allow) => handshake::TlsState::Offered,
            Some(TlsMode::Require) => handshake::TlsState::Required,
        };
        loop {
            match handshake::haggle(&mut **transport, &self.exports, flags, state)? {
                handshake::Step::Go(n) => return Ok(n),
                handshake::Step::StartTls => {
                    let Some(config) = &self.tls else {
                        return Err(HandshakeEnd::Protocol("STARTTLS without TLS".into()));
                    };
                    let placeholder: Box<dyn Transport> =
                        Box::new(Pipe::new(io::empty(), io::sink(), ""));
                    let plain = std::mem::replace(transport, placeholder);
                    *transport = tls::upgrade(plain, config).map_err(|e| {
                        HandshakeEnd::Protocol(format!("TLS handshake failed: {e}"))
                    })?;
                    state = handshake::TlsState::Active;
                }
            }
        }
    }

    /// Accepts connections on a Unix socket forever, one thread each.
    pub fn serve_unix(self: &Arc<Self>, listener: UnixListener) -> io::Result<()> {
        loop {
            match listener.accept() {
                Ok((stream, _)) => self.spawn(Box::new(stream)),
                Err(e) => self.accept_failed(e)?,
            }
        }
    }

    /// Accepts connections on a TCP socket forever, one thread each.
    pub fn serve_tcp(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    self.spawn(Box::new(stream));
                }
                Err(e) => self.accept_failed(e)?,
            }
        }
    }

    fn spawn(self: &Arc<Self>, transport: Box<dyn Transport>) {
        let server = self.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                server.serve(transport);
            });
        if let Err(e) = spawned {
            eprintln!("diskit: cannot start a connection thread: {e}");
        }
    }

    /// Transient accept errors (out of descriptors, aborted connections)
    /// are logged and retried after a pause; others end the server.
    fn accept_failed(&self, e: io::Error) -> io::Result<()> {
        match e.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                eprintln!("diskit: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                Ok(())
            }
            Some(libc::ECONNABORTED | libc::EINTR | libc::EPROTO) => Ok(()),
            _ => Err(e),
        }
    }
}
