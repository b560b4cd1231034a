//! Compressed clusters: raw deflate with a 4 KiB window ("zlib") and zstd.
//!
//! Decompression stops as soon as one whole cluster is produced: the stored
//! size is only known to the sector, so trailing bytes may belong to the
//! next compressed cluster. Anything short of a whole cluster is an error.

use diskit_core::{Error, ErrorKind, Result};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

use super::header::CompressionType;

fn bad(kind: CompressionType, what: impl std::fmt::Display) -> Error {
    let name = match kind {
        CompressionType::Zlib => "deflate",
        CompressionType::Zstd => "zstd",
    };
    Error::new(
        ErrorKind::Io,
        format!("Could not decompress cluster ({name}: {what})"),
    )
}

/// Decompresses `input` into exactly `out.len()` bytes (one cluster).
pub fn decompress(kind: CompressionType, input: &[u8], out: &mut [u8]) -> Result<()> {
    match kind {
        CompressionType::Zlib => inflate(input, out),
        CompressionType::Zstd => unzstd(input, out),
    }
}

fn inflate(input: &[u8], out: &mut [u8]) -> Result<()> {
    let kind = CompressionType::Zlib;
    let mut d = Decompress::new_with_window_bits(false, 12);
    loop {
        let before = (d.total_in(), d.total_out());
        let status = d
            .decompress(
                &input[d.total_in() as usize..],
                &mut out[d.total_out() as usize..],
                FlushDecompress::Finish,
            )
            .map_err(|e| bad(kind, e))?;
        if d.total_out() as usize == out.len() {
            return Ok(());
        }
        match status {
            Status::StreamEnd => return Err(bad(kind, "stream ends before the cluster does")),
            _ if (d.total_in(), d.total_out()) == before => {
                return Err(bad(kind, "truncated stream"));
            }
            _ => {}
        }
    }
}

fn unzstd(input: &[u8], out: &mut [u8]) -> Result<()> {
    let kind = CompressionType::Zstd;
    let mut dctx = zstd::zstd_safe::DCtx::create();
    let mut inb = zstd::zstd_safe::InBuffer::around(input);
    let mut outb = zstd::zstd_safe::OutBuffer::around(out);
    loop {
        let (in_before, out_before) = (inb.pos(), outb.pos());
        let hint = dctx
            .decompress_stream(&mut outb, &mut inb)
            .map_err(|code| bad(kind, zstd::zstd_safe::get_error_name(code)))?;
        if outb.pos() == outb.capacity() {
            return Ok(());
        }
        if inb.pos() == input.len() {
            // Input used up with the cluster not yet full.
            return Err(bad(
                kind,
                if hint == 0 {
                    "frames end before the cluster does"
                } else {
                    "unfinished frame"
                },
            ));
        }
        if (inb.pos(), outb.pos()) == (in_before, out_before) {
            return Err(bad(kind, "no progress"));
        }
    }
}

/// Compresses one cluster. Returns `None` when the result would not be
/// smaller than the cluster (the cluster is then stored uncompressed).
pub fn compress(kind: CompressionType, input: &[u8]) -> Result<Option<Vec<u8>>> {
    let budget = input.len() - 1;
    match kind {
        CompressionType::Zlib => {
            let mut c = Compress::new_with_window_bits(Compression::default(), false, 12);
            let mut out = vec![0u8; budget];
            let status = c
                .compress(input, &mut out, FlushCompress::Finish)
                .map_err(|e| Error::new(ErrorKind::Io, format!("deflate failed: {e}")))?;
            if status != Status::StreamEnd {
                return Ok(None);
            }
            out.truncate(c.total_out() as usize);
            Ok(Some(out))
        }
        CompressionType::Zstd => {
            let mut out = vec![0u8; budget];
            match zstd::bulk::compress_to_buffer(input, &mut out, 0) {
                Ok(n) => {
                    out.truncate(n);
                    Ok(Some(out))
                }
                // Did not fit in the budget.
                Err(_) => Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| ((i * 7) % 251) as u8 ^ (i / 300) as u8)
            .collect()
    }

    #[test]
    fn round_trip_both_kinds_with_trailing_garbage() {
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let data = sample(65536);
            let mut c = compress(kind, &data).unwrap().expect("compressible");
            // The stored size is rounded to sectors: junk may follow.
            c.extend_from_slice(&[0xAA; 700]);
            let mut out = vec![0u8; 65536];
            decompress(kind, &c, &mut out).unwrap();
            assert_eq!(out, data);
        }
    }

    #[test]
    fn incompressible_data_is_not_compressed() {
        let mut x: u64 = 0x1234_5678;
        let data: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            assert!(compress(kind, &data).unwrap().is_none());
        }
    }

    #[test]
    fn bad_streams_are_errors_not_panics() {
        let data = sample(65536);
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let c = compress(kind, &data).unwrap().unwrap();
            let mut out = vec![0u8; 65536];
            // Truncated.
            assert!(decompress(kind, &c[..c.len() / 2], &mut out).is_err());
            // Garbage.
            assert!(decompress(kind, &[0xff; 300], &mut out).is_err());
            // Empty.
            assert!(decompress(kind, &[], &mut out).is_err());
            // A stream for a smaller cluster.
            let small = compress(kind, &data[..4096]).unwrap().unwrap();
            assert!(decompress(kind, &small, &mut out).is_err());
        }
    }
}
