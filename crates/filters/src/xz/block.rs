//! Decompressing one block of an .xz file with liblzma.
//!
//! liblzma's stream decoder is given the block's stream header, then the
//! block itself (header, compressed data, padding, check) as the index
//! places it, read from the device below a piece at a time: it decodes
//! the block header and its filter chain, decompresses, and verifies the
//! check. The block must then have decompressed to exactly the size the
//! index gives, and all its bytes must have been consumed; the output
//! never grows past that size, whatever the data says.

use diskit_core::{BlockDevice, Error, Result};
use liblzma::stream::{Action, Stream};

use super::index::Index;

/// How much of the compressed block is read from below at once.
const PIECE: u64 = 1 << 20;

/// Decompresses block `i` of `index`, read from `below`, into `out` (its
/// old contents dropped, its allocation kept when large enough), with at
/// most `memlimit` bytes of decoder memory.
pub fn decode(
    index: &Index,
    i: usize,
    below: &dyn BlockDevice,
    memlimit: u64,
    mut out: Vec<u8>,
) -> Result<Vec<u8>> {
    let b = index.blocks[i];
    let fail = |why: String| {
        Error::new(
            diskit_core::ErrorKind::Io,
            format!("xz: block {i} at offset {} of the file: {why}", b.offset),
        )
    };
    let size = usize::try_from(b.size).map_err(|_| fail("too large".into()))?;
    out.clear();
    out.reserve_exact(size);
    let lzma = |e: liblzma::stream::Error| match e {
        liblzma::stream::Error::MemLimit => fail(format!(
            "needs more than {memlimit} bytes of decoder memory (raise xz-max-block)"
        )),
        e => fail(format!("corrupt data ({e})")),
    };
    let mut stream = Stream::new_stream_decoder(memlimit, 0).map_err(lzma)?;
    stream
        .process_vec(&index.streams[b.stream], &mut out, Action::Run)
        .map_err(lzma)?;
    let mut piece = vec![0u8; PIECE.min(b.padded()) as usize];
    let end = b.offset + b.padded();
    let mut at = b.offset;
    while at < end {
        let n = (end - at).min(PIECE) as usize;
        below.read_at(&mut piece[..n], at)?;
        let mut input = &piece[..n];
        while !input.is_empty() {
            let before = stream.total_in();
            stream
                .process_vec(input, &mut out, Action::Run)
                .map_err(lzma)?;
            let used = (stream.total_in() - before) as usize;
            if used == 0 {
                return Err(fail(format!(
                    "decompresses to more than the {size} bytes the index says"
                )));
            }
            input = &input[used..];
        }
        at += n as u64;
    }
    if out.len() != size {
        return Err(fail(format!(
            "decompresses to {} bytes, the index says {size}",
            out.len()
        )));
    }
    Ok(out)
}
