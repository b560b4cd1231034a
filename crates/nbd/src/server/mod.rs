//! The NBD server: any set of [`BlockDevice`](diskit_core::BlockDevice)s as
//! exports, over any byte stream, one thread per connection plus a bounded
//! pool of workers per connection.

pub mod bitmap;
pub mod budget;
pub mod export;
pub mod handshake;
pub mod ops;
pub mod splice;
pub mod stats;
pub mod tls;
pub mod transmission;
/// Byte streams (shared with the client): see [`crate::transport`].
pub use crate::transport;
pub mod watchdog;

use std::io;
use std::net::{Shutdown, TcpListener};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use diskit_core::{Serialize, ServerHandle, ServerRef};

pub use bitmap::ExportBitmap;
pub use export::{Advertising, Export, ExportSet, MAX_PAYLOAD, MetaContext};
pub use handshake::HandshakeEnd;
pub use stats::{Stats, StatsSnapshot};
pub use tls::{Authorizer, TlsConfig, TlsMode};
pub use transmission::End;
pub use transport::{Halves, Pipe, Transport};
pub use watchdog::Cutoff;

/// Writes one line to stderr in one system call, so that lines from other
/// threads or from the `--run` command's processes cannot split it
/// (`eprintln!` writes a formatted line piece by piece).
macro_rules! log_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($arg)*);
        line.push('\n');
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}
pub(crate) use log_line;

/// Locks a mutex, going on after a panic elsewhere left it poisoned (the
/// data behind the server's locks stays consistent at every unlock).
pub(crate) use diskit_core::sync::lock;

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
    /// A client that has not finished the handshake after this long is
    /// cut off (sockets only; `None`: no limit).
    pub handshake_timeout: Option<Duration>,
    /// Connections served at once by the accept loops (0: no limit); what
    /// happens to more is `over_limit`'s.
    pub max_connections: usize,
    /// What the accept loops do with a connection beyond
    /// `max_connections`.
    pub over_limit: OverLimit,
}

/// What happens to a connection beyond [`ServerConfig::max_connections`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OverLimit {
    /// It is accepted and closed at once (nbdkit's `--max-connections`).
    #[default]
    Close,
    /// It is not accepted until a served one ends: it waits in the
    /// listening socket's queue (qemu-nbd's `--shared`).
    Wait,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            threads: 16,
            max_in_flight: 64 << 20,
            verbose: false,
            handshake_timeout: Some(Duration::from_secs(60)),
            max_connections: 0,
            over_limit: OverLimit::Close,
        }
    }
}

/// How a connection ended.
#[derive(Debug)]
pub enum ConnectionEnd {
    /// It ended during the handshake.
    Handshake(HandshakeEnd),
    /// The handshake took longer than the handshake timeout.
    HandshakeTimeout,
    /// The accept loop turned it away: too many connections.
    Refused,
    /// A layer of the export refused the client before its handshake
    /// (see [`diskit_core::BlockDevice::preconnect`]), or the server is
    /// shutting down.
    Rejected(String),
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
            ConnectionEnd::HandshakeTimeout => f.write_str("handshake timed out"),
            ConnectionEnd::Refused => f.write_str("refused: too many connections"),
            ConnectionEnd::Rejected(why) => write!(f, "rejected: {why}"),
            ConnectionEnd::Transmission(e) => e.fmt(f),
        }
    }
}

/// What runs when the last client that got past its handshake has gone
/// (see [`Server::on_last_client`]).
type LastClient = Box<dyn FnOnce() + Send>;

/// An NBD server.
pub struct Server {
    exports: ExportSet,
    config: ServerConfig,
    next_id: AtomicU64,
    active: AtomicUsize,
    tls: Option<TlsConfig>,
    /// Signalled (under its mutex) whenever a connection ends, for accept
    /// loops waiting for a free place ([`OverLimit::Wait`]).
    ended: (Mutex<()>, Condvar),
    last_client: Mutex<Option<LastClient>>,
    /// Set once a layer asked the server to stop: new connections are
    /// rejected, and `on_stop` runs when the last open one ends.
    closing: std::sync::atomic::AtomicBool,
    on_stop: Mutex<Option<LastClient>>,
    /// The strictest serialization the exports ask for.
    serial: Serialize,
}

/// The server as the layers of its exports see it (see
/// [`diskit_core::serving`]); weak, as the server holds the layers.
struct Handle(std::sync::Weak<Server>);

impl ServerHandle for Handle {
    fn shutdown(&self) {
        if let Some(s) = self.0.upgrade() {
            s.shutdown();
        }
    }
}

/// Counts a connection as active while it lives; when it ends, wakes
/// accept loops waiting for a place, and runs the last-client action if
/// it was the last and had entered transmission.
struct ActiveGuard<'a> {
    server: &'a Server,
    transmitted: bool,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        let s = self.server;
        let (gate, ended) = &s.ended;
        let left = {
            let _held = lock(gate);
            let left = s.active.fetch_sub(1, Ordering::SeqCst) - 1;
            ended.notify_all();
            left
        };
        if self.transmitted && left == 0 {
            let action = lock(&s.last_client).take();
            if let Some(f) = action {
                f();
            }
        }
        if left == 0 && s.closing.load(Ordering::SeqCst) {
            s.stop_now();
        }
    }
}

impl Server {
    /// A server for `exports`.
    pub fn new(exports: ExportSet, config: ServerConfig) -> Server {
        let serial = exports
            .iter()
            .map(|e| e.device().serialize())
            .max()
            .unwrap_or_default();
        Server {
            closing: std::sync::atomic::AtomicBool::new(false),
            on_stop: Mutex::new(None),
            serial,
            exports,
            config,
            next_id: AtomicU64::new(1),
            active: AtomicUsize::new(0),
            tls: None,
            ended: (Mutex::new(()), Condvar::new()),
            last_client: Mutex::new(None),
        }
    }

    /// Runs `action` once, when a client that entered transmission ends
    /// and no other connection is open (qemu-nbd's exit after the last
    /// client, without `--persistent`). Clients that leave during the
    /// handshake (listing exports, probing) do not count.
    pub fn on_last_client(&self, action: impl FnOnce() + Send + 'static) {
        *lock(&self.last_client) = Some(Box::new(action));
    }

    /// Tells the layers of every export that the server starts, giving
    /// them a handle to stop it (see [`diskit_core::BlockDevice::serving`]);
    /// `action` runs when one does, once the open connections have ended.
    pub fn start(self: &Arc<Self>, action: impl FnOnce() + Send + 'static) {
        *lock(&self.on_stop) = Some(Box::new(action));
        let handle: ServerRef = Arc::new(Handle(Arc::downgrade(self)));
        for e in self.exports.iter() {
            e.device().serving(&handle);
        }
    }

    /// Stops accepting connections; runs the stop action once none is
    /// open (nbdkit_shutdown).
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let (gate, ended) = &self.ended;
        {
            let _held = lock(gate);
            ended.notify_all();
        }
        if self.active.load(Ordering::SeqCst) == 0 {
            self.stop_now();
        }
    }

    /// Runs the stop action, once.
    fn stop_now(&self) {
        let action = lock(&self.on_stop).take();
        if let Some(f) = action {
            f();
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

    /// Serves one connection to its end: handshake, then transmission,
    /// with no handshake deadline (stdin/stdout, in-memory pipes).
    pub fn serve(&self, transport: Box<dyn Transport>) -> ConnectionEnd {
        self.active.fetch_add(1, Ordering::SeqCst);
        self.serve_counted(transport, None)
    }

    /// Serves one connection like [`Server::serve`], calling `cutoff`
    /// (which shuts the socket down) if the handshake outlasts the
    /// configured timeout.
    pub fn serve_with_cutoff(
        &self,
        transport: Box<dyn Transport>,
        cutoff: Cutoff,
    ) -> ConnectionEnd {
        self.active.fetch_add(1, Ordering::SeqCst);
        self.serve_counted(transport, Some(cutoff))
    }

    /// Serves a connection already counted in `active`.
    fn serve_counted(
        &self,
        mut transport: Box<dyn Transport>,
        cutoff: Option<Cutoff>,
    ) -> ConnectionEnd {
        let mut active = ActiveGuard {
            server: self,
            transmitted: false,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let peer = transport.peer();
        let start = Instant::now();
        let client = handshake::Client {
            id,
            peer: transport.peer_info(),
            hangup: Default::default(),
        };
        if let Err(why) = self.preconnect(&client.peer) {
            let end = ConnectionEnd::Rejected(why);
            log_line!("diskit: connection {id} ({peer}): {end}");
            return end;
        }
        let dog = match (self.config.handshake_timeout, cutoff) {
            (Some(t), Some(c)) => Some(watchdog::Watchdog::start(t, c)),
            _ => None,
        };
        let negotiated = self.handshake(&mut transport, &client);
        let timed_out = dog.is_some_and(watchdog::Watchdog::disarm);
        let neg = match negotiated {
            Ok(n) if !timed_out => n,
            r => {
                let end = match r {
                    Err(e) if !timed_out => ConnectionEnd::Handshake(e),
                    _ => ConnectionEnd::HandshakeTimeout,
                };
                if self.config.verbose {
                    log_line!("diskit: connection {id} ({peer}): {end}");
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
        let name = neg.name.clone();
        export.stats().connected();
        let headers = if neg.extended {
            "extended headers"
        } else if neg.structured {
            "structured replies"
        } else {
            "simple replies"
        };
        let conn_stats = Stats::default();
        active.transmitted = true;
        let serial = export.device().serialize();
        let tuning = transmission::Tuning {
            threads: if serial >= Serialize::Requests {
                1
            } else {
                self.config.threads
            },
            max_in_flight: self.config.max_in_flight,
        };
        let end = transmission::run(neg, halves, tuning, &conn_stats);
        if self.config.verbose {
            log_line!(
                "diskit: connection {id} ({peer}): export '{}', {headers}: {}; {end} after {:.3}s",
                name,
                conn_stats.snapshot().summary(),
                start.elapsed().as_secs_f64()
            );
        }
        ConnectionEnd::Transmission(end)
    }

    /// The handshake, STARTTLS included: after a TLS handshake `transport`
    /// is the encrypted stream and option haggling starts over.
    /// The checks before the handshake: the server is not stopping, and
    /// the layers of every export accept `peer`.
    fn preconnect(&self, peer: &diskit_core::Peer) -> Result<(), String> {
        if self.closing.load(Ordering::SeqCst) {
            return Err("the server is shutting down".into());
        }
        for e in self.exports.iter() {
            e.device().preconnect(peer).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn handshake(
        &self,
        transport: &mut Box<dyn Transport>,
        client: &handshake::Client,
    ) -> Result<handshake::Negotiated, HandshakeEnd> {
        let flags = handshake::greet(&mut **transport)?;
        let mut state = match self.tls.as_ref().map(TlsConfig::mode) {
            None => handshake::TlsState::Unavailable,
            Some(TlsMode::Allow) => handshake::TlsState::Offered,
            Some(TlsMode::Require) => handshake::TlsState::Required,
        };
        loop {
            match handshake::haggle(&mut **transport, &self.exports, flags, state, client)? {
                handshake::Step::Go(n) => return Ok(n),
                handshake::Step::StartTls => {
                    let Some(config) = &self.tls else {
                        return Err(HandshakeEnd::Protocol("STARTTLS without TLS".into()));
                    };
                    let placeholder: Box<dyn Transport> =
                        Box::new(Pipe::new(io::empty(), io::sink(), ""));
                    let plain = std::mem::replace(transport, placeholder);
                    let peer = plain.peer();
                    *transport = tls::upgrade(plain, config).map_err(|e| {
                        if tls::Refused::is(&e) {
                            // Refusing a client is worth a line, verbose or not.
                            log_line!("diskit: connection {} ({peer}): {e}", client.id);
                            HandshakeEnd::Protocol(e.to_string())
                        } else {
                            HandshakeEnd::Protocol(format!("TLS handshake failed: {e}"))
                        }
                    })?;
                    state = handshake::TlsState::Active;
                }
            }
        }
    }

    /// Accepts connections on a Unix socket forever, one thread each.
    pub fn serve_unix(self: &Arc<Self>, listener: UnixListener) -> io::Result<()> {
        loop {
            self.wait_for_place();
            match listener.accept() {
                Ok((stream, _)) => {
                    let cutoff = stream.try_clone().ok().map(|s| -> Cutoff {
                        Box::new(move || {
                            let _ = s.shutdown(Shutdown::Both);
                        })
                    });
                    self.spawn(Box::new(stream), cutoff);
                }
                Err(e) => self.accept_failed(e)?,
            }
        }
    }

    /// Accepts connections on a TCP socket forever, one thread each.
    pub fn serve_tcp(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        loop {
            self.wait_for_place();
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let cutoff = stream.try_clone().ok().map(|s| -> Cutoff {
                        Box::new(move || {
                            let _ = s.shutdown(Shutdown::Both);
                        })
                    });
                    self.spawn(Box::new(stream), cutoff);
                }
                Err(e) => self.accept_failed(e)?,
            }
        }
    }

    /// With [`OverLimit::Wait`], waits until fewer than `max_connections`
    /// are served, so that the next connection stays queued meanwhile.
    fn wait_for_place(&self) {
        let mut max = self.config.max_connections;
        if self.config.over_limit != OverLimit::Wait {
            max = 0;
        }
        if self.serial == Serialize::Connections {
            max = 1;
        }
        if max == 0 {
            return;
        }
        let (gate, ended) = &self.ended;
        let mut held = lock(gate);
        while self.active.load(Ordering::SeqCst) >= max && !self.closing.load(Ordering::SeqCst) {
            held = ended.wait(held).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Serves `transport` in a new thread, or closes it at once when
    /// `max_connections` are being served already.
    fn spawn(self: &Arc<Self>, transport: Box<dyn Transport>, cutoff: Option<Cutoff>) {
        let max = self.config.max_connections;
        let before = self.active.fetch_add(1, Ordering::SeqCst);
        if max > 0 && before >= max && self.config.over_limit == OverLimit::Close {
            self.active.fetch_sub(1, Ordering::SeqCst);
            if self.config.verbose {
                log_line!(
                    "diskit: connection from {}: {} ({max} already)",
                    transport.peer(),
                    ConnectionEnd::Refused
                );
            }
            return;
        }
        let server = self.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                server.serve_counted(transport, cutoff);
            });
        if let Err(e) = spawned {
            // The closure (and its transport) was dropped without running.
            self.active.fetch_sub(1, Ordering::SeqCst);
            log_line!("diskit: cannot start a connection thread: {e}");
        }
    }

    /// Transient accept errors (out of descriptors, aborted connections)
    /// are logged and retried after a pause; others end the server.
    fn accept_failed(&self, e: io::Error) -> io::Result<()> {
        match e.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                log_line!("diskit: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                Ok(())
            }
            Some(libc::ECONNABORTED | libc::EINTR | libc::EPROTO) => Ok(()),
            _ => Err(e),
        }
    }
}
