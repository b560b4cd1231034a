//! A writer that stores whole clusters compressed (`convert -c`).
//!
//! Each write is cut into clusters; every whole cluster (and the partial
//! last cluster of the image, zero padded) is compressed on the calling
//! thread, or earlier by [`BlockDevice::prepare_write`] on the thread that
//! announced the write, so that several copy workers compress in
//! parallel while they store in guest order; then it is stored with
//! [`Qcow2Format::write_compressed`](super::device::Qcow2Format::write_compressed).
//! Clusters that do not shrink, and pieces
//! of clusters, are written normally. Everything else passes through.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use diskit_core::sync::lock;

use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Extent, Result, WriteFlags, ZeroFlags,
};

use super::Qcow2;
use super::compress::compress;

/// A qcow2 image written through compression.
pub struct CompressedWriter {
    image: Arc<Qcow2>,
    /// Clusters compressed ahead of their write ([`BlockDevice::prepare_write`]),
    /// by guest offset: the stream, or `None` where it does not shrink.
    prepared: Mutex<HashMap<u64, Option<Vec<u8>>>>,
}

impl CompressedWriter {
    /// Wraps an image opened for writing.
    pub fn new(image: Arc<Qcow2>) -> CompressedWriter {
        CompressedWriter {
            image,
            prepared: Mutex::new(HashMap::new()),
        }
    }

    /// Cuts a write of `buf` at `offset` into cluster pieces: (guest
    /// offset, piece, whether it is stored as a whole cluster: a full one,
    /// or the partial last cluster of the image).
    fn pieces<'b>(&self, buf: &'b [u8], offset: u64) -> Vec<(u64, &'b [u8], bool)> {
        let cs = self.image.geometry().cluster_size();
        let size = self.size();
        let mut out = Vec::new();
        let mut done = 0usize;
        while done < buf.len() {
            let g = offset + done as u64;
            let in_cluster = g % cs;
            let n = ((cs - in_cluster) as usize).min(buf.len() - done);
            let whole = in_cluster == 0 && (n as u64 == cs || g + n as u64 == size);
            out.push((g, &buf[done..done + n], whole));
            done += n;
        }
        out
    }

    /// Compresses a whole-cluster piece (zero padded to the cluster size).
    fn compress_piece(&self, piece: &[u8]) -> Result<Option<Vec<u8>>> {
        let cs = self.image.geometry().cluster_size() as usize;
        let kind = self.image.header().compression_type;
        if piece.len() == cs {
            compress(kind, piece)
        } else {
            let mut padded = piece.to_vec();
            padded.resize(cs, 0);
            compress(kind, &padded)
        }
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

    /// Compresses the whole clusters of a coming write now, so that
    /// writers taking turns (a copy in guest order, which lays compressed
    /// clusters out in that order, as qemu-img) compress in parallel.
    fn prepare_write(&self, buf: &[u8], offset: u64) {
        for (g, piece, whole) in self.pieces(buf, offset) {
            if !whole {
                continue;
            }
            // A failure is met again, and reported, by the write.
            if let Ok(stream) = self.compress_piece(piece) {
                lock(&self.prepared).insert(g, stream);
            }
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        for (g, piece, whole) in self.pieces(buf, offset) {
            if !whole {
                self.image.write_at(piece, g, WriteFlags::NONE)?;
                continue;
            }
            let ready = lock(&self.prepared).remove(&g);
            let stream = match ready {
                Some(s) => s,
                None => self.compress_piece(piece)?,
            };
            let stored = match stream {
                Some(stream) => {
                    let cs = self.image.geometry().cluster_size();
                    self.image
                        .with_units(g, cs, |q| q.write_compressed(g, &stream))?
                }
                None => false,
            };
            if !stored {
                self.image.write_at(piece, g, WriteFlags::NONE)?;
            }
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
