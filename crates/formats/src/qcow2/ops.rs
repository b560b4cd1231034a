//! qcow2 behind the format-neutral [`FormatImage`] interface: each
//! operation delegates to the module that implements it.

use std::sync::Arc;

use diskit_core::{BlockDevice, DeviceRef, Result, StorageRef};

use super::Qcow2;
use super::amend::Amend;
use super::bitmap;
use super::bitmap_bits::{Bits, read_bits};
use super::compressed::CompressedWriter;
use super::empty::{can_empty_completely, empty_completely};
use super::header::{Header, ext};
use super::open::read_header;
use crate::image_ops::NewBitmap;
use crate::image_ops::{AfterClose, BitmapInfo, FormatImage};
use crate::implied::{Named, Role};
use crate::info::{FormatInfo, SnapshotInfo};
use crate::{Format, OptionList, Prealloc};

/// An open qcow2 image and the storage it was opened on.
pub struct Qcow2Image {
    image: Arc<Qcow2>,
    file: StorageRef,
}

impl Qcow2Image {
    /// Wraps `image`, opened on `file`.
    pub fn new(image: Arc<Qcow2>, file: StorageRef) -> Qcow2Image {
        Qcow2Image { image, file }
    }

    /// The qcow2 image itself.
    pub fn qcow2(&self) -> &Arc<Qcow2> {
        &self.image
    }

    /// The header as it is in the file now (snapshots and bitmaps taken
    /// since the image was opened included).
    fn header_now(&self) -> Result<Header> {
        read_header(&*self.file)
    }

    /// The bitmaps of the image as stored.
    fn stored_bitmaps(&self) -> Result<Vec<bitmap::Bitmap>> {
        Ok(bitmap::read(&self.file, &self.header_now()?)?.1)
    }
}

impl FormatImage for Qcow2Image {
    fn format(&self) -> Format {
        Format::QCOW2
    }

    fn implied_names(&self) -> Vec<Named> {
        let h = self.image.header();
        let mut v = Vec::new();
        if let Some(b) = &h.backing_file {
            v.push(Named {
                role: Role::Backing,
                name: b.clone(),
                format: h.backing_format(),
            });
        }
        if let Some(e) = h.extension(ext::DATA_FILE) {
            v.push(Named {
                role: Role::DataFile,
                name: String::from_utf8_lossy(&e.data).into_owned(),
                format: None,
            });
        }
        v
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        super::info::read(&self.file, &self.header_now()?).map(Some)
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.image.geometry().cluster_size())
    }

    fn subcluster_size(&self) -> Option<u64> {
        Some(self.image.geometry().subcluster_size())
    }

    fn external_data(&self) -> Option<String> {
        self.image
            .data_is_external()
            .then(|| self.image.data_location().to_string())
    }

    fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        if self.image.data_is_external() {
            // QEMU lists no snapshots for images with an external data file.
            return Ok(Vec::new());
        }
        let list = super::snapshot::read(&self.file, &self.header_now()?)?;
        Ok(list.iter().map(super::info::snapshot_info).collect())
    }

    fn create_snapshot(&self, name: &str, date_sec: u32, date_nsec: u32) -> Result<()> {
        self.image
            .create_snapshot(name, date_sec, date_nsec)
            .map(drop)
    }

    fn apply_snapshot(&self, id_or_name: &str) -> Result<()> {
        self.image.apply_snapshot(id_or_name)
    }

    fn delete_snapshot(&self, id_or_name: &str) -> Result<()> {
        self.image.delete_snapshot(id_or_name)
    }

    fn bitmaps(&self) -> Result<Vec<BitmapInfo>> {
        Ok(self
            .stored_bitmaps()?
            .iter()
            .enumerate()
            .map(|(index, b)| BitmapInfo {
                index,
                name: b.display_name(),
                granularity: b.granularity(),
                in_use: b.in_use(),
                auto: b.auto(),
            })
            .collect())
    }

    fn bitmap_bits(&self, b: &BitmapInfo) -> Result<Bits> {
        let list = self.stored_bitmaps()?;
        let stored = list
            .get(b.index)
            .ok_or_else(|| diskit_core::Error::invalid(format!("no bitmap '{}'", b.name)))?;
        let cs = self.image.geometry().cluster_size();
        read_bits(&self.file, cs, stored, self.image.size())
    }

    fn stores_bitmaps(&self) -> bool {
        self.image.header().version >= 3
    }

    fn add_bitmaps(&self, new: Vec<NewBitmap>) -> Result<()> {
        self.image.add_bitmaps(new)
    }

    fn edit_bitmaps(&self, edits: Vec<crate::image_ops::BitmapEdit>) -> Result<()> {
        self.image.edit_bitmaps(edits)
    }

    fn compressed_writer(self: Arc<Self>) -> Result<(DeviceRef, u64)> {
        if self.image.encrypted() {
            return Err(diskit_core::Error::unsupported(
                "Compression and encryption not supported at the same time",
            ));
        }
        let cs = self.image.geometry().cluster_size();
        Ok((Arc::new(CompressedWriter::new(self.image.clone())), cs))
    }

    fn amend(&self, options: &OptionList, force: bool) -> Result<()> {
        let mut a = Amend::parse(options)?;
        a.force = force;
        self.image.amend(&a)
    }

    fn check_resize(&self, _new_size: u64, _prealloc: Option<Prealloc>) -> Result<()> {
        Ok(())
    }

    fn resize(&self, new_size: u64, shrink: bool, prealloc: Prealloc) -> Result<()> {
        self.image.resize_with(new_size, shrink, prealloc)
    }

    fn make_empty(&self) -> Result<Option<AfterClose>> {
        if can_empty_completely(self.image.header()) {
            // Reset the file itself, once every handle on it is closed.
            let file = self.file.clone();
            Ok(Some(Box::new(move || empty_completely(&*file))))
        } else {
            self.image.discard_everything()?;
            Ok(None)
        }
    }
}
