//! How to reach a URL: certificates, credentials, headers, timeouts, and
//! nbdkit's curl plugin parameters that set them.

use std::path::PathBuf;
use std::time::Duration;

use diskit_core::{Error, Result};

/// The options of an HTTP source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// A PEM file of certificates to trust instead of the system's.
    pub cainfo: Option<PathBuf>,
    /// A directory of PEM certificates to trust instead of the system's.
    pub capath: Option<PathBuf>,
    /// Verify the server's certificate (default true).
    pub sslverify: bool,
    /// The user name for basic authentication.
    pub user: Option<String>,
    /// The password for basic authentication.
    pub password: Option<String>,
    /// Extra request headers, `Name: value`.
    pub headers: Vec<(String, String)>,
    /// A `Cookie` header value.
    pub cookie: Option<String>,
    /// The `User-Agent` header value.
    pub user_agent: Option<String>,
    /// A limit on each request, connection included.
    pub timeout: Option<Duration>,
    /// How long connecting may take, and a connection may stay silent (no
    /// byte of an answer, no room to send), before the request is given
    /// up as failed (and tried again): see
    /// [`STALL_TIMEOUT`](crate::transport::STALL_TIMEOUT), the default.
    pub stall_timeout: Duration,
    /// Follow redirects (default true).
    pub follow_location: bool,
    /// Connections kept open to the server, and requests in flight at
    /// once from [`diskit_core::BlockDevice::submit`].
    pub connections: usize,
    /// Tries after the first for a request that fails in a way that may
    /// pass (a dropped connection, a 5xx, 408 or 429 answer).
    pub retries: u32,
}

impl Default for HttpOptions {
    fn default() -> HttpOptions {
        HttpOptions {
            cainfo: None,
            capath: None,
            sslverify: true,
            user: None,
            password: None,
            headers: Vec::new(),
            cookie: None,
            user_agent: None,
            timeout: None,
            stall_timeout: crate::transport::STALL_TIMEOUT,
            follow_location: true,
            connections: 16,
            retries: 5,
        }
    }
}

/// The keys of nbdkit's curl plugin that diskit takes: `url`, then
/// [`KEYS`].
pub const PLUGIN_KEYS: &[&str] = &[
    "url",
    "cainfo",
    "capath",
    "sslverify",
    "user",
    "password",
    "header",
    "cookie",
    "user-agent",
    "timeout",
    "followlocation",
    "connections",
    "retries",
];

/// The keys [`HttpOptions::set`] takes (nbdkit's curl plugin's but the
/// URL, and `retries`).
pub const KEYS: &[&str] = PLUGIN_KEYS.split_at(1).1;

impl HttpOptions {
    /// Sets `key` to `value` as nbdkit's curl plugin reads it
    /// (`header` adds a header each time; `password=+FILE` and
    /// `cookie=+FILE` read the value from FILE).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let bad = |why: &str| Error::invalid(format!("http: {key}: {why}: '{value}'"));
        match key {
            "cainfo" => self.cainfo = Some(PathBuf::from(value)),
            "capath" => self.capath = Some(PathBuf::from(value)),
            "sslverify" => self.sslverify = boolean(value).ok_or_else(|| bad("not a boolean"))?,
            "followlocation" => {
                self.follow_location = boolean(value).ok_or_else(|| bad("not a boolean"))?
            }
            "user" => self.user = Some(value.to_string()),
            "password" => self.password = Some(diskit_core::params::secret("http", key, value)?),
            "cookie" => self.cookie = Some(diskit_core::params::secret("http", key, value)?),
            "user-agent" => self.user_agent = Some(value.to_string()),
            "header" => {
                let (name, v) = value
                    .split_once(':')
                    .filter(|(n, _)| !n.trim().is_empty())
                    .ok_or_else(|| bad("expected 'Name: value'"))?;
                self.headers
                    .push((name.trim().to_string(), v.trim().to_string()));
            }
            "timeout" => {
                let secs: u64 = value.trim().parse().map_err(|_| bad("not whole seconds"))?;
                self.timeout = (secs > 0).then(|| Duration::from_secs(secs));
            }
            "connections" => {
                self.connections = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|n| (1..=1024).contains(n))
                    .ok_or_else(|| bad("expected 1 to 1024"))?
            }
            "retries" => self.retries = value.trim().parse().map_err(|_| bad("not a number"))?,
            _ => return Err(Error::invalid(format!("http: unknown parameter '{key}'"))),
        }
        Ok(())
    }
}

/// A boolean as nbdkit reads them.
fn boolean(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// `user:password` in base64, for an `Authorization: Basic` header.
pub(crate) fn basic_auth(user: &str, password: &str) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let input = format!("{user}:{password}");
    let mut out = String::new();
    for chunk in input.as_bytes().chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_is_base64() {
        assert_eq!(
            basic_auth("Aladdin", "open sesame"),
            "QWxhZGRpbjpvcGVuIHNlc2FtZQ=="
        );
        assert_eq!(basic_auth("a", ""), "YTo=");
        assert_eq!(basic_auth("ab", "c"), "YWI6Yw==");
    }

    #[test]
    fn parameters_are_read_as_nbdkit_curl_reads_them() {
        let mut o = HttpOptions::default();
        o.set("header", "X-A: 1").unwrap();
        o.set("header", "X-B:two words").unwrap();
        o.set("sslverify", "false").unwrap();
        o.set("timeout", "30").unwrap();
        o.set("connections", "4").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "s3cret\n").unwrap();
        o.set("password", &format!("+{}", pw.display())).unwrap();
        assert_eq!(
            o.headers,
            vec![
                ("X-A".into(), "1".into()),
                ("X-B".into(), "two words".into())
            ]
        );
        assert!(!o.sslverify);
        assert_eq!(o.timeout, Some(Duration::from_secs(30)));
        assert_eq!(o.connections, 4);
        assert_eq!(o.password.as_deref(), Some("s3cret"));
        for (k, v, says) in [
            ("header", "nocolon", "Name: value"),
            ("connections", "0", "1 to 1024"),
            ("password", "-", "+FILE"),
            ("sslverify", "maybe", "boolean"),
            ("bogus", "1", "unknown parameter"),
        ] {
            let e = o.set(k, v).unwrap_err();
            assert!(e.to_string().contains(says), "{k}: {e}");
        }
    }
}
