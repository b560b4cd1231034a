//! `cow-file=OVERLAY.qcow2`: the cow filter's overlay kept as a qcow2
//! image whose backing file is the source, so that what clients wrote
//! survives the server: `qemu-img info` and `check` read it, `qemu-img
//! commit` (or `diskit commit`) writes it into the source later, and the
//! next `serve` with the same `cow-file` goes on from it.
//!
//! The image is created when the file does not exist (cluster size
//! `cow-block-size`, at most 2 MiB; backing file the source's absolute
//! path or URI, format raw), and reopened when it does (its size and
//! backing file must be the source's). The qcow2 driver does the work:
//! unwritten clusters read from the source, partial writes copy the rest
//! of their cluster from it, zeroes and trims mark clusters; the source is
//! never written. A flush makes the overlay durable. With `cow-on-read`
//! (and `cow-on-cache` for cache requests), what is read from the source
//! is written into the overlay, clusters that read as zeros as zero
//! clusters; a byte-range lock over the clusters of such a read keeps a
//! client's write to them from being overwritten by the copy.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use diskit_core::extent::ExtentWalker;
use diskit_core::range_lock::{RangeGuard, RangeLock};
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, Error, ErrorKind, Extent, Filter,
    Result, StorageRef, WriteFlags, ZeroFlags,
};
use diskit_formats::driver::Opening;
use diskit_formats::implied::{ImpliedFiles, Role};
use diskit_formats::{Format, OpenOptions, OptionList};

use crate::cow::{CowConfig, OnRead};

/// The largest qcow2 cluster.
const MAX_CLUSTER: u64 = 2 << 20;

/// The filter.
pub struct CowFile {
    /// The overlay, opened by the qcow2 driver.
    image: DeviceRef,
    path: PathBuf,
    cluster: u64,
    /// The source's size.
    size: u64,
    on_read: OnRead,
    on_cache: bool,
    /// Clusters being filled from the source by a read, or written.
    locks: RangeLock,
}

impl std::fmt::Debug for CowFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CowFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Gives the qcow2 driver the source as its backing device, whatever
/// name the image records (checked before).
struct Source(DeviceRef);

impl ImpliedFiles for Source {
    fn backing(&mut self, _name: &str, _format: Option<&str>) -> Result<(DeviceRef, u64)> {
        Ok((self.0.clone(), self.0.size()))
    }
    fn data_file(&mut self, name: &str, _writable: bool) -> Result<StorageRef> {
        Err(Error::invalid(format!(
            "cow: cow-file: an overlay with an external data file ('{name}') is not supported"
        )))
    }
}

/// The name the overlay records for `source`: the absolute path of a
/// file, or a URI.
fn backing_name(source: &dyn BlockDevice) -> Result<String> {
    let name = source.describe();
    if name.contains("://") {
        return Ok(name);
    }
    let path = Path::new(&name);
    if path.exists()
        && let Ok(abs) = std::fs::canonicalize(path)
    {
        return Ok(abs.display().to_string());
    }
    Err(Error::invalid(format!(
        "cow: cow-file needs a source with a name for the overlay's backing file \
         (a file or an NBD export), not '{name}'"
    )))
}

impl CowFile {
    /// Creates or reopens the overlay at `config.file` over `next`.
    pub fn new(next: &DeviceRef, config: &CowConfig) -> Result<CowFile> {
        let path = config.file.clone().expect("cow-file given");
        let ctx = |e: Error| e.context(format!("cow: cow-file: {}", path.display()));
        let backing = backing_name(&**next)?;
        if config.block_size > MAX_CLUSTER {
            return Err(Error::invalid(format!(
                "cow: with cow-file, cow-block-size is a qcow2 cluster size: at most 2M, not {}",
                config.block_size
            )));
        }
        let qcow2 = Format::QCOW2.driver();
        if !path.exists() {
            let mut o = OptionList::new();
            o.set("size", &next.size().to_string());
            o.set("backing_file", &backing);
            o.set("backing_fmt", "raw");
            o.set("cluster_size", &config.block_size.to_string());
            diskit_formats::creation::LocalFiles::new(&path)
                .run(|t| qcow2.create(t, None, &o))
                .map_err(ctx)?;
        }
        let file: StorageRef = Arc::new(
            diskit_backends::FileDevice::open(
                &path,
                diskit_core::StorageOptions {
                    writable: true,
                    ..Default::default()
                },
            )
            .map_err(ctx)?,
        );
        // Looked at read-only first: an overlay of another source is
        // refused before anything is written to it.
        let looked = qcow2
            .open(Opening {
                storage: file.clone(),
                opts: &OpenOptions::default(),
                implied: &mut Source(next.clone()),
            })
            .map_err(ctx)?;
        let recorded = looked
            .image
            .implied_names()
            .into_iter()
            .find(|n| matches!(n.role, Role::Backing))
            .map(|n| n.name);
        if recorded.as_deref() != Some(backing.as_str()) {
            return Err(ctx(Error::invalid(format!(
                "the overlay's backing file is {}, not the source {backing}",
                recorded.map_or("missing".to_string(), |b| format!("'{b}'"))
            ))));
        }
        let cluster = looked.image.cluster_size().unwrap_or(config.block_size);
        drop(looked);
        let writable = OpenOptions {
            writable: true,
            ..OpenOptions::default()
        };
        let image = qcow2
            .open(Opening {
                storage: file,
                opts: &writable,
                implied: &mut Source(next.clone()),
            })
            .map_err(ctx)?
            .device;
        // qcow2 sizes are whole sectors: the overlay may end up to 511
        // bytes after the source, which the filter does not show.
        if image.size() != next.size().div_ceil(512) * 512 {
            return Err(ctx(Error::invalid(format!(
                "the overlay is {} bytes, the source {}",
                image.size(),
                next.size()
            ))));
        }
        Ok(CowFile {
            image,
            path,
            cluster,
            size: next.size(),
            on_read: config.on_read.clone(),
            on_cache: config.on_cache,
            locks: RangeLock::new(),
        })
    }

    /// Holds the clusters around `offset..offset+len` (while the guard
    /// lives), so that no fill from the source runs in them meanwhile;
    /// returns the guard and where they start and end.
    fn hold(&self, offset: u64, len: u64) -> (RangeGuard<'_>, u64, u64) {
        let start = offset / self.cluster * self.cluster;
        let end = (offset + len)
            .div_ceil(self.cluster)
            .saturating_mul(self.cluster)
            .min(self.size);
        (self.locks.lock(start, end, true), start, end)
    }

    /// Copies what the source holds of `start..end` (whole clusters, or
    /// up to the end) into the overlay; returns the bytes read.
    fn fill(&self, start: u64, end: u64) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; (end - start) as usize];
        self.image.read_at(&mut buf, start)?;
        let mut pos = start;
        for e in ExtentWalker::new(&*self.image, start, end - start) {
            let e = e?;
            if e.depth > 0 {
                let at = (pos - start) as usize;
                let piece = &buf[at..at + e.length as usize];
                if e.flags.zero || piece.iter().all(|&b| b == 0) {
                    let flags = ZeroFlags {
                        may_trim: false,
                        ..ZeroFlags::default()
                    };
                    self.image.write_zeroes(pos, e.length, flags)?;
                } else {
                    self.image.write_at(piece, pos, WriteFlags::NONE)?;
                }
            }
            pos += e.length;
        }
        Ok(buf)
    }
}

impl Filter for CowFile {
    fn name(&self) -> &str {
        "cow"
    }
    fn size(&self, next: &dyn BlockDevice) -> u64 {
        next.size()
    }
    fn capabilities(&self, _next: &dyn BlockDevice) -> Capabilities {
        let caps = self.image.capabilities();
        Capabilities {
            can_cache: true,
            ..caps
        }
    }
    fn block_size(&self, _next: &dyn BlockDevice) -> BlockSizeLimits {
        self.image.block_size()
    }
    fn is_known_zero(&self, _next: &dyn BlockDevice) -> bool {
        false
    }
    fn read_at(&self, _next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        if !self.on_read.now() || buf.is_empty() {
            return self.image.read_at(buf, offset);
        }
        let (_held, start, end) = self.hold(offset, buf.len() as u64);
        let data = self.fill(start, end)?;
        let at = (offset - start) as usize;
        buf.copy_from_slice(&data[at..at + buf.len()]);
        Ok(())
    }
    fn write_at(
        &self,
        _next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let _held = self.hold(offset, buf.len() as u64);
        self.image.write_at(buf, offset, flags)
    }
    fn write_zeroes(
        &self,
        _next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        let _held = self.hold(offset, len);
        self.image.write_zeroes(offset, len, flags)
    }
    fn trim(
        &self,
        _next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        // Trimmed bytes may read as anything: zeros, not the source's
        // bytes, so that the overlay never depends on them again.
        let _held = self.hold(offset, len);
        let zero = ZeroFlags {
            fua: flags.fua,
            may_trim: true,
            fast: false,
        };
        self.image.write_zeroes(offset, len, zero)
    }
    fn flush(&self, _next: &dyn BlockDevice) -> Result<()> {
        self.image.flush()
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        if !self.on_cache || len == 0 {
            return next.cache(offset, len).or(Ok(()));
        }
        let (_held, start, end) = self.hold(offset, len);
        self.fill(start, end).map(|_| ())
    }
    fn extents(&self, _next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut list = self.image.extents(offset, len)?;
        // Nothing past the source's end.
        let mut left = len;
        list.retain_mut(|e| {
            let keep = left > 0;
            e.length = e.length.min(left);
            left -= e.length;
            keep
        });
        Ok(list)
    }
    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        let r = self.image.close();
        let below = next.close();
        r.and(below).map_err(|e| {
            if e.kind() == ErrorKind::Io {
                e.context(format!("cow: cow-file: {}", self.path.display()))
            } else {
                e
            }
        })
    }
}
