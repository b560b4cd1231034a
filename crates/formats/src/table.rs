//! The one table of formats. Probing, `-f`/`-O`, `create`, `create -o
//! help`, `measure`, the opener and `serve image` all read [`FORMATS`]: a
//! new format is one module that implements
//! [`FormatDriver`] plus one row here. A
//! format QEMU knows and diskit does not read yet has a row too
//! ([`Recognised`]), so that it is refused by name and never read as raw.

use diskit_core::{Error, Result};

use crate::driver::{Format, FormatDriver, unsupported};

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

    /// Every format of the table.
    pub fn all() -> impl Iterator<Item = Format> {
        FORMATS.iter().map(|d| Format(*d))
    }
}
