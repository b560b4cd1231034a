//! The client against servers that break the protocol in transmission:
//! every request ends with a clear error naming what the server did, and
//! nothing hangs or panics.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use diskit_nbd::client::conn::{Connection, Stream};
use diskit_nbd::proto::consts::*;

/// A structured reply chunk header.
fn chunk(flags: u16, kind: u16, cookie: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(cookie);
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

/// A data chunk at `offset` with `len` bytes.
fn data(flags: u16, cookie: &[u8], offset: u64, len: usize) -> Vec<u8> {
    let mut p = offset.to_be_bytes().to_vec();
    p.extend(std::iter::repeat_n(9u8, len));
    chunk(flags, REPLY_TYPE_OFFSET_DATA, cookie, &p)
}

/// Reads one 4 KiB READ of offset 0 through a server that answers its
/// request with `reply(cookie)` and then hangs up; returns the error.
fn read_through(structured: bool, reply: impl FnOnce(&[u8]) -> Vec<u8> + Send + 'static) -> String {
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let conn = Connection::start(Stream::Unix(ours), structured).unwrap();
    let server = std::thread::spawn(move || {
        let mut req = [0u8; 28];
        theirs.read_exact(&mut req).unwrap();
        let _ = theirs.write_all(&reply(&req[8..16]));
        // Hang up: whatever the client still waits for ends.
    });
    let cq = common::send_read(&conn);
    server.join().unwrap();
    let c = cq.wait();
    assert!(c.buf.is_some(), "the buffer comes back whatever happens");
    let e = c.result.expect_err("a broken reply fails the request");
    // Nothing more goes over a connection the server broke.
    assert!(conn.request(CMD_FLUSH, 0, 0, 0, None).is_err());
    e.to_string()
}

#[test]
fn a_reply_to_an_unknown_cookie_ends_the_connection() {
    let e = read_through(false, |_| {
        let mut v = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&0u32.to_be_bytes());
        v.extend_from_slice(&999u64.to_be_bytes());
        v
    });
    assert!(e.contains("unknown cookie 999"), "{e}");
}

#[test]
fn a_data_chunk_outside_the_request_is_refused() {
    let e = read_through(true, |c| data(REPLY_FLAG_DONE, c, 2048, 4096));
    assert!(e.contains("outside the request"), "{e}");
    // Longer than asked, from the start.
    let e = read_through(true, |c| data(REPLY_FLAG_DONE, c, 0, 8192));
    assert!(e.contains("outside the request"), "{e}");
}

#[test]
fn a_read_reply_that_does_not_cover_the_request_fails() {
    let e = read_through(true, |c| data(REPLY_FLAG_DONE, c, 0, 1024));
    assert!(e.contains("does not cover"), "{e}");
}

#[test]
fn a_bad_magic_or_an_unasked_structured_reply_ends_the_connection() {
    let e = read_through(false, |_| vec![0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0]);
    assert!(e.contains("bad reply magic"), "{e}");
    // Structured chunks where simple replies were negotiated.
    let e = read_through(false, |c| data(REPLY_FLAG_DONE, c, 0, 4096));
    assert!(e.contains("bad reply magic"), "{e}");
}

#[test]
fn an_oversized_error_or_status_chunk_is_refused_unread() {
    let e = read_through(true, |c| {
        let mut v = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
        v.extend_from_slice(&REPLY_TYPE_ERROR.to_be_bytes());
        v.extend_from_slice(c);
        v.extend_from_slice(&u32::MAX.to_be_bytes());
        v
    });
    assert!(e.contains("too long"), "{e}");
}

#[test]
fn an_error_chunk_gives_its_errno_and_message() {
    let e = read_through(true, |c| {
        let mut p = 5u32.to_be_bytes().to_vec(); // EIO
        p.extend_from_slice(&(7u16).to_be_bytes());
        p.extend_from_slice(b"bad day");
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, c, &p)
    });
    assert!(e.contains("bad day"), "{e}");
}

#[test]
fn a_server_that_hangs_up_mid_reply_fails_the_request() {
    let e = read_through(true, |c| {
        let mut v = data(REPLY_FLAG_DONE, c, 0, 4096);
        v.truncate(v.len() - 100);
        v
    });
    assert!(!e.is_empty());
}
