//! The binary structures of VMDK sparse extents, parsed and checked in
//! one place: the hosted sparse header ("KDMV", VMDK 4), its
//! streamOptimized footer, the older ESX "COWD" header (VMDK 3, used by
//! vmfsSparse extents), and the grain marker of compressed grains.
//!
//! All integers are little-endian and offsets are in 512-byte sectors.
//! Fields are checked in the order QEMU checks them, with its messages.

use diskit_core::{Error, Result};

/// Bytes per sector: the unit of every offset in the format.
pub const SECTOR: u64 = 512;

/// The magic of a hosted sparse extent.
pub const KDMV: &[u8; 4] = b"KDMV";
/// The magic of an ESX sparse extent (vmfsSparse).
pub const COWD: &[u8; 4] = b"COWD";

/// Flag: the newline-detection bytes are valid.
pub const FLAG_NL_DETECT: u32 = 1;
/// Flag: a redundant grain directory is kept.
pub const FLAG_RGD: u32 = 1 << 1;
/// Flag: a grain table entry of 1 means a grain of zeros.
pub const FLAG_ZEROED_GRAIN: u32 = 1 << 2;
/// Flag: grains are compressed.
pub const FLAG_COMPRESSED: u32 = 1 << 16;
/// Flag: grains carry markers (streamOptimized).
pub const FLAG_MARKERS: u32 = 1 << 17;

/// `compressAlgorithm` for deflate.
pub const COMPRESS_DEFLATE: u16 = 1;

/// `gdOffset` of a stream whose grain directory is at its end (the footer
/// holds the real header).
pub const GD_AT_END: u64 = u64::MAX;

/// Entries of a grain table, as qemu-img creates them.
pub const GTES_PER_GT: u32 = 512;
/// Sectors of a grain, as qemu-img creates them (64 KiB).
pub const GRAIN_SECTORS: u64 = 128;
/// Sectors of the descriptor area qemu-img embeds.
pub const DESC_SECTORS: u64 = 20;

/// Grain table entry: a grain of zeros (with [`FLAG_ZEROED_GRAIN`]).
pub const GTE_ZERO: u32 = 1;

/// The largest grain QEMU accepts, in sectors (1 GiB).
const MAX_GRAIN_SECTORS: u64 = 0x20_0000;
/// The most grain directory entries QEMU accepts.
const MAX_L1_ENTRIES: u64 = 32 << 20;

/// A hosted sparse extent header (VMDK 4), as stored at sector 0 (or in a
/// stream's footer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparseHeader {
    /// Format version (1 to 3).
    pub version: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Sectors of guest data the extent holds.
    pub capacity: u64,
    /// Sectors per grain.
    pub grain_sectors: u64,
    /// Where the embedded descriptor is (sectors; 0 for none).
    pub desc_offset: u64,
    /// Its length (sectors).
    pub desc_sectors: u64,
    /// Entries per grain table.
    pub gtes_per_gt: u32,
    /// The redundant grain directory (sectors).
    pub rgd_offset: u64,
    /// The grain directory (sectors), or [`GD_AT_END`].
    pub gd_offset: u64,
    /// Where grains start (sectors).
    pub overhead: u64,
    /// Whether the extent was not closed cleanly (kept, never acted on, as
    /// QEMU).
    pub unclean_shutdown: u8,
    /// `compressAlgorithm`.
    pub compress: u16,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl SparseHeader {
    /// Reads the fields of a KDMV header (`b` is at least 512 bytes and
    /// starts with the magic); [`check`](Self::check) validates them.
    pub fn parse(b: &[u8]) -> SparseHeader {
        SparseHeader {
            version: u32_at(b, 0x04),
            flags: u32_at(b, 0x08),
            capacity: u64_at(b, 0x0C),
            grain_sectors: u64_at(b, 0x14),
            desc_offset: u64_at(b, 0x1C),
            desc_sectors: u64_at(b, 0x24),
            gtes_per_gt: u32_at(b, 0x2C),
            rgd_offset: u64_at(b, 0x30),
            gd_offset: u64_at(b, 0x38),
            overhead: u64_at(b, 0x40),
            unclean_shutdown: b[0x48],
            compress: u16::from_le_bytes([b[0x4D], b[0x4E]]),
        }
    }

    /// The header as stored (512 bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; SECTOR as usize];
        b[..4].copy_from_slice(KDMV);
        b[0x04..0x08].copy_from_slice(&self.version.to_le_bytes());
        b[0x08..0x0C].copy_from_slice(&self.flags.to_le_bytes());
        b[0x0C..0x14].copy_from_slice(&self.capacity.to_le_bytes());
        b[0x14..0x1C].copy_from_slice(&self.grain_sectors.to_le_bytes());
        b[0x1C..0x24].copy_from_slice(&self.desc_offset.to_le_bytes());
        b[0x24..0x2C].copy_from_slice(&self.desc_sectors.to_le_bytes());
        b[0x2C..0x30].copy_from_slice(&self.gtes_per_gt.to_le_bytes());
        b[0x30..0x38].copy_from_slice(&self.rgd_offset.to_le_bytes());
        b[0x38..0x40].copy_from_slice(&self.gd_offset.to_le_bytes());
        b[0x40..0x48].copy_from_slice(&self.overhead.to_le_bytes());
        b[0x48] = self.unclean_shutdown;
        b[0x49..0x4D].copy_from_slice(b"\n \r\n");
        b[0x4D..0x4F].copy_from_slice(&self.compress.to_le_bytes());
        b
    }

    /// Whether grains are deflate-compressed.
    pub fn compressed(&self) -> bool {
        self.compress == COMPRESS_DEFLATE
    }

    /// Whether a grain table entry of 1 is a zero grain.
    pub fn zeroed_grain(&self) -> bool {
        self.flags & FLAG_ZEROED_GRAIN != 0
    }

    /// Validates the fields against the extent file's length (bytes), in
    /// QEMU's order and with its messages.
    pub fn check(&self, file_len: u64, writable: bool) -> Result<()> {
        if self.version > 3 {
            return Err(Error::unsupported(format!(
                "Unsupported VMDK version {}",
                self.version
            )));
        }
        if self.version == 3 && writable && !self.compressed() {
            return Err(Error::invalid("VMDK version 3 must be read only"));
        }
        if self.gtes_per_gt > GTES_PER_GT {
            return Err(Error::invalid("L2 table size too big"));
        }
        if u64::from(self.gtes_per_gt).saturating_mul(self.grain_sectors) == 0 {
            return Err(Error::invalid("L1 entry size is invalid"));
        }
        if file_len.div_ceil(SECTOR) < self.overhead {
            return Err(Error::invalid(format!(
                "File truncated, expecting at least {} bytes",
                self.overhead.saturating_mul(SECTOR)
            )));
        }
        if self.grain_sectors > MAX_GRAIN_SECTORS {
            return Err(Error::invalid("Invalid granularity, image may be corrupt"));
        }
        if self.l1_entries() > MAX_L1_ENTRIES {
            return Err(Error::invalid("L1 size too big"));
        }
        Ok(())
    }

    /// Grain directory entries needed for the capacity.
    pub fn l1_entries(&self) -> u64 {
        let per = u64::from(self.gtes_per_gt).saturating_mul(self.grain_sectors);
        if per == 0 {
            return 0;
        }
        self.capacity.div_ceil(per)
    }
}

/// An ESX sparse extent header (COWD, VMDK 3): fixed grain tables of 4096
/// entries, no redundant directory, no zero grains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CowdHeader {
    /// Sectors of guest data.
    pub capacity: u64,
    /// Sectors per grain.
    pub grain_sectors: u64,
    /// The grain directory (sectors).
    pub gd_offset: u64,
    /// Its entries.
    pub gd_entries: u64,
}

/// Entries of a COWD grain table.
pub const COWD_GTES: u32 = 4096;

impl CowdHeader {
    /// Reads and checks a COWD header (`b` at least 512 bytes, magic
    /// first).
    pub fn parse(b: &[u8]) -> Result<CowdHeader> {
        let h = CowdHeader {
            capacity: u64::from(u32_at(b, 0x0C)),
            grain_sectors: u64::from(u32_at(b, 0x10)),
            gd_offset: u64::from(u32_at(b, 0x14)),
            gd_entries: u64::from(u32_at(b, 0x18)),
        };
        if h.grain_sectors == 0 {
            return Err(Error::invalid("L1 entry size is invalid"));
        }
        if h.grain_sectors > MAX_GRAIN_SECTORS {
            return Err(Error::invalid("Invalid granularity, image may be corrupt"));
        }
        if h.gd_entries > MAX_L1_ENTRIES {
            return Err(Error::invalid("L1 size too big"));
        }
        Ok(h)
    }
}

/// Bytes of a grain marker before the compressed data: the guest sector
/// (u64) and the compressed length (u32).
pub const GRAIN_MARKER: usize = 12;

/// Marker type of a stream's footer.
const MARKER_FOOTER: u32 = 3;
/// Bytes a stream keeps after its footer header: the footer marker, the
/// footer, the end-of-stream marker.
pub const FOOTER_TAIL: u64 = 3 * SECTOR;

/// Reads the header a stream keeps in its footer (the last three sectors:
/// a footer marker, the header, an end-of-stream marker).
pub fn parse_footer(tail: &[u8]) -> Result<SparseHeader> {
    let invalid = || Error::invalid("Invalid footer");
    if tail.len() < FOOTER_TAIL as usize {
        return Err(invalid());
    }
    let marker = &tail[..512];
    let header = &tail[512..1024];
    let eos = &tail[1024..1536];
    if u32_at(marker, 8) != 0
        || u32_at(marker, 12) != MARKER_FOOTER
        || &header[..4] != KDMV
        || u64_at(eos, 0) != 0
        || u32_at(eos, 8) != 0
        || u32_at(eos, 12) != 0
    {
        return Err(invalid());
    }
    Ok(SparseHeader::parse(header))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> SparseHeader {
        SparseHeader {
            version: 1,
            flags: FLAG_NL_DETECT | FLAG_RGD,
            capacity: 2048,
            grain_sectors: 128,
            desc_offset: 1,
            desc_sectors: 20,
            gtes_per_gt: 512,
            rgd_offset: 21,
            gd_offset: 26,
            overhead: 128,
            unclean_shutdown: 0,
            compress: 0,
        }
    }

    #[test]
    fn round_trip_and_checks() {
        let h = plain();
        let b = h.to_bytes();
        assert_eq!(&b[..4], b"KDMV");
        assert_eq!(SparseHeader::parse(&b), h);
        assert!(h.check(65536, true).is_ok());
        let short = h.check(1000, false).unwrap_err();
        assert!(short.to_string().contains("File truncated"), "{short}");
        let mut v = h.clone();
        v.version = 4;
        assert!(
            v.check(65536, false)
                .unwrap_err()
                .to_string()
                .contains("version 4")
        );
        let mut v = h.clone();
        v.version = 3;
        assert!(v.check(65536, true).is_err());
        assert!(v.check(65536, false).is_ok());
        let mut v = h;
        v.gtes_per_gt = 0;
        assert!(
            v.check(65536, false)
                .unwrap_err()
                .to_string()
                .contains("L1 entry size")
        );
    }

    #[test]
    fn footer_needs_its_markers() {
        let mut tail = vec![0u8; 1536];
        tail[12..16].copy_from_slice(&3u32.to_le_bytes());
        tail[512..1024].copy_from_slice(&plain().to_bytes());
        assert_eq!(parse_footer(&tail).unwrap(), plain());
        tail[12] = 2;
        assert!(parse_footer(&tail).is_err());
    }
}
