//! What an opened image offers beyond its guest device: the format's own
//! tools (`info`, snapshots, bitmaps, amend, resize, commit's emptying),
//! behind one format-neutral interface ([`FormatImage`]).
//!
//! Every operation has a default that fails with
//! [`ErrorKind::NotSupported`] naming the format (or gives an empty
//! answer), so a format implements what it has. Whether a format has an
//! operation at all is [`Capability`], asked of its driver
//! ([`FormatDriver::supports`](crate::FormatDriver::supports)) before
//! opening, as tools that print QEMU's own message for it need.

use std::sync::Arc;

use diskit_core::{DeviceRef, Error, ErrorKind, Result};

use crate::implied::Named;
use crate::info::{FormatInfo, SnapshotInfo};
use crate::{Format, OptionList, Prealloc};

pub use crate::bits::Bits;

/// An operation a format may offer beyond reading and writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Internal snapshots: list, create, apply, delete, read (`-l`).
    Snapshots,
    /// Persistent dirty bitmaps.
    Bitmaps,
    /// Writing compressed clusters (`convert -c`).
    Compression,
    /// Checking (and repairing) its metadata.
    Check,
    /// Changing its creation options (`amend`).
    Amend,
    /// A backing file.
    BackingFile,
    /// Emptying an image so that its backing file shows through (commit).
    MakeEmpty,
    /// Preallocating metadata when created or grown.
    MetadataPreallocation,
}

/// The error of an operation `what` that `format` does not offer.
pub fn unsupported_op(format: &str, what: &str) -> Error {
    Error::new(
        ErrorKind::NotSupported,
        format!("image format '{format}' does not support {what}"),
    )
}

/// One change to an image's persistent bitmaps (`qemu-img bitmap`).
#[derive(Debug, Clone)]
pub enum BitmapEdit {
    /// A new, empty, enabled bitmap; `granularity` in bytes (the image's
    /// default when `None`).
    Add {
        /// Its name.
        name: String,
        /// Bytes one bit covers.
        granularity: Option<u64>,
    },
    /// Deletes a bitmap.
    Remove(String),
    /// Clears every bit.
    Clear(String),
    /// Starts tracking writes.
    Enable(String),
    /// Stops tracking writes.
    Disable(String),
    /// Sets the bits that are set in `bits` (another bitmap's).
    Merge {
        /// The bitmap merged into.
        name: String,
        /// The bits merged in.
        bits: Bits,
    },
}

impl BitmapEdit {
    /// qemu-img's name for the operation.
    pub fn op(&self) -> &'static str {
        match self {
            BitmapEdit::Add { .. } => "add",
            BitmapEdit::Remove(_) => "remove",
            BitmapEdit::Clear(_) => "clear",
            BitmapEdit::Enable(_) => "enable",
            BitmapEdit::Disable(_) => "disable",
            BitmapEdit::Merge { .. } => "merge",
        }
    }

    /// The bitmap changed.
    pub fn name(&self) -> &str {
        match self {
            BitmapEdit::Add { name, .. } | BitmapEdit::Merge { name, .. } => name,
            BitmapEdit::Remove(n)
            | BitmapEdit::Clear(n)
            | BitmapEdit::Enable(n)
            | BitmapEdit::Disable(n) => n,
        }
    }
}

/// A persistent bitmap of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    /// Its position in the image's list (for [`FormatImage::bitmap_bits`]).
    pub index: usize,
    /// Its name, as shown.
    pub name: String,
    /// Bytes one bit covers.
    pub granularity: u64,
    /// Marked inconsistent.
    pub in_use: bool,
    /// Enabled: tracks writes.
    pub auto: bool,
}

/// A step to run on an image's file once every handle on the image is
/// closed (see [`FormatImage::make_empty`]).
pub type AfterClose = Box<dyn FnOnce() -> Result<()>>;

/// What an opened image offers beyond its guest device. Methods that
/// change the image need it opened writable.
pub trait FormatImage: Send + Sync {
    /// The image's format.
    fn format(&self) -> Format;

    /// The files the image names (backing file, data file), as stored in
    /// it, without opening any of them.
    fn implied_names(&self) -> Vec<Named> {
        Vec::new()
    }

    /// What the format adds to `info`; `None` when it adds nothing.
    fn info(&self) -> Result<Option<FormatInfo>> {
        Ok(None)
    }

    /// Whether a newly created image of this format reads as zeros where
    /// nothing was written (QEMU's has_zero_init): not so where unwritten
    /// file space decrypts to noise (LUKS).
    fn created_reads_as_zeros(&self) -> bool {
        true
    }

    /// Whether `map` shows where the image's data lives. QEMU's drivers
    /// without block status (vhdx) show the whole disk as one data extent,
    /// and so does diskit's `map` for them; the device's extents stay
    /// exact for copying.
    fn reports_allocation(&self) -> bool {
        true
    }

    /// The clusters the format allocates in, if it has any.
    fn cluster_size(&self) -> Option<u64> {
        None
    }

    /// The smallest unit of allocation, if the format allocates (subclusters).
    fn subcluster_size(&self) -> Option<u64> {
        None
    }

    /// The location of the external file that holds the guest data, if the
    /// data is not in the image's own file.
    fn external_data(&self) -> Option<String> {
        None
    }

    /// The file holding the guest data at `guest` (what a mapped host
    /// offset there points into), when it is not the image's own file:
    /// the external data file, or the extent of a disk that spans files.
    fn data_file_at(&self, guest: u64) -> Option<String> {
        let _ = guest;
        self.external_data()
    }

    /// The internal snapshots to list (none for formats without them).
    fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        Ok(Vec::new())
    }

    /// Takes an internal snapshot called `name`, dated as given.
    fn create_snapshot(&self, name: &str, date_sec: u32, date_nsec: u32) -> Result<()> {
        let _ = (name, date_sec, date_nsec);
        Err(unsupported_op(self.format().name(), "snapshots"))
    }

    /// Reverts the disk to the snapshot with id or name `id_or_name`.
    fn apply_snapshot(&self, id_or_name: &str) -> Result<()> {
        let _ = id_or_name;
        Err(unsupported_op(self.format().name(), "snapshots"))
    }

    /// Deletes the snapshot with id or name `id_or_name`.
    fn delete_snapshot(&self, id_or_name: &str) -> Result<()> {
        let _ = id_or_name;
        Err(unsupported_op(self.format().name(), "snapshots"))
    }

    /// The persistent bitmaps stored in the image.
    fn bitmaps(&self) -> Result<Vec<BitmapInfo>> {
        Ok(Vec::new())
    }

    /// The bits of bitmap `b` (one of [`Self::bitmaps`]).
    fn bitmap_bits(&self, b: &BitmapInfo) -> Result<Bits> {
        let _ = b;
        Err(unsupported_op(self.format().name(), "bitmaps"))
    }

    /// Whether new bitmaps can be stored in this image.
    fn stores_bitmaps(&self) -> bool {
        false
    }

    /// Adds bitmaps (new names only).
    fn add_bitmaps(&self, new: Vec<NewBitmap>) -> Result<()> {
        let _ = new;
        Err(unsupported_op(self.format().name(), "bitmaps"))
    }

    /// Applies `edits` in order; if one fails, none is stored, and the
    /// error names the operation and the bitmap, as qemu-img's do.
    fn edit_bitmaps(&self, edits: Vec<BitmapEdit>) -> Result<()> {
        let _ = edits;
        Err(unsupported_op(self.format().name(), "bitmaps"))
    }

    /// A device that writes whole clusters compressed, and the cluster size.
    fn compressed_writer(self: Arc<Self>) -> Result<(DeviceRef, u64)> {
        Err(unsupported_op(self.format().name(), "compression"))
    }

    /// Whether every write must be whole clusters written once, as
    /// through [`compressed_writer`](Self::compressed_writer) (a
    /// streamOptimized vmdk): convert then writes that way.
    fn needs_compressed_writes(&self) -> bool {
        false
    }

    /// Checks the open image (formats whose driver checks the opened
    /// image rather than its file: see `FormatDriver::check_opens_image`).
    fn check(&self, repair: crate::check::Repair) -> Result<crate::check::CheckReport> {
        let _ = repair;
        Err(unsupported_op(self.format().name(), "checks"))
    }

    /// Changes the image's options (`amend -o`); checked first with
    /// [`FormatDriver::check_amend_options`](crate::FormatDriver::check_amend_options).
    /// With `force`, changes qemu-img guards behind `--force` go ahead
    /// (overwriting or erasing the last LUKS key slots).
    fn amend(&self, options: &OptionList, force: bool) -> Result<()> {
        let _ = (options, force);
        Err(unsupported_op(self.format().name(), "option amendment"))
    }

    /// Checks a new virtual size before any other resize rule: errors the
    /// format has for `new_size` or `prealloc` whatever the current size.
    fn check_resize(&self, new_size: u64, prealloc: Option<Prealloc>) -> Result<()> {
        let _ = (new_size, prealloc);
        // qemu-img's words for a driver that cannot resize.
        Err(Error::unsupported(
            "Image format driver does not support resize",
        ))
    }

    /// Changes the virtual size; shrinking only with `shrink`; the space of
    /// a grown disk reserved as `prealloc` says.
    fn resize(&self, new_size: u64, shrink: bool, prealloc: Prealloc) -> Result<()> {
        let _ = (new_size, shrink, prealloc);
        Err(unsupported_op(self.format().name(), "resizing"))
    }

    /// Empties the image: afterwards it reads as its backing file (what
    /// commit does). When emptying rewrites the file, nothing is done yet
    /// and the step to run once every handle on the image is closed comes
    /// back.
    fn make_empty(&self) -> Result<Option<AfterClose>> {
        Err(unsupported_op(self.format().name(), "emptying"))
    }
}

/// A request to add a bitmap (`convert --bitmaps`).
pub struct NewBitmap {
    /// Name.
    pub name: String,
    /// Whether it tracks writes.
    pub enabled: bool,
    /// Its bits.
    pub bits: Bits,
}
