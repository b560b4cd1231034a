//! `convert --salvage`: a source whose read errors become zeros, as in
//! qemu-img: a read that fails is tried again sector by sector, and each
//! sector that still fails reads as zeros, with a warning naming its
//! offset and the error.

use diskit_core::{BlockDevice, Extent, Filter, Result};

/// The sector reads are retried in.
const SECTOR: u64 = 512;

/// A layer over the source that reads zeros where it cannot read.
pub struct Salvage;

impl Filter for Salvage {
    fn name(&self) -> &str {
        "salvage"
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        if next.read_at(buf, offset).is_ok() {
            return Ok(());
        }
        let mut at = 0usize;
        while at < buf.len() {
            let pos = offset + at as u64;
            let n = (SECTOR - pos % SECTOR).min((buf.len() - at) as u64) as usize;
            let piece = &mut buf[at..at + n];
            if let Err(e) = next.read_at(piece, pos) {
                eprintln!(
                    "{}: warning: error while reading offset {pos}: {}",
                    crate::names::prog(),
                    e.kind().description()
                );
                piece.fill(0);
            }
            at += n;
        }
        Ok(())
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // Where the allocation cannot be read either, it is data.
        Ok(next
            .extents(offset, len)
            .unwrap_or_else(|_| vec![Extent::data(len)]))
    }
}
