//! [`Storage`]: what an image format needs from the bytes below it.
//!
//! A format (qcow2, and every format to come) never holds a file: it holds
//! storage, which is a [`BlockDevice`] that can also grow, be resized, read
//! past its end as zeros (formats do not pad their metadata), and resolve
//! the names an image stores (backing files, data files) against its own
//! location. A local file is storage; so are memory and null devices, an
//! NBD export and an http source.

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;

use crate::device::BlockDevice;
use crate::error::{Error, ErrorKind, Result};

/// Shared storage, as formats hold it.
pub type StorageRef = Arc<dyn Storage>;

/// How new space is reserved when storage grows (qemu-img's `preallocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preallocation {
    /// Sparse: nothing is allocated.
    #[default]
    Off,
    /// Space is reserved (fallocate).
    Falloc,
    /// Zeros are written over the whole range.
    Full,
}

impl Preallocation {
    /// Parses qemu-img's names: off, falloc, full.
    pub fn parse(s: &str) -> Result<Preallocation> {
        match s {
            "off" => Ok(Preallocation::Off),
            "falloc" => Ok(Preallocation::Falloc),
            "full" => Ok(Preallocation::Full),
            _ => Err(Error::invalid(format!("Invalid parameter '{s}'"))),
        }
    }

    /// qemu-img's name for this mode.
    pub fn name(self) -> &'static str {
        match self {
            Preallocation::Off => "off",
            Preallocation::Falloc => "falloc",
            Preallocation::Full => "full",
        }
    }
}

/// How storage is opened: one value from the command line (`-t`/`-T`,
/// `cache.*` keys, serve's `cache=`) down to the bytes, whatever the
/// storage (a file, an NBD export, an http source).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageOptions {
    /// Open for writing.
    pub writable: bool,
    /// Bypass the host page cache (O_DIRECT; unaligned requests go
    /// through aligned bounce buffers).
    pub direct: bool,
    /// Flushes do nothing (QEMU's cache=unsafe, `cache.no-flush`): for a
    /// copy whose result is worthless if the host crashes before it ends.
    pub no_flush: bool,
    /// Report the size rounded up to a whole 512-byte sector, the tail
    /// reading as zeros (what QEMU's raw format shows of a file).
    pub sector_size: bool,
    /// Space reserved and never written is reported as zeros even after a
    /// reader pulled it into the page cache (where seeks, and so
    /// qemu-img, call it data): what a copier's source wants. Read-only
    /// opens only.
    pub host_zeros: bool,
    /// Connections to keep to storage reached over a network (0: its
    /// default): an NBD export that allows multi-conn gets up to this
    /// many, an http source a pool of four range requests per connection
    /// asked for (what nbdcopy keeps in flight).
    pub connections: usize,
}

impl StorageOptions {
    /// Options for reading (`writable` false) or writing, nothing else.
    pub fn writable(writable: bool) -> StorageOptions {
        StorageOptions {
            writable,
            ..StorageOptions::default()
        }
    }

    /// These options with `mode`'s page cache and flush behaviour.
    pub fn with_cache(self, mode: CacheMode) -> StorageOptions {
        StorageOptions {
            direct: mode.direct,
            no_flush: mode.no_flush,
            ..self
        }
    }
}

/// A cache mode as QEMU names them (qemu-img's `-t`/`-T`, qemu-nbd's
/// `--cache`, serve's `cache=`): whether the host page cache is bypassed
/// and whether flushes reach the storage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheMode {
    /// Bypass the host page cache.
    pub direct: bool,
    /// Flushes do nothing.
    pub no_flush: bool,
}

impl CacheMode {
    /// The mode called `name` (`none`, `directsync`, `writeback`,
    /// `writethrough`, `unsafe`), or `None`.
    pub fn parse(name: &str) -> Option<CacheMode> {
        let (direct, no_flush) = match name {
            "none" | "directsync" => (true, false),
            "writeback" | "writethrough" => (false, false),
            "unsafe" => (false, true),
            _ => return None,
        };
        Some(CacheMode { direct, no_flush })
    }
}

/// A change to the snapshots storage keeps of itself, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotChange<'a> {
    /// Takes a snapshot of this name.
    Create(&'a str),
    /// Removes the snapshot of this name.
    Delete(&'a str),
    /// Makes the storage hold what it held at the snapshot of this name.
    Rollback(&'a str),
}

/// What storage tells of itself for `info` (see [`Storage::node_info`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its unit of allocation (`cluster-size`), if it has one.
    pub cluster_size: Option<u64>,
    /// Its `format-specific` block, if it has one: the type and the
    /// data's fields, in order.
    pub specific: Option<(&'static str, Vec<(&'static str, String)>)>,
}

impl NodeInfo {
    /// A local file's or block device's (QEMU's file-posix node): a
    /// format-specific block with no data.
    pub fn local_file() -> NodeInfo {
        NodeInfo {
            cluster_size: None,
            specific: Some(("file", Vec::new())),
        }
    }
}

/// The bytes under an image format. Every [`BlockDevice`] operation works
/// as on any device (writes within `0..size()`); the methods here add what
/// formats need beyond that. Defaults suit storage of a fixed size.
pub trait Storage: BlockDevice {
    /// The name the storage was opened by (a path or a URI), for messages
    /// and for resolving relative names.
    fn location(&self) -> &str;

    /// Resolves a name stored in an image on this storage (a backing or
    /// data file) the way QEMU does: an absolute name, or one with a
    /// scheme, stands as it is; a relative one is relative to the
    /// directory of [`location`](Self::location).
    fn resolve(&self, name: &str) -> String {
        resolve_relative(self.location(), name)
    }

    /// The length of the stored bytes now. It may be less than `size()`,
    /// which can be rounded up to whole sectors.
    fn file_len(&self) -> Result<u64> {
        Ok(self.size())
    }

    /// Reads `buf.len()` bytes at `offset`; bytes past the end read as
    /// zeros (formats read metadata QEMU does not pad to a cluster).
    fn read_padded(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let size = self.size();
        let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        if n > 0 {
            self.read_at(&mut buf[..n], offset)?;
        }
        buf[n..].fill(0);
        Ok(())
    }

    /// Writes all of `buf` at `offset`, growing the storage when the write
    /// ends past its end (formats allocate at the end). Storage that cannot
    /// grow fails with [`ErrorKind::NoSpace`].
    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::new(ErrorKind::Overflow, "write past the largest offset"))?;
        if end > self.size() {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "write ends at {end}, past the end of {} ({} bytes)",
                    self.location(),
                    self.size()
                ),
            ));
        }
        self.write_at(buf, offset, crate::device::WriteFlags::NONE)
    }

    /// Changes the length, reserving new space as `prealloc` says. Storage
    /// of a fixed size accepts only shrinking to no less than it is (a
    /// no-op), as a block device does.
    fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
        let _ = prealloc;
        let size = self.size();
        if new_len > size {
            return Err(Error::unsupported(format!(
                "Cannot grow {} (its size is {size})",
                self.location()
            )));
        }
        Ok(())
    }

    /// The protocol, as qemu-img names it in `info` ("file", "host_device",
    /// "nbd", "null-co").
    fn protocol(&self) -> &'static str;

    /// Bytes the storage occupies (a file's blocks), when known.
    fn allocated_bytes(&self) -> Option<u64> {
        None
    }

    /// The snapshots the storage keeps of itself (an RBD image's), in
    /// order: name and the size at each. Storage that keeps none fails
    /// with [`ErrorKind::NotSupported`].
    fn snapshots(&self) -> Result<Vec<(String, u64)>> {
        Err(Error::from_kind(ErrorKind::NotSupported))
    }

    /// Takes, removes or goes back to a snapshot the storage keeps of
    /// itself (see [`snapshots`](Self::snapshots)).
    fn change_snapshot(&self, change: SnapshotChange<'_>) -> Result<()> {
        let _ = change;
        Err(Error::from_kind(ErrorKind::NotSupported))
    }

    /// What the storage tells of itself beyond its size, as QEMU's
    /// protocol driver does for `info` (`bdrv_get_info`,
    /// `bdrv_get_specific_info`); `None` for storage that tells nothing
    /// (an NBD export).
    fn node_info(&self) -> Option<NodeInfo> {
        None
    }

    /// The file descriptor holding the bytes at plain offsets, when there is
    /// one (for splice and copy_file_range).
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// Whether writes must come front to back, nearly in order (a new S3
    /// object, uploaded part after part as it fills): a copy into it
    /// writes in source order.
    fn writes_in_order(&self) -> bool {
        false
    }

    /// How many bytes at the start may still be written at any time, however
    /// far the writes have gone: all of them (`u64::MAX`) unless the storage
    /// [writes in order](Self::writes_in_order). A new S3 object keeps its
    /// first part in memory until it is closed, so that a format writes its
    /// header, and the tables it keeps next to it, last; metadata a format
    /// changes in place must lie within these bytes, or be placed at the end
    /// once the data is written.
    fn rewritable_head(&self) -> u64 {
        u64::MAX
    }

    /// Whether this is a device of a fixed size (a block device, an NBD
    /// export) rather than a file that grows.
    fn is_fixed_size(&self) -> bool {
        true
    }

    /// Takes QEMU's image locks on the storage (see [`lock`]), after
    /// checking that no other process holds locks they conflict with: the
    /// permissions `perm` this open uses and those `unshare` it lets no one
    /// else use. The locks last as long as the storage is open. Storage
    /// that is not a local file has none, the default.
    fn lock_image(&self, perm: u8, unshare: u8) -> Result<()> {
        let _ = (perm, unshare);
        Ok(())
    }
}

/// QEMU's image locking: permissions, as bits, and their names. A process
/// holding permission `p` holds a shared lock on byte `100 + p` of the
/// image file; one that lets no one else have `p` holds a shared lock on
/// byte `200 + p` (QEMU's file-posix driver, open file description locks).
pub mod lock {
    /// Reading, and seeing the data stay consistent.
    pub const READ: u8 = 1 << 0;
    /// Writing.
    pub const WRITE: u8 = 1 << 1;
    /// Writing without changing what the image shows.
    pub const WRITE_UNCHANGED: u8 = 1 << 2;
    /// Changing the size.
    pub const RESIZE: u8 = 1 << 3;
    /// Where the permission bytes start.
    pub const PERM_BASE: u64 = 100;
    /// Where the bytes of unshared permissions start.
    pub const SHARED_BASE: u64 = 200;

    /// What an open of an image file uses and keeps from others, as QEMU:
    /// a writer uses read and write (and resize, for a format with
    /// metadata, which also lets no one else write or resize the file,
    /// read or written); a reader reads.
    pub fn for_image(writable: bool, metadata: bool) -> (u8, u8) {
        let keep = if metadata { WRITE | RESIZE } else { 0 };
        match (writable, metadata) {
            (true, true) => (READ | WRITE | RESIZE, keep),
            (true, false) => (READ | WRITE, keep),
            (false, _) => (READ, keep),
        }
    }

    /// What an open of a qcow2 image's external data file uses and keeps
    /// from others, as QEMU: a writer uses read, write and resize, a
    /// reader reads; neither lets anyone else resize it.
    pub fn for_data_file(writable: bool) -> (u8, u8) {
        if writable {
            (READ | WRITE | RESIZE, RESIZE)
        } else {
            (READ, RESIZE)
        }
    }

    /// QEMU's name for permission bit `i`.
    pub fn name(i: u32) -> &'static str {
        ["consistent read", "write", "write unchanged", "resize"]
            .get(i as usize)
            .copied()
            .unwrap_or("unknown")
    }
}

/// Resolves `name` against the directory of `location`, as QEMU resolves
/// relative backing and data file names. Names with a protocol prefix
/// (`nbd://…`, `json:…`) and absolute paths stand as they are.
pub fn resolve_relative(location: &str, name: &str) -> String {
    if name.starts_with('/') || has_protocol(name) {
        return name.to_string();
    }
    match Path::new(location).parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !has_protocol(location) => {
            dir.join(name).to_string_lossy().into_owned()
        }
        _ => name.to_string(),
    }
}

/// Whether `name` starts with a protocol prefix (`scheme:` with a scheme of
/// letters, digits, `+`, `-`, `.`), as QEMU's `path_has_protocol` decides.
pub fn has_protocol(name: &str) -> bool {
    let Some(colon) = name.find(':') else {
        return false;
    };
    let scheme = &name[..colon];
    !scheme.is_empty()
        && !scheme.contains('/')
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-._".contains(&b))
}

macro_rules! forward_storage {
    ($ty:ty) => {
        impl<T: Storage + ?Sized> Storage for $ty {
            fn location(&self) -> &str {
                (**self).location()
            }
            fn protocol(&self) -> &'static str {
                (**self).protocol()
            }
            fn resolve(&self, name: &str) -> String {
                (**self).resolve(name)
            }
            fn file_len(&self) -> Result<u64> {
                (**self).file_len()
            }
            fn read_padded(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                (**self).read_padded(buf, offset)
            }
            fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
                (**self).write_extend(buf, offset)
            }
            fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
                (**self).resize(new_len, prealloc)
            }
            fn allocated_bytes(&self) -> Option<u64> {
                (**self).allocated_bytes()
            }
            fn node_info(&self) -> Option<NodeInfo> {
                (**self).node_info()
            }
            fn snapshots(&self) -> Result<Vec<(String, u64)>> {
                (**self).snapshots()
            }
            fn change_snapshot(&self, change: SnapshotChange<'_>) -> Result<()> {
                (**self).change_snapshot(change)
            }
            fn fd(&self) -> Option<BorrowedFd<'_>> {
                (**self).fd()
            }
            fn is_fixed_size(&self) -> bool {
                (**self).is_fixed_size()
            }
            fn writes_in_order(&self) -> bool {
                (**self).writes_in_order()
            }
            fn rewritable_head(&self) -> u64 {
                (**self).rewritable_head()
            }
            fn lock_image(&self, perm: u8, unshare: u8) -> Result<()> {
                (**self).lock_image(perm, unshare)
            }
        }
    };
}

forward_storage!(Arc<T>);
forward_storage!(Box<T>);
forward_storage!(&T);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_names_resolve_against_the_image_directory() {
        assert_eq!(
            resolve_relative("/a/b/img.qcow2", "base.raw"),
            "/a/b/base.raw"
        );
        assert_eq!(resolve_relative("img.qcow2", "base.raw"), "base.raw");
        assert_eq!(resolve_relative("d/img.qcow2", "../x"), "d/../x");
        assert_eq!(resolve_relative("/a/img", "/etc/passwd"), "/etc/passwd");
        assert_eq!(resolve_relative("/a/img", "nbd://h/x"), "nbd://h/x");
        assert_eq!(resolve_relative("nbd://h/x", "base"), "base");
    }

    #[test]
    fn protocol_prefixes() {
        assert!(has_protocol("nbd+unix:///?socket=s"));
        assert!(has_protocol("json:{}"));
        assert!(has_protocol("null-co://"));
        assert!(!has_protocol("./a:b"));
        assert!(!has_protocol("a/b:c"));
        assert!(!has_protocol("plain"));
        assert!(!has_protocol(":x"));
    }
}
