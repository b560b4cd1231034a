//! Local files as raw bytes, for copiers (`diskit copy`, nbdcopy's
//! semantics): a source held as one (the command never writes it, by any
//! name), a destination taken over with a writer's locks, and a sink that
//! discards.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use diskit_backends::{FileDevice, NullDevice};
use diskit_core::StorageOptions;
use diskit_core::{DeviceRef, Result, StorageRef};

/// A regular file or block device read as raw bytes, noted as a source
/// of the running command.
pub fn open_source(path: &str) -> Result<StorageRef> {
    let dev = FileDevice::open(path, StorageOptions::default())?;
    if let Some(fd) = diskit_core::Storage::fd(&dev) {
        diskit_backends::image_lock::hold_as_source(fd, path)?;
    }
    Ok(Arc::new(dev))
}

/// An open regular file or block device taken over as a destination:
/// refused if it is a source of the command, then locked as a writer
/// (QEMU's locks, held while it is open).
pub fn adopt_destination(file: File, path: &str) -> Result<StorageRef> {
    let rw = StorageOptions {
        writable: true,
        ..Default::default()
    };
    let dev = FileDevice::adopt(file, Path::new(path), rw)?;
    let (perm, unshare) = diskit_core::storage::lock::for_image(true, false);
    diskit_core::Storage::lock_image(&dev, perm, unshare)?;
    Ok(Arc::new(dev))
}

/// A device of `size` bytes that discards what is written to it.
pub fn null_sink(size: u64) -> DeviceRef {
    Arc::new(NullDevice::new(size))
}
