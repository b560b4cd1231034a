//! Changing the backing file recorded in a qcow2 header (rebase, commit).
//!
//! Only the header cluster is rewritten: the backing file name, and the
//! backing format extension, which QEMU keeps first among the extensions.
//! Every other extension, known or not, is kept as it was.

use diskit_core::Storage;
use diskit_core::{Error, ErrorKind, Result};

use super::header::{Header, HeaderExtension, autoclear, ext, incompat};
use super::open::read_header;
use crate::driver::BackingName;

/// The header of `header` with its backing file changed to `to` (None:
/// no backing file).
pub fn with_backing(header: &Header, to: Option<BackingName<'_>>) -> Header {
    let mut h = header.clone();
    h.extensions.retain(|e| e.kind != ext::BACKING_FORMAT);
    h.backing_file = to.map(|b| b.file.to_string());
    if let Some(b) = to {
        h.extensions.insert(
            0,
            HeaderExtension {
                kind: ext::BACKING_FORMAT,
                data: b.format.as_bytes().to_vec(),
            },
        );
    }
    // A writer clears the autoclear bits it does not know (and keeps the
    // ones it does: the header says nothing new about bitmaps).
    h.autoclear_features &= autoclear::KNOWN;
    h
}

/// Rewrites the header of the (closed) qcow2 image in `file` so that its
/// backing file is `to`, or none.
///
/// Fails with [`ErrorKind::NoSpace`] when the name does not fit in the
/// header cluster, leaving the image as it was.
pub fn change_backing_file(file: &dyn Storage, to: Option<BackingName<'_>>) -> Result<()> {
    let header = read_header(file)?;
    if header.incompatible_features & incompat::CORRUPT != 0 {
        return Err(Error::new(
            ErrorKind::Io,
            "qcow2: Image is corrupt; cannot be opened read/write",
        ));
    }
    let bytes = with_backing(&header, to).to_bytes()?;
    file.write_extend(&bytes, 0)?;
    file.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(h: &Header) -> Header {
        Header::parse(&h.to_bytes().unwrap()).unwrap()
    }

    fn sample() -> Header {
        let mut bytes = vec![0u8; 4096];
        bytes[..4].copy_from_slice(&super::super::header::MAGIC);
        bytes[7] = 3;
        bytes[23] = 12; // 4 KiB clusters
        bytes[24..32].copy_from_slice(&(1u64 << 20).to_be_bytes());
        bytes[36..40].copy_from_slice(&1u32.to_be_bytes());
        bytes[40..48].copy_from_slice(&(3u64 * 4096).to_be_bytes());
        bytes[48..56].copy_from_slice(&4096u64.to_be_bytes());
        bytes[56..60].copy_from_slice(&1u32.to_be_bytes());
        bytes[99] = 4;
        bytes[103] = 112;
        // One unknown extension that must survive.
        bytes[112..116].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        bytes[116..120].copy_from_slice(&3u32.to_be_bytes());
        bytes[120..123].copy_from_slice(b"abc");
        Header::parse(&bytes).unwrap()
    }

    #[test]
    fn adds_name_and_format_first_keeping_unknown_extensions() {
        let h = parsed(&with_backing(
            &sample(),
            Some(BackingName {
                file: "base.img",
                format: "raw",
            }),
        ));
        assert_eq!(h.backing_file.as_deref(), Some("base.img"));
        assert_eq!(h.backing_format().as_deref(), Some("raw"));
        assert_eq!(h.extensions[0].kind, ext::BACKING_FORMAT);
        assert!(h.extensions.iter().any(|e| e.kind == 0x1234_5678));
    }

    #[test]
    fn replaces_and_removes() {
        let one = with_backing(
            &sample(),
            Some(BackingName {
                file: "a",
                format: "qcow2",
            }),
        );
        let two = parsed(&with_backing(
            &one,
            Some(BackingName {
                file: "b",
                format: "raw",
            }),
        ));
        assert_eq!(two.backing_file.as_deref(), Some("b"));
        assert_eq!(
            two.extensions
                .iter()
                .filter(|e| e.kind == ext::BACKING_FORMAT)
                .count(),
            1
        );
        let none = parsed(&with_backing(&two, None));
        assert_eq!(none.backing_file, None);
        assert_eq!(none.backing_format(), None);
        assert_eq!(none.extensions.len(), 1);
    }

    #[test]
    fn a_name_too_long_for_the_cluster_is_no_space() {
        let long = "x".repeat(5000);
        let h = with_backing(
            &sample(),
            Some(BackingName {
                file: &long,
                format: "raw",
            }),
        );
        assert_eq!(h.to_bytes().unwrap_err().kind(), ErrorKind::NoSpace);
    }
}
