//! The raw format: guest offset = file offset, so a raw image is its file.

use diskit_core::{Error, ErrorKind, Preallocation, Result, StorageRef};

use crate::creation::{Basics, FormatOptions, NewFiles, Offered, Planned};

use crate::driver::Measurement;
use crate::image_ops::FormatImage;
use crate::{Format, Measured, OptionList, Prealloc};

/// The creation options raw offers.
const OFFERED: Offered = Offered(&["size=<size>            - Virtual disk size"]);

/// Validated raw creation options.
#[derive(Debug, Clone, Default)]
pub struct RawCreateOptions {
    /// Preallocation mode text as given (validated at creation, as qemu-img does).
    pub preallocation: Option<String>,
    /// `nocow` as given (only meaningful on btrfs).
    pub nocow: Option<bool>,
    /// Extent size hint in bytes (applied where the file system supports it).
    pub extent_size_hint: Option<u64>,
    /// `nocow` as given (the "Formatting" line shows it so).
    nocow_given: Option<String>,
}

impl RawCreateOptions {
    /// Checks the option list: unknown keys and malformed values are errors.
    pub fn parse(options: &OptionList) -> Result<RawCreateOptions> {
        OFFERED.check(options)?;
        Ok(RawCreateOptions {
            preallocation: options.text("preallocation"),
            nocow: options.flag("nocow")?,
            extent_size_hint: options.size("extent_size_hint")?,
            nocow_given: options.text("nocow"),
        })
    }

    /// The preallocation mode, with qemu-img's messages for bad values.
    pub fn preallocation_mode(&self) -> Result<Preallocation> {
        match self.preallocation.as_deref() {
            None => Ok(Preallocation::Off),
            Some("metadata") => Err(Error::unsupported(
                "Unsupported preallocation mode: metadata",
            )),
            Some(p) => Preallocation::parse(p)
                .map_err(|_| Error::invalid(format!("invalid parameter value: {p}"))),
        }
    }
}

/// Creates a raw image of `size` bytes (rounded up to a whole sector, as
/// QEMU does) where `target` says. Like qemu-img, the first block is
/// written so that the image starts allocated.
pub fn create(target: &mut dyn NewFiles, size: u64, opts: &RawCreateOptions) -> Result<()> {
    let prealloc = opts.preallocation_mode()?;
    let size = size
        .checked_next_multiple_of(512)
        .ok_or_else(|| Error::invalid("Could not resize file: Invalid argument"))?;
    crate::creation::make_image(target, |dev| {
        dev.resize(size, prealloc).map_err(|e| {
            if e.kind() == ErrorKind::NoSpace && e.detail().contains("too large") {
                Error::invalid("The image size is too large for file format 'raw'")
            } else {
                e
            }
        })?;
        if prealloc != Preallocation::Full && size > 0 {
            let first = vec![0u8; dev.size().min(4096) as usize];
            dev.write_at(&first, 0, diskit_core::WriteFlags::NONE)?;
        }
        Ok(())
    })
}

/// raw's probe: anything could be a raw image, so it scores 1.
pub fn probe(_: &[u8], _: &str) -> u32 {
    1
}

/// The raw driver: the image is its storage.
pub struct RawDriver;

impl crate::driver::FormatDriver for RawDriver {
    fn name(&self) -> &'static str {
        "raw"
    }

    fn sector_sized(&self) -> bool {
        true
    }

    fn open(&self, at: crate::driver::Opening<'_>) -> Result<crate::driver::Opened> {
        let storage = at.storage;
        Ok(crate::driver::Opened {
            device: storage.clone(),
            image: std::sync::Arc::new(RawImage { storage }),
        })
    }

    fn check_create_options(&self, options: &OptionList) -> Result<()> {
        OFFERED.check(options)
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        Planned::boxed(options, RawCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("raw", with_file)
    }

    fn measure(&self, options: &OptionList, of: Measured<'_>) -> Result<Measurement> {
        OFFERED.check(options)?;
        Ok(Measurement::fixed(match of {
            Measured::Image(img) => img.virtual_size(),
            Measured::Size(size) => size.div_ceil(512) * 512,
        }))
    }
}

/// An open raw image: its storage, which resizes.
pub struct RawImage {
    storage: StorageRef,
}

impl FormatImage for RawImage {
    fn format(&self) -> Format {
        Format::RAW
    }

    fn check_resize(&self, new_size: u64, prealloc: Option<Prealloc>) -> Result<()> {
        crate::prealloc::check_plain_resize(new_size, prealloc)
    }

    fn resize(&self, new_size: u64, _shrink: bool, prealloc: Prealloc) -> Result<()> {
        crate::prealloc::resize_plain(&*self.storage, new_size, prealloc)
    }
}

impl FormatOptions for RawCreateOptions {
    fn summary(&self, _: &Basics) -> String {
        let mut out = String::new();
        if let Some(v) = &self.nocow_given {
            out.push_str(&format!(" nocow={v}"));
        }
        if let Some(v) = &self.preallocation {
            out.push_str(&format!(" preallocation={v}"));
        }
        if let Some(v) = self.extent_size_hint {
            out.push_str(&format!(" extent_size_hint={v}"));
        }
        out
    }

    fn make(&self, target: &mut dyn NewFiles, size: u64, _: &Basics) -> Result<()> {
        create(target, size, self)
    }
}
