//! The VHDX structures outside the log, parsed and validated in one place
//! and written: the file identifier, the two headers, the region table,
//! the metadata region and the BAT's geometry (MS-VHDX v1.0, with QEMU
//! 10's choices and quirks where they differ).
//!
//! Every integer is little-endian; every checksum is CRC-32C over a whole
//! structure with its checksum field zeroed.

use diskit_core::{Error, ErrorKind, Result};

/// 1 MiB: the unit of every region and payload block offset.
pub const MIB: u64 = 1 << 20;
/// The file type identifier at offset 0.
pub const SIGNATURE: &[u8; 8] = b"vhdxfile";
/// Where the creator string starts, and its most bytes (UTF-16LE).
pub const CREATOR_AT: usize = 8;
/// Bytes the creator may take.
pub const CREATOR_LEN: usize = 512;
/// The two header slots.
pub const HEADER_OFFSETS: [u64; 2] = [0x10000, 0x20000];
/// Bytes a header's checksum covers.
pub const HEADER_BLOCK: usize = 4096;
/// Bytes of the header fields (the rest of the block is reserved).
pub const HEADER_FIELDS: usize = 80;
/// The region table read (QEMU reads only the first copy).
pub const REGION_TABLE_OFFSET: u64 = 0x30000;
/// The second copy of the region table (written, never read).
pub const REGION_TABLE2_OFFSET: u64 = 0x40000;
/// Bytes of a region table (and of the metadata table).
pub const TABLE_LEN: usize = 65536;
/// Most region table entries (the spec's limit).
pub const MAX_REGIONS: u32 = 2047;
/// The largest virtual size `create` makes.
pub const MAX_SIZE: u64 = 64 << 40;
/// The smallest payload block.
pub const MIN_BLOCK: u64 = MIB;
/// The largest payload block.
pub const MAX_BLOCK: u64 = 256 * MIB;
/// Where the log starts in images QEMU (and diskit) make.
pub const LOG_OFFSET: u64 = MIB;
/// The default log length.
pub const DEFAULT_LOG: u64 = MIB;
/// The only logical sector size read and written.
pub const SECTOR: u32 = 512;

/// A GUID as stored (Microsoft byte order; compared as bytes).
pub type Guid = [u8; 16];

/// The all-zero GUID.
pub const NULL_GUID: Guid = [0; 16];
/// Region: the block allocation table.
pub const BAT_GUID: Guid = guid(0x2DC2_7766, 0xF623, 0x4200, 0x9D64_115E_9BFD_4A08);
/// Region: the metadata.
pub const METADATA_GUID: Guid = guid(0x8B7C_A206, 0x4790, 0x4B9A, 0xB8FE_575F_050F_886E);
/// Metadata item: file parameters (block size, flags).
pub const FILE_PARAMETERS: Guid = guid(0xCAA1_6737, 0xFA36, 0x4D43, 0xB3B6_33F0_AA44_E76B);
/// Metadata item: the virtual disk size.
pub const VIRTUAL_DISK_SIZE: Guid = guid(0x2FA5_4224, 0xCD1B, 0x4876, 0xB211_5DBE_D83B_F4B8);
/// Metadata item: SCSI page 83 data (the virtual disk id).
pub const PAGE83: Guid = guid(0xBECA_12AB, 0xB2E6, 0x4523, 0x93EF_C309_E000_C746);
/// Metadata item: the logical sector size.
pub const LOGICAL_SECTOR: Guid = guid(0x8141_BF1D, 0xA96F, 0x4709, 0xBA47_F233_A8FA_AB5F);
/// Metadata item: the physical sector size.
pub const PHYSICAL_SECTOR: Guid = guid(0xCDA3_48C7, 0x445D, 0x4471, 0x9CC9_E988_5251_C556);
/// Metadata item: the parent locator (differencing images).
pub const PARENT_LOCATOR: Guid = guid(0xA8D3_5F2D, 0xB30B, 0x454D, 0xABF7_D3D8_4834_AB0C);

/// A GUID's text fields in the on-disk byte order.
const fn guid(d1: u32, d2: u16, d3: u16, d4: u64) -> Guid {
    let a = d1.to_le_bytes();
    let b = d2.to_le_bytes();
    let c = d3.to_le_bytes();
    let d = d4.to_be_bytes();
    [
        a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], d[0], d[1], d[2], d[3], d[4], d[5], d[6],
        d[7],
    ]
}

/// A GUID as text, for messages.
pub fn guid_text(g: &Guid) -> String {
    let d1 = u32::from_le_bytes([g[0], g[1], g[2], g[3]]);
    let d2 = u16::from_le_bytes([g[4], g[5]]);
    let d3 = u16::from_le_bytes([g[6], g[7]]);
    let tail: String = g[10..].iter().map(|b| format!("{b:02X}")).collect();
    format!("{d1:08X}-{d2:04X}-{d3:04X}-{:02X}{:02X}-{tail}", g[8], g[9])
}

/// A fresh random GUID (a version 4 UUID's bytes, stored as they come,
/// as QEMU stores them).
pub fn new_guid() -> Result<Guid> {
    let mut g = [0u8; 16];
    crate::luks::keys::random(&mut g)?;
    g[6] = (g[6] & 0x0f) | 0x40;
    g[8] = (g[8] & 0x3f) | 0x80;
    Ok(g)
}

/// CRC-32C (Castagnoli) as VHDX uses it.
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[[u32; 256]; 8]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [[0u32; 256]; 8];
        for i in 0..256u32 {
            let mut c = i;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            t[0][i as usize] = c;
        }
        for i in 0..256 {
            for k in 1..8 {
                let prev = t[k - 1][i];
                t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            }
        }
        t
    });
    let mut crc = !0u32;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let lo = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) ^ crc;
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = (crc >> 8) ^ t[0][((crc ^ b as u32) & 0xff) as usize];
    }
    !crc
}

/// Whether the CRC-32C of `b` with its 4-byte field at `at` zeroed is
/// the value stored there.
pub fn checksum_ok(b: &[u8], at: usize) -> bool {
    let stored = le32(b, at);
    let mut copy = b.to_vec();
    copy[at..at + 4].fill(0);
    crc32c(&copy) == stored
}

/// Stores the CRC-32C of `b` (field at `at` zeroed first) at `at`.
pub fn set_checksum(b: &mut [u8], at: usize) {
    b[at..at + 4].fill(0);
    let c = crc32c(b);
    b[at..at + 4].copy_from_slice(&c.to_le_bytes());
}

pub(crate) use crate::bytes::{le16, le32, le64};

pub(crate) fn guid_at(b: &[u8], at: usize) -> Guid {
    b[at..at + 16].try_into().expect("16 bytes")
}

/// An image that is not valid VHDX (QEMU: EINVAL).
pub fn invalid(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidInput, what.into())
}

/// A VHDX feature diskit (like QEMU) does not read (QEMU: ENOTSUP).
pub fn unsupported(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::NotSupported, what.into())
}

/// One of the two headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The sequence number: the valid header with the higher one is current.
    pub sequence: u64,
    /// Changed at the first write of each session.
    pub file_write_guid: Guid,
    /// Changed at the first write of each session (user-visible data).
    pub data_write_guid: Guid,
    /// The log entries that apply carry this GUID (zero: no log to replay).
    pub log_guid: Guid,
    /// Must be 0.
    pub log_version: u16,
    /// Must be 1.
    pub version: u16,
    /// Bytes of the log.
    pub log_length: u32,
    /// Where the log starts.
    pub log_offset: u64,
}

impl Header {
    /// The header in the 4 KiB block `b` if it is valid (signature `head`,
    /// version 1, checksum over the block), as QEMU tells a header it can
    /// use from one it ignores.
    pub fn parse(b: &[u8]) -> Option<Header> {
        if b.len() < HEADER_BLOCK || &b[..4] != b"head" || !checksum_ok(&b[..HEADER_BLOCK], 4) {
            return None;
        }
        let h = Header {
            sequence: le64(b, 8),
            file_write_guid: guid_at(b, 16),
            data_write_guid: guid_at(b, 32),
            log_guid: guid_at(b, 48),
            log_version: le16(b, 64),
            version: le16(b, 66),
            log_length: le32(b, 68),
            log_offset: le64(b, 72),
        };
        (h.version == 1).then_some(h)
    }

    /// Writes the fields into the 4 KiB block `b` (its reserved bytes kept)
    /// and checksums the block.
    pub fn write_into(&self, b: &mut [u8]) {
        b[..4].copy_from_slice(b"head");
        b[8..16].copy_from_slice(&self.sequence.to_le_bytes());
        b[16..32].copy_from_slice(&self.file_write_guid);
        b[32..48].copy_from_slice(&self.data_write_guid);
        b[48..64].copy_from_slice(&self.log_guid);
        b[64..66].copy_from_slice(&self.log_version.to_le_bytes());
        b[66..68].copy_from_slice(&self.version.to_le_bytes());
        b[68..72].copy_from_slice(&self.log_length.to_le_bytes());
        b[72..80].copy_from_slice(&self.log_offset.to_le_bytes());
        set_checksum(&mut b[..HEADER_BLOCK], 4);
    }

    /// The 80 bytes of fields (for telling identical copies apart).
    fn fields(&self) -> [u8; HEADER_FIELDS] {
        let mut b = vec![0u8; HEADER_BLOCK];
        self.write_into(&mut b);
        let mut f = [0u8; HEADER_FIELDS];
        f.copy_from_slice(&b[..HEADER_FIELDS]);
        f[4..8].fill(0);
        f
    }

    /// Checks the log fields as QEMU does before looking at the log (even
    /// with no log).
    pub fn check_log_fields(&self) -> Result<()> {
        if self.log_offset < MIB || !self.log_offset.is_multiple_of(MIB) {
            return Err(invalid(format!(
                "VHDX log offset {} is not a multiple of 1 MiB from 1 MiB on",
                self.log_offset
            )));
        }
        if self.log_version != 0 {
            return Err(invalid(format!(
                "VHDX log version {} is not supported",
                self.log_version
            )));
        }
        Ok(())
    }

    /// Whether there is a log to look at.
    pub fn has_log(&self) -> bool {
        self.log_guid != NULL_GUID && self.log_length != 0
    }
}

/// Picks the current header of the two slots (`None`: not valid): the
/// valid one with the higher sequence number; of two with the same, the
/// first if their fields are the same (Disk2VHD writes them so).
pub fn current_header(h: [Option<Header>; 2]) -> Result<(usize, Header)> {
    match h {
        [None, None] => Err(invalid("No valid VHDX header found")),
        [Some(a), None] => Ok((0, a)),
        [None, Some(b)] => Ok((1, b)),
        [Some(a), Some(b)] => {
            if a.sequence > b.sequence {
                Ok((0, a))
            } else if b.sequence > a.sequence {
                Ok((1, b))
            } else if a.fields() == b.fields() {
                Ok((0, a))
            } else {
                Err(invalid("No valid VHDX header found"))
            }
        }
    }
}

/// The file ranges registered so far (log, regions), newest last, to find
/// overlaps as QEMU does.
#[derive(Debug, Clone, Default)]
pub struct Regions(Vec<(u64, u64)>);

impl Regions {
    /// Fails if `offset..offset+len` overlaps a registered range (checked
    /// newest first, as QEMU reports the newest one).
    pub fn check(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset.saturating_add(len);
        for &(s, e) in self.0.iter().rev() {
            if offset < e && s < end {
                return Err(invalid(format!(
                    "VHDX region {offset}-{end} overlaps with region {s}-{e}"
                )));
            }
        }
        Ok(())
    }

    /// Where the last registered range ends.
    pub fn end(&self) -> u64 {
        self.0.iter().map(|r| r.1).max().unwrap_or(0)
    }

    /// Registers a range.
    pub fn add(&mut self, offset: u64, len: u64) {
        self.0.push((offset, offset.saturating_add(len)));
    }
}

/// A region table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Where the region starts.
    pub offset: u64,
    /// Its bytes.
    pub length: u32,
}

impl Region {
    /// One past its last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.length as u64
    }
}

/// The region table: where the BAT and the metadata are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionTable {
    /// The BAT region.
    pub bat: Region,
    /// The metadata region.
    pub metadata: Region,
}

impl RegionTable {
    /// Parses the 64 KiB table in `b`, registering each region in
    /// `regions` (which holds the log) and refusing overlaps, duplicates,
    /// missing regions and unknown required ones.
    pub fn parse(b: &[u8], regions: &mut Regions) -> Result<RegionTable> {
        if b.len() < TABLE_LEN || &b[..4] != b"regi" {
            return Err(invalid("VHDX region table signature not found"));
        }
        if !checksum_ok(&b[..TABLE_LEN], 4) {
            return Err(invalid("VHDX region table checksum mismatch"));
        }
        let count = le32(b, 8);
        if count > MAX_REGIONS {
            return Err(invalid(format!(
                "VHDX region table has {count} entries (at most {MAX_REGIONS})"
            )));
        }
        let (mut bat, mut metadata) = (None, None);
        for i in 0..count as usize {
            let e = 16 + i * 32;
            let g = guid_at(b, e);
            let r = Region {
                offset: le64(b, e + 16),
                length: le32(b, e + 24),
            };
            let required = le32(b, e + 28) & 1 != 0;
            regions.check(r.offset, r.length as u64)?;
            regions.add(r.offset, r.length as u64);
            let slot = if g == BAT_GUID {
                &mut bat
            } else if g == METADATA_GUID {
                &mut metadata
            } else if required {
                return Err(unsupported(format!(
                    "VHDX region {} is required but unknown",
                    guid_text(&g)
                )));
            } else {
                continue;
            };
            if slot.replace(r).is_some() {
                return Err(invalid(format!(
                    "VHDX region table names region {} twice",
                    guid_text(&g)
                )));
            }
        }
        match (bat, metadata) {
            (Some(bat), Some(metadata)) => Ok(RegionTable { bat, metadata }),
            (None, _) => Err(invalid("VHDX region table has no BAT region")),
            (_, None) => Err(invalid("VHDX region table has no metadata region")),
        }
    }

    /// The table as QEMU writes it (BAT first, flags 0), checksummed.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; TABLE_LEN];
        b[..4].copy_from_slice(b"regi");
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        for (i, (g, r)) in [(BAT_GUID, self.bat), (METADATA_GUID, self.metadata)]
            .iter()
            .enumerate()
        {
            let e = 16 + i * 32;
            b[e..e + 16].copy_from_slice(g);
            b[e + 16..e + 24].copy_from_slice(&r.offset.to_le_bytes());
            b[e + 24..e + 28].copy_from_slice(&r.length.to_le_bytes());
        }
        set_checksum(&mut b, 4);
        b
    }
}

/// Metadata item flag: required.
const MD_REQUIRED: u32 = 4;
/// Metadata item flag: a property of the virtual disk.
const MD_VIRTUAL_DISK: u32 = 2;

/// Where one metadata item is, relative to the metadata region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// Offset from the region's start.
    pub offset: u32,
    /// Its bytes.
    pub length: u32,
}

/// The metadata items diskit reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    /// Bytes of a payload block.
    pub block_size: u32,
    /// LeaveBlocksAllocated (fixed images; not interpreted).
    pub leave_allocated: bool,
    /// The virtual size in bytes (whole sectors: a tail is dropped).
    pub virtual_size: u64,
    /// The logical sector size (512).
    pub logical_sector: u32,
    /// The physical sector size (any value).
    pub physical_sector: u32,
    /// The virtual disk id.
    pub page83: Guid,
}

impl Metadata {
    /// Parses the 64 KiB metadata table in `table` of a region of
    /// `region_len` bytes; `item` reads an item's bytes (offset relative
    /// to the region).
    pub fn parse(
        table: &[u8],
        region_len: u32,
        item: &mut dyn FnMut(Item) -> Result<Vec<u8>>,
    ) -> Result<Metadata> {
        if table.len() < TABLE_LEN || &table[..8] != b"metadata" {
            return Err(invalid("VHDX metadata table signature not found"));
        }
        let count = le16(table, 10) as usize;
        if count * 32 > TABLE_LEN - 32 {
            return Err(invalid(format!(
                "VHDX metadata table has {count} entries (at most 2047)"
            )));
        }
        let known = [
            FILE_PARAMETERS,
            VIRTUAL_DISK_SIZE,
            PAGE83,
            LOGICAL_SECTOR,
            PHYSICAL_SECTOR,
            PARENT_LOCATOR,
        ];
        let mut found: [Option<Item>; 6] = [None; 6];
        for i in 0..count {
            let e = 32 + i * 32;
            let g = guid_at(table, e);
            let it = Item {
                offset: le32(table, e + 16),
                length: le32(table, e + 20),
            };
            let flags = le32(table, e + 24);
            let Some(k) = known.iter().position(|x| *x == g) else {
                if flags & MD_REQUIRED != 0 {
                    return Err(unsupported(format!(
                        "VHDX metadata item {} is required but unknown",
                        guid_text(&g)
                    )));
                }
                continue;
            };
            if found[k].replace(it).is_some() {
                return Err(invalid(format!(
                    "VHDX metadata table names item {} twice",
                    guid_text(&g)
                )));
            }
        }
        let names = [
            "file parameters",
            "virtual disk size",
            "page 83 data",
            "logical sector size",
            "physical sector size",
        ];
        let mut get = |k: usize, need: u32| -> Result<Vec<u8>> {
            let it = found[k].ok_or_else(|| {
                unsupported(format!("VHDX metadata has no {} item (required)", names[k]))
            })?;
            if it.length < need || it.offset as u64 + it.length as u64 > region_len as u64 {
                return Err(invalid(format!(
                    "VHDX metadata item {} ({} bytes at {}) does not fit its region ({region_len} bytes)",
                    names[k], it.length, it.offset
                )));
            }
            item(Item {
                offset: it.offset,
                length: need,
            })
        };
        let fp = get(0, 8)?;
        let vs = get(1, 8)?;
        let p83 = get(2, 16)?;
        let ls = get(3, 4)?;
        let ps = get(4, 4)?;
        let block_size = le32(&fp, 0);
        let flags = le32(&fp, 4);
        if flags & 2 != 0 {
            if found[5].is_some() {
                return Err(unsupported(
                    "VHDX differencing images (with a parent) are not supported",
                ));
            }
            return Err(invalid(
                "VHDX image says it has a parent but has no parent locator",
            ));
        }
        let bs = block_size as u64;
        if !(MIN_BLOCK..=MAX_BLOCK).contains(&bs) || !bs.is_power_of_two() {
            return Err(invalid(format!(
                "VHDX block size {block_size} is not a power of two from 1 MiB to 256 MiB"
            )));
        }
        let logical_sector = le32(&ls, 0);
        if logical_sector != SECTOR {
            return Err(unsupported(format!(
                "VHDX logical sector size {logical_sector} is not supported (only 512)"
            )));
        }
        Ok(Metadata {
            block_size,
            leave_allocated: flags & 1 != 0,
            virtual_size: le64(&vs, 0) / 512 * 512,
            logical_sector,
            physical_sector: le32(&ps, 0),
            page83: guid_at(&p83, 0),
        })
    }

    /// The metadata region's first 64 KiB + 40 bytes as QEMU writes them
    /// (the table, then the items packed from 64 KiB).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; TABLE_LEN + 40];
        b[..8].copy_from_slice(b"metadata");
        b[10..12].copy_from_slice(&5u16.to_le_bytes());
        let items: [(Guid, u32, u32, u32); 5] = [
            (FILE_PARAMETERS, 0, 8, MD_REQUIRED),
            (VIRTUAL_DISK_SIZE, 8, 8, MD_REQUIRED | MD_VIRTUAL_DISK),
            (PAGE83, 16, 16, MD_REQUIRED | MD_VIRTUAL_DISK),
            (LOGICAL_SECTOR, 32, 4, MD_REQUIRED | MD_VIRTUAL_DISK),
            (PHYSICAL_SECTOR, 36, 4, MD_REQUIRED | MD_VIRTUAL_DISK),
        ];
        for (i, (g, off, len, flags)) in items.iter().enumerate() {
            let e = 32 + i * 32;
            b[e..e + 16].copy_from_slice(g);
            b[e + 16..e + 20].copy_from_slice(&(TABLE_LEN as u32 + off).to_le_bytes());
            b[e + 20..e + 24].copy_from_slice(&len.to_le_bytes());
            b[e + 24..e + 28].copy_from_slice(&flags.to_le_bytes());
        }
        let d = TABLE_LEN;
        b[d..d + 4].copy_from_slice(&self.block_size.to_le_bytes());
        b[d + 4..d + 8].copy_from_slice(&u32::from(self.leave_allocated).to_le_bytes());
        b[d + 8..d + 16].copy_from_slice(&self.virtual_size.to_le_bytes());
        b[d + 16..d + 32].copy_from_slice(&self.page83);
        b[d + 32..d + 36].copy_from_slice(&self.logical_sector.to_le_bytes());
        b[d + 36..d + 40].copy_from_slice(&self.physical_sector.to_le_bytes());
        b
    }
}

/// BAT entry state: not present (reads as zeros).
pub const PAYLOAD_NOT_PRESENT: u64 = 0;
/// BAT entry state: undefined (reads as zeros).
pub const PAYLOAD_UNDEFINED: u64 = 1;
/// BAT entry state: zero.
pub const PAYLOAD_ZERO: u64 = 2;
/// BAT entry state: unmapped.
pub const PAYLOAD_UNMAPPED: u64 = 3;
/// BAT entry state: unmapped, as the v0.95 draft numbered it.
pub const PAYLOAD_UNMAPPED_V095: u64 = 5;
/// BAT entry state: the block is in the file.
pub const PAYLOAD_FULLY_PRESENT: u64 = 6;
/// BAT entry state: partly in the file (differencing images only).
pub const PAYLOAD_PARTIALLY_PRESENT: u64 = 7;

/// The state of a BAT entry.
pub fn entry_state(e: u64) -> u64 {
    e & 7
}

/// The file offset of a BAT entry (bits 20..64, in bytes).
pub fn entry_offset(e: u64) -> u64 {
    e & !(MIB - 1)
}

/// Whether a payload entry in this state reads as zeros (and a write
/// allocates a block).
pub fn reads_as_zero(state: u64) -> bool {
    matches!(
        state,
        PAYLOAD_NOT_PRESENT
            | PAYLOAD_UNDEFINED
            | PAYLOAD_ZERO
            | PAYLOAD_UNMAPPED
            | PAYLOAD_UNMAPPED_V095
    )
}

/// A payload block: guest offset / block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Block(pub u64);

/// A position in the BAT, where payload entries and sector bitmap entries
/// are interleaved (QEMU's messages name entries by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BatIndex(pub u64);

impl std::fmt::Display for BatIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The BAT in memory (whole 4 KiB sectors), indexed by [`BatIndex`] only,
/// so that a payload block number cannot stand for its entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bat(Vec<u64>);

/// BAT entries in one 4 KiB sector.
pub const ENTRIES_PER_SECTOR: u64 = 512;

impl Bat {
    /// The entries in `raw` (little-endian), then zeros up to `len`.
    pub fn new(raw: &[u8], len: u64) -> Bat {
        let mut v: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        v.resize(len as usize, PAYLOAD_NOT_PRESENT);
        Bat(v)
    }

    /// Every entry, in order.
    pub fn entries(&self) -> &[u64] {
        &self.0
    }

    /// Sets entry `i`.
    pub fn set(&mut self, i: BatIndex, e: u64) {
        self.0[i.0 as usize] = e;
    }

    /// The bytes of BAT sector `s` (entries 512·s to 512·s + 511).
    pub fn sector(&self, s: u64) -> Vec<u8> {
        let first = (s * ENTRIES_PER_SECTOR) as usize;
        self.0[first..first + ENTRIES_PER_SECTOR as usize]
            .iter()
            .flat_map(|e| e.to_le_bytes())
            .collect()
    }
}

impl std::ops::Index<BatIndex> for Bat {
    type Output = u64;
    fn index(&self, i: BatIndex) -> &u64 {
        &self.0[i.0 as usize]
    }
}

/// The BAT's shape: payload blocks interleaved with a sector bitmap entry
/// after every `chunk_ratio` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of a payload block.
    pub block_size: u64,
    /// The virtual size.
    pub virtual_size: u64,
    /// Payload blocks per sector bitmap block.
    pub chunk_ratio: u64,
    /// Payload blocks.
    pub blocks: u64,
    /// BAT entries, as QEMU counts them (32-bit arithmetic: an empty disk
    /// gets a huge BAT).
    pub bat_entries: u64,
}

impl Geometry {
    /// The geometry of a disk of `virtual_size` bytes in blocks of
    /// `block_size` (a power of two from 1 MiB to 256 MiB).
    pub fn new(virtual_size: u64, block_size: u64) -> Result<Geometry> {
        let chunk_ratio = ((1u64 << 23) * SECTOR as u64) / block_size;
        let blocks = virtual_size.div_ceil(block_size);
        if blocks > u32::MAX as u64 {
            return Err(invalid(format!(
                "VHDX virtual size {virtual_size} needs too many blocks of {block_size} bytes"
            )));
        }
        let shift = chunk_ratio.trailing_zeros();
        let extra = (blocks as u32).wrapping_sub(1) >> shift;
        Ok(Geometry {
            block_size,
            virtual_size,
            chunk_ratio,
            blocks,
            bat_entries: blocks + extra as u64,
        })
    }

    /// The BAT index of payload block `b`.
    pub fn bat_index(&self, b: Block) -> BatIndex {
        BatIndex(b.0 + b.0 / self.chunk_ratio)
    }

    /// The BAT entries that matter: up to the last payload block's.
    pub fn used_entries(&self) -> u64 {
        if self.blocks == 0 {
            0
        } else {
            self.bat_index(Block(self.blocks - 1)).0 + 1
        }
    }

    /// Whether BAT index `i` is a sector bitmap entry.
    pub fn is_bitmap_index(&self, i: u64) -> bool {
        i % (self.chunk_ratio + 1) == self.chunk_ratio
    }

    /// Bytes of the BAT region QEMU makes for it (whole MiB).
    pub fn bat_region_len(&self) -> u64 {
        (self.bat_entries * 8).div_ceil(MIB) * MIB
    }
}

/// QEMU's block size for a disk of `size` bytes when none is given.
pub fn default_block_size(size: u64) -> u64 {
    const GIB: u64 = 1 << 30;
    const TIB: u64 = 1 << 40;
    if size > 32 * TIB {
        64 * MIB
    } else if size > 100 * GIB {
        32 * MIB
    } else if size > GIB {
        16 * MIB
    } else {
        8 * MIB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guids_are_stored_microsoft_style() {
        assert_eq!(
            BAT_GUID,
            [
                0x66, 0x77, 0xc2, 0x2d, 0x23, 0xf6, 0x00, 0x42, 0x9d, 0x64, 0x11, 0x5e, 0x9b, 0xfd,
                0x4a, 0x08
            ]
        );
        assert_eq!(guid_text(&BAT_GUID), "2DC27766-F623-4200-9D64-115E9BFD4A08");
    }

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let long: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut slow = !0u32;
        for &b in &long {
            slow ^= b as u32;
            for _ in 0..8 {
                slow = if slow & 1 != 0 {
                    (slow >> 1) ^ 0x82F6_3B78
                } else {
                    slow >> 1
                };
            }
        }
        assert_eq!(crc32c(&long), !slow);
    }

    #[test]
    fn the_default_region_table_is_qemus() {
        let rt = RegionTable {
            bat: Region {
                offset: 2 * MIB,
                length: MIB as u32,
            },
            metadata: Region {
                offset: 3 * MIB,
                length: MIB as u32,
            },
        };
        assert_eq!(le32(&rt.to_bytes(), 4), 0x2c6f_ce83);
    }

    #[test]
    fn geometry_counts_as_qemu() {
        let g = Geometry::new(64 << 40, 64 * MIB).unwrap();
        assert_eq!(g.bat_entries, 1_064_959);
        assert_eq!(g.bat_region_len(), 9 * MIB);
        let g = Geometry::new(0, 8 * MIB).unwrap();
        assert_eq!(g.bat_entries, 8_388_607);
        assert_eq!(g.bat_region_len(), 64 * MIB);
        assert_eq!(g.used_entries(), 0);
        let g = Geometry::new(100 << 20, 8 * MIB).unwrap();
        assert_eq!(g.bat_entries, 13);
        let g = Geometry::new(5 << 30, MIB).unwrap();
        assert_eq!(g.bat_index(Block(4096)), BatIndex(4097));
        assert!(g.is_bitmap_index(4096));
    }

    #[test]
    fn headers_pick_as_qemu() {
        let h = Header {
            sequence: 5,
            file_write_guid: [1; 16],
            data_write_guid: [2; 16],
            log_guid: NULL_GUID,
            log_version: 0,
            version: 1,
            log_length: MIB as u32,
            log_offset: MIB,
        };
        let mut b = vec![0u8; HEADER_BLOCK];
        h.write_into(&mut b);
        assert_eq!(Header::parse(&b), Some(h.clone()));
        b[100] = 1;
        assert_eq!(Header::parse(&b), None);
        let mut h2 = h.clone();
        h2.sequence = 6;
        assert_eq!(
            current_header([Some(h.clone()), Some(h2.clone())])
                .unwrap()
                .0,
            1
        );
        assert_eq!(
            current_header([Some(h.clone()), Some(h.clone())])
                .unwrap()
                .0,
            0
        );
        let mut h3 = h.clone();
        h3.data_write_guid = [9; 16];
        assert!(current_header([Some(h.clone()), Some(h3)]).is_err());
        assert!(current_header([None, None]).is_err());
    }
}
