//! The format driver interface, and [`Format`], a handle to one row of
//! the table of formats (`crate::table`): a driver depends on this
//! module only, the table on every driver.

use std::fmt;
use std::sync::Arc;

use diskit_core::{DeviceRef, Error, ErrorKind, Result, Storage, StorageRef};

use crate::check::{CheckReport, Repair};
use crate::creation::Creation;
use crate::image_ops::{Capability, FormatImage, unsupported_op};
use crate::implied::ImpliedFiles;
use crate::{Image, OpenOptions, OptionList};

/// A backing file as an image's header records it: its name and its
/// format (QEMU refuses a name without a format, and so does this type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackingName<'a> {
    /// The name, as the header keeps it (relative to the image's
    /// directory, or absolute, or a protocol's name).
    pub file: &'a str,
    /// Its format (`raw`, `qcow2`, ...).
    pub format: &'a str,
}

/// What `qemu-img measure` sizes an image for: a new image of a size
/// (`--size`), or one converted from an image.
#[derive(Clone, Copy)]
pub enum Measured<'a> {
    /// An empty image of this many bytes.
    Size(u64),
    /// The image converted, its allocation as it is.
    Image(&'a Image),
}

/// The result of a measurement, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measurement {
    /// Space needed for the image as converted (allocated data only).
    pub required: u64,
    /// Space needed with every cluster allocated.
    pub fully_allocated: u64,
    /// Space for persistent bitmaps, when both sides support them.
    pub bitmaps: Option<u64>,
}

impl Measurement {
    /// The measurement of an image that takes `bytes` whatever is
    /// allocated (plain storage, a LUKS volume): no bitmaps.
    pub fn fixed(bytes: u64) -> Measurement {
        Measurement {
            required: bytes,
            fully_allocated: bytes,
            bitmaps: None,
        }
    }
}

/// What opening an image gives.
pub struct Opened {
    /// What the guest sees.
    pub device: DeviceRef,
    /// What the image offers beyond the device (the format's own tools).
    pub image: Arc<dyn FormatImage>,
}

/// What a driver opens an image from.
pub struct Opening<'a> {
    /// The image's storage.
    pub storage: StorageRef,
    /// How to open it.
    pub opts: &'a OpenOptions,
    /// The opener of the files the image names (backing file, data file,
    /// extents).
    pub implied: &'a mut dyn ImpliedFiles,
}

/// An image format.
pub trait FormatDriver: Sync {
    /// The name, as `-f` and qemu-img spell it.
    fn name(&self) -> &'static str;

    /// Whether diskit reads the format (false: recognised only).
    fn supported(&self) -> bool {
        true
    }

    /// Whether its storage is shown with the size rounded up to whole
    /// sectors (QEMU's raw over a file).
    fn sector_sized(&self) -> bool {
        false
    }

    /// The keys its node takes in `--image-opts` and `json:` descriptions,
    /// besides the ones every node takes.
    fn open_keys(&self) -> &'static [&'static str] {
        &[]
    }

    /// The child nodes its description may carry besides `file`.
    fn children(&self) -> &'static [&'static str] {
        &[]
    }

    /// Opens the image `at` says.
    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let _ = at;
        Err(unsupported(self.name()))
    }

    /// Whether `check` needs the image opened (its files named by it),
    /// and is then [`FormatImage::check`] rather than [`check`](Self::check).
    fn check_opens_image(&self) -> bool {
        false
    }

    /// Whether the format offers `what`.
    fn supports(&self, what: Capability) -> bool {
        let _ = what;
        false
    }

    /// Parses creation options (`-o`) for a new image, to be completed
    /// from the command line and made ([`Creation`]).
    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn Creation>> {
        let _ = options;
        Err(unsupported(self.name()))
    }

    /// Checks (and with `repair`, repairs) the metadata of the image on
    /// `storage`, which nothing else has open.
    fn check(&self, storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
        let _ = (storage, repair);
        Err(unsupported_op(self.name(), "checks"))
    }

    /// `amend -o help`, for formats that can amend.
    fn amend_help(&self) -> Option<String> {
        None
    }

    /// Checks amend options (`-o`) alone: unknown keys, malformed values
    /// and changes the format cannot make are errors.
    fn check_amend_options(&self, options: &OptionList) -> Result<()> {
        let _ = options;
        Err(unsupported_op(self.name(), "option amendment"))
    }

    /// Records `to` as the backing file of the closed image on `file`
    /// (None: no backing file).
    fn change_backing_file(&self, file: &dyn Storage, to: Option<BackingName<'_>>) -> Result<()> {
        let _ = (file, to);
        Err(unsupported_op(self.name(), "backing files"))
    }

    /// Creates a new image of `size` bytes (or the size in `options`)
    /// where `target` says; returns the size. The one way in is
    /// [`parse_create`](Self::parse_create).
    fn create(
        &self,
        target: &mut dyn crate::creation::NewFiles,
        size: Option<u64>,
        options: &OptionList,
    ) -> Result<u64> {
        let mut new = self.parse_create(options)?;
        let size = one_size(size, new.size())?;
        new.set_size(size);
        new.create(target)?;
        Ok(size)
    }

    /// Checks creation options (`-o`) alone: unknown keys and malformed
    /// values are errors.
    fn check_create_options(&self, options: &OptionList) -> Result<()> {
        self.parse_create(options).map(drop)
    }

    /// `create -o help`, with or without a file name given.
    fn create_help(&self, with_file: bool) -> String {
        let _ = with_file;
        format!(
            "Creation options for '{}' are not available in this build\n",
            self.name()
        )
    }

    /// What an image of this format made from `of` with `options` needs
    /// on disk, as `qemu-img measure`.
    fn measure(&self, options: &OptionList, of: Measured<'_>) -> Result<Measurement> {
        let _ = (options, of);
        if self.supported() {
            Err(Error::unsupported(format!(
                "Block driver '{}' does not support size measurement",
                self.name()
            )))
        } else {
            Err(unsupported(self.name()))
        }
    }
}

/// The error for a format diskit recognises but does not read.
pub fn unsupported(name: &str) -> Error {
    Error::new(
        ErrorKind::NotSupported,
        format!(
            "image format '{name}' is recognised but not supported by diskit yet \
             (it is not read as raw; give -f raw to read the container's bytes)"
        ),
    )
}

/// A format of the table: a cheap handle that compares by name.
#[derive(Clone, Copy)]
pub struct Format(pub(crate) &'static dyn FormatDriver);

impl Format {
    /// The format's name.
    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// Its driver.
    pub fn driver(self) -> &'static dyn FormatDriver {
        self.0
    }

    /// Whether the format offers `what`.
    pub fn supports(self, what: Capability) -> bool {
        self.0.supports(what)
    }
}

impl PartialEq for Format {
    fn eq(&self, other: &Format) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Format {}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Debug for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Format({})", self.name())
    }
}

/// Picks the size of a new image: given once, as an argument or as
/// `-o size=`, as qemu-img requires.
pub fn one_size(arg: Option<u64>, option: Option<u64>) -> Result<u64> {
    match (arg, option) {
        (Some(_), Some(_)) => Err(Error::invalid("The image size must be specified only once")),
        (Some(s), None) | (None, Some(s)) => Ok(s),
        (None, None) => Err(Error::invalid("Image creation needs a size parameter")),
    }
}
