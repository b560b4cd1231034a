//! Image formats: what sits between a file and the guest's view of a disk.
//!
//! [`open_image`] opens a file as an [`Image`], probing the format unless it
//! is given; [`create_image`] makes a new one from `-o` style options. Each
//! format lives in its own module; raw is the identity mapping, so a raw image
//! is its file device.

pub mod options;
pub mod probe;
pub mod qcow2;
pub mod raw;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use diskit_backends::{FileDevice, FileOptions};
use diskit_core::{DeviceRef, Error, Result};

pub use options::OptionList;

/// The image formats diskit knows by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A plain disk image: guest offset = file offset.
    Raw,
    /// QEMU copy-on-write v2/v3 (recognised by probing; the driver comes next).
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

    fn driver_missing(self) -> Error {
        Error::unsupported(format!(
            "'{}' images are not supported by this build yet",
            self.name()
        ))
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How to open an image.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// Open for writing.
    pub writable: bool,
    /// Bypass the host page cache.
    pub direct: bool,
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
}

impl Image {
    /// The guest-visible size.
    pub fn virtual_size(&self) -> u64 {
        self.device.size()
    }
}

/// Opens `path` as an image of format `format`, or of the probed format.
pub fn open_image(path: &Path, format: Option<Format>, opts: OpenOptions) -> Result<Image> {
    let file = Arc::new(FileDevice::open(
        path,
        FileOptions {
            writable: opts.writable,
            direct: opts.direct,
            sector_size: true,
        },
    )?);
    let format = match format {
        Some(f) => f,
        None => probe::probe(&*file)?,
    };
    match format {
        Format::Raw => Ok(Image {
            device: file.clone(),
            format,
            filename: path.to_path_buf(),
            file,
        }),
        Format::Qcow2 => Err(format.driver_missing()),
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
