//! The key files of nbdkit's `--tls-psk`, qemu's `tls-creds-psk` and
//! libnbd's `tls-psk-file`: `identity:hexkey` lines, as GnuTLS's psktool
//! writes them.

use std::io::Read;
use std::path::Path;

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
