//! A writer that stores whole clusters compressed (`convert -c`).
//!
//! Each write is cut into clusters; every whole cluster (and the partial
//! last cluster of the image, zero padded) is compressed on the calling
//! thread, so that several copy workers compress in parallel, then stored
//! with [`Qcow2::write_compressed`]. Clusters that do not shrink, and pieces
//! of clusters, are written normally. Everything else passes through.

use std::sync::Arc;

use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Extent, Result, WriteFlags, ZeroFlags,
};

use super::Qcow2;
use super::compress::compress;

/// A qcow2 image written through compression.
pub struct CompressedWriter {
    image: Arc<Qcow2>,
}

impl CompressedWriter {
    /// Wraps an image opened for writing.
    pub fn new(image: Arc<Qcow2>) -> CompressedWriter {
        CompressedWriter { image }
    }
}

impl BlockDevice for CompressedWriter {
    fn size(&self) -> u64 {
        self.image.size()
    }

    fn capabilities(&self) -> Capabilities {
        self.image.capabilities()
    }

    fn block_size(&self) -> BlockSizeLimits {
        self.image.block_size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.image.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        let cs = self.image.geometry().cluster_size();
        let size = self.size();
        let kind = self.image.header().compression_type;
        let mut done = 0usize;
        let mut padded = Vec::new();
        while done < buf.len() {
            let g = offset + done as u64;
            let in_cluster = g % cs;
            let n = ((cs - in_cluster) as usize).min(buf.len() - done);
            let piece = &buf[done..done + n];
            let whole = in_cluster == 0 && (n as u64 == cs || g + n as u64 == size);
            if !whole {
                self.image.write_at(piece, g, WriteFlags::NONE)?;
            } else {
                let cluster: &[u8] = if n as u64 == cs {
                    piece
                } else {
                    padded.clear();
                    padded.extend_from_slice(piece);
                    padded.resize(cs as usize, 0);
                    &padded
                };
                match compress(kind, cluster)? {
                    Some(stream) => self.image.write_compressed(g, &stream, piece)?,
                    None => self.image.write_at(piece, g, WriteFlags::NONE)?,
                }
            }
            done += n;
        }
        if flags.fua {
            self.image.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.image.write_zeroes(offset, len, flags)
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.image.trim(offset, len, flags)
    }

    fn flush(&self) -> Result<()> {
        self.image.flush()
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.image.extents(offset, len)
    }

    fn describe(&self) -> String {
        self.image.describe()
    }
}
