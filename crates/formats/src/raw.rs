//! The raw format: guest offset = file offset, so a raw image is its file.

use std::path::Path;

use diskit_backends::{FileDevice, Preallocation};
use diskit_core::size::parse_size;
use diskit_core::{Error, Result};

use crate::OptionList;

/// The `-o` options raw images accept at creation.
pub const CREATE_OPTIONS: &[&str] = &["size", "preallocation"];

/// Help text for `-o help`, as qemu-img prints it for raw.
pub const CREATE_HELP: &str = "Creation options for 'raw':
  preallocation=<str (off, falloc, full)> - Preallocation mode (allowed values: off, falloc, full)
  size=<size>            - Virtual disk size
";

/// Creates a raw image; returns its size.
pub fn create(path: &Path, size: Option<u64>, options: &OptionList) -> Result<u64> {
    options.check_known(CREATE_OPTIONS, "raw")?;
    let size = match (size, options.get("size")) {
        (Some(s), _) => s,
        (None, Some(s)) => parse_size(s)?,
        (None, None) => return Err(Error::invalid("Image creation needs a size parameter")),
    };
    let prealloc = match options.get("preallocation") {
        None => Preallocation::Off,
        Some(p) => Preallocation::parse(p).map_err(|_| {
            Error::invalid(format!(
                "Parameter 'preallocation' does not accept value '{p}'"
            ))
        })?,
    };
    FileDevice::create(path, size, prealloc)?;
    Ok(size)
}

/// Parses the preallocation mode named in `options` (default off).
pub fn preallocation(options: &OptionList) -> Result<Preallocation> {
    options
        .get("preallocation")
        .map_or(Ok(Preallocation::Off), Preallocation::parse)
}
