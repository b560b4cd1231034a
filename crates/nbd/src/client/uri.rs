//! NBD URIs (doc/uri.md of the NBD project): where a server is and which
//! export to ask for.
//!
//! `nbd://host[:port]/export`, `nbd+unix:///export?socket=PATH`, and the
//! `nbds` forms for TLS. The export name is the path after the first `/`,
//! percent-decoded; query parameters the client does not know are refused
//! by name rather than ignored.

use diskit_core::{Error, Result};

/// The default NBD port.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A TCP host (name, IPv4, or IPv6 without brackets) and port.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A Unix domain socket.
    Unix(String),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// Where to connect.
    pub address: Address,
    /// The export name ("" for the default export).
    pub export: String,
    /// Whether the connection uses TLS (`nbds`, or credentials given
    /// apart from the name).
    pub tls: bool,
    /// Whether the name says so (`nbds`): QEMU, whose TLS comes from a
    /// `tls-creds` object, shows its nodes as `nbd` whatever they use.
    pub tls_in_name: bool,
    /// The user name (TLS-PSK identity), if any.
    pub user: Option<String>,
    /// `tls-certificates=DIR`.
    pub tls_certificates: Option<String>,
    /// `tls-psk-file=FILE`.
    pub tls_psk_file: Option<String>,
    /// `tls-verify-peer=true|false`.
    pub tls_verify_peer: Option<bool>,
    /// `tls-hostname=NAME`.
    pub tls_hostname: Option<String>,
}

/// Whether `name` is an NBD URI (one of the four schemes).
pub fn is_nbd_uri(name: &str) -> bool {
    ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"]
        .iter()
        .any(|p| name.starts_with(p))
}

impl NbdUri {
    /// Parses an NBD URI, refusing what it cannot honour by name.
    pub fn parse(uri: &str) -> Result<NbdUri> {
        let bad = |why: &str| Error::invalid(format!("invalid NBD URI '{uri}': {why}"));
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| bad("no scheme"))?;
        let (tls, unix) = match scheme {
            "nbd" => (false, false),
            "nbds" => (true, false),
            "nbd+unix" => (false, true),
            "nbds+unix" => (true, true),
            other => return Err(bad(&format!("unknown scheme '{other}'"))),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let (user, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(percent_decode(u).ok_or_else(|| bad("bad user"))?), h),
            None => (None, authority),
        };
        let export = percent_decode(path).ok_or_else(|| bad("bad export name"))?;
        let mut out = NbdUri {
            address: Address::Unix(String::new()),
            export,
            tls,
            tls_in_name: tls,
            user,
            tls_certificates: None,
            tls_psk_file: None,
            tls_verify_peer: None,
            tls_hostname: None,
        };
        let mut socket = None;
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| bad(&format!("bad value of '{k}'")))?;
            match k {
                "socket" if unix => socket = Some(v),
                "tls-certificates" => out.tls_certificates = Some(v),
                "tls-psk-file" => out.tls_psk_file = Some(v),
                "tls-hostname" => out.tls_hostname = Some(v),
                "tls-verify-peer" => {
                    out.tls_verify_peer = Some(match v.as_str() {
                        "true" | "1" | "yes" | "on" => true,
                        "false" | "0" | "no" | "off" => false,
                        _ => return Err(bad("tls-verify-peer must be true or false")),
                    })
                }
                other => return Err(bad(&format!("unknown query parameter '{other}'"))),
            }
        }
        out.address = if unix {
            if !hostport.is_empty() {
                return Err(bad("a Unix socket URI has no host"));
            }
            Address::Unix(socket.ok_or_else(|| bad("nbd+unix needs ?socket=PATH"))?)
        } else {
            let (host, port) = split_host_port(hostport).ok_or_else(|| bad("bad host or port"))?;
            if host.is_empty() {
                return Err(bad("no host"));
            }
            Address::Tcp { host, port }
        };
        Ok(out)
    }
}

impl NbdUri {
    /// A plain-text address and export, with nothing else set: what
    /// QEMU's structured description (`server.type=unix,server.path=S`,
    /// `export=E`) names.
    pub fn plain(address: Address, export: &str) -> NbdUri {
        NbdUri {
            address,
            export: export.to_string(),
            tls: false,
            tls_in_name: false,
            user: None,
            tls_certificates: None,
            tls_psk_file: None,
            tls_verify_peer: None,
            tls_hostname: None,
        }
    }

    /// The URI in QEMU's canonical spelling (what qemu-img shows as the
    /// file name of an NBD node): `nbd+unix:///EXPORT?socket=PATH` or
    /// `nbd+unix://?socket=PATH`, `nbd://HOST:PORT/EXPORT` or
    /// `nbd://HOST:PORT`.
    pub fn canonical(&self) -> String {
        let s = if self.tls && self.tls_in_name {
            "s"
        } else {
            ""
        };
        match (&self.address, self.export.is_empty()) {
            (Address::Unix(path), false) => {
                format!("nbd{s}+unix:///{}?socket={path}", self.export)
            }
            (Address::Unix(path), true) => format!("nbd{s}+unix://?socket={path}"),
            (Address::Tcp { host, port }, false) => {
                format!("nbd{s}://{host}:{port}/{}", self.export)
            }
            (Address::Tcp { host, port }, true) => format!("nbd{s}://{host}:{port}"),
        }
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn split_host_port(s: &str) -> Option<(String, u16)> {
    let port = |p: &str| p.parse::<u16>().ok();
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => port(p)?,
            None if after.is_empty() => DEFAULT_PORT,
            None => return None,
        };
        return Some((host.to_string(), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Some((percent_decode(h)?, port(p)?)),
        Some(_) => None,
        None => Some((percent_decode(s)?, DEFAULT_PORT)),
    }
}

/// Decodes `%XX` escapes; None for a bad escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_and_unix_forms() {
        let u = NbdUri::parse("nbd://example.com:10810/my%20disk").unwrap();
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "example.com".into(),
                port: 10810
            }
        );
        assert_eq!(u.export, "my disk");
        assert!(!u.tls);
        let u = NbdUri::parse("nbd://[::1]/").unwrap();
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "::1".into(),
                port: DEFAULT_PORT
            }
        );
        assert_eq!(u.export, "");
        let u = NbdUri::parse("nbds+unix://alice@/exp?socket=/tmp/s%3d&tls-psk-file=k").unwrap();
        assert_eq!(u.address, Address::Unix("/tmp/s=".into()));
        assert_eq!(u.export, "exp");
        assert!(u.tls);
        assert_eq!(u.user.as_deref(), Some("alice"));
        assert_eq!(u.tls_psk_file.as_deref(), Some("k"));
        let u = NbdUri::parse("nbd://localhost").unwrap();
        assert_eq!(u.export, "");
        assert_eq!(u.canonical(), "nbd://localhost:10809");
        let u = NbdUri::parse("nbd+unix:///?socket=/s").unwrap();
        assert_eq!(u.canonical(), "nbd+unix://?socket=/s");
        let u = NbdUri::parse("nbd+unix:///e?socket=/s").unwrap();
        assert_eq!(u.canonical(), "nbd+unix:///e?socket=/s");
    }

    #[test]
    fn bad_uris_are_refused_by_name() {
        for (uri, want) in [
            ("nbd+unix:///", "socket"),
            ("nbd://h/?colour=red", "'colour'"),
            ("nbd://h:99999/", "port"),
            ("nbd+unix://host/?socket=s", "no host"),
            ("nbd:///x", "no host"),
            ("nbd://h/%zz", "export"),
            ("nbd://h/?tls-verify-peer=maybe", "tls-verify-peer"),
            ("http://h/", "scheme"),
        ] {
            let e = NbdUri::parse(uri).unwrap_err();
            assert!(e.to_string().contains(want), "{uri}: {e}");
        }
    }
}
