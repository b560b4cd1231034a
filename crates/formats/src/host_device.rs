//! `host_device` as a format name (`-f host_device`, `-O host_device`):
//! QEMU's protocol driver for block and character devices used as the
//! top node, that is raw bytes of an existing device. Nothing is ever
//! probed as it; "creating" one checks that the device is there and
//! large enough, as QEMU's driver does.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use diskit_core::{Error, ErrorKind, Result};

use crate::creation::{Basics, FormatOptions, NewFiles, Planned};
use crate::driver::{FormatDriver, Opened, Opening};
use crate::image_ops::FormatImage;
use crate::{Format, OptionList};

/// The driver's name.
pub const NAME: &str = "host_device";

/// The `-o` options it takes: its own (a device is no file, and takes
/// none of the file protocol's).
const CREATE_OPTIONS: &[&str] = &["size", "preallocation"];

/// The creation options host_device offers.
const OFFERED: crate::creation::Offered = crate::creation::Offered(&[
    "preallocation=<str>    - Preallocation mode (allowed values: off)",
    "size=<size>            - Virtual disk size",
]);

/// host_device's probe: never probed, only named.
pub fn probe(_: &[u8], _: &str) -> u32 {
    0
}

/// The host_device driver.
pub struct HostDeviceDriver;

/// Refuses what is not a block or character device, in QEMU's words.
fn check_device(meta: &std::fs::Metadata, name: &str) -> Result<()> {
    let t = meta.file_type();
    if t.is_block_device() || t.is_char_device() {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "'{NAME}' driver requires '{name}' to be either a character or block device"
        )))
    }
}

/// The size of the device at `path`, once it is known to be one.
fn device_size(path: &Path) -> Result<u64> {
    let name = path.display().to_string();
    let not_created = |why: String| {
        Error::invalid(format!(
            "Protocol driver '{NAME}' does not support creating new images, so an existing \
             image must be selected as the target; however, opening the given target as an \
             existing image failed: {why}"
        ))
    };
    let meta = std::fs::metadata(path).map_err(|e| {
        let e = Error::from(e);
        not_created(format!("Could not open '{name}': {}", e.detail()))
    })?;
    check_device(&meta, &name).map_err(|e| not_created(e.detail()))?;
    use std::io::Seek;
    let mut f = std::fs::File::open(path)?;
    Ok(f.seek(std::io::SeekFrom::End(0))?)
}

impl FormatDriver for HostDeviceDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let Opening { storage, .. } = at;
        let name = storage.location().to_string();
        let fd = storage.fd().ok_or_else(|| {
            Error::invalid(format!(
                "'{NAME}' driver requires '{name}' to be either a character or block device"
            ))
        })?;
        let meta = std::fs::File::from(fd.try_clone_to_owned()?).metadata()?;
        check_device(&meta, &name)?;
        Ok(Opened {
            device: storage,
            image: Arc::new(HostDeviceImage),
        })
    }

    fn check_create_options(&self, options: &OptionList) -> Result<()> {
        self.parse_create(options).map(drop)
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        options.check_known(CREATE_OPTIONS)?;
        let opts = HostDeviceOptions {
            preallocation: options.text("preallocation"),
        };
        Planned::boxed(options, opts)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("host_device", with_file)
    }
}

/// A "creation"'s own options: checked against the device.
struct HostDeviceOptions {
    preallocation: Option<String>,
}

impl FormatOptions for HostDeviceOptions {
    fn summary(&self, _: &Basics) -> String {
        match &self.preallocation {
            Some(p) => format!(" preallocation={p}"),
            None => String::new(),
        }
    }

    /// Checks that the device is there and holds the size; writes nothing.
    fn make(&self, target: &mut dyn NewFiles, size: u64, _: &Basics) -> Result<()> {
        let path = Path::new(target.name());
        if let Some(p) = self.preallocation.as_deref().filter(|p| *p != "off") {
            return Err(Error::unsupported(format!(
                "Unsupported preallocation mode '{p}'"
            )));
        }
        if size > device_size(path)? {
            return Err(Error::new(ErrorKind::NoSpace, "Cannot grow device files"));
        }
        Ok(())
    }
}

/// An open device: nothing beyond its bytes.
struct HostDeviceImage;

impl FormatImage for HostDeviceImage {
    fn format(&self) -> Format {
        Format::HOST_DEVICE
    }

    fn created_reads_as_zeros(&self) -> bool {
        // A device keeps what it held (QEMU: no zero init).
        false
    }
}
