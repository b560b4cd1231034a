//! The tar filter (nbdkit-tar-filter): serves one file inside a tarball
//! (an OVA's disk, say) as the offset filter serves a window.
//!
//! - `tar-entry=NAME` (required): the entry's name exactly as the tarball
//!   stores it (as `tar tf` lists it).
//! - `tar-limit=SIZE`: look for the entry's header only in the first SIZE
//!   bytes of the tarball (default 0: the whole tarball).
//!
//! The headers are read from the device below when the filter is
//! stacked, one after another: ustar headers (a `prefix` field before the
//! name), GNU long names (`L` entries) and pax extended headers (`x`
//! entries: `path` and `size`; `g` entries are checked and otherwise
//! ignored). Every field is checked before use: the header checksum,
//! numbers in octal or base-256 that fit, an entry that stays inside the
//! tarball, long names and extended headers of at most [`MAX_EXTENDED`]
//! bytes. The first entry of that name is served; one that is not a
//! regular file (a directory, a link, a sparse file) is refused. Writes
//! go to the entry's bytes in the tarball, as nbdkit's do (serve with
//! `-r` to keep it untouched).

use diskit_core::{DeviceRef, Error, Result};

use crate::offset::{Offset, OffsetConfig};
use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["tar-entry", "tar-limit"];

/// Bytes in a tar block (each header is one).
const BLOCK: u64 = 512;
/// The largest long name or extended header read.
pub const MAX_EXTENDED: u64 = 1 << 20;

/// The parameters, as given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TarConfig {
    /// The entry to serve.
    pub entry: Option<String>,
    /// How far into the tarball to look (0: to its end).
    pub limit: u64,
}

impl Configure for TarConfig {
    /// Takes `tar-entry=` and `tar-limit=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "tar-entry" => {
                if self.entry.is_some() {
                    return Err(Error::invalid(
                        "tar: only one tar-entry parameter can be given",
                    ));
                }
                self.entry = Some(value.to_string());
            }
            "tar-limit" => self.limit = params::size("tar", key, value)?,
            _ => return Err(unknown("tar", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        let entry = match self.entry.as_deref() {
            Some(e) if !e.is_empty() => e,
            _ => {
                return Err(Error::invalid(
                    "tar: you must supply the tar-entry=<FILENAME> parameter",
                ));
            }
        };
        let read = |off: u64, buf: &mut [u8]| next.read_at(buf, off);
        let (offset, size) = locate(&read, next.size(), entry.as_bytes(), self.limit)?;
        let window = Offset::new(
            &*next,
            &OffsetConfig {
                offset,
                range: Some(size),
            },
        )?
        .named("tar");
        Ok(over(window, next))
    }
}

/// An error about the tarball.
fn bad(why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("tar: {why}"))
}

/// A numeric field: octal digits (leading spaces allowed, ended by a
/// space, a NUL or the field's end), or base-256 (the first byte 0x80).
fn number(field: &[u8]) -> Option<u64> {
    match field.first()? {
        0x80 => field[1..]
            .iter()
            .try_fold(0u64, |v, &b| v.checked_mul(256)?.checked_add(u64::from(b))),
        b if b & 0x80 != 0 => None,
        _ => {
            let s = field.iter().skip_while(|&&b| b == b' ');
            let digits: Vec<u8> = s.take_while(|&&b| b != b' ' && b != 0).copied().collect();
            let end = field.len()
                - field
                    .iter()
                    .rev()
                    .take_while(|&&b| b == b' ' || b == 0)
                    .count();
            let start = field.iter().take_while(|&&b| b == b' ').count();
            if digits.is_empty() || start + digits.len() != end {
                return None;
            }
            digits.iter().try_fold(0u64, |v, &b| {
                (b'0'..=b'7').contains(&b).then_some(())?;
                v.checked_mul(8)?.checked_add(u64::from(b - b'0'))
            })
        }
    }
}

/// The bytes of a NUL-terminated field.
fn text(field: &[u8]) -> &[u8] {
    let n = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    &field[..n]
}

/// Whether the header's checksum is right (the sum of its bytes with the
/// checksum field as spaces, unsigned or, as old tars wrote it, signed).
fn checksum_ok(h: &[u8; 512]) -> bool {
    let Some(want) = number(&h[148..156]) else {
        return false;
    };
    let field = |i: usize| if (148..156).contains(&i) { b' ' } else { h[i] };
    let unsigned: u64 = (0..512).map(|i| u64::from(field(i))).sum();
    let signed: i64 = (0..512).map(|i| i64::from(field(i) as i8)).sum();
    want == unsigned || i64::try_from(want).is_ok_and(|w| w == signed)
}

/// What an extended header says of the next entry.
#[derive(Debug, Default)]
struct Extended {
    path: Option<Vec<u8>>,
    size: Option<u64>,
    sparse: bool,
}

/// Reads pax records (`LENGTH KEY=VALUE\n`), each checked.
fn pax(data: &[u8], into: &mut Extended) -> Result<()> {
    let invalid = || bad("invalid pax extended header");
    let mut rest = data;
    while !rest.is_empty() {
        // Tars pad the last block with NULs after the records.
        if rest.iter().all(|&b| b == 0) {
            break;
        }
        let sp = rest.iter().position(|&b| b == b' ').ok_or_else(invalid)?;
        let len: usize = std::str::from_utf8(&rest[..sp])
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
            .ok_or_else(invalid)?;
        if len <= sp + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err(invalid());
        }
        let record = &rest[sp + 1..len - 1];
        let eq = record.iter().position(|&b| b == b'=').ok_or_else(invalid)?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        match key {
            b"path" => into.path = Some(value.to_vec()),
            b"size" => {
                into.size = Some(
                    std::str::from_utf8(value)
                        .ok()
                        .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(invalid)?,
                )
            }
            k if k.starts_with(b"GNU.sparse.") => into.sparse = true,
            _ => {}
        }
        rest = &rest[len..];
    }
    Ok(())
}

/// Where the data of the entry named `name` lies in the tarball of `size`
/// bytes that `read` reads: (offset, length). Only headers that start
/// before `limit` (0: anywhere) are looked at.
pub fn locate(
    read: &dyn Fn(u64, &mut [u8]) -> Result<()>,
    size: u64,
    name: &[u8],
    limit: u64,
) -> Result<(u64, u64)> {
    let shown = String::from_utf8_lossy(name);
    let end = if limit == 0 { size } else { limit.min(size) };
    let mut pos = 0u64;
    let mut next = Extended::default();
    loop {
        if pos >= end || size - pos < BLOCK {
            let where_ = if end < size {
                format!(" in the first {end} bytes (tar-limit)")
            } else {
                String::new()
            };
            return Err(bad(format!(
                "'{shown}' not found in the tarball{where_}: check that the file really exists in the tarball"
            )));
        }
        let mut h = [0u8; 512];
        read(pos, &mut h)?;
        if h.iter().all(|&b| b == 0) {
            return Err(bad(format!(
                "'{shown}' not found in the tarball: check that the file really exists in the tarball"
            )));
        }
        if !checksum_ok(&h) {
            return Err(bad(format!(
                "invalid header at offset {pos}: this does not look like a tar archive"
            )));
        }
        let kind = h[156];
        let stored = number(&h[124..136])
            .ok_or_else(|| bad(format!("invalid size in the header at offset {pos}")))?;
        let data = pos + BLOCK;
        let len = next
            .size
            .filter(|_| !matches!(kind, b'x' | b'g' | b'L' | b'K'))
            .unwrap_or(stored);
        let after = len
            .checked_add(BLOCK - 1)
            .map(|l| l / BLOCK * BLOCK)
            .and_then(|l| data.checked_add(l))
            .filter(|&a| a <= size)
            .ok_or_else(|| {
                bad(format!(
                    "the entry at offset {pos} runs past the end of the tarball"
                ))
            })?;
        let extended = || -> Result<Vec<u8>> {
            if len > MAX_EXTENDED {
                return Err(bad(format!(
                    "extended header of {len} bytes at offset {pos} is too large (at most {MAX_EXTENDED})"
                )));
            }
            let mut v = vec![0u8; len as usize];
            read(data, &mut v)?;
            Ok(v)
        };
        match kind {
            b'x' => pax(&extended()?, &mut next)?,
            b'g' => pax(&extended()?, &mut Extended::default())?,
            b'L' => next.path = Some(text(&extended()?).to_vec()),
            b'K' => {
                extended()?;
            }
            _ => {
                let path = next.path.take().unwrap_or_else(|| {
                    let base = text(&h[0..100]);
                    let prefix = text(&h[345..500]);
                    // POSIX ustar: the prefix and the name; old GNU keeps
                    // other fields there.
                    if &h[257..263] == b"ustar\0" && !prefix.is_empty() {
                        [prefix, b"/", base].concat()
                    } else {
                        base.to_vec()
                    }
                });
                let sparse = std::mem::take(&mut next).sparse;
                if path == name {
                    if sparse || kind == b'S' {
                        return Err(bad(format!(
                            "'{shown}' is a sparse file, which cannot be served"
                        )));
                    }
                    if !matches!(kind, b'0' | 0 | b'7') {
                        return Err(bad(format!(
                            "'{shown}' is not a regular file (type '{}')",
                            kind.escape_ascii()
                        )));
                    }
                    return Ok((data, len));
                }
            }
        }
        pos = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header block: `name`, `size`, `kind`, with its checksum.
    fn header(name: &[u8], size: u64, kind: u8) -> [u8; 512] {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name);
        h[100..108].copy_from_slice(b"0000644\0");
        h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        h
    }

    /// An entry: its header and data, padded.
    fn entry(out: &mut Vec<u8>, name: &[u8], data: &[u8], kind: u8) {
        out.extend_from_slice(&header(name, data.len() as u64, kind));
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    fn find(tar: &[u8], name: &str, limit: u64) -> Result<(u64, u64)> {
        let read = |off: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&tar[off as usize..off as usize + buf.len()]);
            Ok(())
        };
        locate(&read, tar.len() as u64, name.as_bytes(), limit)
    }

    #[test]
    fn numbers_in_octal_and_base_256() {
        assert_eq!(number(b"00000001750\0"), Some(1000));
        assert_eq!(number(b"   1750 \0\0\0\0"), Some(1000));
        assert_eq!(number(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]), Some(256));
        assert_eq!(number(b"00000001790\0"), None);
        assert_eq!(number(b"0000 0001\0\0\0"), None);
        assert_eq!(number(b"\0\0\0\0"), None);
        assert_eq!(number(&[0xff; 12]), None);
        assert_eq!(
            number(&[
                0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff
            ]),
            None
        );
    }

    #[test]
    fn entries_long_names_and_pax_headers_are_found() {
        let mut tar = Vec::new();
        entry(&mut tar, b"a.ovf", b"<xml/>", b'0');
        let long = "d/".repeat(80) + "disk.img";
        entry(
            &mut tar,
            b"././@LongLink",
            format!("{long}\0").as_bytes(),
            b'L',
        );
        entry(&mut tar, &long.as_bytes()[..100], &[7u8; 1000], b'0');
        entry(
            &mut tar,
            b"PaxHeaders/x",
            b"16 path=pax.img\n11 size=10\n",
            b'x',
        );
        entry(&mut tar, b"ignored", &[9u8; 10], b'0');
        entry(&mut tar, b"dir/", b"", b'5');
        tar.extend_from_slice(&[0; 1024]);
        assert_eq!(find(&tar, "a.ovf", 0).unwrap(), (512, 6));
        assert_eq!(find(&tar, &long, 0).unwrap(), (2560, 1000));
        assert_eq!(find(&tar, "pax.img", 0).unwrap(), (5120, 10));
        let e = find(&tar, "dir/", 0).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = find(&tar, "nope", 0).unwrap_err().to_string();
        assert!(e.contains("'nope' not found"), "{e}");
        let e = find(&tar, "pax.img", 2048).unwrap_err().to_string();
        assert!(e.contains("tar-limit"), "{e}");
        // A changed byte breaks the checksum; a truncated tarball ends early.
        let mut bad = tar.clone();
        bad[1024 + 5] ^= 1;
        assert!(
            find(&bad, &long, 0)
                .unwrap_err()
                .to_string()
                .contains("does not look like")
        );
        assert!(find(&tar[..3000], "pax.img", 0).is_err());
    }
}
