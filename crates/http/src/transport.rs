//! What every client of an HTTP server that answers range requests
//! shares (the http source, and S3's objects): the agent and its TLS
//! roots, retries with a growing wait, which failures may pass, and the
//! checks of a partial answer before its bytes are taken.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use diskit_core::{Error, ErrorKind, Result};
use ureq::Agent;
use ureq::http::{HeaderMap, Response, StatusCode};
use ureq::tls::{Certificate, RootCerts, TlsConfig};

use crate::options::HttpOptions;

/// The first wait before a retry; it doubles each time.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Why one try failed.
pub enum Failure {
    /// Worth another try: a dropped connection, a short body, a 5xx.
    Transient(Error),
    /// Not worth another: the answer will not change.
    Permanent(Error),
}

/// Runs `f` until it succeeds, fails for good, or `retries` more tries
/// after the first have failed, waiting longer before each.
pub fn retrying<T>(
    retries: u32,
    mut f: impl FnMut() -> std::result::Result<T, Failure>,
) -> Result<T> {
    let mut wait = FIRST_BACKOFF;
    let mut tries = 0;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(Failure::Permanent(e)) => return Err(e),
            Err(Failure::Transient(e)) if tries >= retries => {
                return Err(e.context(format!("after {retries} retries")));
            }
            Err(Failure::Transient(_)) => {
                std::thread::sleep(wait);
                wait = wait.saturating_mul(2);
                tries += 1;
            }
        }
    }
}

/// An error about `what` (a URL in quotes, an `s3://` name).
pub fn error(what: &str, kind: ErrorKind, msg: impl std::fmt::Display) -> Error {
    Error::new(kind, format!("{what}: {msg}"))
}

/// Whether an answer with `status` may be different next time (a
/// server error, a timeout, throttling).
pub fn status_may_pass(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 429 | 500 | 502 | 503 | 504)
}

/// The error kind an unhoped-for `status` stands for.
pub fn status_kind(status: StatusCode) -> ErrorKind {
    match status.as_u16() {
        401 | 403 => ErrorKind::PermissionDenied,
        404 | 410 => ErrorKind::NotFound,
        _ => ErrorKind::Io,
    }
}

/// What a request that got no answer (`e`) means for `what`: worth
/// another try unless it will fail again (a certificate, a bad URL).
pub fn failure(what: &str, e: ureq::Error) -> Failure {
    use ureq::Error as U;
    // A certificate the server's answer fails on will fail again.
    let tls = match &e {
        U::Io(io) => io
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some()),
        U::Rustls(_) | U::Tls(_) => true,
        _ => false,
    };
    let transient = !tls
        && matches!(
            e,
            U::Io(_) | U::Timeout(_) | U::ConnectionFailed | U::BodyStalled | U::Protocol(_)
        );
    let kind = match &e {
        U::Io(io) => ErrorKind::from_errno(io.raw_os_error().unwrap_or(EIO)),
        U::BadUri(_) => ErrorKind::InvalidInput,
        _ => ErrorKind::Io,
    };
    let err = error(what, kind, e);
    if transient {
        Failure::Transient(err)
    } else {
        Failure::Permanent(err)
    }
}

/// EIO, without a libc dependency.
const EIO: i32 = 5;

/// A header's value as text.
pub fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
}

/// `Content-Range: bytes A-B/TOTAL` (TOTAL may be `*`).
pub fn content_range(h: &HeaderMap) -> Option<(u64, u64, Option<u64>)> {
    parse_content_range(&header(h, "content-range")?)
}

/// A `Content-Range` value, `bytes A-B/TOTAL` (TOTAL may be `*`): the
/// first and last byte and the total, or `None` when it is not that.
pub fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    (a <= b).then_some((a, b, total))
}

/// What a partial answer must show to be the bytes asked of the resource
/// first seen.
pub struct Expected<'a> {
    /// Names the resource in messages.
    pub what: &'a str,
    /// Its size.
    pub size: u64,
    /// Its entity tag, when known: another one is another resource.
    pub etag: Option<&'a str>,
}

impl Expected<'_> {
    fn err(&self, kind: ErrorKind, msg: impl std::fmt::Display) -> Error {
        error(self.what, kind, msg)
    }

    /// Checks a 206 answer's `Content-Range` and entity tag (header values,
    /// when sent) against a request for `len` bytes at `offset`.
    pub fn check(
        &self,
        content_range: Option<&str>,
        etag: Option<&str>,
        offset: u64,
        len: usize,
    ) -> std::result::Result<(), Failure> {
        let last = offset + len as u64 - 1;
        match content_range.and_then(parse_content_range) {
            Some((a, b, total)) => {
                if let Some(t) = total.filter(|&t| t != self.size) {
                    return Err(Failure::Permanent(self.err(
                        ErrorKind::Io,
                        format!("the resource changed size from {} to {t} bytes", self.size),
                    )));
                }
                if (a, b) != (offset, last) {
                    return Err(Failure::Permanent(self.err(
                        ErrorKind::Io,
                        format!("asked for bytes {offset}-{last}, the server sent {a}-{b}"),
                    )));
                }
            }
            None => {
                return Err(Failure::Permanent(self.err(
                    ErrorKind::NotSupported,
                    "the server does not support range requests \
                     (its partial answer has no Content-Range)",
                )));
            }
        }
        if let (Some(want), Some(got)) = (self.etag, etag)
            && want != got.trim()
        {
            return Err(Failure::Permanent(self.err(
                ErrorKind::Io,
                format!(
                    "the resource changed (entity tag {want} is now {})",
                    got.trim()
                ),
            )));
        }
        Ok(())
    }

    /// A short body: worth another try.
    pub fn short(&self, got: usize, len: usize, offset: u64) -> Failure {
        Failure::Transient(self.err(
            ErrorKind::Io,
            format!("short answer: {got} of {len} bytes at {offset}"),
        ))
    }

    /// Takes a 206 answer to a request for `buf.len()` bytes at `offset`
    /// into `buf`, after checking its range, total and entity tag; reads
    /// the body to its end, so that the connection goes back to the pool.
    pub fn take(
        &self,
        r: &mut Response<ureq::Body>,
        buf: &mut [u8],
        offset: u64,
    ) -> std::result::Result<(), Failure> {
        self.check(
            header(r.headers(), "content-range").as_deref(),
            header(r.headers(), "etag").as_deref(),
            offset,
            buf.len(),
        )?;
        let mut reader = r.body_mut().as_reader();
        let mut got = 0;
        while got < buf.len() {
            match reader.read(&mut buf[got..]) {
                Ok(0) => return Err(self.short(got, buf.len(), offset)),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Failure::Transient(self.err(
                        ErrorKind::Io,
                        format!("reading {} bytes at {offset}: {e}", buf.len()),
                    )));
                }
            }
        }
        // Reading to the end of the body gives the connection back to the
        // pool (a body left unread closes it); a body longer than asked is
        // the server's mistake.
        match reader.read(&mut [0u8; 1]) {
            Ok(0) => Ok(()),
            Ok(_) => Err(Failure::Permanent(self.err(
                ErrorKind::Io,
                format!(
                    "the server sent more than the {} bytes asked at {offset}",
                    buf.len()
                ),
            ))),
            Err(_) => Ok(()),
        }
    }
}

/// How long connecting may take, and how long a connection may stay
/// silent (no byte of an answer, no room to send) before the request is
/// given up and tried again, by default ([`HttpOptions::stall_timeout`]):
/// a server or store that stops answering (a Ceph cluster that is full
/// blocks every write) makes a command fail, never hang. The same minute
/// as botocore's connect and read timeouts.
pub const STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The agent: its TLS roots, verification, timeouts, redirects and pool.
pub fn agent(opts: &HttpOptions) -> Result<Agent> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let tls = TlsConfig::builder()
        .root_certs(RootCerts::Specific(Arc::new(roots(opts)?)))
        .disable_verification(!opts.sslverify)
        .unversioned_rustls_crypto_provider(provider)
        .build();
    let mut config = Agent::config_builder()
        .tls_config(tls)
        .http_status_as_error(false)
        .max_idle_connections(opts.connections.max(1) * 2)
        .max_idle_connections_per_host(opts.connections.max(1))
        .timeout_global(opts.timeout)
        .timeout_connect(Some(opts.stall_timeout))
        .timeout_per_read(Some(opts.stall_timeout))
        .timeout_per_write(Some(opts.stall_timeout))
        .max_redirects(if opts.follow_location { 10 } else { 0 });
    if let Some(ua) = &opts.user_agent {
        config = config.user_agent(ua.as_str());
    }
    Ok(Agent::new_with_config(config.build()))
}

/// The certificates to trust: `cainfo` and `capath` when given, else the
/// system's.
fn roots(opts: &HttpOptions) -> Result<Vec<Certificate<'static>>> {
    let mut files = Vec::new();
    if let Some(f) = &opts.cainfo {
        files.push(f.clone());
    }
    if let Some(dir) = &opts.capath {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::from(e).context(format!("http: capath: {}", dir.display())))?;
        for e in entries.flatten() {
            if e.path().is_file() {
                files.push(e.path());
            }
        }
    }
    if files.is_empty() {
        if !opts.sslverify {
            return Ok(Vec::new());
        }
        let found = rustls_native_certs::load_native_certs();
        return Ok(found
            .certs
            .iter()
            .map(|c| Certificate::from_der(c.as_ref()).to_owned())
            .collect());
    }
    let mut certs = Vec::new();
    for f in files {
        let pem = std::fs::read(&f)
            .map_err(|e| Error::from(e).context(format!("http: {}", f.display())))?;
        for item in ureq::tls::parse_pem(&pem) {
            if let Ok(ureq::tls::PemItem::Certificate(c)) = item {
                certs.push(c);
            }
        }
    }
    if certs.is_empty() && opts.cainfo.is_some() {
        return Err(Error::invalid(format!(
            "http: cainfo: no certificate in {}",
            opts.cainfo
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        )));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_are_parsed_and_checked() {
        let mut h = HeaderMap::new();
        h.insert("content-range", "bytes 10-19/100".parse().unwrap());
        assert_eq!(content_range(&h), Some((10, 19, Some(100))));
        h.insert("content-range", "bytes 0-0/*".parse().unwrap());
        assert_eq!(content_range(&h), Some((0, 0, None)));
        for bad in ["bytes 9-1/100", "items 0-1/2", "bytes x-1/2", "bytes 0-1"] {
            h.insert("content-range", bad.parse().unwrap());
            assert_eq!(content_range(&h), None, "{bad}");
        }
    }

    #[test]
    fn a_server_that_stops_answering_fails_the_request_and_may_pass() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/disk", listener.local_addr().unwrap());
        // Takes the request, then says nothing until the client is gone.
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
        });
        let opts = HttpOptions {
            stall_timeout: std::time::Duration::from_millis(300),
            ..Default::default()
        };
        let e = agent(&opts).unwrap().get(&url).call().unwrap_err();
        match failure("'disk'", e) {
            Failure::Transient(e) => assert!(e.to_string().contains("'disk'"), "{e}"),
            Failure::Permanent(e) => panic!("a stall is worth another try: {e}"),
        }
        server.join().unwrap();
    }

    #[test]
    fn retries_stop_at_the_limit_or_a_lasting_failure() {
        let mut n = 0;
        let r: Result<()> = retrying(2, || {
            n += 1;
            Err(Failure::Transient(Error::invalid("again")))
        });
        assert!(r.unwrap_err().to_string().contains("after 2 retries"));
        assert_eq!(n, 3);
        let mut n = 0;
        let r: Result<()> = retrying(5, || {
            n += 1;
            Err(Failure::Permanent(Error::invalid("no")))
        });
        assert!(r.is_err());
        assert_eq!(n, 1);
        let mut n = 0;
        assert_eq!(
            retrying(5, || {
                n += 1;
                if n < 3 {
                    Err(Failure::Transient(Error::invalid("again")))
                } else {
                    Ok(n)
                }
            })
            .unwrap(),
            3
        );
    }
}
