//! The NBD client against a hostile server: whatever bytes the server
//! sends during the handshake and in replies, the client gives data or an
//! error, never a panic, a hang or unbounded memory.
#![no_main]

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use diskit_core::aio::ReadSink;
use diskit_nbd::client::conn::{Connection, Stream};
use diskit_nbd::client::handshake;
use libfuzzer_sys::fuzz_target;

/// A stream that reads the fuzz input and swallows writes.
struct Scripted<'a>(&'a [u8]);

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A read's sink that checks that all it is given lies within the read.
struct Within {
    offset: u64,
    len: u64,
    discard: bool,
}

impl Within {
    fn check(&self, offset: u64, len: u64) {
        assert!(
            offset >= self.offset && offset + len <= self.offset + self.len,
            "{len} bytes at {offset} handed to a read of {} at {}",
            self.len,
            self.offset
        );
    }
}

impl ReadSink for Within {
    fn data(&self, offset: u64, data: &[u8]) -> diskit_core::Result<()> {
        self.check(offset, data.len() as u64);
        Ok(())
    }
    fn zeros(&self, offset: u64, len: u64) -> diskit_core::Result<()> {
        self.check(offset, len);
        Ok(())
    }
    fn discards(&self) -> bool {
        self.discard
    }
}

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    // Byte 0 picks the part: the handshake, or replies in transmission.
    let (pick, rest) = (data[0], &data[1..]);
    if pick & 1 == 0 {
        let _ = handshake::negotiate(&mut Scripted(rest), "", &["base:allocation"]);
        return;
    }
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let conn = Connection::start_with(Stream::Unix(ours), pick & 2 != 0, pick & 4 != 0).unwrap();
    // The server's bytes, then it hangs up: every request ends.
    let writer = std::thread::spawn({
        let bytes = rest.to_vec();
        move || {
            let _ = theirs.write_all(&bytes);
            let _ = theirs.shutdown(Shutdown::Write);
            let mut sink = Vec::new();
            let _ = theirs.read_to_end(&mut sink);
        }
    });
    use diskit_core::CompletionQueue;
    use diskit_core::buffer::AlignedBuf;
    use diskit_nbd::client::conn::{Group, Piece};
    use diskit_nbd::proto::consts::{CMD_BLOCK_STATUS, CMD_READ};
    // A read in two pieces into an owned buffer, waited for...
    let read = |at: u64| Piece {
        command: CMD_READ,
        flags: 0,
        offset: at,
        length: 2048,
        at: at as usize,
    };
    let group = Group::new(2, Some(AlignedBuf::new(4096, 512).unwrap()), None);
    conn.send(&group, &[read(0), read(2048)], None);
    group.release(None);
    let _ = group.wait();
    // ...one whose completion goes to a queue...
    let cq = CompletionQueue::new();
    let group = Group::new(
        1,
        Some(AlignedBuf::new(4096, 512).unwrap()),
        Some((cq.clone(), 7)),
    );
    conn.send(&group, &[read(0)], None);
    group.release(None);
    let c = cq.wait();
    assert_eq!(c.tag, 7);
    assert!(c.buf.is_some(), "a completed read gives its buffer back");
    // ...streaming reads handed to sinks, more than fit on the wire (the
    // rest wait in the client and fail when the server hangs up), one of
    // them longer than the reader's staging buffer; the sink may discard
    // (the data is spliced away unseen)...
    let discard = pick & 8 != 0;
    let long = if pick & 16 != 0 { 5 << 20 } else { 1 << 20 };
    let streamed: Vec<_> = [(0u64, 3u64 << 20), (3 << 20, 3 << 20), (6 << 20, long)]
        .into_iter()
        .enumerate()
        .map(|(i, (offset, len))| {
            let piece = Piece {
                command: CMD_READ,
                flags: 0,
                offset,
                length: len,
                at: 0,
            };
            let sink = Arc::new(Within {
                offset,
                len,
                discard,
            });
            let buf = AlignedBuf::new(len as usize, 512).unwrap();
            let group =
                Group::with_sink(1, Some(buf), Some((cq.clone(), 10 + i as u64)), Some(sink));
            conn.send_streaming(&group, &[piece]);
            group.release(None);
            group
        })
        .collect();
    for _ in &streamed {
        let c = cq.wait();
        assert!((10..13).contains(&c.tag));
    }
    // ...and a block status.
    let _ = conn.request(CMD_BLOCK_STATUS, 0, 0, 1 << 20, None);
    conn.close();
    drop(conn);
    let _ = writer.join();
    let _ = diskit_nbd::client::uri::NbdUri::parse(&String::from_utf8_lossy(rest));
});
