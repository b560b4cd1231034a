//! Range GETs over plain HTTP whose bodies are read straight into the
//! caller's buffer. The agent (ureq) reads a body into a buffer of its own
//! and copies it out: for a store on the local network (radosgw, MinIO)
//! that copy was a sixth of a download's processor time. This path takes
//! only what it can do exactly: `http://` URLs, no proxy in the
//! environment, an answer `206` with a `Content-Length` of the bytes
//! asked, or a refusal (4xx, 5xx) with a small body, given to the caller
//! to name; anything else (a chunked body, a redirect, a 200 that ignored
//! the range) is left to the agent, which sends the request again and
//! reads the answer its way. Connections are kept open for the next request (HTTP/1.1
//! keep-alive), a few per server.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

use diskit_core::ErrorKind;
use diskit_core::sync::lock;

use crate::transport::{Expected, Failure, error};

/// The longest header section taken (the rest is the agent's to read).
const MAX_HEAD: usize = 64 << 10;

/// The longest error body taken (S3's XML error documents are small).
const MAX_ERROR_BODY: u64 = 64 << 10;

/// What a direct GET did.
pub enum Got {
    /// The bytes are in the buffer.
    Bytes,
    /// The server refused (a 4xx or 5xx answer, its body as text): the
    /// caller names the error from them.
    Refused {
        /// The status code.
        status: u16,
        /// The body (at most 64 KiB).
        body: String,
    },
    /// The answer is not one this path takes: ask again through the agent.
    Other,
}

/// Kept-alive connections to one server, and the requests' settings.
pub struct DirectGets {
    /// `host[:port]` as the URL gives it (the Host header).
    authority: String,
    idle: Mutex<Vec<TcpStream>>,
    keep: usize,
    stall: Duration,
    /// Header lines sent with every request besides Host, Range and
    /// Accept-Encoding (`Name: value\r\n` each).
    extra: String,
}

impl DirectGets {
    /// Direct GETs for the server of `endpoint`, keeping up to `keep`
    /// connections: `None` unless `endpoint` is `http://` and no proxy is
    /// set in the environment (the agent honours it; this path would not).
    pub fn for_endpoint(endpoint: &str, keep: usize, stall: Duration) -> Option<DirectGets> {
        let rest = endpoint.strip_prefix("http://")?;
        let authority = rest.split(['/', '?']).next()?.to_string();
        if authority.is_empty() || authority.contains('@') {
            return None;
        }
        let proxied = ["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"]
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
        (!proxied).then(|| DirectGets {
            authority,
            idle: Mutex::new(Vec::new()),
            keep: keep.max(1),
            stall,
            extra: String::new(),
        })
    }

    /// The same, sending `headers` with every request too; `None` when a
    /// name or value could break the request (a line break, a NUL, a
    /// colon in a name: the agent refuses those).
    pub fn with_headers(mut self, headers: &[(String, String)]) -> Option<DirectGets> {
        for (k, v) in headers {
            let bad = |t: &str| t.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0));
            if k.is_empty() || k.contains(':') || bad(k) || bad(v) {
                return None;
            }
            self.extra.push_str(&format!("{k}: {v}\r\n"));
        }
        Some(self)
    }

    /// GETs `buf.len()` bytes at `offset` of `url` (a URL of this server)
    /// into `buf`, checked against `expected`.
    pub fn get_range(
        &self,
        url: &str,
        buf: &mut [u8],
        offset: u64,
        expected: &Expected<'_>,
    ) -> std::result::Result<Got, Failure> {
        let Some(target) = url
            .strip_prefix("http://")
            .and_then(|r| r.strip_prefix(self.authority.as_str()))
            .filter(|t| t.starts_with('/'))
        else {
            return Ok(Got::Other);
        };
        let last = offset + buf.len() as u64 - 1;
        let request = format!(
            "GET {target} HTTP/1.1\r\nHost: {}\r\nRange: bytes={offset}-{last}\r\n\
             Accept-Encoding: identity\r\n{}\r\n",
            self.authority, self.extra
        );
        // A kept connection the server has closed fails at once: one more
        // try on a new connection before the failure counts.
        let pooled = lock(&self.idle).pop();
        let reused = pooled.is_some();
        let first = match pooled {
            Some(s) => self.exchange(s, &request, buf, offset, expected),
            None => self
                .connect()
                .and_then(|s| self.exchange(s, &request, buf, offset, expected)),
        };
        match first {
            Err(Failure::Transient(_)) if reused => self
                .connect()
                .and_then(|s| self.exchange(s, &request, buf, offset, expected)),
            r => r,
        }
    }

    fn connect(&self) -> std::result::Result<TcpStream, Failure> {
        let fail = |e: io::Error| {
            Failure::Transient(error(
                &self.authority,
                ErrorKind::Io,
                format!("connecting: {e}"),
            ))
        };
        let s = TcpStream::connect(self.authority.as_str()).map_err(fail)?;
        s.set_nodelay(true).map_err(fail)?;
        s.set_read_timeout(Some(self.stall)).map_err(fail)?;
        s.set_write_timeout(Some(self.stall)).map_err(fail)?;
        Ok(s)
    }

    /// Sends `request` on `s` and reads its answer into `buf`; keeps `s`
    /// for the next request when the answer allows it.
    fn exchange(
        &self,
        mut s: TcpStream,
        request: &str,
        buf: &mut [u8],
        offset: u64,
        expected: &Expected<'_>,
    ) -> std::result::Result<Got, Failure> {
        let len = buf.len();
        let io_fail = |e: io::Error| {
            Failure::Transient(error(
                expected.what,
                ErrorKind::Io,
                format!("reading {len} bytes at {offset}: {e}"),
            ))
        };
        s.write_all(request.as_bytes()).map_err(io_fail)?;
        let (head, extra) = read_head(&mut s).map_err(io_fail)?;
        let Some(answer) = Answer::parse(&head) else {
            return Ok(Got::Other);
        };
        if answer.status >= 400
            && !answer.chunked
            && let Some(n) = answer.length.filter(|&n| n <= MAX_ERROR_BODY)
        {
            // A refusal with a small body (S3's error document): read whole,
            // so the connection can serve the next request.
            let mut body = extra;
            body.truncate(n as usize);
            let mut rest = Vec::new();
            (&mut s)
                .take(n - body.len() as u64)
                .read_to_end(&mut rest)
                .map_err(io_fail)?;
            body.extend_from_slice(&rest);
            if body.len() as u64 != n {
                return Err(expected.short(body.len(), n as usize, offset));
            }
            self.keep(s, &answer);
            return Ok(Got::Refused {
                status: answer.status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        if answer.status != 206 || answer.chunked || answer.length != Some(buf.len() as u64) {
            // Not this path's: the agent asks again (this connection,
            // with an answer half read, is dropped).
            return Ok(Got::Other);
        }
        expected.check(
            answer.content_range.as_deref(),
            answer.etag.as_deref(),
            offset,
            buf.len(),
        )?;
        if extra.len() > buf.len() {
            return Err(Failure::Permanent(error(
                expected.what,
                ErrorKind::Io,
                format!(
                    "the server sent more than the {} bytes asked at {offset}",
                    buf.len()
                ),
            )));
        }
        buf[..extra.len()].copy_from_slice(&extra);
        let mut got = extra.len();
        while got < buf.len() {
            match s.read(&mut buf[got..]) {
                Ok(0) => return Err(expected.short(got, buf.len(), offset)),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_fail(e)),
            }
        }
        self.keep(s, &answer);
        Ok(Got::Bytes)
    }

    /// Keeps `s` for the next request unless the answer closes it.
    fn keep(&self, s: TcpStream, answer: &Answer) {
        if !answer.close {
            let mut idle = lock(&self.idle);
            if idle.len() < self.keep {
                idle.push(s);
            }
        }
    }
}

/// Reads up to the end of the header section: the section, and the body
/// bytes that came with it.
fn read_head(s: &mut TcpStream) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut data = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            ));
        }
        let from = data.len().saturating_sub(3);
        data.extend_from_slice(&chunk[..n]);
        if let Some(at) = data[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = from + at + 4;
            let extra = data.split_off(end);
            return Ok((data, extra));
        }
        if data.len() > MAX_HEAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the answer's headers are too long",
            ));
        }
    }
}

/// What an answer's header section says, as far as this path needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// `Content-Length`.
    pub length: Option<u64>,
    /// `Content-Range`.
    pub content_range: Option<String>,
    /// `ETag`.
    pub etag: Option<String>,
    /// A `Transfer-Encoding` was given (the body is not plain).
    pub chunked: bool,
    /// `Connection: close`.
    pub close: bool,
}

impl Answer {
    /// Parses an HTTP/1.1 header section, status line first (`None`: not
    /// one this path takes).
    pub fn parse(head: &[u8]) -> Option<Answer> {
        let text = std::str::from_utf8(head).ok()?;
        let mut lines = text.split("\r\n");
        let status_line = lines.next()?;
        let mut words = status_line.split(' ');
        let version = words.next()?;
        if version != "HTTP/1.1" {
            // HTTP/1.0 closes by default and may differ: the agent's.
            return None;
        }
        let mut a = Answer {
            status: words.next()?.parse().ok()?,
            ..Answer::default()
        };
        for line in lines.filter(|l| !l.is_empty()) {
            let (name, value) = line.split_once(':')?;
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => {
                    if a.length.is_some() {
                        return None;
                    }
                    a.length = Some(value.parse().ok()?);
                }
                "content-range" => a.content_range = Some(value.to_string()),
                "etag" => a.etag = Some(value.to_string()),
                "transfer-encoding" => a.chunked = true,
                "connection" => a.close = value.eq_ignore_ascii_case("close"),
                _ => {}
            }
        }
        Some(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;

    #[test]
    fn headers_are_read_as_this_path_needs() {
        let a = Answer::parse(
            b"HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\n\
              Content-Range: bytes 0-9/100\r\nETag: \"x\"\r\n\r\n",
        )
        .unwrap();
        assert_eq!(a.status, 206);
        assert_eq!(a.length, Some(10));
        assert_eq!(a.content_range.as_deref(), Some("bytes 0-9/100"));
        assert_eq!(a.etag.as_deref(), Some("\"x\""));
        assert!(!a.chunked && !a.close);
        let c = Answer::parse(
            b"HTTP/1.1 206 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        assert!(c.chunked && c.close);
        assert!(Answer::parse(b"HTTP/1.0 206 OK\r\n\r\n").is_none());
        assert!(
            Answer::parse(b"HTTP/1.1 206 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
                .is_none()
        );
        assert!(Answer::parse(b"HTTP/1.1 x\r\n\r\n").is_none());
    }

    #[test]
    fn only_plain_http_without_a_proxy_is_taken() {
        let t = Duration::from_secs(1);
        assert!(DirectGets::for_endpoint("https://s3.example", 4, t).is_none());
        assert!(DirectGets::for_endpoint("http://user@host", 4, t).is_none());
        if std::env::var_os("http_proxy").is_none()
            && std::env::var_os("HTTP_PROXY").is_none()
            && std::env::var_os("all_proxy").is_none()
            && std::env::var_os("ALL_PROXY").is_none()
        {
            let d = DirectGets::for_endpoint("http://127.0.0.1:9/b?x", 4, t).unwrap();
            assert_eq!(d.authority, "127.0.0.1:9");
        }
    }

    /// A server answering each GET on a kept connection with the bytes
    /// `i % 251` of the range asked, `rounds` times, then closing.
    fn serve(listener: TcpListener, answers: usize, close_after: usize) {
        let (mut r, mut w) = accept(&listener);
        for n in 0..answers {
            let mut range = (0u64, 0u64);
            for line in request_lines(&mut r) {
                if let Some(v) = line.strip_prefix("Range: bytes=") {
                    let (a, b) = v.split_once('-').unwrap();
                    range = (a.parse().unwrap(), b.parse().unwrap());
                }
            }
            let body: Vec<u8> = (range.0..=range.1).map(|i| (i % 251) as u8).collect();
            let close = if n + 1 == close_after {
                "Connection: close\r\n"
            } else {
                ""
            };
            write!(
                w,
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\n\
                 Content-Range: bytes {}-{}/1000000\r\n{close}\r\n",
                body.len(),
                range.0,
                range.1
            )
            .unwrap();
            w.write_all(&body).unwrap();
            if !close.is_empty() {
                return;
            }
        }
    }

    /// The next connection to `listener`: read buffered, and written.
    fn accept(listener: &TcpListener) -> (io::BufReader<TcpStream>, TcpStream) {
        let (c, _) = listener.accept().unwrap();
        (io::BufReader::new(c.try_clone().unwrap()), c)
    }

    /// The lines of the next request's header section, line ends cut.
    fn request_lines(r: &mut io::BufReader<TcpStream>) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                return lines;
            }
            lines.push(line.trim_end().to_string());
        }
    }

    /// Direct GETs to the test server at `addr`.
    fn to(addr: std::net::SocketAddr) -> DirectGets {
        DirectGets {
            authority: addr.to_string(),
            idle: Mutex::new(Vec::new()),
            keep: 2,
            stall: Duration::from_secs(10),
            extra: String::new(),
        }
    }

    #[test]
    fn the_callers_headers_go_with_each_request_and_line_breaks_are_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut r, mut w) = accept(&listener);
            let lines = request_lines(&mut r);
            write!(
                w,
                "HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\n\
                 Content-Range: bytes 0-3/1000000\r\n\r\n\0\x01\x02\x03"
            )
            .unwrap();
            lines
        });
        let headers = [
            ("Cookie".to_string(), "a=b".to_string()),
            ("Authorization".to_string(), "Basic eDp5".to_string()),
        ];
        let d = to(addr).with_headers(&headers).unwrap();
        let mut buf = [9u8; 4];
        let url = format!("http://{addr}/disk.img");
        assert!(matches!(
            d.get_range(&url, &mut buf, 0, &whole_test_object()),
            Ok(Got::Bytes)
        ));
        assert_eq!(buf, [0, 1, 2, 3]);
        let lines = server.join().unwrap();
        assert_eq!(lines[0], "GET /disk.img HTTP/1.1");
        assert!(lines.contains(&"Cookie: a=b".to_string()), "{lines:?}");
        assert!(
            lines.contains(&"Authorization: Basic eDp5".to_string()),
            "{lines:?}"
        );
        for bad in [
            ("X", "a\r\nEvil: 1"),
            ("X:Y", "v"),
            ("", "v"),
            ("X", "a\nb"),
        ] {
            let h = [(bad.0.to_string(), bad.1.to_string())];
            assert!(to(addr).with_headers(&h).is_none(), "{bad:?}");
        }
    }

    /// The test servers' resource.
    fn whole_test_object() -> Expected<'static> {
        Expected {
            what: "test",
            size: 1000000,
            etag: None,
        }
    }

    #[test]
    fn bodies_land_in_the_buffer_and_connections_are_kept() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || serve(listener, 3, 0));
        let d = to(addr);
        let url = format!("http://{addr}/bucket/key?sig=1");
        let expected = whole_test_object();
        for (offset, len) in [(0u64, 70000usize), (123457, 5), (999000, 1000)] {
            let mut buf = vec![0u8; len];
            assert!(matches!(
                d.get_range(&url, &mut buf, offset, &expected),
                Ok(Got::Bytes)
            ));
            assert!(
                buf.iter()
                    .enumerate()
                    .all(|(i, &b)| b == ((offset + i as u64) % 251) as u8)
            );
            // One connection served all three.
            assert_eq!(lock(&d.idle).len(), 1);
        }
        server.join().unwrap();
    }

    #[test]
    fn refusals_come_back_with_their_body_and_the_connection_serves_on() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut r, mut w) = accept(&listener);
            let body = "<Error><Code>NoSuchKey</Code></Error>";
            for _ in 0..2 {
                request_lines(&mut r);
                write!(
                    w,
                    "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
            }
        });
        let d = to(addr);
        let expected = whole_test_object();
        for _ in 0..2 {
            let mut buf = vec![0u8; 10];
            match d.get_range(&format!("http://{addr}/k"), &mut buf, 0, &expected) {
                Ok(Got::Refused { status, body }) => {
                    assert_eq!(status, 404);
                    assert_eq!(body, "<Error><Code>NoSuchKey</Code></Error>");
                }
                _ => panic!("not a refusal"),
            }
            assert_eq!(lock(&d.idle).len(), 1, "the connection is kept");
        }
        server.join().unwrap();
    }

    #[test]
    fn a_kept_connection_the_server_closed_is_replaced() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            // The first connection answers once and closes without
            // saying so; the second answers the retried request.
            let l2 = listener.try_clone().unwrap();
            serve(listener, 1, 0);
            serve(l2, 1, 0);
        });
        let d = to(addr);
        let url = format!("http://{addr}/k");
        let expected = whole_test_object();
        for offset in [0u64, 4096] {
            let mut buf = vec![0u8; 4096];
            assert!(matches!(
                d.get_range(&url, &mut buf, offset, &expected),
                Ok(Got::Bytes)
            ));
            assert_eq!(buf[1], ((offset + 1) % 251) as u8);
        }
        server.join().unwrap();
    }
}
