//! The persistent dirty bitmaps an NBD export serves as
//! `qemu:dirty-bitmap:NAME` (qemu-nbd's `-B NAME`, the `bitmap=NAME` key
//! of `serve image`): looked up in the image, then down its backing chain,
//! as qemu-nbd looks; refused in qemu-nbd's words when missing or
//! inconsistent. Bitmaps are reached through what the image offers
//! ([`FormatImage`](diskit_formats::image_ops::FormatImage)), whatever
//! its format.

use std::sync::Arc;

use diskit_core::{Error, ErrorKind, Result};
use diskit_formats::image_ops::BitmapInfo;
use diskit_nbd::server::ExportBitmap;

use crate::Image;

/// The bitmaps `names` of `image` (or of its backing chain), in the order
/// given, to serve; the first missing or inconsistent one is the error.
/// (qemu-nbd keeps its `-B` names in the reverse order of its command
/// line: it checks, and lists, the last one first.) Only the bitmaps of
/// the image itself that are enabled take the export's writes: a write
/// changes the top image, not the files below it.
pub fn for_export(image: &Image, names: &[String]) -> Result<Vec<Arc<ExportBitmap>>> {
    let mut out: Vec<Arc<ExportBitmap>> = Vec::new();
    for name in names {
        let (layer, info) = find(image, name)?;
        if info.in_use {
            return Err(Error::invalid(format!(
                "Bitmap '{name}' is inconsistent and cannot be used"
            )));
        }
        let bits = layer.ops.bitmap_bits(&info)?;
        let enabled = info.auto && layer.depth == 0;
        out.push(Arc::new(ExportBitmap::new(name.clone(), bits, enabled)));
    }
    Ok(out)
}

/// An image of the chain and how deep it is (0: the top).
struct Layer<'a> {
    ops: &'a dyn diskit_formats::image_ops::FormatImage,
    depth: usize,
}

/// The first image of the chain that has bitmap `name`, and the bitmap.
fn find<'a>(image: &'a Image, name: &str) -> Result<(Layer<'a>, BitmapInfo)> {
    for (depth, layer) in image.chain().into_iter().enumerate() {
        let found = layer.ops.bitmaps()?.into_iter().find(|b| b.name == name);
        if let Some(info) = found {
            let layer = Layer {
                ops: layer.ops.as_ref(),
                depth,
            };
            return Ok((layer, info));
        }
    }
    Err(Error::new(
        ErrorKind::NotFound,
        format!("Bitmap '{name}' is not found"),
    ))
}
