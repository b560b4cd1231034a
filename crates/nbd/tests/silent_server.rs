//! A server that takes requests and never answers: the requests fail once
//! the reply timeout passes, with an error that says so, instead of
//! hanging. (A test binary of its own: the timeout is the process's.)

mod common;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use diskit_nbd::client::conn::{Connection, Stream};
use diskit_nbd::client::watchdog;
use diskit_nbd::proto::consts::*;

#[test]
fn requests_to_a_silent_server_time_out() {
    watchdog::set_timeout(Some(Duration::from_millis(400)));
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let conn = Connection::start(Stream::Unix(ours), true).unwrap();
    // The server reads every request and answers none, keeping the
    // connection open.
    let server = std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        while theirs.read(&mut sink).is_ok_and(|n| n > 0) {}
    });
    // An idle connection is left alone however long it stays idle.
    std::thread::sleep(Duration::from_millis(900));
    let start = Instant::now();
    let cq = common::send_read(&conn);
    let c = cq.wait();
    let waited = start.elapsed();
    assert!(c.buf.is_some(), "the buffer comes back");
    let e = c.result.expect_err("no reply is an error").to_string();
    assert!(e.contains("sent nothing for 0.400 s"), "{e}");
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    // A blocking request on the dead connection fails at once.
    let e = conn
        .request(CMD_FLUSH, 0, 0, 0, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sent nothing"), "{e}");
    drop(conn);
    server.join().unwrap();
}
