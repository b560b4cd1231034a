//! Image formats: what sits between a file and the guest's view of a disk.
//!
//! [`open_image`] opens a file as an [`Image`], probing the format unless it
//! is given; [`create_image`] makes a new one from `-o` style options. Each
//! format lives in its own module; raw is the identity mapping, so a raw image
//! is its file device.

mod chain;
pub mod options;
pub mod probe;
pub mod qcow2;
pub mod raw;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use diskit_backends::{FileDevice, FileOptions};
use diskit_core::{BlockDevice, DeviceRef, Error, Result};

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
        match name {
            "raw" => Ok(Format::Raw),
            "qcow2" => Ok(Format::Qcow2),
            _ => Err(Error::invalid(format!("Unknown file format '{name}'"))),
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
}

/// An open image: the guest-visible device plus what `info` and `map` need.
pub struct Image {
    /// What the guest sees.
    pub device: DeviceRef,
    /// The image's format.
    pub format: Format,
    /// The file name as given.
    pub filename: PathBuf,
    /// The file (protocol layer) under the format.
    pub file: Arc<FileDevice>,
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

    /// Writes cached metadata and syncs: call before exiting after writes.
    pub fn close(&self) -> Result<()> {
        match &self.qcow2 {
            Some(q) => q.close(),
            None => Ok(()),
        }
    }
}

/// Backing chains deeper than this are refused (a loop that escaped
/// detection, or an absurd image).
const MAX_CHAIN_DEPTH: usize = 256;

/// Opens `path` as an image of format `format`, or of the probed format.
pub fn open_image(path: &Path, format: Option<Format>, opts: OpenOptions) -> Result<Image> {
    open_in_chain(path, format, opts, &mut Vec::new())
}

fn open_in_chain(
    path: &Path,
    format: Option<Format>,
    opts: OpenOptions,
    seen: &mut Vec<(u64, u64)>,
) -> Result<Image> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::metadata(path) {
        let id = (m.dev(), m.ino());
        if seen.contains(&id) {
            return Err(Error::invalid(format!(
                "Backing file chain of '{}' contains a loop",
                path.display()
            )));
        }
        if seen.len() >= MAX_CHAIN_DEPTH {
            return Err(Error::invalid("Backing file chain is too deep"));
        }
        seen.push(id);
    }
    let probe_file = FileDevice::open(
        path,
        FileOptions {
            writable: opts.writable,
            direct: opts.direct,
            sector_size: false,
        },
    )?;
    let format = match format {
        Some(f) => f,
        None => probe::probe(&probe_file)?,
    };
    match format {
        Format::Raw => {
            drop(probe_file);
            let file = Arc::new(FileDevice::open(
                path,
                FileOptions {
                    writable: opts.writable,
                    direct: opts.direct,
                    sector_size: true,
                },
            )?);
            Ok(Image {
                device: file.clone(),
                format,
                filename: path.to_path_buf(),
                file,
                qcow2: None,
                backing: None,
            })
        }
        Format::Qcow2 => {
            let file = Arc::new(probe_file);
            let below = std::cell::RefCell::new(None);
            let mut open_backing = |p: &Path, fmt: Option<&str>| -> Result<(DeviceRef, u64)> {
                if opts.no_backing {
                    // An empty device: everything reads as zeros.
                    let none: DeviceRef = Arc::new(diskit_backends::NullDevice::new(0));
                    return Ok((none, 0));
                }
                let fmt = fmt.map(Format::from_name).transpose()?;
                let below_writable = opts.writable && opts.writable_backing_depth > 0;
                let ro = OpenOptions {
                    writable: below_writable,
                    snapshot: None,
                    writable_backing_depth: opts.writable_backing_depth.saturating_sub(1),
                    ..opts.clone()
                };
                let img = open_in_chain(p, fmt, ro, seen)?;
                let r = (img.device.clone(), img.virtual_size());
                *below.borrow_mut() = Some(Box::new(img));
                Ok(r)
            };
            let q = Arc::new(qcow2::open::open(
                path,
                file.clone(),
                qcow2::Qcow2Options {
                    writable: opts.writable,
                    direct: opts.direct,
                    l2_cache_size: opts.l2_cache_size,
                    snapshot: opts.snapshot.clone(),
                },
                &mut open_backing,
            )?);
            Ok(Image {
                device: q.clone(),
                format,
                filename: path.to_path_buf(),
                file,
                qcow2: Some(q),
                backing: below.into_inner(),
            })
        }
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
