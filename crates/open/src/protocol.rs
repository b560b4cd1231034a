//! Protocols: the table of ways to reach storage (QEMU's protocol drivers).
//!
//! A row names a driver (`file`, `host_device`, `null-co`), the prefixes by
//! which a plain name selects it (`null-co://`, `file:`), the keys it takes
//! and the function that opens it. A new protocol (the NBD client's
//! `nbd://`, an http source) is one row.

use std::sync::Arc;

use diskit_backends::{FileDevice, FileOptions, NullDevice};
use diskit_core::storage::has_protocol;
use diskit_core::{Error, Result, StorageRef};
use diskit_formats::options::{bool_value, size_value};

use crate::spec::{NodeKind, Spec};

/// How the storage is opened.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProtocolMode {
    /// Open for writing.
    pub writable: bool,
    /// Bypass the host page cache.
    pub direct: bool,
    /// Round the size up to whole sectors (what QEMU's raw shows of a file).
    pub sector_size: bool,
    /// Flushes do nothing (cache=unsafe, `cache.no-flush`).
    pub no_flush: bool,
    /// Space reserved and never written is reported as zeros even after
    /// a reader pulled it into the page cache (a copier's source; see
    /// `OpenOptions::host_zeros`).
    pub host_zeros: bool,
}

/// A protocol driver.
#[derive(Debug)]
pub struct Protocol {
    /// The driver name (`file.driver=` in a spec).
    pub name: &'static str,
    /// Name prefixes that select it (the whole name is its `filename`).
    pub prefixes: &'static [&'static str],
    /// The keys its node takes besides `driver`.
    pub keys: &'static [&'static str],
    /// Whether its names are local paths (the trust gate checks them).
    pub local: bool,
    /// Whether its requests travel over a network, where each waits for a
    /// round trip and keeping many in flight pays.
    pub network: bool,
    /// Opens the storage a node describes.
    pub open: fn(&Spec, ProtocolMode) -> Result<StorageRef>,
}

/// Every protocol, the local file first (the one a plain path selects).
pub const PROTOCOLS: &[Protocol] = &[
    Protocol {
        name: "file",
        prefixes: &["file:"],
        keys: &["filename"],
        local: true,
        network: false,
        open: open_file,
    },
    Protocol {
        name: "host_device",
        prefixes: &["host_device:"],
        keys: &["filename"],
        local: true,
        network: false,
        open: open_file,
    },
    Protocol {
        name: "nbd",
        prefixes: &["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"],
        keys: &["filename"],
        local: false,
        network: true,
        open: open_nbd,
    },
    Protocol {
        name: "http",
        prefixes: &["http://"],
        keys: HTTP_KEYS,
        local: false,
        network: true,
        open: open_http,
    },
    Protocol {
        name: "https",
        prefixes: &["https://"],
        keys: HTTP_KEYS,
        local: false,
        network: true,
        open: open_http,
    },
    Protocol {
        name: "null-co",
        prefixes: &["null-co://"],
        keys: &["filename", "size", "read-zeroes"],
        local: false,
        network: false,
        open: open_null,
    },
];

/// The protocol driver called `name`.
pub fn by_name(name: &str) -> Option<&'static Protocol> {
    PROTOCOLS.iter().find(|p| p.name == name)
}

/// The protocol a plain name selects: by prefix, else the local file.
/// A name with an unknown `scheme:` is refused, as QEMU refuses it (a file
/// whose name has a colon is reached as `./name` or `file:name`).
pub fn for_name(name: &str) -> Result<&'static Protocol> {
    if let Some(p) = PROTOCOLS
        .iter()
        .find(|p| p.prefixes.iter().any(|pre| name.starts_with(pre)))
    {
        return Ok(p);
    }
    if has_protocol(name) {
        let scheme = &name[..name.find(':').unwrap_or(0)];
        return Err(Error::invalid(format!("Unknown protocol '{scheme}'")));
    }
    Ok(&PROTOCOLS[0])
}

/// Opens the storage a protocol node describes, refusing keys it does not
/// take.
pub fn open(proto: &Protocol, node: &Spec, mode: ProtocolMode) -> Result<StorageRef> {
    node.check_keys(
        NodeKind::Protocol,
        proto.name,
        &with_driver(proto.keys),
        &[],
    )?;
    (proto.open)(node, mode)
}

fn with_driver(keys: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec!["driver"];
    v.extend_from_slice(keys);
    v
}

fn filename(node: &Spec, driver: &str) -> Result<String> {
    node.get("filename").map(str::to_string).ok_or_else(|| {
        Error::invalid(format!(
            "Parameter 'filename' is required for driver '{driver}'"
        ))
    })
}

fn open_file(node: &Spec, mode: ProtocolMode) -> Result<StorageRef> {
    let name = filename(node, "file")?;
    let path = name
        .strip_prefix("file:")
        .or_else(|| name.strip_prefix("host_device:"))
        .unwrap_or(&name);
    let dev = FileDevice::open(
        path,
        FileOptions {
            writable: mode.writable,
            direct: mode.direct,
            sector_size: mode.sector_size,
            no_flush: mode.no_flush,
            unwritten_map: mode.host_zeros && !mode.writable,
        },
    )?;
    Ok(Arc::new(dev))
}

/// An NBD export, by URI.
fn open_nbd(node: &Spec, _mode: ProtocolMode) -> Result<StorageRef> {
    let uri = filename(node, "nbd")?;
    Ok(Arc::new(diskit_nbd::client::NbdClient::connect(&uri)?))
}

/// The keys of QEMU's http and https drivers that diskit takes.
const HTTP_KEYS: &[&str] = &[
    "filename",
    "url",
    "sslverify",
    "cookie",
    "timeout",
    "username",
];

/// A URL (read-only), as QEMU's curl drivers: `url` (or the whole name),
/// `sslverify`, `cookie`, `timeout` (seconds), `username`.
fn open_http(node: &Spec, _mode: ProtocolMode) -> Result<StorageRef> {
    let url = match node.get("url") {
        Some(u) => u.to_string(),
        None => filename(node, "http")?,
    };
    let mut opts = diskit_http::HttpOptions::default();
    for (key, ours) in [
        ("sslverify", "sslverify"),
        ("cookie", "cookie"),
        ("timeout", "timeout"),
        ("username", "user"),
    ] {
        if let Some(v) = node.get(key) {
            opts.set(ours, v)?;
        }
    }
    Ok(Arc::new(diskit_http::HttpDevice::open(&url, &opts)?))
}

/// QEMU's null-co: `size` (default 1 GiB) and `read-zeroes` (default off:
/// its contents are reported unknown, though diskit reads zeros anyway).
fn open_null(node: &Spec, _mode: ProtocolMode) -> Result<StorageRef> {
    let size = match node.get("size") {
        Some(s) => size_value("size", s)?,
        None => 1 << 30,
    };
    let zeroes = match node.get("read-zeroes") {
        Some(v) => bool_value("read-zeroes", v)?,
        None => false,
    };
    Ok(Arc::new(if zeroes {
        NullDevice::new(size)
    } else {
        NullDevice::unknown_contents(size)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_select_protocols() {
        assert_eq!(for_name("/a/b.img").unwrap().name, "file");
        assert_eq!(for_name("./a:b").unwrap().name, "file");
        assert_eq!(for_name("file:a:b").unwrap().name, "file");
        assert_eq!(for_name("null-co://").unwrap().name, "null-co");
        assert_eq!(for_name("http://h/x").unwrap().name, "http");
        assert_eq!(for_name("https://h/x").unwrap().name, "https");
        let e = for_name("gopher://x").unwrap_err();
        assert!(e.to_string().contains("'gopher'"), "{e}");
    }
}
