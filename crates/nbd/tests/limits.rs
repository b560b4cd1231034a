//! Resource limits of the server: the handshake deadline (slow or silent
//! clients are cut off, finished handshakes are not) and the bounded
//! memory of a connection whose client floods requests without reading
//! replies (the server stops reading instead of buffering).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use diskit_backends::MemoryDevice;
use diskit_nbd::proto::*;
use diskit_nbd::server::{ConnectionEnd, End, Export, ExportSet, Pipe, Server, ServerConfig};

fn server(config: ServerConfig) -> Arc<Server> {
    let mut exports = ExportSet::new();
    exports.add(Export::new("", Arc::new(MemoryDevice::new(1 << 20))));
    Arc::new(Server::new(exports, config))
}

/// Serves the server end of a socket pair with a cutoff; returns the
/// client end and the server thread.
fn connect(
    srv: &Arc<Server>,
) -> (
    UnixStream,
    std::thread::JoinHandle<(ConnectionEnd, Duration)>,
) {
    let (client, end) = UnixStream::pair().unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let closer = end.try_clone().unwrap();
    let srv = srv.clone();
    let t = std::thread::spawn(move || {
        let start = Instant::now();
        let r = srv.serve_with_cutoff(
            Box::new(end),
            Box::new(move || {
                let _ = closer.shutdown(Shutdown::Both);
            }),
        );
        (r, start.elapsed())
    });
    (client, t)
}

/// Client flags then NBD_OPT_EXPORT_NAME "" (no option reply; the server
/// answers with the export size and flags).
fn export_name_handshake() -> Vec<u8> {
    let mut v = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    v.extend(ClientOption::ExportName(String::new()).encode());
    v
}

fn request(command: u16, cookie: u64, offset: u64, length: u64) -> Vec<u8> {
    RequestHeader {
        flags: 0,
        command,
        cookie,
        offset,
        length,
        extended: false,
    }
    .encode()
}

fn timeout_config(ms: u64) -> ServerConfig {
    ServerConfig {
        handshake_timeout: Some(Duration::from_millis(ms)),
        ..ServerConfig::default()
    }
}

#[test]
fn a_silent_client_is_cut_off_after_the_handshake_timeout() {
    let srv = server(timeout_config(300));
    let (mut c, t) = connect(&srv);
    let mut greeting = [0u8; 18];
    c.read_exact(&mut greeting).unwrap();
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).expect("EOF, not a read timeout");
    let (end, took) = t.join().unwrap();
    assert!(matches!(end, ConnectionEnd::HandshakeTimeout), "{end}");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(srv.active_connections(), 0);
}

#[test]
fn a_slow_loris_client_is_cut_off_even_while_sending() {
    let srv = server(timeout_config(400));
    let (mut c, t) = connect(&srv);
    let mut greeting = [0u8; 18];
    c.read_exact(&mut greeting).unwrap();
    // One byte every 20 ms: each read succeeds, the whole never ends.
    let opt = OptionHeader {
        option: OPT_EXPORT_NAME,
        length: 4000,
    };
    let mut bytes = export_name_handshake()[..4].to_vec();
    bytes.extend(opt.encode());
    bytes.extend(std::iter::repeat_n(b'x', 4000));
    let start = Instant::now();
    for b in bytes {
        if c.write_all(&[b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(start.elapsed() < Duration::from_secs(20), "never cut off");
    }
    let (end, took) = t.join().unwrap();
    assert!(matches!(end, ConnectionEnd::HandshakeTimeout), "{end}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn a_finished_handshake_outlives_the_timeout() {
    let srv = server(timeout_config(200));
    let (mut c, t) = connect(&srv);
    let mut greeting = [0u8; 18];
    c.read_exact(&mut greeting).unwrap();
    c.write_all(&export_name_handshake()).unwrap();
    let mut info = [0u8; 10];
    c.read_exact(&mut info).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    c.write_all(&request(CMD_READ, 7, 0, 512)).unwrap();
    let mut reply = [0u8; 16 + 512];
    c.read_exact(&mut reply)
        .expect("transmission after the timeout");
    assert_eq!(u32::from_be_bytes(reply[4..8].try_into().unwrap()), 0);
    assert_eq!(u64::from_be_bytes(reply[8..16].try_into().unwrap()), 7);
    c.write_all(&request(CMD_DISC, 8, 0, 0)).unwrap();
    let (end, _) = t.join().unwrap();
    assert!(
        matches!(end, ConnectionEnd::Transmission(End::Disconnect)),
        "{end}"
    );
}

/// A client script: the handshake, then 64 KiB writes until `total`
/// requests were sent. Counts the bytes the server has read.
struct Flood {
    head: Vec<u8>,
    pos: usize,
    sent: u64,
    total: u64,
    consumed: Arc<AtomicU64>,
}

const CHUNK: u64 = 64 << 10;

impl Read for Flood {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.head.len() {
            if self.sent == self.total {
                return Ok(0);
            }
            self.head = request(CMD_WRITE, self.sent, 0, CHUNK);
            self.head.resize(self.head.len() + CHUNK as usize, 0xab);
            self.pos = 0;
            self.sent += 1;
        }
        let n = buf.len().min(self.head.len() - self.pos);
        buf[..n].copy_from_slice(&self.head[self.pos..self.pos + n]);
        self.pos += n;
        self.consumed.fetch_add(n as u64, Ordering::SeqCst);
        Ok(n)
    }
}

/// A client that does not read: writes past `allow` bytes block until
/// the gate opens.
struct Gate {
    state: Arc<(Mutex<(bool, u64)>, Condvar)>,
    allow: u64,
}

impl Write for Gate {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (lock, cv) = &*self.state;
        let mut st = lock.lock().unwrap();
        while !st.0 && st.1 + buf.len() as u64 > self.allow {
            st = cv.wait(st).unwrap();
        }
        st.1 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_client_that_never_reads_replies_stops_the_reader() {
    let threads = 4u64;
    let srv = server(ServerConfig {
        threads: threads as usize,
        ..ServerConfig::default()
    });
    let budget = ServerConfig::default().max_in_flight.max(64 << 20);
    let consumed = Arc::new(AtomicU64::new(0));
    let total = 2 * budget / CHUNK + 200;
    let flood = Flood {
        head: export_name_handshake(),
        pos: 0,
        sent: 0,
        total,
        consumed: consumed.clone(),
    };
    let state = Arc::new((Mutex::new((false, 0u64)), Condvar::new()));
    // The greeting and the export information get through, replies do not.
    let gate = Gate {
        state: state.clone(),
        allow: 18 + 10,
    };
    let s = srv.clone();
    let t = std::thread::spawn(move || s.serve(Box::new(Pipe::new(flood, gate, "flood"))));

    let start = Instant::now();
    let mut last = (0, Instant::now());
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = consumed.load(Ordering::SeqCst);
        if now != last.0 {
            last = (now, Instant::now());
        } else if now > 0 && last.1.elapsed() > Duration::from_millis(500) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the reader never stopped: {now} bytes read"
        );
    }
    // Each worker holds one request whose reply cannot be written (or,
    // with cheap requests run by the reader's worker itself, the reader
    // stops at the first such reply); the reader's buffer may hold one
    // more part-read request.
    let read = consumed.load(Ordering::SeqCst);
    let slack = (256 << 10) + 2 * (CHUNK + 1024) + 1024;
    let held = threads * (CHUNK + 1024);
    assert!(
        read <= held.min(budget) + slack,
        "read {read} bytes with no reply taken ({threads} workers, budget {budget})"
    );
    assert!(read >= CHUNK, "only {read} bytes read");
    assert!(!t.is_finished());

    // The client starts reading: everything is served and answered.
    {
        let (lock, cv) = &*state;
        lock.lock().unwrap().0 = true;
        cv.notify_all();
    }
    let end = t.join().unwrap();
    assert!(
        matches!(end, ConnectionEnd::Transmission(End::Closed)),
        "{end}"
    );
    let written = state.0.lock().unwrap().1;
    assert_eq!(written, 18 + 10 + 16 * total, "one simple reply per write");
}
