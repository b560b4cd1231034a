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

/// Every format, in QEMU's order where probe scores tie; raw (which
/// scores 1 for anything) last.
pub static FORMATS: &[Row] = &[
    Row {
        driver: &crate::qcow2::driver::Qcow2Driver,
        probe: crate::qcow2::driver::probe,
    },
    Row {
        driver: &Recognised("qcow"),
        probe: recognised::qcow1,
    },
    Row {
        driver: &crate::qed::QedDriver,
        probe: crate::qed::probe,
    },
    Row {
        driver: &crate::vmdk::VmdkDriver,
        probe: crate::vmdk::probe,
    },
    Row {
        driver: &crate::vhdx::VhdxDriver,
        probe: crate::vhdx::probe,
    },
    Row {
        driver: &crate::vpc::VpcDriver,
        probe: crate::vpc::probe,
    },
    Row {
        driver: &crate::vdi::VdiDriver,
        probe: crate::vdi::probe,
    },
    Row {
        driver: &crate::luks::LuksDriver,
        probe: crate::luks::probe,
    },
    Row {
        driver: &Recognised("parallels"),
        probe: recognised::parallels,
    },
    Row {
        driver: &Recognised("bochs"),
        probe: recognised::bochs,
    },
    Row {
        driver: &Recognised("cloop"),
        probe: recognised::cloop,
    },
    Row {
        driver: &Recognised("dmg"),
        probe: recognised::dmg,
    },
    Row {
        driver: &crate::raw::RawDriver,
        probe: crate::raw::probe,
    },
    Row {
        driver: &crate::host_device::HostDeviceDriver,
        probe: crate::host_device::probe,
    },
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
