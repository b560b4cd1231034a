//! The format driver interface and the one table of formats.
//!
//! Probing, `-f`/`-O`, `create`, `create -o help`, `measure`, the opener
//! and `serve image` all read [`FORMATS`]: a new format is one module that
//! implements [`FormatDriver`] plus one row here. A format QEMU knows and
//! diskit does not read yet has a row too ([`Recognised`]), so that it is
//! refused by name and never read as raw.

use std::fmt;
use std::sync::Arc;

use diskit_core::{DeviceRef, Error, ErrorKind, Result, Storage, StorageRef};

use crate::check::{CheckReport, Repair};
use crate::creation::Creation;
use crate::image_ops::{Capability, FormatImage, unsupported_op};
use crate::implied::ImpliedFiles;
use crate::qcow2::measure::Measurement;
use crate::{Image, OpenOptions, OptionList};

/// What opening an image gives.
pub struct Opened {
    /// What the guest sees.
    pub device: DeviceRef,
    /// What the image offers beyond the device (the format's own tools).
    pub image: Arc<dyn FormatImage>,
}

/// An image format.
pub trait FormatDriver: Sync {
    /// The name, as `-f` and qemu-img spell it.
    fn name(&self) -> &'static str;

    /// Scores the first bytes of an image (at most
    /// [`PROBE_BYTES`](crate::probe::PROBE_BYTES)) and its name, as QEMU
    /// scores them: 0 is "not this format", 100 is certain.
    fn probe(&self, head: &[u8], filename: &str) -> u32;

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

    /// Opens the image on `storage`; the files it names are opened through
    /// `implied`.
    fn open(
        &self,
        storage: StorageRef,
        opts: &OpenOptions,
        implied: &mut dyn ImpliedFiles,
    ) -> Result<Opened> {
        let _ = (storage, opts, implied);
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

    /// Records `name` (in format `format`) as the backing file of the
    /// closed image on `storage`, or no backing file.
    fn change_backing_file(
        &self,
        storage: &dyn Storage,
        name: Option<&str>,
        format: Option<&str>,
    ) -> Result<()> {
        let _ = (storage, name, format);
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

    /// What an image of this format made from `source` (or of `size`
    /// bytes) with `options` needs on disk, as `qemu-img measure`.
    fn measure(
        &self,
        options: &OptionList,
        size: Option<u64>,
        source: Option<&Image>,
    ) -> Result<Measurement> {
        let _ = (options, size, source);
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

/// A format QEMU knows that diskit only recognises.
pub struct Recognised {
    /// Its name.
    pub name: &'static str,
    /// Its probe.
    pub probe: fn(&[u8], &str) -> u32,
}

impl FormatDriver for Recognised {
    fn name(&self) -> &'static str {
        self.name
    }
    fn probe(&self, head: &[u8], filename: &str) -> u32 {
        (self.probe)(head, filename)
    }
    fn supported(&self) -> bool {
        false
    }
}

/// Every format, in QEMU's order where probe scores tie; raw (which
/// scores 1 for anything) last.
pub static FORMATS: &[&dyn FormatDriver] = &[
    &crate::qcow2::driver::Qcow2Driver,
    &Recognised {
        name: "qcow",
        probe: crate::probe::qcow1,
    },
    &crate::qed::QedDriver,
    &crate::vmdk::VmdkDriver,
    &crate::vhdx::VhdxDriver,
    &crate::vpc::VpcDriver,
    &crate::vdi::VdiDriver,
    &crate::luks::LuksDriver,
    &Recognised {
        name: "parallels",
        probe: crate::probe::parallels,
    },
    &Recognised {
        name: "bochs",
        probe: crate::probe::bochs,
    },
    &Recognised {
        name: "cloop",
        probe: crate::probe::cloop,
    },
    &Recognised {
        name: "dmg",
        probe: crate::probe::dmg,
    },
    &crate::raw::RawDriver,
    &crate::host_device::HostDeviceDriver,
];

/// A format of the table: a cheap handle that compares by name.
#[derive(Clone, Copy)]
pub struct Format(&'static dyn FormatDriver);

impl Format {
    /// A plain disk image: guest offset = storage offset.
    pub const RAW: Format = Format(&crate::raw::RawDriver);
    /// QEMU copy-on-write v2/v3.
    pub const QCOW2: Format = Format(&crate::qcow2::driver::Qcow2Driver);
    /// An existing block or character device, named as QEMU's protocol
    /// driver (`-f host_device`): its raw bytes.
    pub const HOST_DEVICE: Format = Format(&crate::host_device::HostDeviceDriver);
    /// VirtualBox's disk image.
    pub const VDI: Format = Format(&crate::vdi::VdiDriver);
    /// Virtual PC's VHD.
    pub const VPC: Format = Format(&crate::vpc::VpcDriver);
    /// Hyper-V's VHDX.
    pub const VHDX: Format = Format(&crate::vhdx::VhdxDriver);
    /// QEMU enhanced disk.
    pub const QED: Format = Format(&crate::qed::QedDriver);
    /// VMware's disk.
    pub const VMDK: Format = Format(&crate::vmdk::VmdkDriver);
    /// A LUKS volume.
    pub const LUKS: Format = Format(&crate::luks::LuksDriver);

    /// The format called `name` (`-f`, `-O`, a backing format), refusing
    /// one diskit only recognises by name.
    pub fn from_name(name: &str) -> Result<Format> {
        match Format::known(name) {
            Some(f) if f.0.supported() => Ok(f),
            Some(_) => Err(unsupported(name)),
            None => Err(Error::invalid(format!("Unknown file format '{name}'"))),
        }
    }

    /// The row called `name`, supported or not.
    pub fn known(name: &str) -> Option<Format> {
        FORMATS
            .iter()
            .find(|d| d.name() == name)
            .map(|d| Format(*d))
    }

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

    /// Every format of the table.
    pub fn all() -> impl Iterator<Item = Format> {
        FORMATS.iter().map(|d| Format(*d))
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
