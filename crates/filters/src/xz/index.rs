//! The map of an .xz file: where each block lies, compressed and
//! uncompressed, read from the stream footers and indexes at the end of
//! each stream (the xz file format, version 1.2.1).
//!
//! A file is one or more streams, each followed by stream padding (a
//! multiple of 4 zero bytes). A stream is a 12-byte header, its blocks,
//! an index listing each block's unpadded and uncompressed sizes, and a
//! 12-byte footer whose backward size locates the index. The file is read
//! backwards from its end, stream by stream, as `xz --list` does. Every
//! field is checked before it is used (magic bytes, CRC32s, reserved bits,
//! variable-length integers in their shortest form, sizes that add up to
//! the stream's own), and what would take memory is bounded: an index
//! larger than [`MAX_INDEX`] bytes or more than [`MAX_STREAMS`] streams is
//! refused, so hostile input costs neither a panic nor unbounded memory.

use diskit_core::{Error, Result};

/// The stream header's magic bytes.
const HEADER_MAGIC: [u8; 6] = [0xfd, b'7', b'z', b'X', b'Z', 0];
/// The stream footer's magic bytes.
const FOOTER_MAGIC: [u8; 2] = [b'Y', b'Z'];
/// Bytes in a stream header, and in a stream footer.
pub const HEADER: u64 = 12;
/// The largest index read, in bytes (a few bytes per block: millions of
/// blocks).
pub const MAX_INDEX: u64 = 16 << 20;
/// The most streams followed in one file.
pub const MAX_STREAMS: usize = 1 << 16;
/// The largest value of a variable-length integer (2^63 - 1).
const VLI_MAX: u64 = u64::MAX / 2;
/// The smallest unpadded size of a block (header, one byte, no check).
const UNPADDED_MIN: u64 = 5;

/// One non-empty block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// Where its bytes start in the uncompressed data.
    pub start: u64,
    /// How many bytes it decompresses to.
    pub size: u64,
    /// Where the block (its header) starts in the file.
    pub offset: u64,
    /// Its length in the file without the block padding: header,
    /// compressed data and check.
    pub unpadded: u64,
    /// The stream it belongs to (an index into [`Index::streams`]).
    pub stream: usize,
}

impl Block {
    /// Its length in the file, block padding included.
    pub fn padded(&self) -> u64 {
        round4(self.unpadded)
    }
}

/// The blocks of a file, in order, and the headers of its streams.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Index {
    /// The non-empty blocks, by uncompressed offset.
    pub blocks: Vec<Block>,
    /// Each stream's header (magic, flags, CRC32), as the file holds it.
    pub streams: Vec<[u8; HEADER as usize]>,
    /// The uncompressed size of the whole file.
    pub size: u64,
}

impl Index {
    /// The block holding uncompressed byte `offset` (`None` past the end).
    pub fn find(&self, offset: u64) -> Option<usize> {
        let i = self.blocks.partition_point(|b| b.start + b.size <= offset);
        (i < self.blocks.len()).then_some(i)
    }

    /// The uncompressed size of the largest block.
    pub fn largest_block(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).max().unwrap_or(0)
    }
}

/// An error about a malformed file.
fn bad(why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("xz: {why}"))
}

/// `n` rounded up to a multiple of 4 (`n` is at most [`VLI_MAX`]).
fn round4(n: u64) -> u64 {
    (n + 3) & !3
}

/// The bytes a block's check takes for the stream flags' check type.
fn check_size(flags: [u8; 2]) -> u64 {
    match flags[1] & 0x0f {
        0 => 0,
        1..=3 => 4,
        4..=6 => 8,
        7..=9 => 16,
        10..=12 => 32,
        _ => 64,
    }
}

/// Checks the stream flags: the reserved bits are zero.
fn check_flags(flags: [u8; 2], what: &str) -> Result<()> {
    if flags[0] != 0 || flags[1] & 0xf0 != 0 {
        return Err(bad(format!("unsupported {what} flags")));
    }
    Ok(())
}

/// Reads the map of the .xz file of `size` bytes that `read` reads.
pub fn parse(read: &dyn Fn(u64, &mut [u8]) -> Result<()>, size: u64) -> Result<Index> {
    if size < 2 * HEADER {
        return Err(bad("not an xz file (too short)"));
    }
    let mut magic = [0u8; 6];
    read(0, &mut magic)?;
    if magic != HEADER_MAGIC {
        return Err(bad("not an xz file"));
    }
    if !size.is_multiple_of(4) {
        return Err(bad("not an xz file: size is not a multiple of 4 bytes"));
    }
    // Streams from the last to the first.
    let mut streams: Vec<Stream> = Vec::new();
    let mut pos = size;
    // What is left of MAX_INDEX for the indexes still to read.
    let mut index_budget = MAX_INDEX;
    while pos > 0 {
        let mut footer = [0u8; HEADER as usize];
        if pos < HEADER {
            return Err(bad(format!("corrupted file at {pos}")));
        }
        read(pos - HEADER, &mut footer)?;
        if footer[8..12] == [0; 4] {
            pos = skip_padding(read, pos)?;
            continue;
        }
        if streams.len() == MAX_STREAMS {
            return Err(bad(format!("more than {MAX_STREAMS} streams")));
        }
        pos -= HEADER;
        let one = stream(read, pos, &footer, &mut index_budget)?;
        pos = one.start;
        streams.push(one);
    }
    let mut index = Index::default();
    for (n, Stream { header, blocks, .. }) in streams.into_iter().rev().enumerate() {
        index.streams.push(header);
        for (offset, unpadded, usize_) in blocks {
            let start = index.size;
            index.size = start
                .checked_add(usize_)
                .filter(|&s| s <= VLI_MAX)
                .ok_or_else(|| bad("uncompressed size too large"))?;
            if usize_ > 0 {
                index.blocks.push(Block {
                    start,
                    size: usize_,
                    offset,
                    unpadded,
                    stream: n,
                });
            }
        }
    }
    Ok(index)
}

/// Where the stream padding that ends at `pos` (a multiple of 4) starts:
/// zero words are skipped, read a piece at a time.
fn skip_padding(read: &dyn Fn(u64, &mut [u8]) -> Result<()>, mut pos: u64) -> Result<u64> {
    let mut buf = vec![0u8; 64 << 10];
    while pos > 0 {
        let n = pos.min(buf.len() as u64);
        let piece = &mut buf[..n as usize];
        read(pos - n, piece)?;
        let zeros = piece.iter().rev().take_while(|&&b| b == 0).count() as u64 / 4 * 4;
        pos -= zeros;
        if zeros < n {
            break;
        }
    }
    Ok(pos)
}

/// One stream, as read from its footer back.
struct Stream {
    header: [u8; HEADER as usize],
    /// Its blocks: file offset, unpadded size, uncompressed size.
    blocks: Vec<(u64, u64, u64)>,
    /// Where it starts in the file.
    start: u64,
}

/// Reads the stream whose footer (`footer`) starts at `pos`, taking its
/// index's bytes from `budget`.
fn stream(
    read: &dyn Fn(u64, &mut [u8]) -> Result<()>,
    pos: u64,
    footer: &[u8; 12],
    budget: &mut u64,
) -> Result<Stream> {
    if footer[10..12] != FOOTER_MAGIC {
        return Err(bad("invalid stream footer (no magic bytes)"));
    }
    if crc32fast::hash(&footer[4..10]).to_le_bytes() != footer[0..4] {
        return Err(bad("invalid stream footer (CRC32 mismatch)"));
    }
    let flags = [footer[8], footer[9]];
    check_flags(flags, "stream footer")?;
    let backward = (u64::from(u32::from_le_bytes([
        footer[4], footer[5], footer[6], footer[7],
    ])) + 1)
        * 4;
    *budget = budget.checked_sub(backward).ok_or_else(|| {
        bad(format!(
            "index of {backward} bytes is too large (at most {MAX_INDEX} in all)"
        ))
    })?;
    let index_pos = pos
        .checked_sub(backward)
        .filter(|&p| p >= HEADER)
        .ok_or_else(|| bad("invalid stream footer (index before the start of the file)"))?;
    let mut raw = vec![0u8; backward as usize];
    read(index_pos, &mut raw)?;
    let records = records(&raw)?;
    let check = check_size(flags);
    let mut blocks_len = 0u64;
    for &(unpadded, _) in &records {
        if unpadded < UNPADDED_MIN + check {
            return Err(bad("invalid index (block too small)"));
        }
        blocks_len = blocks_len
            .checked_add(round4(unpadded))
            .ok_or_else(|| bad("invalid index (blocks too large)"))?;
    }
    let start = index_pos
        .checked_sub(blocks_len)
        .and_then(|p| p.checked_sub(HEADER))
        .ok_or_else(|| bad("invalid index (blocks before the start of the file)"))?;
    let mut header = [0u8; HEADER as usize];
    read(start, &mut header)?;
    if header[0..6] != HEADER_MAGIC {
        return Err(bad(format!("invalid stream header at {start}")));
    }
    if crc32fast::hash(&header[6..8]).to_le_bytes() != header[8..12] {
        return Err(bad("invalid stream header (CRC32 mismatch)"));
    }
    if header[6..8] != flags {
        return Err(bad("header and footer of stream are not equal"));
    }
    let mut offset = start + HEADER;
    let blocks = records
        .into_iter()
        .map(|(unpadded, usize_)| {
            let b = (offset, unpadded, usize_);
            offset += round4(unpadded);
            b
        })
        .collect();
    Ok(Stream {
        header,
        blocks,
        start,
    })
}

/// The records (unpadded size, uncompressed size) of an index, checked
/// whole: indicator, count, records, padding and CRC32.
pub fn records(raw: &[u8]) -> Result<Vec<(u64, u64)>> {
    let invalid = || bad("invalid index");
    if raw.len() < 8 || !raw.len().is_multiple_of(4) || raw[0] != 0 {
        return Err(invalid());
    }
    let (body, crc) = raw.split_at(raw.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(bad("invalid index (CRC32 mismatch)"));
    }
    let mut at = 1;
    let count = vli(body, &mut at).ok_or_else(invalid)?;
    // Each record takes at least two bytes: a count beyond that is a lie.
    if count > (body.len() as u64) / 2 {
        return Err(invalid());
    }
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let unpadded = vli(body, &mut at).ok_or_else(invalid)?;
        let usize_ = vli(body, &mut at).ok_or_else(invalid)?;
        out.push((unpadded, usize_));
    }
    // Index padding: zeros up to the CRC32, fewer than 4.
    let rest = &body[at..];
    if rest.len() >= 4 || rest.iter().any(|&b| b != 0) || !body.len().is_multiple_of(4) {
        return Err(invalid());
    }
    Ok(out)
}

/// A variable-length integer at `*at` of `buf`, in its shortest form;
/// `*at` moves past it.
fn vli(buf: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..9 {
        let b = *buf.get(*at + i)?;
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            // A last byte of zero (beyond the first) is not the shortest form.
            if i > 0 && b == 0 {
                return None;
            }
            *at += i + 1;
            return (value <= VLI_MAX).then_some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A variable-length integer.
    fn enc(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// An index of `records`, with the right padding and CRC32.
    fn index(records: &[(u64, u64)]) -> Vec<u8> {
        let mut v = vec![0u8];
        enc(records.len() as u64, &mut v);
        for &(u, s) in records {
            enc(u, &mut v);
            enc(s, &mut v);
        }
        while v.len() % 4 != 0 {
            v.push(0);
        }
        let crc = crc32fast::hash(&v);
        v.extend_from_slice(&crc.to_le_bytes());
        v
    }

    #[test]
    fn variable_length_integers() {
        for v in [0, 1, 127, 128, 300, 1 << 35, VLI_MAX] {
            let mut b = Vec::new();
            enc(v, &mut b);
            let mut at = 0;
            assert_eq!(vli(&b, &mut at), Some(v));
            assert_eq!(at, b.len());
        }
        // Not the shortest form, too long, cut short.
        assert_eq!(vli(&[0x80, 0x00], &mut 0), None);
        assert_eq!(vli(&[0xff; 10], &mut 0), None);
        assert_eq!(vli(&[0x80], &mut 0), None);
    }

    #[test]
    fn indexes_are_checked_whole() {
        let good = index(&[(100, 1000), (40, 4096)]);
        assert_eq!(records(&good).unwrap(), vec![(100, 1000), (40, 4096)]);
        let mut crc = good.clone();
        crc[2] ^= 1;
        assert!(records(&crc).unwrap_err().to_string().contains("CRC32"));
        // A count larger than the bytes could hold.
        let mut lie = vec![0u8];
        enc(1 << 40, &mut lie);
        lie.resize(8, 0);
        let c = crc32fast::hash(&lie[..4]);
        lie[4..].copy_from_slice(&c.to_le_bytes());
        assert!(records(&lie).is_err());
        assert!(records(&[]).is_err());
        assert!(records(&[1, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn a_file_xz_made_is_mapped() {
        // `printf 'hello\n' | xz -C crc32 | od -An -tx1`
        let file: [u8; 60] = [
            0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00, 0x00, 0x01, 0x69, 0x22, 0xde, 0x36, 0x02, 0x00,
            0x21, 0x01, 0x16, 0x00, 0x00, 0x00, 0x74, 0x2f, 0xe5, 0xa3, 0x01, 0x00, 0x05, 0x68,
            0x65, 0x6c, 0x6c, 0x6f, 0x0a, 0x00, 0x00, 0x00, 0x20, 0x30, 0x3a, 0x36, 0x00, 0x01,
            0x1a, 0x06, 0xc5, 0xea, 0xc8, 0x79, 0x90, 0x42, 0x99, 0x0d, 0x01, 0x00, 0x00, 0x00,
            0x00, 0x01, 0x59, 0x5a,
        ];
        let read = |off: u64, buf: &mut [u8]| -> Result<()> {
            buf.copy_from_slice(&file[off as usize..off as usize + buf.len()]);
            Ok(())
        };
        let ix = parse(&read, file.len() as u64).unwrap();
        assert_eq!(ix.size, 6);
        assert_eq!(
            ix.blocks,
            vec![Block {
                start: 0,
                size: 6,
                offset: 12,
                unpadded: 26,
                stream: 0
            }]
        );
        assert_eq!(ix.find(5), Some(0));
        assert_eq!(ix.find(6), None);
        // Truncated, padded wrongly, a byte changed in the footer.
        assert!(parse(&read, 56).is_err());
        let mut f = file;
        f[50] ^= 1;
        let read2 = |off: u64, buf: &mut [u8]| -> Result<()> {
            buf.copy_from_slice(&f[off as usize..off as usize + buf.len()]);
            Ok(())
        };
        assert!(parse(&read2, 60).is_err());
    }
}
