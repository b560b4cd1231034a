//! `convert --salvage`: a source whose read errors become zeros, as in
//! qemu-img: a read that fails is tried again sector by sector, and each
//! sector that still fails reads as zeros, with a warning naming its
//! offset and the error.

use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, Extent, FileView, Result,
};

/// The sector reads are retried in.
const SECTOR: u64 = 512;

/// A source that reads zeros where it cannot read.
pub struct Salvage(pub DeviceRef);

impl BlockDevice for Salvage {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn block_size(&self) -> BlockSizeLimits {
        self.0.block_size()
    }
    fn is_known_zero(&self) -> bool {
        self.0.is_known_zero()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.0.read_at(buf, offset).is_ok() {
            return Ok(());
        }
        let mut at = 0usize;
        while at < buf.len() {
            let pos = offset + at as u64;
            let n = (SECTOR - pos % SECTOR).min((buf.len() - at) as u64) as usize;
            let piece = &mut buf[at..at + n];
            if let Err(e) = self.0.read_at(piece, pos) {
                eprintln!(
                    "diskit: warning: error while reading offset {pos}: {}",
                    e.kind().description()
                );
                piece.fill(0);
            }
            at += n;
        }
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // Where the allocation cannot be read either, it is data.
        Ok(self
            .0
            .extents(offset, len)
            .unwrap_or_else(|_| vec![Extent::data(len)]))
    }
    fn file_view(&self, _offset: u64, _len: u64) -> Option<FileView<'_>> {
        None
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}
