//! The client against diskit's own server over a socket pair: many
//! threads with requests in flight at once, every command, flags and
//! extents, errors as the server sends them.

mod common;

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, ErrorKind, WriteFlags, ZeroFlags};
use diskit_nbd::client::NbdClient;
use diskit_nbd::client::conn::Stream;
use diskit_nbd::server::{ConnectionEnd, Export, ExportSet, Server, ServerConfig};

const SIZE: u64 = 8 << 20;

fn connect(read_only: bool) -> (NbdClient, Arc<MemoryDevice>, JoinHandle<ConnectionEnd>) {
    let dev = Arc::new(MemoryDevice::new(SIZE));
    let mut exports = ExportSet::new();
    let export = Export::new("disk", dev.clone());
    exports.add(export.with_read_only(read_only));
    let server = Server::new(
        exports,
        ServerConfig {
            threads: 4,
            ..ServerConfig::default()
        },
    );
    let (client, srv) = UnixStream::pair().unwrap();
    let server = std::thread::spawn(move || server.serve(Box::new(srv)));
    let c = NbdClient::over(Stream::Unix(client), "test", "disk").unwrap();
    (c, dev, server)
}

#[test]
fn many_threads_in_flight_read_back_what_they_wrote() {
    let (c, dev, server) = connect(false);
    let c = Arc::new(c);
    common::parallel_round_trips(&c, 32, 32768, 32768);
    // What the server's device holds is what was written.
    let mut a = vec![0u8; SIZE as usize];
    let mut b = vec![0u8; SIZE as usize];
    c.read_at(&mut a, 0).unwrap();
    dev.read_at(&mut b, 0).unwrap();
    assert_eq!(a, b);
    c.close().unwrap();
    drop(c);
    server.join().unwrap();
}

#[test]
fn commands_flags_and_extents() {
    let (c, dev, _server) = connect(false);
    let caps = c.capabilities();
    assert!(caps.can_write && caps.can_zero && caps.can_trim && caps.can_extents);
    assert_eq!(c.size(), SIZE);
    assert!(
        c.extended_headers(),
        "diskit's server offers extended headers"
    );
    // A read longer than the server's maximum is split.
    let big = vec![7u8; (SIZE - 4096) as usize];
    c.write_at(&big, 4096, WriteFlags::FUA).unwrap();
    c.write_zeroes(
        1 << 20,
        1 << 20,
        ZeroFlags {
            may_trim: true,
            ..Default::default()
        },
    )
    .unwrap();
    c.trim(4 << 20, 1 << 20, WriteFlags::NONE).unwrap();
    c.flush().unwrap();
    c.cache(0, 4096).unwrap();
    let mut buf = vec![1u8; SIZE as usize];
    c.read_at(&mut buf, 0).unwrap();
    let mut want = vec![0u8; SIZE as usize];
    dev.read_at(&mut want, 0).unwrap();
    assert_eq!(buf, want);
    assert!(buf[(1 << 20)..(2 << 20)].iter().all(|&b| b == 0));
    // Extents: the zeroed range is a hole, with host offsets as a file's.
    let e = c.extents(1 << 20, 1 << 20).unwrap();
    assert!(e[0].flags.zero && !e[0].flags.data, "{e:?}");
    assert_eq!(e[0].host_offset, Some(1 << 20));
    let walked: u64 = diskit_core::extent::walk(&c, 0, SIZE)
        .map(|e| e.unwrap().length)
        .sum();
    assert_eq!(walked, SIZE);
    // Out of range is refused before anything is sent.
    assert!(c.read_at(&mut [0u8; 2], SIZE - 1).is_err());
    // REQ_ONE: one extent, the first; DF: the same bytes as a plain read.
    let (len, flags) = c
        .block_status_one("base:allocation", 1 << 20, 4 << 20)
        .unwrap();
    assert_eq!((len, flags & 1), (1 << 20, 1), "the zeroed MiB is a hole");
    let all = c.block_status("base:allocation", 0, SIZE).unwrap();
    assert!(all.len() > 1);
    let mut df = vec![0u8; 3 << 20];
    c.read_df(&mut df, 512 << 10).unwrap();
    assert_eq!(df, want[(512 << 10)..(512 << 10) + (3 << 20)]);
}

#[test]
fn a_read_only_export_refuses_writes() {
    let (c, _dev, _server) = connect(true);
    assert!(!c.capabilities().can_write);
    let e = c.write_at(&[1], 0, WriteFlags::NONE).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied);
}

#[test]
fn unknown_exports_are_named() {
    let mut exports = ExportSet::new();
    exports.add(Export::new("disk", Arc::new(MemoryDevice::new(4096))));
    let server = Server::new(exports, ServerConfig::default());
    let (client, srv) = UnixStream::pair().unwrap();
    std::thread::spawn(move || server.serve(Box::new(srv)));
    let e = NbdClient::over(Stream::Unix(client), "test", "nosuch")
        .err()
        .unwrap();
    assert!(e.to_string().contains("nosuch"), "{e}");
}

/// A server that replies to the first request with a simple reply whose
/// data stops short, then hangs up: the request fails, nothing hangs.
#[test]
fn a_reply_cut_short_fails_the_request() {
    use diskit_nbd::client::conn::{Connection, Stream};
    use diskit_nbd::proto::consts::{CMD_READ, SIMPLE_REPLY_MAGIC};
    use std::io::{Read, Write};
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let conn = Connection::start(Stream::Unix(ours), false).unwrap();
    let server = std::thread::spawn(move || {
        let mut req = [0u8; 28];
        theirs.read_exact(&mut req).unwrap();
        let cookie = &req[8..16];
        let mut reply = Vec::new();
        reply.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        reply.extend_from_slice(&0u32.to_be_bytes());
        reply.extend_from_slice(cookie);
        reply.extend_from_slice(&[7u8; 100]);
        theirs.write_all(&reply).unwrap();
    });
    let cq = common::send_read(&conn);
    server.join().unwrap();
    let c = cq.wait();
    assert!(c.result.is_err());
    assert!(c.buf.is_some());
    // Later requests fail at once: the connection is dead.
    assert!(conn.request(CMD_READ, 0, 0, 512, None).is_err());
}

/// A memory device that counts the extents it is asked for.
struct CountingExtents {
    mem: MemoryDevice,
    asked: std::sync::atomic::AtomicUsize,
}

impl BlockDevice for CountingExtents {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn capabilities(&self) -> diskit_core::Capabilities {
        self.mem.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> diskit_core::Result<()> {
        self.mem.read_at(buf, offset)
    }
    fn extents(&self, offset: u64, len: u64) -> diskit_core::Result<Vec<diskit_core::Extent>> {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.mem.extents(offset, len)
    }
}

#[test]
fn block_status_of_one_context_of_several_asks_the_server_for_it_alone() {
    use diskit_core::bits::Bits;
    use diskit_nbd::server::ExportBitmap;
    let dev = Arc::new(CountingExtents {
        mem: MemoryDevice::new(SIZE),
        asked: Default::default(),
    });
    let mut bits = Bits::new(SIZE, 16);
    bits.set_range(1 << 20, 2 << 20);
    let export = Export::new("disk", dev.clone())
        .with_read_only(true)
        .with_bitmaps(vec![Arc::new(ExportBitmap::new("b", bits, false))]);
    let mut exports = ExportSet::new();
    exports.add(export);
    let server = Server::new(exports, ServerConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let serving = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        server.serve(Box::new(s))
    });
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let c = NbdClient::connect_with(&uri, &["base:allocation", "qemu:dirty-bitmap:b"]).unwrap();
    assert!(c.extended_headers());
    // The bitmap's answer needs no extents: with a payload naming its
    // context alone, the server works out nothing else.
    let dirty = c.block_status("qemu:dirty-bitmap:b", 0, SIZE).unwrap();
    assert_eq!(dirty, [(1 << 20, 0), (1 << 20, 1), (SIZE - (2 << 20), 0)]);
    assert_eq!(dev.asked.load(std::sync::atomic::Ordering::Relaxed), 0);
    // base:allocation alone: the device's extents, once.
    let alloc = c.block_status("base:allocation", 0, SIZE).unwrap();
    assert_eq!(alloc.iter().map(|d| d.0).sum::<u64>(), SIZE);
    assert!(dev.asked.load(std::sync::atomic::Ordering::Relaxed) > 0);
    c.close().unwrap();
    drop(c);
    serving.join().unwrap();
}
