//! Image formats: what sits between a file and the guest's view of a disk.
//!
//! A format sits on [`Storage`](diskit_core::Storage), never on a file, and
//! opens the files an image names through [`implied::ImpliedFiles`]: the
//! opener (crate `diskit-open`) turns names into storage and chains.
//! [`create_image`] makes a new image from `-o` style options. Each format
//! lives in its own module; raw is the identity mapping, so a raw image is
//! its storage.

mod chain;
pub mod implied;
pub mod options;
pub mod probe;
pub mod qcow2;
pub mod raw;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use diskit_core::{BlockDevice, DeviceRef, Error, Result, StorageRef};

pub use options::OptionList;

/// The image formats diskit knows by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A plain disk image: guest offset = file offset.
    Raw,
    /// QEMU copy-on-write v2/v3.
    Qcow2,
}

impl Format {
    /// Parses a format name as given to `-f`/`-O`.
    pub fn from_name(name: &str) -> Result<Format> {
        match probe::by_name(name) {
            Some(row) => row.format.ok_or_else(|| probe::unsupported(name)),
            None => Err(Error::invalid(format!("Unknown file format '{name}'"))),
        }
    }

    /// The format's name.
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How to open an image.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Open for writing.
    pub writable: bool,
    /// Bypass the host page cache.
    pub direct: bool,
    /// Bytes of qcow2 L2 tables to cache (QEMU's l2-cache-size).
    pub l2_cache_size: Option<u64>,
    /// Read this internal snapshot (qcow2 only; id or name).
    pub snapshot: Option<String>,
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
}

/// An open image: the guest-visible device plus what `info` and `map` need.
pub struct Image {
    /// What the guest sees.
    pub device: DeviceRef,
    /// The image's format.
    pub format: Format,
    /// The file name as given.
    pub filename: PathBuf,
    /// The storage (protocol layer) under the format.
    pub file: StorageRef,
    /// The qcow2 driver, for qcow2 images.
    pub qcow2: Option<Arc<qcow2::Qcow2>>,
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
        use implied::{Named, Role};
        let Some(q) = &self.qcow2 else {
            return Vec::new();
        };
        let h = q.header();
        let mut v = Vec::new();
        if let Some(b) = &h.backing_file {
            v.push(Named {
                role: Role::Backing,
                name: b.clone(),
                format: h.backing_format(),
            });
        }
        if let Some(e) = h.extension(qcow2::header::ext::DATA_FILE) {
            v.push(Named {
                role: Role::DataFile,
                name: String::from_utf8_lossy(&e.data).into_owned(),
                format: None,
            });
        }
        v
    }

    /// Writes cached metadata and syncs: call before exiting after writes.
    pub fn close(&self) -> Result<()> {
        self.device.close()
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
    match format {
        Format::Raw => {
            let opts = raw::RawCreateOptions::parse(options)?;
            let size = match (size, opts.size) {
                (Some(_), Some(_)) => {
                    return Err(Error::invalid("The image size must be specified only once"));
                }
                (Some(s), None) | (None, Some(s)) => s,
                (None, None) => {
                    return Err(Error::invalid("Image creation needs a size parameter"));
                }
            };
            raw::create(path, size, &opts)?;
            Ok(size)
        }
        Format::Qcow2 => {
            let mut opts = qcow2::create::Qcow2CreateOptions::parse(options)?;
            let size = match (size, opts.size) {
                (Some(_), Some(_)) => {
                    return Err(Error::invalid("The image size must be specified only once"));
                }
                (Some(s), None) => {
                    opts.set_size(s);
                    s
                }
                (None, Some(s)) => s,
                (None, None) => {
                    return Err(Error::invalid("Image creation needs a size parameter"));
                }
            };
            qcow2::create::create(path, &opts)?;
            Ok(size)
        }
    }
}
