//! A new image being planned (`create`): a format's creation options,
//! parsed from `-o` by its driver
//! ([`FormatDriver::parse_create`](crate::FormatDriver::parse_create)),
//! completed from the command line, shown, then made.

use std::path::Path;

use diskit_core::Result;

/// The creation options of one format, parsed and open to the values the
/// command line adds (size, backing file).
pub trait Creation {
    /// The virtual size, if given.
    fn size(&self) -> Option<u64>;

    /// Sets the virtual size (from the size argument or the backing file).
    fn set_size(&mut self, size: u64);

    /// The backing file, if given.
    fn backing_file(&self) -> Option<&str> {
        None
    }

    /// The backing file's format, if given.
    fn backing_format(&self) -> Option<&str> {
        None
    }

    /// Sets the backing file (formats without one ignore it: check
    /// [`Capability::BackingFile`](crate::image_ops::Capability::BackingFile)).
    fn set_backing_file(&mut self, name: &str) {
        let _ = name;
    }

    /// Sets the backing file's format.
    fn set_backing_format(&mut self, name: &str) {
        let _ = name;
    }

    /// The options of qemu-img's "Formatting" line, after `fmt=NAME`
    /// (each with its leading space).
    fn summary(&self) -> String;

    /// Makes the image at `path`.
    fn create(&self, path: &Path) -> Result<()>;
}

/// Makes a new image file at `path` with `make`, which gets the file
/// created empty: as QEMU does, a failed creation removes the file it
/// made (one that existed before stays).
pub fn create_file(
    path: &Path,
    make: impl FnOnce(&diskit_backends::FileDevice) -> Result<()>,
) -> Result<()> {
    use diskit_core::BlockDevice;
    let existed = path.exists();
    let result = diskit_backends::FileDevice::create(path, 0, diskit_backends::Preallocation::Off)
        .and_then(|dev| {
            make(&dev)?;
            dev.flush()
        });
    if result.is_err() && !existed {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// The "Formatting" line's options after the size: ` key=value` for each.
pub fn summary_of(size: Option<u64>, given: &[(String, String)]) -> String {
    let mut out = String::new();
    if let Some(s) = size {
        out += &format!(" size={s}");
    }
    for (k, v) in given {
        out += &format!(" {k}={v}");
    }
    out
}
