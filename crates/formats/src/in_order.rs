//! Images written once, front to back, on storage that
//! [writes in order](diskit_core::Storage::writes_in_order) (a new S3
//! object): a byte can be written only until the writes have gone well
//! past it, except in the head the storage keeps
//! ([`rewritable_head`](diskit_core::Storage::rewritable_head)). Formats
//! append their data; the metadata they change in place as they write
//! (a block map, grain tables, a BAT) must lie in that head, or be held in
//! memory and placed at the end (qcow2's and QED's tables). An image whose
//! metadata cannot be written so is refused when it is opened, before any
//! data is written, never half way.

use diskit_core::{Error, Result, Storage};

/// Refuses to write the `format` image on `file` when `file` is written in
/// order and the metadata the image changes in place (`what`) ends at byte
/// `end`, past the head the storage keeps.
pub fn check_in_place(file: &dyn Storage, format: &str, what: &str, end: u64) -> Result<()> {
    if !file.writes_in_order() {
        return Ok(());
    }
    let head = file.rewritable_head();
    if end <= head {
        return Ok(());
    }
    Err(Error::unsupported(format!(
        "{}: cannot write this {format} image front to back: the metadata it changes in place \
         ({what}) reaches byte {end}, past the first {head} bytes, which alone can be \
         written again",
        file.location()
    )))
}
