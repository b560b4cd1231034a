//! Image formats: what sits between a file and the guest's view of a disk.
//!
//! A format sits on [`Storage`](diskit_core::Storage), never on a file, and
//! opens the files an image names through [`implied::ImpliedFiles`]: the
//! opener (crate `diskit-open`) turns names into storage and chains.
//! [`create_image`] makes a new image from `-o` style options. Each format
//! lives in its own module; raw is the identity mapping, so a raw image is
//! its storage.

pub use diskit_core::bits;
mod bytes;
mod chain;
pub mod check;
pub mod creation;
pub mod crypto;
pub mod driver;
pub mod host_device;
pub mod image_ops;
pub mod implied;
pub mod in_order;
pub mod info;
pub mod luks;
pub mod mapped;
pub mod options;
pub mod prealloc;
pub mod probe;
pub mod qcow2;
pub mod qed;
pub mod raw;
pub mod recognised;
pub mod table;
pub mod vdi;
pub mod vhdx;
pub mod vmdk;
pub mod vpc;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use diskit_core::{BlockDevice, DeviceRef, Result, StorageRef};

pub use check::{CheckReport, Repair};
pub use creation::Creation;
pub use driver::{BackingName, Format, FormatDriver, Measured};
pub use image_ops::{BitmapEdit, BitmapInfo, Capability, FormatImage, NewBitmap};
pub use info::{FormatInfo, InfoValue, SnapshotInfo};
pub use options::OptionList;
pub use prealloc::Prealloc;

/// How to open an image.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Open for writing.
    pub writable: bool,
    /// Bypass the host page cache.
    pub direct: bool,
    /// The image file's flushes do nothing (cache=unsafe).
    pub no_flush: bool,
    /// Take no image locks on a read-only open (`-U`, `--force-share`):
    /// read an image a running VM uses.
    pub force_share: bool,
    /// The image is a source of the running command: this process refuses
    /// to create, truncate or write any of its files (the image, its
    /// backing chain, its data file), whatever name it is given (checked
    /// by device and inode, `-U` or not).
    pub source: bool,
    /// Let no one else write or resize the image's files while it is open,
    /// as qemu-img convert does with its sources (QEMU's
    /// `BDRV_O_NO_SHARE`); a read-only open only.
    pub no_share: bool,
    /// Bytes of qcow2 L2 tables to cache (QEMU's l2-cache-size).
    pub l2_cache_size: Option<u64>,
    /// Read this internal snapshot (qcow2 only; id or name).
    pub snapshot: Option<String>,
    /// Open the image read-only under a new temporary qcow2 overlay that
    /// takes the writes and is gone once closed (QEMU's `snapshot=on`,
    /// qemu-nbd's `-s`); the opener's entry points honour it.
    pub temporary_overlay: bool,
    /// How many layers of the backing chain below the image are opened
    /// writable too (with `writable`): commit writes into its base.
    pub writable_backing_depth: usize,
    /// Do not open the backing file: the image reads as if it had none
    /// (what an unsafe rebase needs when the backing file is gone).
    pub no_backing: bool,
    /// The image comes from someone else: the files it names must be
    /// regular files inside its directory (see `diskit_open::gate`).
    pub untrusted: bool,
    /// Open only the image's own metadata (info): the files it names are
    /// not opened, its backing reads as absent and a data file as empty.
    pub metadata_only: bool,
    /// The id of the secret (`--object secret,...`) that unlocks an
    /// encrypted image (`key-secret=`, `encrypt.key-secret=`).
    pub key_secret: Option<String>,
    /// The format's own node keys given in the description (those its
    /// driver lists in `open_keys` that the opener does not take itself),
    /// such as vpc's `force_size_calc`.
    pub node_options: Vec<(String, String)>,
    /// Ask the host file where allocated data clusters were never written
    /// (preallocated space reads as zeros) and report them as zeros, as a
    /// copier wants; `map` and block status keep qemu-img's answer, which
    /// asks only for images with preallocated metadata.
    pub host_zeros: bool,
    /// Trims and write-zeroes never deallocate while the image is open
    /// (QEMU's `discard=ignore`, qemu-nbd's default; see
    /// [`mapped::Mapped::keeping_allocations`]).
    pub keep_allocations: bool,
}

/// An open image: the guest-visible device plus what the format offers
/// beyond it.
pub struct Image {
    /// What the guest sees.
    pub device: DeviceRef,
    /// The image's format.
    pub format: Format,
    /// The driver of the top node as QEMU names it: the format's name, or
    /// a protocol's where a description puts one on top
    /// (`driver=null-co`, `driver=file`), which QEMU shows as the format.
    pub driver: &'static str,
    /// The file name as given.
    pub filename: PathBuf,
    /// The storage (protocol layer) under the format.
    pub file: StorageRef,
    /// What the format offers beyond the device (snapshots, bitmaps, info...).
    pub ops: Arc<dyn FormatImage>,
    /// The image below this one in its backing chain.
    pub backing: Option<Box<Image>>,
}

impl Image {
    /// The guest-visible size.
    pub fn virtual_size(&self) -> u64 {
        self.device.size()
    }

    /// The images of the chain, this one first.
    pub fn chain(&self) -> Vec<&Image> {
        let mut v = vec![self];
        while let Some(b) = v.last().and_then(|i| i.backing.as_deref()) {
            v.push(b);
        }
        v
    }

    /// The files this image names (backing file, data file), as stored in
    /// it, without opening any of them.
    pub fn implied_names(&self) -> Vec<implied::Named> {
        self.ops.implied_names()
    }

    /// Writes cached metadata and syncs: call before exiting after writes.
    /// The storage under the format is closed after it (storage that is
    /// finished only when closed: a new S3 object).
    pub fn close(&self) -> Result<()> {
        self.device.close()?;
        let same = std::ptr::addr_eq(Arc::as_ptr(&self.device), Arc::as_ptr(&self.file));
        if same { Ok(()) } else { self.file.close() }
    }
}

/// Creates a new image of `format` at `path` of `size` bytes (or the size
/// given in `options`), with the format's creation options.
pub fn create_image(
    path: &Path,
    format: Format,
    size: Option<u64>,
    options: &OptionList,
) -> Result<u64> {
    crate::creation::LocalFiles::new(path)
        .run(|target| format.driver().create(target, size, options))
}
