//! Persistent dirty bitmaps: the bitmaps header extension and the bitmap
//! directory, parsed and validated with QEMU's limits (for listing; the
//! bitmap tables and data are not read here).
//!
//! As in QEMU, the extension only counts when autoclear bit 0 is set: a
//! program that does not know bitmaps clears the bit when it writes, and
//! the bitmaps it may have made stale are then ignored.

use diskit_core::Storage;
use diskit_core::{Error, Result};

use super::header::{Header, autoclear, ext};
use super::table::{be16, be32, be64};

/// At most this many bitmaps (QCOW2_MAX_BITMAPS).
pub const MAX_BITMAPS: u32 = 65535;

/// The directory is at most this large (QCOW2_MAX_BITMAP_DIRECTORY_SIZE).
pub const MAX_DIRECTORY_BYTES: u64 = 1024 * MAX_BITMAPS as u64;

/// Bytes of the fixed part of a directory entry.
pub const ENTRY_HEADER_BYTES: usize = 24;

/// Bitmap names are at most this long (BME_MAX_NAME_SIZE).
pub const MAX_NAME_BYTES: usize = 1023;

/// A bitmap table has at most this many entries (BME_MAX_TABLE_SIZE).
pub const MAX_TABLE_ENTRIES: u32 = 0x800_0000;

/// A bitmap's data is at most this large (BME_MAX_PHYS_SIZE).
pub const MAX_PHYS_BYTES: u64 = 0x2000_0000;

/// Granularity limits, as log2 of bytes (BME_MIN/MAX_GRANULARITY_BITS).
pub const GRANULARITY_BITS: std::ops::RangeInclusive<u8> = 9..=31;

/// Bitmap flags.
pub mod flags {
    /// The bitmap was not saved cleanly: its contents cannot be trusted.
    pub const IN_USE: u32 = 1 << 0;
    /// The bitmap is enabled: it must track every write.
    pub const AUTO: u32 = 1 << 1;
    /// Every flag QEMU accepts (it treats extra_data_compatible as reserved).
    pub const KNOWN: u32 = IN_USE | AUTO;
}

/// The only bitmap type: dirty tracking.
pub const TYPE_DIRTY_TRACKING: u8 = 1;

/// The bitmaps header extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapsExt {
    /// Number of bitmaps in the directory.
    pub nb_bitmaps: u32,
    /// Bytes of the directory.
    pub directory_size: u64,
    /// Offset of the directory (cluster aligned).
    pub directory_offset: u64,
}

/// What an image says about its bitmaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BitmapsState {
    /// No bitmaps extension.
    None,
    /// An extension that autoclear bit 0 no longer vouches for: a program
    /// without bitmap support wrote the image, so QEMU ignores the bitmaps
    /// (and warns).
    Stale,
    /// A valid extension.
    Present(BitmapsExt),
}

/// One bitmap directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    /// Offset of the bitmap table.
    pub table_offset: u64,
    /// Entries of the bitmap table.
    pub table_size: u32,
    /// [`flags`].
    pub flags: u32,
    /// The bitmap type ([`TYPE_DIRTY_TRACKING`]).
    pub kind: u8,
    /// log2 of the bytes one bit covers.
    pub granularity_bits: u8,
    /// The name, as stored.
    pub name: Vec<u8>,
}

impl Bitmap {
    /// Bytes one bit covers.
    pub fn granularity(&self) -> u64 {
        1 << self.granularity_bits
    }

    /// Whether the bitmap is marked inconsistent.
    pub fn in_use(&self) -> bool {
        self.flags & flags::IN_USE != 0
    }

    /// Whether the bitmap is enabled.
    pub fn auto(&self) -> bool {
        self.flags & flags::AUTO != 0
    }

    /// The name as QEMU shows it (a C string: cut at the first NUL).
    pub fn display_name(&self) -> String {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.name.len());
        String::from_utf8_lossy(&self.name[..end]).into_owned()
    }
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::io(msg)
}

impl BitmapsExt {
    /// The extension of `header`, validated as QEMU does when it opens an
    /// image.
    pub fn of(header: &Header) -> Result<BitmapsState> {
        let Some(e) = header.extension(ext::BITMAPS) else {
            return Ok(BitmapsState::None);
        };
        if e.data.len() != 24 {
            return Err(corrupt("bitmaps_ext: Invalid extension length"));
        }
        if header.autoclear_features & autoclear::BITMAPS == 0 {
            return Ok(BitmapsState::Stale);
        }
        let d = &e.data;
        if be32(d, 4) != 0 {
            return Err(corrupt("bitmaps_ext: Reserved field is not zero"));
        }
        let x = BitmapsExt {
            nb_bitmaps: be32(d, 0),
            directory_size: be64(d, 8),
            directory_offset: be64(d, 16),
        };
        if x.nb_bitmaps > MAX_BITMAPS {
            return Err(corrupt(format!(
                "bitmaps_ext: Image has {} bitmaps, exceeding the QEMU supported maximum of {MAX_BITMAPS}",
                x.nb_bitmaps
            )));
        }
        if x.nb_bitmaps == 0 {
            return Err(corrupt("found bitmaps extension with zero bitmaps"));
        }
        if !x.directory_offset.is_multiple_of(header.cluster_size()) {
            return Err(corrupt("bitmaps_ext: invalid bitmap directory offset"));
        }
        if x.directory_size > MAX_DIRECTORY_BYTES {
            return Err(corrupt(format!(
                "bitmaps_ext: bitmap directory size ({}) exceeds the maximum supported size ({MAX_DIRECTORY_BYTES})",
                x.directory_size
            )));
        }
        Ok(BitmapsState::Present(x))
    }
}

/// What directory entries are checked against besides their own bytes.
#[derive(Debug, Clone, Copy)]
pub struct DirectoryContext {
    /// The image's cluster size.
    pub cluster_size: u64,
    /// The image's virtual size (a consistent bitmap must cover it).
    pub virtual_size: u64,
}

/// Parses and validates the directory in `dir` (exactly
/// `ext.directory_size` bytes), which must hold `ext.nb_bitmaps` entries.
pub fn parse_directory(dir: &[u8], ext: &BitmapsExt, cx: &DirectoryContext) -> Result<Vec<Bitmap>> {
    if dir.is_empty() {
        return Err(corrupt("Requested bitmap directory size is zero"));
    }
    let broken = || corrupt("Broken bitmap directory");
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < dir.len() {
        let h = dir.get(at..at + ENTRY_HEADER_BYTES).ok_or_else(broken)?;
        if out.len() as u32 >= ext.nb_bitmaps {
            return Err(corrupt(
                "More bitmaps found than specified in header extension",
            ));
        }
        let name_len = be16(h, 18) as usize;
        let extra_len = be32(h, 20) as usize;
        let end = (at + ENTRY_HEADER_BYTES)
            .checked_add(extra_len)
            .and_then(|n| n.checked_add(name_len))
            .ok_or_else(broken)?;
        let next = end.next_multiple_of(8);
        if next > dir.len() {
            return Err(broken());
        }
        if extra_len != 0 {
            return Err(corrupt("Bitmap extra data is not supported"));
        }
        let bm = Bitmap {
            table_offset: be64(h, 0),
            table_size: be32(h, 8),
            flags: be32(h, 12),
            kind: h[16],
            granularity_bits: h[17],
            name: dir[at + ENTRY_HEADER_BYTES + extra_len..end].to_vec(),
        };
        check_entry(&bm, cx)?;
        out.push(bm);
        at = next;
    }
    if (out.len() as u32) < ext.nb_bitmaps {
        return Err(corrupt(
            "Less bitmaps found than specified in header extension",
        ));
    }
    Ok(out)
}

/// QEMU's `check_dir_entry`.
fn check_entry(bm: &Bitmap, cx: &DirectoryContext) -> Result<()> {
    let bad = bm.table_size == 0
        || bm.table_offset == 0
        || !bm.table_offset.is_multiple_of(cx.cluster_size)
        || bm.table_size > MAX_TABLE_ENTRIES
        || !GRANULARITY_BITS.contains(&bm.granularity_bits)
        || bm.flags & !flags::KNOWN != 0
        || bm.name.len() > MAX_NAME_BYTES
        || bm.kind != TYPE_DIRTY_TRACKING;
    let phys = bm.table_size as u64 * cx.cluster_size;
    // phys ≤ 2^29, so the bits it holds times the granularity fit in u64.
    let too_small = || !bm.in_use() && cx.virtual_size > (phys * 8) << bm.granularity_bits;
    if bad || phys > MAX_PHYS_BYTES || too_small() {
        return Err(corrupt(format!(
            "Bitmap '{}' doesn't satisfy the constraints",
            bm.display_name()
        )));
    }
    Ok(())
}

/// The on-disk bytes of a directory holding `list`, in order (each entry
/// padded to 8 bytes, no extra data).
pub fn directory_bytes(list: &[Bitmap]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in list {
        out.extend_from_slice(&b.table_offset.to_be_bytes());
        out.extend_from_slice(&b.table_size.to_be_bytes());
        out.extend_from_slice(&b.flags.to_be_bytes());
        out.push(b.kind);
        out.push(b.granularity_bits);
        out.extend_from_slice(&(b.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(&b.name);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    out
}

impl BitmapsExt {
    /// The extension's 24 data bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut d = Vec::with_capacity(24);
        d.extend_from_slice(&self.nb_bitmaps.to_be_bytes());
        d.extend_from_slice(&0u32.to_be_bytes());
        d.extend_from_slice(&self.directory_size.to_be_bytes());
        d.extend_from_slice(&self.directory_offset.to_be_bytes());
        d
    }
}

/// Reads and validates the bitmap directory of an image: the state of its
/// extension (see [`BitmapsExt::of`]) and the bitmaps, none unless the
/// extension is [`BitmapsState::Present`].
pub fn read(file: &dyn Storage, header: &Header) -> Result<(BitmapsState, Vec<Bitmap>)> {
    let state = BitmapsExt::of(header)?;
    let BitmapsState::Present(x) = &state else {
        return Ok((state, Vec::new()));
    };
    let end = x
        .directory_offset
        .checked_add(x.directory_size)
        .ok_or_else(|| corrupt("bitmaps_ext: invalid bitmap directory offset"))?;
    if end > file.file_len()? {
        return Err(corrupt("Bitmap directory extends past the end of the file"));
    }
    // Bounded by MAX_DIRECTORY_BYTES (checked in BitmapsExt::of) and the file.
    let mut dir = vec![0u8; x.directory_size as usize];
    file.read_padded(&mut dir, x.directory_offset)?;
    let cx = DirectoryContext {
        cluster_size: header.cluster_size(),
        virtual_size: header.size,
    };
    let list = parse_directory(&dir, x, &cx)?;
    Ok((state, list))
}

#[cfg(test)]
mod tests;
