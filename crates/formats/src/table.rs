//! The one table of formats. Probing, `-f`/`-O`, `create`, `create -o
//! help`, `measure`, the opener and `serve image` all read [`FORMATS`]: a
//! new format is one module that implements
//! [`FormatDriver`] and a probe, plus one row here. A
//! format QEMU knows and diskit does not read yet has a row too
//! ([`Recognised`]), so that it is refused by name and never read as raw.

use diskit_core::{Error, Result};

use crate::driver::{Format, FormatDriver, unsupported};
use crate::recognised::{self, Recognised};

/// One format of the table: its driver and its probe (kept in the
/// format's module).
pub struct Row {
    /// The driver.
    pub driver: &'static dyn FormatDriver,
    /// Scores the first bytes of an image (at most
    /// [`PROBE_BYTES`](crate::probe::PROBE_BYTES)) and its name, as QEMU
    /// scores them: 0 is "not this format", 100 is certain.
    pub probe: fn(&[u8], &str) -> u32,
}

impl Row {
    /// The row of `driver`, probed by `probe`.
    pub const fn new(driver: &'static dyn FormatDriver, probe: fn(&[u8], &str) -> u32) -> Row {
        Row { driver, probe }
    }
}

/// Every format, in QEMU's order where probe scores tie; raw (which
/// scores 1 for anything) last.
pub static FORMATS: &[Row] = &[
    Row::new(
        &crate::qcow2::driver::Qcow2Driver,
        crate::qcow2::driver::probe,
    ),
    Row::new(&Recognised("qcow"), recognised::qcow1),
    Row::new(&crate::qed::QedDriver, crate::qed::probe),
    Row::new(&crate::vmdk::VmdkDriver, crate::vmdk::probe),
    Row::new(&crate::vhdx::VhdxDriver, crate::vhdx::probe),
    Row::new(&crate::vpc::VpcDriver, crate::vpc::probe),
    Row::new(&crate::vdi::VdiDriver, crate::vdi::probe),
    Row::new(&crate::luks::LuksDriver, crate::luks::probe),
    Row::new(&Recognised("parallels"), recognised::parallels),
    Row::new(&Recognised("bochs"), recognised::bochs),
    Row::new(&Recognised("cloop"), recognised::cloop),
    Row::new(&Recognised("dmg"), recognised::dmg),
    Row::new(&crate::raw::RawDriver, crate::raw::probe),
    Row::new(
        &crate::host_device::HostDeviceDriver,
        crate::host_device::probe,
    ),
];

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
        Format::all().find(|f| f.name() == name)
    }

    /// Every format of the table.
    pub fn all() -> impl Iterator<Item = Format> {
        FORMATS.iter().map(|row| Format(row.driver))
    }
}
