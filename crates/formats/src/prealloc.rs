//! Preallocation modes, as `-o preallocation=` and `resize --preallocation`
//! name them.

use diskit_core::{Error, Preallocation, Result, Storage};

/// How an image's space is reserved when it is created or grown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prealloc {
    /// Nothing beyond the format's own tables.
    #[default]
    Off,
    /// Metadata for the whole disk, data clusters allocated but not written
    /// (formats with metadata only).
    Metadata,
    /// Like metadata, with the data space reserved by fallocate.
    Falloc,
    /// Like metadata, with the data space written with zeros.
    Full,
}

impl Prealloc {
    /// The mode called `s` (off, metadata, falloc, full).
    pub fn parse(s: &str) -> Option<Prealloc> {
        match s {
            "off" => Some(Prealloc::Off),
            "metadata" => Some(Prealloc::Metadata),
            "falloc" => Some(Prealloc::Falloc),
            "full" => Some(Prealloc::Full),
            _ => None,
        }
    }

    /// qemu-img's name for the mode.
    pub fn name(self) -> &'static str {
        match self {
            Prealloc::Off => "off",
            Prealloc::Metadata => "metadata",
            Prealloc::Falloc => "falloc",
            Prealloc::Full => "full",
        }
    }

    /// The same mode for plain storage, which has no metadata (`None` for
    /// [`Prealloc::Metadata`]).
    pub fn for_storage(self) -> Option<Preallocation> {
        match self {
            Prealloc::Off => Some(Preallocation::Off),
            Prealloc::Metadata => None,
            Prealloc::Falloc => Some(Preallocation::Falloc),
            Prealloc::Full => Some(Preallocation::Full),
        }
    }
}

/// `resize`'s checks for an image whose guest data is plain storage (raw,
/// a LUKS payload): no metadata to preallocate, and a positive size.
pub fn check_plain_resize(new_size: u64, prealloc: Option<Prealloc>) -> Result<()> {
    if prealloc == Some(Prealloc::Metadata) {
        return Err(metadata_unsupported());
    }
    if new_size == 0 || new_size > i64::MAX as u64 {
        return Err(Error::invalid("New image size must be positive"));
    }
    Ok(())
}

/// Resizes plain storage to `len` bytes, preallocated as `prealloc` says.
pub fn resize_plain(storage: &dyn Storage, len: u64, prealloc: Prealloc) -> Result<()> {
    let mode = prealloc.for_storage().ok_or_else(metadata_unsupported)?;
    storage.resize(len, mode)
}

fn metadata_unsupported() -> Error {
    Error::unsupported("Unsupported preallocation mode: metadata")
}
