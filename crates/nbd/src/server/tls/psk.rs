//! The PSK engine: TLS with pre-shared keys through OpenSSL, for the key
//! files nbdkit's `--tls-psk` and qemu's `tls-creds-psk` read.
//!
//! The clients that matter (libnbd, qemu, nbdkit's nbd plugin) use
//! GnuTLS with `NORMAL:+ECDHE-PSK:+DHE-PSK:+PSK`. Over TLS 1.3 they offer
//! the key with a SHA-256 binder (psk_dhe_ke mode); OpenSSL takes keys
//! from its PSK server callback as SHA-256 keys, which only the SHA-256
//! suites can use, so only those are enabled (GnuTLS 3.7 then picks
//! TLS_AES_128_GCM_SHA256). Over TLS 1.2 the ECDHE-PSK suites come first
//! (forward secrecy), then plain PSK, as GnuTLS orders them (GnuTLS 3.7
//! picks ECDHE-PSK-CHACHA20-POLY1305). No DHE-PSK: GnuTLS clients always
//! offer ECDHE-PSK too.
//!
//! The key file is read again at every handshake, as GnuTLS does for
//! nbdkit and qemu: keys can be added or revoked while the server runs.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use openssl::ssl::{
    ErrorCode, SslContext, SslMethod, SslOptions, SslSessionCacheMode, SslStream, SslVersion,
};
use openssl::{error::ErrorStack, ex_data::Index, ssl::Ssl};

use super::Session;

/// TLS 1.3 suites: those with SHA-256, the hash of OpenSSL's keys from
/// the PSK server callback (and of GnuTLS's binders).
const TLS13_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";

/// TLS 1.2 suites, best first: ECDHE-PSK, then plain PSK.
const TLS12_SUITES: &str = "ECDHE-PSK-CHACHA20-POLY1305:ECDHE-PSK-AES256-CBC-SHA384:\
                            ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-GCM-SHA384:\
                            PSK-AES128-GCM-SHA256:PSK-CHACHA20-POLY1305";

/// Plaintext encrypted per call (four full records).
const MAX_WRITE: usize = 64 * 1024;

/// The longest key accepted (OpenSSL 3's limit).
pub const MAX_KEY_LEN: usize = 512;

/// The longest identity accepted (GnuTLS's limit).
pub const MAX_IDENTITY_LEN: usize = 128;

/// One entry of a key file.
#[derive(Clone, PartialEq, Eq)]
pub struct PskEntry {
    /// The identity (user name) the client sends.
    pub identity: Vec<u8>,
    /// The key.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for PskEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PskEntry")
            .field("identity", &show_identity(&self.identity))
            .field("key", &format_args!("<{} bytes>", self.key.len()))
            .finish()
    }
}

/// Parses a key file: one `identity:hexkey` per line, as GnuTLS's psktool
/// writes them. An identity written `#HEX` is given in hexadecimal (as
/// newer GnuTLS versions read it). Blank lines are skipped; anything else that is not
/// an entry is an error, reported with its line number (never with the
/// key). When an identity appears twice the first entry counts, as with
/// GnuTLS.
pub fn parse_key_file(text: &[u8]) -> Result<Vec<PskEntry>, String> {
    let mut entries: Vec<PskEntry> = Vec::new();
    for (i, line) in text.split(|&b| b == b'\n').enumerate() {
        let n = i + 1;
        let line = line.trim_ascii();
        if line.is_empty() {
            continue;
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return Err(format!("line {n}: no ':' between identity and key"));
        };
        let (name, hex) = (&line[..colon], &line[colon + 1..]);
        let identity = match name.strip_prefix(b"#") {
            Some(h) => {
                decode_hex(h).map_err(|e| format!("line {n}: identity in hexadecimal: {e}"))?
            }
            None => name.to_vec(),
        };
        if identity.is_empty() {
            return Err(format!("line {n}: empty identity"));
        }
        if identity.len() > MAX_IDENTITY_LEN {
            return Err(format!(
                "line {n}: identity longer than {MAX_IDENTITY_LEN} bytes"
            ));
        }
        if identity.contains(&0) {
            return Err(format!("line {n}: identity contains a NUL byte"));
        }
        let key = decode_hex(hex).map_err(|e| format!("line {n}: key: {e}"))?;
        if key.is_empty() {
            return Err(format!("line {n}: empty key"));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(format!("line {n}: key longer than {MAX_KEY_LEN} bytes"));
        }
        if !entries.iter().any(|e| e.identity == identity) {
            entries.push(PskEntry { identity, key });
        }
    }
    if entries.is_empty() {
        return Err("no keys".into());
    }
    Ok(entries)
}

fn decode_hex(hex: &[u8]) -> Result<Vec<u8>, &'static str> {
    if !hex.len().is_multiple_of(2) {
        return Err("odd number of hexadecimal digits");
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err("not a hexadecimal digit"),
    };
    hex.chunks_exact(2)
        .map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// An identity for messages: printable text, anything else escaped.
fn show_identity(identity: &[u8]) -> String {
    let mut s = String::from("\"");
    for c in identity.escape_ascii() {
        s.push(char::from(c));
    }
    s.push('"');
    s
}

/// The largest key file read (some 200000 keys).
const MAX_FILE_LEN: u64 = 16 << 20;

/// Reads and parses the key file at `path`.
fn read_key_file(path: &Path) -> Result<Vec<PskEntry>, String> {
    let mut text = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE_LEN + 1).read_to_end(&mut text))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if text.len() as u64 > MAX_FILE_LEN {
        return Err(format!(
            "{}: larger than {} MiB",
            path.display(),
            MAX_FILE_LEN >> 20
        ));
    }
    parse_key_file(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// What the key lookup of one handshake found, kept with the connection
/// to explain a failed handshake and to name the client afterwards.
#[derive(Debug)]
enum Lookup {
    /// The identity has a key.
    Found(Vec<u8>),
    /// The identity is not in the key file.
    Unknown(Vec<u8>),
    /// The key is longer than OpenSSL takes.
    TooLong(Vec<u8>),
    /// The key file could not be read.
    FileError(String),
}

/// The PSK server settings.
pub struct PskConfig {
    ctx: SslContext,
    lookup: Index<Ssl, Lookup>,
}

impl std::fmt::Debug for PskConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PskConfig").finish_non_exhaustive()
    }
}

fn setup_error(e: ErrorStack) -> io::Error {
    io::Error::other(format!("TLS-PSK setup (OpenSSL): {e}"))
}

impl PskConfig {
    /// Settings for the key file at `path`, which must hold at least one
    /// valid key now.
    pub fn new(path: &Path) -> io::Result<PskConfig> {
        // Absolute: the server may change directory after this.
        let path: PathBuf = std::fs::canonicalize(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        read_key_file(&path).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;

        let lookup = Ssl::new_ex_index::<Lookup>().map_err(setup_error)?;
        let mut b = SslContext::builder(SslMethod::tls_server()).map_err(setup_error)?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(setup_error)?;
        b.set_ciphersuites(TLS13_SUITES).map_err(setup_error)?;
        b.set_cipher_list(TLS12_SUITES).map_err(setup_error)?;
        b.set_options(
            SslOptions::CIPHER_SERVER_PREFERENCE
                | SslOptions::NO_RENEGOTIATION
                | SslOptions::NO_TICKET,
        );
        // No resumption: nothing would use it, and no tickets to send.
        b.set_num_tickets(0).map_err(setup_error)?;
        b.set_session_cache_mode(SslSessionCacheMode::OFF);
        b.set_psk_server_callback(move |ssl, identity, out| {
            let found = match identity {
                None => Lookup::Unknown(Vec::new()),
                Some(id) => match read_key_file(&path) {
                    Err(e) => Lookup::FileError(e),
                    Ok(entries) => match entries.iter().find(|e| e.identity == id) {
                        None => Lookup::Unknown(id.to_vec()),
                        Some(e) if e.key.len() > out.len() => Lookup::TooLong(id.to_vec()),
                        Some(e) => {
                            out[..e.key.len()].copy_from_slice(&e.key);
                            ssl.set_ex_data(lookup, Lookup::Found(id.to_vec()));
                            return Ok(e.key.len());
                        }
                    },
                },
            };
            ssl.set_ex_data(lookup, found);
            Ok(0)
        });
        Ok(PskConfig {
            ctx: b.build(),
            lookup,
        })
    }

    /// A session for one client.
    pub(super) fn session(&self) -> io::Result<Box<dyn Session>> {
        let mut ssl = Ssl::new(&self.ctx).map_err(setup_error)?;
        ssl.set_accept_state();
        let stream = SslStream::new(ssl, Buffers::default()).map_err(setup_error)?;
        Ok(Box::new(PskSession {
            stream,
            lookup: self.lookup,
        }))
    }
}

/// The in-memory stream OpenSSL runs over: ciphertext fed in, records
/// sealed out. Reading an empty inbox "would block" until the end of the
/// stream has been noted.
#[derive(Default)]
struct Buffers {
    incoming: Vec<u8>,
    /// How much of `incoming` OpenSSL has read.
    pos: usize,
    eof: bool,
    outgoing: Vec<u8>,
}

impl Buffers {
    fn push(&mut self, data: &[u8]) {
        if self.pos == self.incoming.len() {
            self.incoming.clear();
        } else {
            self.incoming.drain(..self.pos);
        }
        self.pos = 0;
        self.incoming.extend_from_slice(data);
    }
}

impl Read for Buffers {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let rest = &self.incoming[self.pos..];
        if rest.is_empty() {
            return if self.eof {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let n = rest.len().min(out.len());
        out[..n].copy_from_slice(&rest[..n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for Buffers {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.outgoing.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One client's OpenSSL session.
struct PskSession {
    stream: SslStream<Buffers>,
    lookup: Index<Ssl, Lookup>,
}

impl PskSession {
    /// Why the handshake failed, in words: what the key lookup found, then
    /// what OpenSSL says.
    fn handshake_error(&self, e: &openssl::ssl::Error) -> io::Error {
        let why = match self.stream.ssl().ex_data(self.lookup) {
            Some(Lookup::Unknown(id)) if id.is_empty() => "the client sent no PSK identity".into(),
            Some(Lookup::Unknown(id)) => format!("unknown PSK identity {}", show_identity(id)),
            Some(Lookup::TooLong(id)) => format!(
                "the key of PSK identity {} is too long for OpenSSL",
                show_identity(id)
            ),
            Some(Lookup::FileError(m)) => format!("cannot read the PSK key file: {m}"),
            Some(Lookup::Found(id)) => format!(
                "PSK identity {} is known but the handshake failed (wrong key?)",
                show_identity(id)
            ),
            None => "the client offered no pre-shared key".into(),
        };
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("TLS-PSK: {why}: {}", openssl_error(e)),
        )
    }
}

/// OpenSSL's error, on one line.
fn openssl_error(e: &openssl::ssl::Error) -> String {
    match e.ssl_error() {
        Some(stack) => {
            let mut s = String::new();
            for (i, err) in stack.errors().iter().enumerate() {
                if i > 0 {
                    s.push_str("; ");
                }
                match err.reason() {
                    Some(r) => s.push_str(r),
                    None => {
                        let _ = write!(s, "{err}");
                    }
                }
            }
            if s.is_empty() { e.to_string() } else { s }
        }
        None => e.to_string(),
    }
}

impl Session for PskSession {
    fn is_handshaking(&self) -> bool {
        !self.stream.ssl().is_init_finished()
    }

    fn feed(&mut self, input: &[u8]) -> io::Result<usize> {
        let handshaking = self.is_handshaking();
        let buffers = self.stream.get_mut();
        if input.is_empty() {
            buffers.eof = true;
            if handshaking {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "client closed the connection during the TLS handshake",
                ));
            }
        } else {
            buffers.push(input);
        }
        if handshaking {
            match self.stream.do_handshake() {
                Ok(()) => {}
                Err(e) if e.code() == ErrorCode::WANT_READ && !self.stream.get_ref().eof => {}
                Err(e) => return Err(self.handshake_error(&e)),
            }
        }
        Ok(input.len())
    }

    fn read_plain(&mut self, out: &mut [u8]) -> io::Result<usize> {
        match self.stream.ssl_read(out) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(e) if self.stream.get_ref().eof => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "TLS: the client closed the connection without close_notify ({})",
                    openssl_error(&e)
                ),
            )),
            Err(e) if e.code() == ErrorCode::WANT_READ => Err(io::ErrorKind::WouldBlock.into()),
            Err(e) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("TLS: {}", openssl_error(&e)),
            )),
        }
    }

    fn write_plain(&mut self, data: &[u8]) -> io::Result<usize> {
        // A bounded piece at a time: the session is locked while it is
        // encrypted, and the reader waits for it.
        let data = &data[..data.len().min(MAX_WRITE)];
        self.stream
            .ssl_write(data)
            .map_err(|e| io::Error::other(format!("TLS: {}", openssl_error(&e))))
    }

    fn take_sealed(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        let outgoing = &mut self.stream.get_mut().outgoing;
        if outgoing.is_empty() {
            // Keep the buffer: trading it for `out` would drop its room.
            return Ok(());
        }
        if out.is_empty() {
            // The two buffers trade places: no copy.
            std::mem::swap(out, outgoing);
        } else {
            out.append(outgoing);
        }
        Ok(())
    }

    fn close_notify(&mut self) {
        // Only sends ours: the client's may never come.
        let _ = self.stream.shutdown();
    }

    fn describe(&self) -> String {
        let ssl = self.stream.ssl();
        let cipher = ssl.current_cipher().map_or("", |c| c.name());
        let who = match ssl.ex_data(self.lookup) {
            Some(Lookup::Found(id)) => show_identity(id),
            _ => "?".into(),
        };
        format!("{} {cipher}, PSK identity {who}", ssl.version_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files() {
        let e = parse_key_file(b"alice:00ff10\n\nbob:ABCD\r\n  carol:01  \n").unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(e[0].identity, b"alice");
        assert_eq!(e[0].key, [0x00, 0xff, 0x10]);
        assert_eq!(e[1].identity, b"bob");
        assert_eq!(e[1].key, [0xab, 0xcd]);
        assert_eq!(e[2].identity, b"carol");
        assert_eq!(e[2].key, [0x01]);
        // Hexadecimal identity; first entry of a name wins.
        let e = parse_key_file(b"#616263:01\nabc:02\n").unwrap();
        assert_eq!(
            e,
            [PskEntry {
                identity: b"abc".to_vec(),
                key: vec![1]
            }]
        );
        // A colon inside the key part is not a valid hex digit.
        assert!(parse_key_file(b"a:01:02").is_err());
    }

    #[test]
    fn bad_key_files_say_where() {
        for (text, what) in [
            (&b""[..], "no keys"),
            (b"\n \n", "no keys"),
            (b"alice:00\nbob\n", "line 2: no ':'"),
            (b":00", "line 1: empty identity"),
            (b"alice:", "line 1: empty key"),
            (b"alice:0", "line 1: key: odd number"),
            (b"alice:zz", "line 1: key: not a hexadecimal"),
            (b"#zz:00", "line 1: identity in hexadecimal"),
            (b"#00:00", "line 1: identity contains a NUL"),
        ] {
            let e = parse_key_file(text).unwrap_err();
            assert!(e.contains(what), "{text:?}: {e}");
        }
        let long = format!("a:{}", "00".repeat(MAX_KEY_LEN + 1));
        assert!(
            parse_key_file(long.as_bytes())
                .unwrap_err()
                .contains("longer")
        );
        let long = format!("{}:00", "a".repeat(MAX_IDENTITY_LEN + 1));
        assert!(
            parse_key_file(long.as_bytes())
                .unwrap_err()
                .contains("longer")
        );
    }

    #[test]
    fn errors_never_show_the_key() {
        let e = parse_key_file(b"alice:00112233445566778899zz").unwrap_err();
        assert!(!e.contains("0011"), "{e}");
        let e = parse_key_file(b"alice:0011").unwrap();
        assert!(!format!("{e:?}").contains("0011"));
    }

    #[test]
    fn identities_are_shown_escaped() {
        assert_eq!(show_identity(b"alice"), "\"alice\"");
        assert_eq!(show_identity(b"a\x01\xff"), "\"a\\x01\\xff\"");
    }
}
