//! What the client and server tests share: one asynchronous read sent the
//! way the block layer sends it, many threads writing and reading back at
//! once, and a server thread on a socket pair.
//! (Each test binary uses what it needs.)

#![allow(dead_code)]

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use diskit_backends::MemoryDevice;
use diskit_core::buffer::AlignedBuf;
use diskit_core::{BlockDevice, CompletionQueue, WriteFlags};
use diskit_nbd::client::conn::{Connection, Group, Piece};
use diskit_nbd::proto::consts::CMD_READ;
use diskit_nbd::server::{ConnectionEnd, Server};

/// Sends one 4 KiB READ of offset 0 on `conn`, into a buffer of its own;
/// its completion arrives on the returned queue.
pub fn send_read(conn: &Connection) -> CompletionQueue {
    let cq = CompletionQueue::new();
    let group = Group::new(
        1,
        Some(AlignedBuf::new(4096, 512).unwrap()),
        Some((cq.clone(), 1)),
    );
    let piece = Piece {
        command: CMD_READ,
        flags: 0,
        offset: 0,
        length: 4096,
        at: 0,
    };
    conn.send(&group, &[piece], None);
    group.release(None);
    cq
}

/// A client's socket with a server thread at the other end.
pub struct Peer {
    /// The client's end; its reads time out after 10 s.
    pub sock: UnixStream,
    /// The thread serving the connection.
    pub server: JoinHandle<ConnectionEnd>,
    /// The memory behind the export the test reads and writes.
    pub dev: Arc<MemoryDevice>,
}

/// Runs `server` on one end of a socket pair, in a thread of its own.
pub fn connect(server: Server, dev: Arc<MemoryDevice>) -> Peer {
    let (client, srv) = UnixStream::pair().unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let server = std::thread::spawn(move || server.serve(Box::new(srv)));
    Peer {
        sock: client,
        server,
        dev,
    }
}

/// Eight threads at once write `rounds` blocks of `len` bytes each
/// through `dev` (thread t's block i at `(t * rounds + i) * stride`, all
/// of one byte of its own) and read each back at once.
pub fn parallel_round_trips<D: BlockDevice + 'static>(
    dev: &Arc<D>,
    rounds: u64,
    stride: u64,
    len: usize,
) {
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                for i in 0..rounds {
                    let off = (u64::from(t) * rounds + i) * stride;
                    let data = vec![t.wrapping_mul(31).wrapping_add(i as u8) | 1; len];
                    dev.write_at(&data, off, WriteFlags::NONE).unwrap();
                    let mut back = vec![0u8; len];
                    dev.read_at(&mut back, off).unwrap();
                    assert_eq!(back, data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
