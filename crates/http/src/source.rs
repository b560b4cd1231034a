//! One URL, reached over a pool of kept-alive connections: its size, and
//! byte ranges of it by range requests, retried when the failure may pass.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use diskit_core::{Error, ErrorKind, Result};
use ureq::Agent;
use ureq::http::{HeaderMap, StatusCode};
use ureq::tls::{Certificate, RootCerts, TlsConfig};

use crate::options::{HttpOptions, basic_auth};

/// The largest read sent as one range request; longer reads are split.
pub(crate) const MAX_REQUEST: usize = 32 << 20;

/// The first wait before a retry; it doubles each time.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Why one try failed.
enum Failure {
    /// Worth another try: a dropped connection, a short body, a 5xx.
    Transient(Error),
    /// Not worth another: the answer will not change.
    Permanent(Error),
}

/// A URL and how to reach it.
pub(crate) struct Source {
    agent: Agent,
    url: String,
    /// Headers sent with every request (authentication, the user's).
    headers: Vec<(String, String)>,
    retries: u32,
    /// The resource's size, from the first answer.
    pub(crate) size: u64,
    /// Its entity tag, when the server gave one: a later answer with
    /// another one is another resource.
    etag: Option<String>,
}

impl Source {
    /// Connects to `url` and learns its size; refuses a server that
    /// cannot answer range requests.
    pub(crate) fn open(url: &str, opts: &HttpOptions) -> Result<Source> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(Error::invalid(format!(
                "'{url}': not an http:// or https:// URL"
            )));
        }
        let agent = agent(opts)?;
        let mut headers = opts.headers.clone();
        if let Some(user) = &opts.user {
            let auth = basic_auth(user, opts.password.as_deref().unwrap_or(""));
            headers.push(("Authorization".into(), format!("Basic {auth}")));
        }
        if let Some(c) = &opts.cookie {
            headers.push(("Cookie".into(), c.clone()));
        }
        let mut source = Source {
            agent,
            url: url.to_string(),
            headers,
            retries: opts.retries,
            size: 0,
            etag: None,
        };
        let (size, etag) = source.retrying(|s| s.probe())?;
        source.size = size;
        source.etag = etag;
        Ok(source)
    }

    /// Runs `f` until it succeeds, fails for good, or the retries run out.
    fn retrying<T>(
        &self,
        mut f: impl FnMut(&Source) -> std::result::Result<T, Failure>,
    ) -> Result<T> {
        let mut wait = FIRST_BACKOFF;
        let mut tries = 0;
        loop {
            match f(self) {
                Ok(v) => return Ok(v),
                Err(Failure::Permanent(e)) => return Err(e),
                Err(Failure::Transient(e)) if tries >= self.retries => {
                    return Err(e.context(format!("after {} retries", self.retries)));
                }
                Err(Failure::Transient(_)) => {
                    std::thread::sleep(wait);
                    wait = wait.saturating_mul(2);
                    tries += 1;
                }
            }
        }
    }

    /// The URL.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    fn get(&self) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let mut r = self.agent.get(&self.url);
        for (k, v) in &self.headers {
            r = r.header(k, v);
        }
        r
    }

    /// The size and entity tag, from a HEAD (when it says ranges are
    /// accepted) or else from a one-byte range request.
    fn probe(&self) -> std::result::Result<(u64, Option<String>), Failure> {
        let mut head = self.agent.head(&self.url);
        for (k, v) in &self.headers {
            head = head.header(k, v);
        }
        let r = head.call().map_err(|e| self.failure(e))?;
        let status = r.status();
        let headers = r.headers();
        if status.is_success() {
            let ranges = header(headers, "accept-ranges");
            let length = header(headers, "content-length").and_then(|v| v.parse::<u64>().ok());
            if let (Some(len), Some("bytes")) = (length, ranges.as_deref()) {
                return Ok((len, header(headers, "etag")));
            }
            if length == Some(0) {
                return Ok((0, header(headers, "etag")));
            }
            if ranges.as_deref() == Some("none") {
                return Err(Failure::Permanent(
                    self.cannot_range("it sends Accept-Ranges: none"),
                ));
            }
        } else if let Some(f) = self.bad_status(status, false) {
            return Err(f);
        }
        // No word on ranges in the HEAD (or no HEAD): ask for a byte.
        let mut r = self
            .get()
            .header("Range", "bytes=0-0")
            .call()
            .map_err(|e| self.failure(e))?;
        let status = r.status();
        if status == StatusCode::OK {
            return Err(Failure::Permanent(self.cannot_range(
                "it answered a range request with the whole resource",
            )));
        }
        if let Some(f) = self.bad_status(status, true) {
            return Err(f);
        }
        let (_, _, total) = content_range(r.headers()).ok_or_else(|| {
            Failure::Permanent(self.cannot_range("its partial answer has no Content-Range"))
        })?;
        let total = total.ok_or_else(|| {
            Failure::Permanent(self.err(
                ErrorKind::NotSupported,
                "the server does not say the resource's size",
            ))
        })?;
        let etag = header(r.headers(), "etag");
        // Read to the end, so that the connection goes back to the pool.
        let _ = std::io::copy(
            &mut r.body_mut().as_reader().take(1 << 16),
            &mut std::io::sink(),
        );
        Ok((total, etag))
    }

    /// Reads `buf.len()` bytes at `offset` (in range), in range requests
    /// of at most [`MAX_REQUEST`] bytes.
    pub(crate) fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        for (i, piece) in buf.chunks_mut(MAX_REQUEST).enumerate() {
            let at = offset + (i * MAX_REQUEST) as u64;
            self.retrying(|s| s.read_once(piece, at))?;
        }
        Ok(())
    }

    fn read_once(&self, buf: &mut [u8], offset: u64) -> std::result::Result<(), Failure> {
        let last = offset + buf.len() as u64 - 1;
        let mut r = self
            .get()
            .header("Range", format!("bytes={offset}-{last}"))
            .call()
            .map_err(|e| self.failure(e))?;
        let status = r.status();
        if status == StatusCode::OK {
            return Err(Failure::Permanent(self.cannot_range(
                "it answered a range request with the whole resource",
            )));
        }
        if status == StatusCode::RANGE_NOT_SATISFIABLE {
            return Err(Failure::Permanent(self.err(
                ErrorKind::Io,
                format!(
                    "bytes {offset}-{last} are past the end: the resource shrank from {} bytes",
                    self.size
                ),
            )));
        }
        if let Some(f) = self.bad_status(status, true) {
            return Err(f);
        }
        match content_range(r.headers()) {
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
                return Err(Failure::Permanent(
                    self.cannot_range("its partial answer has no Content-Range"),
                ));
            }
        }
        if let (Some(want), Some(got)) = (&self.etag, header(r.headers(), "etag"))
            && *want != got
        {
            return Err(Failure::Permanent(self.err(
                ErrorKind::Io,
                format!("the resource changed (entity tag {want} is now {got})"),
            )));
        }
        let mut reader = r.body_mut().as_reader();
        let mut got = 0;
        while got < buf.len() {
            match reader.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(Failure::Transient(self.err(
                        ErrorKind::Io,
                        format!("short answer: {got} of {} bytes at {offset}", buf.len()),
                    )));
                }
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

    fn err(&self, kind: ErrorKind, msg: impl std::fmt::Display) -> Error {
        Error::new(kind, format!("'{}': {msg}", self.url))
    }

    fn cannot_range(&self, why: &str) -> Error {
        self.err(
            ErrorKind::NotSupported,
            format!("the server does not support range requests ({why})"),
        )
    }

    /// What a status other than the one hoped for means: `None` when it
    /// is that one (2xx; 206 when `partial`).
    fn bad_status(&self, status: StatusCode, partial: bool) -> Option<Failure> {
        if (partial && status == StatusCode::PARTIAL_CONTENT) || (!partial && status.is_success()) {
            return None;
        }
        let code = status.as_u16();
        let e = |kind| self.err(kind, format!("HTTP status {status}"));
        Some(match code {
            408 | 429 | 500 | 502 | 503 | 504 => Failure::Transient(e(ErrorKind::Io)),
            401 | 403 => Failure::Permanent(e(ErrorKind::PermissionDenied)),
            404 | 410 => Failure::Permanent(e(ErrorKind::NotFound)),
            _ => Failure::Permanent(e(ErrorKind::Io)),
        })
    }

    fn failure(&self, e: ureq::Error) -> Failure {
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
            U::Io(io) => ErrorKind::from_errno(io.raw_os_error().unwrap_or(libc_eio())),
            U::BadUri(_) => ErrorKind::InvalidInput,
            _ => ErrorKind::Io,
        };
        let err = self.err(kind, e);
        if transient {
            Failure::Transient(err)
        } else {
            Failure::Permanent(err)
        }
    }
}

/// EIO, without a libc dependency.
fn libc_eio() -> i32 {
    5
}

/// A header's value as text.
fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
}

/// `Content-Range: bytes A-B/TOTAL` (TOTAL may be `*`).
fn content_range(h: &HeaderMap) -> Option<(u64, u64, Option<u64>)> {
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

/// The agent: its TLS roots, verification, timeouts, redirects and pool.
fn agent(opts: &HttpOptions) -> Result<Agent> {
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
}
