//! The PSK engine: TLS with pre-shared keys through OpenSSL, for the key
//! files nbdkit's `--tls-psk` and qemu's `tls-creds-psk` read (and
//! libnbd's `tls-psk-file`), for either end of a connection: the server's
//! settings are in [`crate::server::tls::psk`], the client's in
//! [`crate::client::tls`].
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
//! The servers that matter (nbdkit, qemu-nbd) use GnuTLS with the same
//! priorities: diskit's client offers the same suites, and sends the
//! SHA-256 key from its PSK client callback.
//!
//! A server reads the key file again at every handshake, as GnuTLS does
//! for nbdkit and qemu: keys can be added or revoked while it runs.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::path::Path;

use openssl::error::ErrorStack;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslOptions, SslRef,
    SslSessionCacheMode, SslStream, SslVersion,
};

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
pub(crate) fn show_identity(identity: &[u8]) -> String {
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
pub(crate) fn read_key_file(path: &Path) -> Result<Vec<PskEntry>, String> {
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

/// OpenSSL's error, on one line.
pub(crate) fn openssl_error(e: &openssl::ssl::Error) -> String {
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

/// What differs between the two ends of a PSK session: how a failed
/// handshake is explained, and whose identity the session runs under.
pub(crate) trait PskRole: Send + 'static {
    /// The other end, in messages: "client" or "server".
    const PEER: &'static str;

    /// Why the handshake failed, in words (OpenSSL's error follows).
    fn why_failed(&self, ssl: &SslRef) -> String;

    /// The PSK identity, shown for logs.
    fn identity(&self, ssl: &SslRef) -> String;
}

/// One end of an OpenSSL PSK session.
pub(crate) struct PskSession<R> {
    stream: SslStream<Buffers>,
    role: R,
}

impl<R: PskRole> PskSession<R> {
    /// The server end, on `ssl`, waiting for the client's hello.
    pub(crate) fn accept(mut ssl: Ssl, role: R) -> io::Result<PskSession<R>> {
        ssl.set_accept_state();
        let stream = SslStream::new(ssl, Buffers::default()).map_err(setup_error)?;
        Ok(PskSession { stream, role })
    }

    /// The client end, on `ssl`: its hello is sealed at once, ready to
    /// go out.
    pub(crate) fn connect(mut ssl: Ssl, role: R) -> io::Result<PskSession<R>> {
        ssl.set_connect_state();
        let stream = SslStream::new(ssl, Buffers::default()).map_err(setup_error)?;
        let mut session = PskSession { stream, role };
        match session.stream.do_handshake() {
            Err(e) if e.code() == ErrorCode::WANT_READ => Ok(session),
            Ok(()) => Err(io::Error::other(
                "TLS-PSK: OpenSSL finished a handshake before the server spoke",
            )),
            Err(e) => Err(session.handshake_error(&e)),
        }
    }

    /// Why the handshake failed, in words: what the role knows, then what
    /// OpenSSL says.
    fn handshake_error(&self, e: &openssl::ssl::Error) -> io::Error {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "TLS-PSK: {}: {}",
                self.role.why_failed(self.stream.ssl()),
                openssl_error(e)
            ),
        )
    }
}

impl<R: PskRole> Session for PskSession<R> {
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
                    format!("{} closed the connection during the TLS handshake", R::PEER),
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
                    "TLS: the {} closed the connection without close_notify ({})",
                    R::PEER,
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
        // Only sends ours: the peer's may never come.
        let _ = self.stream.shutdown();
    }

    fn describe(&self) -> String {
        let ssl = self.stream.ssl();
        let cipher = ssl.current_cipher().map_or("", |c| c.name());
        format!(
            "{} {cipher}, PSK identity {}",
            ssl.version_str(),
            self.role.identity(ssl)
        )
    }
}

/// Settings both ends share: TLS 1.2 at least, the suites above, no
/// renegotiation, no tickets and no resumption (nothing would use them).
pub(crate) fn context(method: SslMethod) -> io::Result<SslContextBuilder> {
    let mut b = SslContext::builder(method).map_err(setup_error)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(setup_error)?;
    b.set_ciphersuites(TLS13_SUITES).map_err(setup_error)?;
    b.set_cipher_list(TLS12_SUITES).map_err(setup_error)?;
    b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::NO_TICKET);
    b.set_session_cache_mode(SslSessionCacheMode::OFF);
    Ok(b)
}

/// An OpenSSL error in setting a session up.
pub(crate) fn setup_error(e: ErrorStack) -> io::Error {
    io::Error::other(format!("TLS-PSK setup (OpenSSL): {e}"))
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
