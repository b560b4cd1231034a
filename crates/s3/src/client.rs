//! One object and the requests on it: each signed by rusty-s3 (a URL
//! with a Signature V4 in its query, nothing sent by the library) and sent
//! by diskit's HTTP client (`diskit_http::transport`: the agent, retries
//! with back-off, the checks of range answers). S3's errors are read from
//! their XML body and named by their code.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use diskit_core::{Error, ErrorKind, Result};
use diskit_http::direct::{DirectGets, Got};
use diskit_http::transport::{self, Expected, Failure, header};
use rusty_s3::actions::{CreateMultipartUpload, ListObjectsV2, S3Action};
use rusty_s3::{Bucket, Credentials, UrlStyle};
use ureq::Agent;
use ureq::http::{Response, StatusCode};

use crate::config::{S3Options, Settings, process_env};
use crate::name::{PREFIX, S3Name};

/// How long a signed URL stays valid: each request is signed just
/// before it is sent.
const EXPIRY: Duration = Duration::from_secs(15 * 60);

/// The largest read sent as one range request; longer reads are split.
pub(crate) const MAX_REQUEST: usize = 32 << 20;

/// The bucket, who asks, and how: what the requests on every object in
/// it share.
struct Store {
    agent: Agent,
    /// Range GETs read straight into the caller's buffer, for a plain
    /// `http://` endpoint (diskit_http::direct).
    direct: Option<DirectGets>,
    bucket: Bucket,
    credentials: Option<Credentials>,
    retries: u32,
}

/// One object, where it is and who asks.
pub(crate) struct Client {
    store: Arc<Store>,
    /// The object's key.
    pub(crate) key: String,
    /// `s3://BUCKET/KEY`, as messages name it.
    pub(crate) what: String,
}

impl Client {
    /// A client for `name`, with the settings `opts` and the environment
    /// give.
    pub(crate) fn new(name: &S3Name, opts: &S3Options) -> Result<Client> {
        let settings = Settings::find(opts, &process_env)?;
        let what = name.to_string();
        let (endpoint, style) = match &settings.endpoint_url {
            // An S3-compatible store: path-style, as the AWS tools reach
            // an endpoint given by address.
            Some(url) => (url.clone(), UrlStyle::Path),
            None => (
                format!("https://s3.{}.amazonaws.com", settings.region),
                UrlStyle::VirtualHost,
            ),
        };
        let direct = DirectGets::for_endpoint(
            &endpoint,
            opts.connections.max(1),
            diskit_http::transport::STALL_TIMEOUT,
        );
        let endpoint = endpoint
            .parse()
            .map_err(|e| Error::invalid(format!("{what}: endpoint '{endpoint}': {e}")))?;
        let bucket = Bucket::new(endpoint, style, name.bucket.clone(), settings.region)
            .map_err(|e| Error::invalid(format!("{what}: {e}")))?;
        let credentials = settings.keys.map(|k| match k.session_token {
            Some(t) => Credentials::new_with_token(k.access_key, k.secret_key, t),
            None => Credentials::new(k.access_key, k.secret_key),
        });
        let http = diskit_http::HttpOptions {
            connections: opts.connections.max(1),
            ..Default::default()
        };
        let store = Store {
            agent: transport::agent(&http)?,
            direct,
            bucket,
            credentials,
            retries: opts.retries,
        };
        Ok(Client {
            store: Arc::new(store),
            key: name.key.clone(),
            what,
        })
    }

    /// The object `key` of the same bucket, reached the same way.
    pub(crate) fn object(&self, key: String) -> Client {
        let what = format!("{PREFIX}{}/{key}", self.bucket().name());
        Client {
            store: self.store.clone(),
            key,
            what,
        }
    }

    fn bucket(&self) -> &Bucket {
        &self.store.bucket
    }

    fn agent(&self) -> &Agent {
        &self.store.agent
    }

    fn creds(&self) -> Option<&Credentials> {
        self.store.credentials.as_ref()
    }

    fn err(&self, kind: ErrorKind, msg: impl std::fmt::Display) -> Error {
        transport::error(&self.what, kind, msg)
    }

    /// Runs `f` until it succeeds, fails for good, or the retries run out.
    pub(crate) fn retrying<T>(
        &self,
        mut f: impl FnMut(&Client) -> std::result::Result<T, Failure>,
    ) -> Result<T> {
        transport::retrying(self.store.retries, || f(self))
    }

    /// Sends `req`; an answer that is not a success is a failure named by
    /// S3's error code.
    fn send(
        &self,
        req: std::result::Result<Response<ureq::Body>, ureq::Error>,
    ) -> std::result::Result<Response<ureq::Body>, Failure> {
        let r = req.map_err(|e| transport::failure(&self.what, e))?;
        if r.status().is_success() {
            Ok(r)
        } else {
            Err(self.refusal(r).1)
        }
    }

    /// What an answer other than a success means: S3's error code (from
    /// the XML body, when there is one), and a failure that may pass or not.
    fn refusal(&self, mut r: Response<ureq::Body>) -> (Option<String>, Failure) {
        let mut body = String::new();
        let _ = r
            .body_mut()
            .as_reader()
            .take(64 << 10)
            .read_to_string(&mut body);
        self.refusal_of(r.status(), &body)
    }

    /// What an answer of `status` with `body` means (see [`Self::refusal`]).
    fn refusal_of(&self, status: StatusCode, body: &str) -> (Option<String>, Failure) {
        let code = xml_text(body, "Code");
        let message = xml_text(body, "Message").filter(|m| !m.is_empty());
        let text = match (&code, message) {
            (Some(c), Some(m)) => format!("{c}: {m} (HTTP {status})"),
            (Some(c), None) => format!("{c} (HTTP {status})"),
            (None, _) => format!("HTTP status {status}"),
        };
        let kind = match code.as_deref() {
            Some("NoSuchKey" | "NoSuchBucket" | "NoSuchUpload") => ErrorKind::NotFound,
            Some(
                "AccessDenied"
                | "InvalidAccessKeyId"
                | "SignatureDoesNotMatch"
                | "ExpiredToken"
                | "InvalidToken",
            ) => ErrorKind::PermissionDenied,
            _ => transport::status_kind(status),
        };
        let e = self.err(kind, text);
        let may_pass = transport::status_may_pass(status)
            || matches!(
                code.as_deref(),
                Some("SlowDown" | "RequestTimeout" | "InternalError" | "ServiceUnavailable")
            );
        let failure = if may_pass {
            Failure::Transient(e)
        } else {
            Failure::Permanent(e)
        };
        (code, failure)
    }

    /// The object's size and entity tag.
    pub(crate) fn head(&self) -> Result<(u64, Option<String>)> {
        self.retrying(|c| c.head_once())
    }

    fn head_once(&self) -> std::result::Result<(u64, Option<String>), Failure> {
        let url = self
            .bucket()
            .head_object(self.creds(), &self.key)
            .sign(EXPIRY);
        let r = self
            .agent()
            .head(url.as_str())
            .call()
            .map_err(|e| transport::failure(&self.what, e))?;
        let status = r.status();
        if !status.is_success() {
            // AWS answers a HEAD with no body to name the error: a GET of
            // the first byte has one.
            let get = self.get_url();
            let r = self.agent().get(&get).header("Range", "bytes=0-0").call();
            return Err(match self.send(r) {
                Err(f) => f,
                Ok(_) => Failure::Permanent(self.err(
                    transport::status_kind(status),
                    format!("HTTP status {status}"),
                )),
            });
        }
        let size = header(r.headers(), "content-length")
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                Failure::Permanent(self.err(ErrorKind::Io, "the store does not say the size"))
            })?;
        Ok((size, header(r.headers(), "etag")))
    }

    fn get_url(&self) -> String {
        self.store
            .bucket
            .get_object(self.creds(), &self.key)
            .sign(EXPIRY)
            .to_string()
    }

    /// Reads `buf.len()` bytes at `offset` of the object of `size` bytes
    /// and entity tag `etag`, in range requests of at most
    /// [`MAX_REQUEST`] bytes.
    pub(crate) fn read(
        &self,
        buf: &mut [u8],
        offset: u64,
        size: u64,
        etag: Option<&str>,
    ) -> Result<()> {
        self.read_ranges(buf, offset, size, etag, IfMissing::Fail)
    }

    /// Reads `buf.len()` bytes at `offset` of the object, which must be
    /// `size` bytes if it is there; a missing object reads as zeros.
    pub(crate) fn read_or_zeros(&self, buf: &mut [u8], offset: u64, size: u64) -> Result<()> {
        self.read_ranges(buf, offset, size, None, IfMissing::Zeros)
    }

    fn read_ranges(
        &self,
        buf: &mut [u8],
        offset: u64,
        size: u64,
        etag: Option<&str>,
        missing: IfMissing,
    ) -> Result<()> {
        let expected = Expected {
            what: &self.what,
            size,
            etag,
        };
        for (i, piece) in buf.chunks_mut(MAX_REQUEST).enumerate() {
            let at = offset + (i * MAX_REQUEST) as u64;
            let last = at + piece.len() as u64 - 1;
            self.retrying(|c| {
                let url = c.get_url();
                let refused = |piece: &mut [u8], (code, f): (Option<String>, Failure)| match code {
                    Some(code) if code == "NoSuchKey" && missing == IfMissing::Zeros => {
                        piece.fill(0);
                        Ok(())
                    }
                    _ => Err(f),
                };
                if let Some(d) = &c.store.direct {
                    match d.get_range(&url, piece, at, &expected)? {
                        Got::Bytes => return Ok(()),
                        Got::Refused { status, body } => {
                            let status = StatusCode::from_u16(status)
                                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                            return refused(piece, c.refusal_of(status, &body));
                        }
                        Got::Other => {}
                    }
                }
                let r = c
                    .agent()
                    .get(&url)
                    .header("Range", format!("bytes={at}-{last}"))
                    .call()
                    .map_err(|e| transport::failure(&c.what, e))?;
                if !r.status().is_success() {
                    return refused(piece, c.refusal(r));
                }
                let mut r = r;
                if r.status() != StatusCode::PARTIAL_CONTENT {
                    return Err(Failure::Permanent(c.err(
                        ErrorKind::Io,
                        format!("a range request was answered with HTTP {}", r.status()),
                    )));
                }
                expected.take(&mut r, piece, at)
            })?;
        }
        Ok(())
    }

    /// One page of at most `max` keys that start with `prefix`, in
    /// order, after `start_after` (a key) or from `token` (the page
    /// before's last word); the token of the next page, if there is one.
    pub(crate) fn list_page(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        token: Option<&str>,
        max: usize,
    ) -> Result<(Vec<String>, Option<String>)> {
        self.retrying(|c| {
            let mut action = c.bucket().list_objects_v2(c.creds());
            action.with_prefix(prefix);
            action.with_max_keys(max);
            if let Some(after) = start_after {
                action.with_start_after(after);
            }
            if let Some(token) = token {
                action.with_continuation_token(token);
            }
            let url = action.sign(EXPIRY);
            let mut r = c.send(c.agent().get(url.as_str()).call())?;
            let body = read_text(&mut r).map_err(|e| c.transient(e))?;
            let page = ListObjectsV2::parse_response(&body).map_err(|e| {
                Failure::Permanent(c.err(ErrorKind::Io, format!("ListObjectsV2: {e}")))
            })?;
            let keys = page.contents.into_iter().map(|o| o.key).collect();
            Ok((keys, page.next_continuation_token))
        })
    }

    /// Starts a multipart upload; its id.
    pub(crate) fn create_upload(&self) -> Result<String> {
        self.retrying(|c| {
            let url = c
                .bucket()
                .create_multipart_upload(c.creds(), &c.key)
                .sign(EXPIRY);
            let mut r = c.send(c.agent().post(url.as_str()).send_empty())?;
            let body = read_text(&mut r).map_err(|e| c.transient(e))?;
            CreateMultipartUpload::parse_response(&body)
                .map(|r| r.upload_id().to_string())
                .map_err(|e| {
                    Failure::Permanent(c.err(ErrorKind::Io, format!("CreateMultipartUpload: {e}")))
                })
        })
    }

    /// Uploads part `number` (from 1) of upload `id`; its entity tag.
    pub(crate) fn upload_part(&self, id: &str, number: u16, body: &[u8]) -> Result<String> {
        self.retrying(|c| {
            let url = c
                .bucket()
                .upload_part(c.creds(), &c.key, number, id)
                .sign(EXPIRY);
            let r = c.send(c.agent().put(url.as_str()).send(body))?;
            header(r.headers(), "etag").ok_or_else(|| {
                Failure::Permanent(c.err(
                    ErrorKind::Io,
                    format!("the store gave part {number} no entity tag"),
                ))
            })
        })
    }

    /// Completes upload `id` from its parts' entity tags, in order.
    pub(crate) fn complete(&self, id: &str, etags: &[String]) -> Result<()> {
        self.retrying(|c| {
            let action = c.bucket().complete_multipart_upload(
                c.creds(),
                &c.key,
                id,
                etags.iter().map(String::as_str),
            );
            let url = action.sign(EXPIRY);
            let mut r = c.send(c.agent().post(url.as_str()).send(action.body()))?;
            // S3 may answer 200 and still fail: the body says.
            let body = read_text(&mut r).map_err(|e| c.transient(e))?;
            match xml_text(&body, "Code") {
                Some(code) => Err(Failure::Permanent(
                    c.err(ErrorKind::Io, format!("CompleteMultipartUpload: {code}")),
                )),
                None => Ok(()),
            }
        })
    }

    /// Aborts upload `id`: its parts go.
    pub(crate) fn abort(&self, id: &str) -> Result<()> {
        self.retrying(|c| {
            let url = c
                .bucket()
                .abort_multipart_upload(c.creds(), &c.key, id)
                .sign(EXPIRY);
            c.send(c.agent().delete(url.as_str()).call()).map(drop)
        })
    }

    /// Writes the whole object in one request.
    pub(crate) fn put(&self, body: &[u8]) -> Result<()> {
        self.retrying(|c| {
            let url = c.bucket().put_object(c.creds(), &c.key).sign(EXPIRY);
            c.send(c.agent().put(url.as_str()).send(body)).map(drop)
        })
    }

    /// Removes the object.
    pub(crate) fn delete(&self) -> Result<()> {
        self.retrying(|c| {
            let url = c.bucket().delete_object(c.creds(), &c.key).sign(EXPIRY);
            c.send(c.agent().delete(url.as_str()).call()).map(drop)
        })
    }

    fn transient(&self, e: std::io::Error) -> Failure {
        Failure::Transient(self.err(ErrorKind::Io, e))
    }
}

/// What a read of an object that is not there gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IfMissing {
    /// An error (NoSuchKey).
    Fail,
    /// Zeros (a sharded disk's objects never written).
    Zeros,
}

/// A small answer's body as text.
fn read_text(r: &mut Response<ureq::Body>) -> std::io::Result<String> {
    let mut s = String::new();
    r.body_mut()
        .as_reader()
        .take(1 << 20)
        .read_to_string(&mut s)?;
    Ok(s)
}

/// The text of the first `<tag>` element of an XML document (S3's error
/// answers are flat: `<Error><Code>..</Code><Message>..</Message>`).
pub fn xml_text(xml: &str, tag: &str) -> Option<String> {
    let open = format!("<{tag}>");
    let start = xml.find(&open)? + open.len();
    let end = xml[start..].find(&format!("</{tag}>"))? + start;
    Some(unescape(xml[start..end].trim()))
}

/// XML's five predefined entities.
fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_are_read_from_the_body() {
        let body = r#"<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>a &amp; b</Message><BucketName>x</BucketName></Error>"#;
        assert_eq!(xml_text(body, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(xml_text(body, "Message").as_deref(), Some("a & b"));
        assert_eq!(xml_text(body, "Key"), None);
        assert_eq!(xml_text("", "Code"), None);
    }
}
