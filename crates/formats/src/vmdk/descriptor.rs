//! The VMDK descriptor: the text that names the disk's type, its content
//! IDs, its parent and its extents, embedded in a sparse file or kept in a
//! file of its own. Read as QEMU reads it (substring searches for the
//! keys, one extent per line), bounded in size and in extents, and written
//! as qemu-img writes it.

use diskit_core::{Error, Result};

/// The most descriptor bytes read (QEMU reads no more).
pub const MAX_TEXT: usize = (1 << 20) - 1;
/// Where QEMU looks for the content IDs: the first 10 KiB.
const ID_WINDOW: usize = 10240;
/// The most extents a descriptor may list. QEMU has no limit and takes
/// minutes over 20,000; a 16 TiB twoGbMaxExtent disk has 8192.
pub const MAX_EXTENTS: usize = 8192;

/// QEMU's test for a vmdk text descriptor: a line `version=1`, `2` or `3`
/// (ending the line) among the first bytes; 100 if so, else 0.
pub(crate) fn probe_score(h: &[u8]) -> u32 {
    // QEMU looks at the first sector only: comment lines and lines of
    // spaces are skipped; the first other line must be the version.
    let h = &h[..h.len().min(512)];
    let mut p = 0;
    while p < h.len() {
        match h[p] {
            b'#' => match h[p..].iter().position(|&b| b == b'\n') {
                Some(n) => p += n + 1,
                None => return 0,
            },
            b' ' => {
                while p < h.len() && h[p] == b' ' {
                    p += 1;
                }
                if h.get(p) == Some(&b'\r') {
                    p += 1;
                }
                if h.get(p) != Some(&b'\n') {
                    return 0;
                }
                p += 1;
            }
            _ => {
                let rest = &h[p..];
                let version = rest.starts_with(b"version=")
                    && matches!(rest.get(8), Some(b'1'..=b'3'))
                    && (rest[9..].starts_with(b"\n") || rest[9..].starts_with(b"\r\n"));
                return u32::from(version) * 100;
            }
        }
    }
    0
}

/// What an extent line names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtentKind {
    /// Raw data at `offset` sectors into the file (FLAT).
    Flat {
        /// Sectors into the file.
        offset: u64,
    },
    /// Raw data, the whole file (VMFS).
    Vmfs,
    /// A hosted sparse extent (SPARSE): KDMV or COWD.
    Sparse,
    /// An ESX sparse extent (VMFSSPARSE).
    VmfsSparse,
    /// A space-efficient sparse extent (SESPARSE).
    SeSparse,
}

impl ExtentKind {
    /// The type as the descriptor spells it.
    pub fn name(&self) -> &'static str {
        match self {
            ExtentKind::Flat { .. } => "FLAT",
            ExtentKind::Vmfs => "VMFS",
            ExtentKind::Sparse => "SPARSE",
            ExtentKind::VmfsSparse => "VMFSSPARSE",
            ExtentKind::SeSparse => "SESPARSE",
        }
    }
}

/// One extent line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentLine {
    /// Its size in sectors (sparse extents take their header's instead).
    pub sectors: u64,
    /// Its type.
    pub kind: ExtentKind,
    /// The file, as written (relative to the descriptor's directory).
    pub file: String,
}

/// A parsed descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// The text as read (up to its first NUL).
    pub text: String,
    /// `createType`.
    pub create_type: String,
    /// The content ID.
    pub cid: u32,
    /// The parent's content ID (`ffffffff` without one).
    pub parent_cid: u32,
    /// `parentFileNameHint`, if any.
    pub parent: Option<String>,
    /// The extents, in order.
    pub extents: Vec<ExtentLine>,
}

/// The create types a descriptor file may have.
const FILE_TYPES: &[&str] = &[
    "monolithicFlat",
    "vmfs",
    "vmfsSparse",
    "seSparse",
    "twoGbMaxExtentSparse",
    "twoGbMaxExtentFlat",
];

/// The text of a descriptor area: up to the first NUL, at most
/// [`MAX_TEXT`] bytes, invalid UTF-8 replaced.
pub fn text_of(bytes: &[u8]) -> String {
    let b = &bytes[..bytes.len().min(MAX_TEXT)];
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The bytes of a descriptor area up to its first NUL (at most
/// [`MAX_TEXT`]).
pub fn bytes_of(bytes: &[u8]) -> Vec<u8> {
    let b = &bytes[..bytes.len().min(MAX_TEXT)];
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    b[..end].to_vec()
}

/// The value after the first `key` in `text`: `skip` characters on, up to
/// the next `"` (None when either is missing).
fn quoted_after(text: &str, key: &str, skip: usize) -> Option<String> {
    let at = text.find(key)? + key.len() + skip;
    let rest = text.get(at..)?;
    let end = rest.find('"')?;
    Some(rest[..end].to_string())
}

/// The hexadecimal value after the first `key` (4 characters on: `CID=`
/// or, for `parentCID`, its last four), as QEMU's `%x` reads it.
fn hex_after(window: &str, key: &str) -> Option<u32> {
    let at = window.find(key)? + key.len() + 1;
    let rest = window.get(at..)?.trim_start();
    let rest = rest
        .strip_prefix("0x")
        .or_else(|| rest.strip_prefix("0X"))
        .unwrap_or(rest);
    let digits: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
    if digits.is_empty() {
        return None;
    }
    // %x keeps the low 32 bits of a longer number.
    let v = digits.chars().fold(0u64, |a, c| {
        (a << 4) | u64::from(c.to_digit(16).expect("hex")) & 0xF
    });
    Some(v as u32)
}

/// The content IDs of a descriptor (the first 10 KiB): `CID` and
/// `parentCID`, both required.
pub fn content_ids(text: &str) -> Result<(u32, u32)> {
    let window = match text.char_indices().nth(ID_WINDOW) {
        Some((i, _)) => &text[..i],
        None => text,
    };
    let missing = || Error::invalid("Invalid argument: the descriptor has no CID and parentCID");
    let cid = hex_after(window, "CID").ok_or_else(missing)?;
    let parent = hex_after(window, "parentCID").ok_or_else(missing)?;
    Ok((cid, parent))
}

/// `parentFileNameHint`, if the descriptor has one.
pub fn parent_hint(text: &str) -> Option<String> {
    let window = match text.char_indices().nth(ID_WINDOW) {
        Some((i, _)) => &text[..i],
        None => text,
    };
    quoted_after(window, "parentFileNameHint", 2).filter(|s| !s.is_empty())
}

/// One whitespace-separated field of at most `max` characters (`%Ns`).
fn word<'a>(s: &mut &'a str, max: usize) -> Option<&'a str> {
    let t = s.trim_start();
    if t.is_empty() {
        return None;
    }
    let end = t
        .char_indices()
        .find(|(_, c)| c.is_whitespace())
        .map_or(t.len(), |(i, _)| i);
    let end = t.char_indices().nth(max).map_or(end, |(i, _)| i.min(end));
    *s = &t[end..];
    Some(&t[..end])
}

/// A decimal number as `%ld` reads it (sign, digits; `0x800` reads 0).
fn number(s: &mut &str) -> Option<i64> {
    let t = s.trim_start();
    let (neg, body) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let n = body.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 {
        return None;
    }
    let v: i64 = body[..n].parse().unwrap_or(i64::MAX);
    *s = &body[n..];
    Some(if neg { -v } else { v })
}

/// A quoted file name (`"%511[^\n\r"]"`): 1 to 511 characters.
fn quoted(s: &mut &str) -> Option<String> {
    let t = s.trim_start().strip_prefix('"')?;
    let end = t.find(['"', '\n', '\r']).unwrap_or(t.len());
    if end == 0 || !t[end..].starts_with('"') {
        return None;
    }
    let name: String = t[..end].chars().take(511).collect();
    if name.len() < end {
        return None;
    }
    *s = &t[end + 1..];
    Some(name)
}

/// Reads one extent line as QEMU does: `None` for a line that is skipped
/// (not an extent, not `RW`, an empty or unknown extent, ZERO).
pub fn extent_line(line: &str) -> Result<Option<ExtentLine>> {
    let mut s = line;
    let invalid = || {
        Error::invalid(format!(
            "Invalid extent line: {}",
            line.trim_end_matches(['\r', '\n'])
        ))
    };
    let Some(access) = word(&mut s, 10) else {
        return Ok(None);
    };
    let Some(sectors) = number(&mut s) else {
        return Ok(None);
    };
    let Some(kind) = word(&mut s, 10) else {
        return Ok(None);
    };
    let Some(file) = quoted(&mut s) else {
        return Ok(None);
    };
    let offset = number(&mut s);
    if access != "RW" {
        return Ok(None);
    }
    let kind = match (kind, offset) {
        ("FLAT", Some(o)) if o >= 0 => ExtentKind::Flat { offset: o as u64 },
        ("FLAT", _) => return Err(invalid()),
        ("VMFS", None) => ExtentKind::Vmfs,
        (_, Some(_)) => return Err(invalid()),
        ("SPARSE", None) => ExtentKind::Sparse,
        ("VMFSSPARSE", None) => ExtentKind::VmfsSparse,
        ("SESPARSE", None) => ExtentKind::SeSparse,
        _ => return Ok(None),
    };
    if sectors <= 0 {
        return Ok(None);
    }
    Ok(Some(ExtentLine {
        sectors: sectors as u64,
        kind,
        file,
    }))
}

impl Descriptor {
    /// Parses a descriptor file's text (or a sparse file's embedded
    /// descriptor standing for a descriptor file).
    pub fn parse(bytes: &[u8]) -> Result<Descriptor> {
        let text = text_of(bytes);
        let create_type = quoted_after(&text, "createType", 2)
            .filter(|t| t.len() < 128)
            .ok_or_else(|| Error::invalid("invalid VMDK image descriptor"))?;
        if !FILE_TYPES.contains(&create_type.as_str()) {
            return Err(Error::unsupported(format!(
                "Unsupported image type '{create_type}'"
            )));
        }
        let mut extents = Vec::new();
        for line in text.split('\n') {
            if let Some(e) = extent_line(line)? {
                if extents.len() == MAX_EXTENTS {
                    return Err(Error::unsupported(format!(
                        "VMDK descriptor lists more than {MAX_EXTENTS} extents"
                    )));
                }
                extents.push(e);
            }
        }
        let (cid, parent_cid) = content_ids(&text)?;
        Ok(Descriptor {
            parent: parent_hint(&text),
            text,
            create_type,
            cid,
            parent_cid,
            extents,
        })
    }
}

/// What a new descriptor says.
#[derive(Debug, Clone)]
pub struct NewDescriptor<'a> {
    /// Its content ID.
    pub cid: u32,
    /// The parent's content ID (`0xffffffff` without a parent).
    pub parent_cid: u32,
    /// `createType`.
    pub create_type: &'a str,
    /// `parentFileNameHint`, as given.
    pub parent: Option<&'a str>,
    /// The extent lines, each without its newline.
    pub extents: Vec<String>,
    /// `ddb.virtualHWVersion`.
    pub hw_version: &'a str,
    /// The disk's size in bytes (for the geometry).
    pub size: u64,
    /// `ddb.adapterType`.
    pub adapter: &'a str,
    /// `ddb.toolsVersion`.
    pub tools_version: &'a str,
}

impl NewDescriptor<'_> {
    /// The text qemu-img writes.
    pub fn text(&self) -> String {
        let heads: u64 = if self.adapter == "ide" { 16 } else { 255 };
        let cylinders = self.size / (63 * heads * 512);
        let mut t = format!(
            "# Disk DescriptorFile\nversion=1\nCID={:x}\nparentCID={:x}\ncreateType=\"{}\"\n",
            self.cid, self.parent_cid, self.create_type
        );
        // qemu-img's hint line has no newline of its own: it takes the
        // blank line's.
        if let Some(p) = self.parent {
            t += &format!("parentFileNameHint=\"{p}\"");
        }
        t += "\n# Extent description\n";
        for e in &self.extents {
            t += e;
            t += "\n";
        }
        t += &format!(
            "\n# The Disk Data Base\n#DDB\n\nddb.virtualHWVersion = \"{}\"\n\
             ddb.geometry.cylinders = \"{cylinders}\"\nddb.geometry.heads = \"{heads}\"\n\
             ddb.geometry.sectors = \"63\"\nddb.adapterType = \"{}\"\nddb.toolsVersion = \"{}\"\n",
            self.hw_version, self.adapter, self.tools_version
        );
        t
    }
}

/// The descriptor `text` with its content ID replaced by `cid` (the
/// first `CID=` value), every other byte unchanged.
pub fn with_cid(text: &[u8], cid: u32) -> Option<Vec<u8>> {
    let at = text.windows(4).position(|w| w == b"CID=")? + 4;
    let rest = &text[at..];
    let n = rest.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let mut out = text[..at].to_vec();
    out.extend_from_slice(format!("{cid:x}").as_bytes());
    out.extend_from_slice(&rest[n..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extent_lines_as_qemu_reads_them() {
        let l = extent_line("RW 2048 SPARSE \"a.vmdk\"").unwrap().unwrap();
        assert_eq!(l.sectors, 2048);
        assert_eq!(l.kind, ExtentKind::Sparse);
        assert_eq!(l.file, "a.vmdk");
        let f = extent_line("  RW 10 FLAT \"b c-flat.vmdk\" 7\r")
            .unwrap()
            .unwrap();
        assert_eq!(f.kind, ExtentKind::Flat { offset: 7 });
        assert_eq!(f.file, "b c-flat.vmdk");
        assert!(extent_line("RW 2048 FLAT \"f\"").is_err());
        assert!(extent_line("RW 2048 SPARSE \"s.vmdk\" 5").is_err());
        assert!(extent_line("RW 2048 VMFS \"s.vmdk\" 5").is_err());
        for skipped in [
            "# comment",
            "rw 2048 SPARSE \"a\"",
            "RDONLY 2048 SPARSE \"a\"",
            "RW 0 SPARSE \"a\"",
            "RW 0x800 FLAT \"a\" 0",
            "RW 16 ZERO",
            "RW 16 ZERO \"x\"",
            "RW 16 FOO \"x\"",
            "RW 16 SPARSE \"\"",
            "ddb.adapterType = \"ide\"",
        ] {
            assert_eq!(extent_line(skipped).unwrap(), None, "{skipped}");
        }
    }

    #[test]
    fn descriptors_parse_and_refuse() {
        let d = NewDescriptor {
            cid: 0x2a618811,
            parent_cid: 0xffff_ffff,
            create_type: "twoGbMaxExtentFlat",
            parent: None,
            extents: vec!["RW 4194304 FLAT \"d-f001.vmdk\" 0".into()],
            hw_version: "4",
            size: 2 << 30,
            adapter: "ide",
            tools_version: "2147483647",
        };
        let text = d.text();
        assert!(text.contains("ddb.geometry.cylinders = \"4161\""), "{text}");
        let p = Descriptor::parse(text.as_bytes()).unwrap();
        assert_eq!(p.cid, 0x2a618811);
        assert_eq!(p.parent_cid, 0xffff_ffff);
        assert_eq!(p.extents.len(), 1);
        assert_eq!(p.parent, None);
        let e = Descriptor::parse(b"createType=\"monolithicSparse\"\nCID=1\nparentCID=2\n")
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("Unsupported image type 'monolithicSparse'")
        );
        assert!(
            Descriptor::parse(b"garbage")
                .unwrap_err()
                .to_string()
                .contains("invalid VMDK image descriptor")
        );
        let many = format!(
            "CID=1\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\n{}",
            "RW 1 FLAT \"x\" 0\n".repeat(MAX_EXTENTS + 1)
        );
        assert!(Descriptor::parse(many.as_bytes()).is_err());
        assert_eq!(
            with_cid(b"CID=abc\nparentCID=ffffffff\n\xff", 0x12).unwrap(),
            b"CID=12\nparentCID=ffffffff\n\xff"
        );
    }
}
