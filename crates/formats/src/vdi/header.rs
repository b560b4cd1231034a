//! The VDI (VirtualBox) header: parsed and validated in one place, and
//! written. 512 bytes, little-endian, at offset 0; the block map follows
//! at `offset_bmap`, the data blocks at `offset_data`.

use diskit_core::{Error, ErrorKind, Result};

/// The signature at 0x40.
pub const SIGNATURE: u32 = 0xBEDA_107F;
/// The only version read and written (1.1).
pub const VERSION: u32 = 0x0001_0001;
/// Bytes of the header.
pub const HEADER_LEN: usize = 512;
/// The block size QEMU (and VirtualBox) use, the only one accepted.
pub const BLOCK_SIZE: u64 = 1 << 20;
/// The sector size, the only one accepted.
pub const SECTOR_SIZE: u32 = 512;
/// A block never allocated (reads as zeros).
pub const UNALLOCATED: u32 = 0xFFFF_FFFF;
/// A block discarded (reads as zeros).
pub const DISCARDED: u32 = 0xFFFF_FFFE;
/// The most blocks an image may have (QEMU's limit: the block map must
/// stay below 2 GiB).
pub const MAX_BLOCKS: u32 = 0x1FFF_FF80;
/// The largest virtual size.
pub const MAX_SIZE: u64 = MAX_BLOCKS as u64 * BLOCK_SIZE;
/// The text QEMU writes at the start of the header.
pub const QEMU_TEXT: &[u8] = b"<<< QEMU VM Virtual Disk Image >>>\n";

/// A dynamic image: blocks allocated as written.
pub const TYPE_DYNAMIC: u32 = 1;
/// A static image: every block allocated at creation.
pub const TYPE_STATIC: u32 = 2;

/// A parsed, validated VDI header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The 512 bytes as read (fields not interpreted are kept as they are).
    raw: Vec<u8>,
    /// Dynamic or static (other values are read as dynamic, as QEMU).
    pub image_type: u32,
    /// Where the block map starts.
    pub offset_bmap: u32,
    /// Where data block 0 starts.
    pub offset_data: u32,
    /// The virtual size (rounded up to whole sectors).
    pub disk_size: u64,
    /// Blocks of the virtual disk.
    pub blocks_in_image: u32,
    /// Data blocks in use.
    pub blocks_allocated: u32,
}

use crate::bytes::{le32, le64};

fn unsupported(what: String) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("unsupported VDI image ({what})"),
    )
}

impl Header {
    /// Parses and validates the header in `b` (at least 512 bytes), with
    /// QEMU's checks in QEMU's order and its messages.
    pub fn parse(b: &[u8]) -> Result<Header> {
        if b.len() < HEADER_LEN {
            return Err(Error::invalid("Image not in VDI format (file too short)"));
        }
        let mut disk_size = le64(b, 0x170);
        if disk_size > MAX_SIZE {
            return Err(Error::invalid(format!(
                "Unsupported VDI image size (size is {disk_size:#x}, max supported is {MAX_SIZE:#x})"
            )));
        }
        // VBoxManage can write sizes that are not whole sectors.
        disk_size = disk_size.div_ceil(512) * 512;
        let signature = le32(b, 0x40);
        if signature != SIGNATURE {
            return Err(Error::invalid(format!(
                "Image not in VDI format (bad signature {signature:08x})"
            )));
        }
        let version = le32(b, 0x44);
        if version != VERSION {
            return Err(unsupported(format!(
                "version {}.{}",
                version >> 16,
                version & 0xffff
            )));
        }
        let offset_bmap = le32(b, 0x154);
        let offset_data = le32(b, 0x158);
        if !offset_bmap.is_multiple_of(512) {
            return Err(unsupported(format!(
                "unaligned block map offset {offset_bmap:#x}"
            )));
        }
        if !offset_data.is_multiple_of(512) {
            return Err(unsupported(format!(
                "unaligned data offset {offset_data:#x}"
            )));
        }
        let sector_size = le32(b, 0x168);
        if sector_size != SECTOR_SIZE {
            return Err(unsupported(format!("sector size {sector_size} is not 512")));
        }
        let block_size = le32(b, 0x178);
        if block_size as u64 != BLOCK_SIZE {
            return Err(unsupported(format!(
                "block size {block_size} is not {BLOCK_SIZE}"
            )));
        }
        let blocks_in_image = le32(b, 0x180);
        let room = blocks_in_image as u64 * BLOCK_SIZE;
        if disk_size > room {
            return Err(unsupported(format!(
                "disk size {disk_size}, image bitmap has room for {room}"
            )));
        }
        if b[0x1A8..0x1B8].iter().any(|&x| x != 0) {
            return Err(unsupported("non-NULL link UUID".into()));
        }
        if b[0x1B8..0x1C8].iter().any(|&x| x != 0) {
            return Err(unsupported("non-NULL parent UUID".into()));
        }
        if blocks_in_image > MAX_BLOCKS {
            return Err(unsupported(format!(
                "too many blocks {blocks_in_image}, max is {MAX_BLOCKS}"
            )));
        }
        // diskit's own checks: the block map and the data must not overlap
        // the header or each other (QEMU would write through them).
        let bmap_end = offset_bmap as u64 + bmap_bytes(blocks_in_image);
        if (offset_bmap as u64) < HEADER_LEN as u64 || (offset_data as u64) < bmap_end {
            return Err(unsupported(format!(
                "block map at {offset_bmap:#x} and data at {offset_data:#x} overlap"
            )));
        }
        Ok(Header {
            raw: b[..HEADER_LEN].to_vec(),
            image_type: le32(b, 0x4C),
            offset_bmap,
            offset_data,
            disk_size,
            blocks_in_image,
            blocks_allocated: le32(b, 0x184),
        })
    }

    /// A new header as `qemu-img create -f vdi` writes it; `uuids` are the
    /// image and modification UUIDs, stored as given.
    pub fn new(disk_size: u64, static_image: bool, uuids: [[u8; 16]; 2]) -> Header {
        let blocks = disk_size.div_ceil(BLOCK_SIZE) as u32;
        let offset_bmap = HEADER_LEN as u32;
        let offset_data = offset_bmap + bmap_bytes(blocks) as u32;
        let mut raw = vec![0u8; HEADER_LEN];
        raw[..QEMU_TEXT.len()].copy_from_slice(QEMU_TEXT);
        raw[0x188..0x198].copy_from_slice(&uuids[0]);
        raw[0x198..0x1A8].copy_from_slice(&uuids[1]);
        let mut h = Header {
            raw,
            image_type: if static_image {
                TYPE_STATIC
            } else {
                TYPE_DYNAMIC
            },
            offset_bmap,
            offset_data,
            disk_size,
            blocks_in_image: blocks,
            blocks_allocated: if static_image { blocks } else { 0 },
        };
        h.raw[0x48..0x4C].copy_from_slice(&0x180u32.to_le_bytes());
        h.raw[0x168..0x16C].copy_from_slice(&SECTOR_SIZE.to_le_bytes());
        h.raw[0x178..0x17C].copy_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
        h.raw = h.to_bytes();
        h
    }

    /// Whether every block was allocated at creation.
    pub fn is_static(&self) -> bool {
        self.image_type == TYPE_STATIC
    }

    /// Bytes of the block map (whole sectors).
    pub fn bmap_len(&self) -> u64 {
        bmap_bytes(self.blocks_in_image)
    }

    /// The header as stored: the bytes read, with the fields diskit keeps
    /// written back.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = self.raw.clone();
        b[0x40..0x44].copy_from_slice(&SIGNATURE.to_le_bytes());
        b[0x44..0x48].copy_from_slice(&VERSION.to_le_bytes());
        b[0x4C..0x50].copy_from_slice(&self.image_type.to_le_bytes());
        b[0x154..0x158].copy_from_slice(&self.offset_bmap.to_le_bytes());
        b[0x158..0x15C].copy_from_slice(&self.offset_data.to_le_bytes());
        b[0x170..0x178].copy_from_slice(&self.disk_size.to_le_bytes());
        b[0x180..0x184].copy_from_slice(&self.blocks_in_image.to_le_bytes());
        b[0x184..0x188].copy_from_slice(&self.blocks_allocated.to_le_bytes());
        b
    }
}

/// Bytes of a block map of `blocks` entries, in whole sectors.
pub fn bmap_bytes(blocks: u32) -> u64 {
    (blocks as u64 * 4).div_ceil(512) * 512
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_header_parses_back() {
        let h = Header::new(100 << 20, false, [[1; 16], [2; 16]]);
        let p = Header::parse(&h.to_bytes()).unwrap();
        assert_eq!(p, h);
        assert_eq!(p.blocks_in_image, 100);
        assert_eq!(p.offset_data, 1024);
    }

    #[test]
    fn hostile_fields_are_refused_by_name() {
        let good = Header::new(16 << 20, false, [[1; 16], [2; 16]]).to_bytes();
        type Mutation = fn(&mut Vec<u8>);
        let cases: &[(&str, Mutation)] = &[
            ("bad signature", |b| b[0x40] = 0),
            ("version 1.0", |b| {
                b[0x44..0x48].copy_from_slice(&0x10000u32.to_le_bytes())
            }),
            ("unaligned block map", |b| b[0x154] = 1),
            ("unaligned data", |b| b[0x158] = 1),
            ("sector size", |b| b[0x169] = 0x10),
            ("block size", |b| b[0x17A] = 0x20),
            ("image bitmap has room", |b| b[0x180] = 1),
            ("link UUID", |b| b[0x1A8] = 1),
            ("parent UUID", |b| b[0x1B8] = 1),
            ("max supported", |b| {
                b[0x170..0x178].copy_from_slice(&u64::MAX.to_le_bytes())
            }),
            ("too many blocks", |b| {
                b[0x180..0x184].copy_from_slice(&u32::MAX.to_le_bytes())
            }),
            ("overlap", |b| {
                b[0x158..0x15C].copy_from_slice(&512u32.to_le_bytes())
            }),
        ];
        for (msg, mutate) in cases {
            let mut b = good.clone();
            mutate(&mut b);
            let e = Header::parse(&b).unwrap_err().to_string();
            assert!(e.contains(msg), "{msg}: {e}");
        }
    }
}
