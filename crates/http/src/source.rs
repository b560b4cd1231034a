//! One URL, reached over a pool of kept-alive connections: its size, and
//! byte ranges of it by range requests, retried when the failure may pass.

use std::io::Read;

use diskit_core::{Error, ErrorKind, Result};
use ureq::Agent;
use ureq::http::StatusCode;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::direct::{DirectGets, Got};
use crate::options::{HttpOptions, basic_auth};
use crate::transport::{self, Expected, Failure, content_range, header};

/// The largest read sent as one range request; longer reads are split.
pub(crate) const MAX_REQUEST: usize = 32 << 20;

/// A URL and how to reach it.
pub struct Source {
    agent: Agent,
    url: String,
    /// The URL in quotes, as messages name it.
    what: String,
    /// Headers sent with every request (authentication, the user's).
    headers: Vec<(String, String)>,
    retries: u32,
    /// The resource's size, from the first answer.
    pub(crate) size: u64,
    /// Its entity tag, when the server gave one: a later answer with
    /// another one is another resource.
    etag: Option<String>,
    /// Range GETs read straight into the caller's buffer, for a plain
    /// `http://` URL (see [`crate::direct`]); given up after the first
    /// answer they do not take (a redirect: the agent follows it).
    direct: Option<DirectGets>,
    direct_taken: AtomicBool,
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
        let agent = transport::agent(opts)?;
        let mut headers = opts.headers.clone();
        if let Some(user) = &opts.user {
            let auth = basic_auth(user, opts.password.as_deref().unwrap_or(""));
            headers.push(("Authorization".into(), format!("Basic {auth}")));
        }
        if let Some(c) = &opts.cookie {
            headers.push(("Cookie".into(), c.clone()));
        }
        // Not where a whole-request timeout is asked (only a stall is
        // timed on that path).
        let direct = opts
            .timeout
            .is_none()
            .then(|| DirectGets::for_endpoint(url, opts.connections.max(1), opts.stall_timeout))
            .flatten()
            .and_then(|d| {
                let ua = opts
                    .user_agent
                    .iter()
                    .map(|u| ("User-Agent".to_string(), u.clone()));
                let all: Vec<(String, String)> = headers.iter().cloned().chain(ua).collect();
                d.with_headers(&all)
            });
        let mut source = Source {
            agent,
            url: url.to_string(),
            what: format!("'{url}'"),
            headers,
            retries: opts.retries,
            size: 0,
            etag: None,
            direct,
            direct_taken: AtomicBool::new(true),
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
        transport::retrying(self.retries, || f(self))
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
        let mut r = self.get_range("bytes=0-0".into())?;
        if let Some(f) = self.bad_status(r.status(), true) {
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
        let expected = Expected {
            what: &self.what,
            size: self.size,
            etag: self.etag.as_deref(),
        };
        if let Some(d) = &self.direct
            && self.direct_taken.load(Ordering::Relaxed)
        {
            match d.get_range(&self.url, buf, offset, &expected)? {
                Got::Bytes => return Ok(()),
                Got::Refused { status, .. } => {
                    let status =
                        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                    return Err(self.refusal(status, offset, last).unwrap_or_else(|| {
                        Failure::Permanent(self.err(ErrorKind::Io, format!("HTTP status {status}")))
                    }));
                }
                Got::Other => self.direct_taken.store(false, Ordering::Relaxed),
            }
        }
        let mut r = self.get_range(format!("bytes={offset}-{last}"))?;
        if let Some(f) = self.refusal(r.status(), offset, last) {
            return Err(f);
        }
        expected.take(&mut r, buf, offset)
    }

    /// What the answer `status` to a GET of bytes `offset..=last` means
    /// when it is not the part asked: `None` for 206.
    fn refusal(&self, status: StatusCode, offset: u64, last: u64) -> Option<Failure> {
        if status == StatusCode::RANGE_NOT_SATISFIABLE {
            return Some(Failure::Permanent(self.err(
                ErrorKind::Io,
                format!(
                    "bytes {offset}-{last} are past the end: the resource shrank from {} bytes",
                    self.size
                ),
            )));
        }
        self.bad_status(status, true)
    }

    /// A GET of the byte range `range` (`bytes=A-B`); a server that answers
    /// with the whole resource cannot serve ranges.
    fn get_range(
        &self,
        range: String,
    ) -> std::result::Result<ureq::http::Response<ureq::Body>, Failure> {
        let r = self
            .get()
            .header("Range", range)
            .call()
            .map_err(|e| self.failure(e))?;
        if r.status() == StatusCode::OK {
            return Err(Failure::Permanent(self.cannot_range(
                "it answered a range request with the whole resource",
            )));
        }
        Ok(r)
    }

    fn err(&self, kind: ErrorKind, msg: impl std::fmt::Display) -> Error {
        transport::error(&self.what, kind, msg)
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
        let e = self.err(
            transport::status_kind(status),
            format!("HTTP status {status}"),
        );
        Some(if transport::status_may_pass(status) {
            Failure::Transient(e)
        } else {
            Failure::Permanent(e)
        })
    }

    fn failure(&self, e: ureq::Error) -> Failure {
        transport::failure(&self.what, e)
    }
}
