//! The VHD footer and dynamic disk header: parsed and validated in one
//! place, and written; and the CHS geometry QEMU computes for a size.
//! Every integer is big-endian.

use diskit_core::{Error, ErrorKind, Result};

/// The footer's cookie.
pub const COOKIE: &[u8; 8] = b"conectix";
/// The dynamic header's cookie.
pub const DYN_COOKIE: &[u8; 8] = b"cxsparse";
/// Bytes of the footer.
pub const FOOTER_LEN: usize = 512;
/// Bytes of the dynamic header.
pub const DYN_LEN: usize = 1024;
/// A fixed disk.
pub const TYPE_FIXED: u32 = 2;
/// A dynamic disk.
pub const TYPE_DYNAMIC: u32 = 3;
/// The largest geometry, which marks a size given exactly.
pub const MAX_CHS_SECTORS: u64 = 65535 * 16 * 255;
/// The most sectors an image may have.
pub const MAX_SECTORS: u64 = 0xFF00_0000;
/// The block size QEMU creates dynamic images with.
pub const BLOCK_SIZE: u32 = 2 << 20;
/// Seconds from the Unix epoch to the VHD one (2000-01-01).
pub const EPOCH_2000: u64 = 946_684_800;

use crate::bytes::{be16, be32, be64};

/// The one's complement of the byte sum, the checksum field counted as
/// zeros.
pub fn checksum(b: &[u8], field: usize) -> u32 {
    let sum = b
        .iter()
        .enumerate()
        .filter(|(i, _)| !(field..field + 4).contains(i))
        .fold(0u32, |s, (_, &x)| s.wrapping_add(x as u32));
    !sum
}

/// Cylinders, heads, sectors per track.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chs {
    /// Cylinders.
    pub cylinders: u16,
    /// Heads.
    pub heads: u8,
    /// Sectors per track.
    pub sectors: u8,
}

impl Chs {
    /// Sectors the geometry addresses.
    pub fn total(self) -> u64 {
        self.cylinders as u64 * self.heads as u64 * self.sectors as u64
    }

    /// The VHD specification's geometry for `ts` sectors, with QEMU's
    /// clamp to the largest geometry.
    pub fn for_sectors(ts: u64) -> Chs {
        let ts = ts.min(MAX_CHS_SECTORS);
        let (spt, heads, cth);
        if ts >= 65535 * 16 * 63 {
            spt = 255;
            heads = 16;
            cth = ts / 255;
        } else {
            let mut s = 17u64;
            let mut c = ts / s;
            let mut h = c.div_ceil(1024).max(4);
            if c >= h * 1024 || h > 16 {
                s = 31;
                h = 16;
                c = ts / s;
            }
            if c >= h * 1024 {
                s = 63;
                h = 16;
                c = ts / s;
            }
            spt = s;
            heads = h;
            cth = c;
        }
        Chs {
            cylinders: (cth / heads) as u16,
            heads: heads as u8,
            sectors: spt as u8,
        }
    }
}

/// How the virtual size is read (QEMU's `force_size_calc` open option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SizeCalc {
    /// By the creating application (QEMU 10's rule).
    #[default]
    Auto,
    /// From the CHS geometry.
    Chs,
    /// From the footer's current size.
    CurrentSize,
}

impl SizeCalc {
    /// Parses `force_size_calc=`.
    pub fn parse(v: &str) -> Result<SizeCalc> {
        match v {
            "chs" => Ok(SizeCalc::Chs),
            "current_size" => Ok(SizeCalc::CurrentSize),
            _ => Err(Error::invalid(format!(
                "Invalid size calculation mode: '{v}'"
            ))),
        }
    }
}

/// A parsed, checked footer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footer {
    raw: Vec<u8>,
    /// Where the dynamic header is (all ones for fixed disks).
    pub data_offset: u64,
    /// The creating application, four characters.
    pub creator_app: [u8; 4],
    /// The size given at creation.
    pub current_size: u64,
    /// The geometry.
    pub chs: Chs,
    /// Fixed, dynamic or differencing.
    pub disk_type: u32,
}

impl Footer {
    /// Parses a footer (512 bytes), its cookie and checksum checked.
    pub fn parse(b: &[u8]) -> Result<Footer> {
        if b.len() < FOOTER_LEN || &b[..8] != COOKIE {
            return Err(Error::invalid("invalid VPC image"));
        }
        if be32(b, 64) != checksum(&b[..FOOTER_LEN], 64) {
            return Err(Error::invalid("Incorrect header checksum"));
        }
        Ok(Footer {
            raw: b[..FOOTER_LEN].to_vec(),
            data_offset: be64(b, 16),
            creator_app: b[28..32].try_into().expect("4 bytes"),
            current_size: be64(b, 48),
            chs: Chs {
                cylinders: be16(b, 56),
                heads: b[58],
                sectors: b[59],
            },
            disk_type: be32(b, 60),
        })
    }

    /// The virtual size in sectors, as QEMU 10 reads it: from the geometry
    /// for images made by Virtual PC or (older) QEMU, unless the geometry
    /// is the largest one; from the current size otherwise (Hyper-V,
    /// Azure, disk2vhd, QEMU with force_size, anything else).
    pub fn total_sectors(&self, calc: SizeCalc) -> u64 {
        let chs_app = match calc {
            SizeCalc::Auto => matches!(&self.creator_app, b"vpc " | b"qemu"),
            SizeCalc::Chs => true,
            SizeCalc::CurrentSize => false,
        };
        if chs_app && self.chs.total() != MAX_CHS_SECTORS {
            self.chs.total()
        } else {
            self.current_size / 512
        }
    }

    /// A new footer as QEMU writes it.
    pub fn new(
        size: u64,
        chs: Chs,
        disk_type: u32,
        forced: bool,
        uuid: [u8; 16],
        now: u64,
    ) -> Footer {
        let mut b = vec![0u8; FOOTER_LEN];
        b[..8].copy_from_slice(COOKIE);
        b[8..12].copy_from_slice(&2u32.to_be_bytes());
        b[12..16].copy_from_slice(&0x0001_0000u32.to_be_bytes());
        let data_offset = if disk_type == TYPE_FIXED {
            u64::MAX
        } else {
            FOOTER_LEN as u64
        };
        b[16..24].copy_from_slice(&data_offset.to_be_bytes());
        b[24..28].copy_from_slice(&(now.saturating_sub(EPOCH_2000) as u32).to_be_bytes());
        let app = if forced { *b"qem2" } else { *b"qemu" };
        b[28..32].copy_from_slice(&app);
        b[32..36].copy_from_slice(&[0, 5, 0, 3]);
        b[36..40].copy_from_slice(b"Wi2k");
        b[40..48].copy_from_slice(&size.to_be_bytes());
        b[48..56].copy_from_slice(&size.to_be_bytes());
        b[56..58].copy_from_slice(&chs.cylinders.to_be_bytes());
        b[58] = chs.heads;
        b[59] = chs.sectors;
        b[60..64].copy_from_slice(&disk_type.to_be_bytes());
        b[68..84].copy_from_slice(&uuid);
        let sum = checksum(&b, 64);
        b[64..68].copy_from_slice(&sum.to_be_bytes());
        Footer::parse(&b).expect("a footer diskit makes parses")
    }

    /// The footer as stored.
    pub fn to_bytes(&self) -> &[u8] {
        &self.raw
    }
}

/// The dynamic disk header's fields diskit uses, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynHeader {
    /// Where the block allocation table is.
    pub table_offset: u64,
    /// Entries of the table.
    pub max_table_entries: u32,
    /// Bytes of a block (a power of two, at least 512).
    pub block_size: u32,
}

impl DynHeader {
    /// Parses the dynamic header for an image of `total_bytes`.
    pub fn parse(b: &[u8], total_bytes: u64) -> Result<DynHeader> {
        if b.len() < DYN_LEN || &b[..8] != DYN_COOKIE {
            return Err(Error::invalid("Invalid header magic"));
        }
        let block_size = be32(b, 32);
        if !block_size.is_power_of_two() || block_size < 512 {
            return Err(Error::invalid(format!("Invalid block size {block_size}")));
        }
        if total_bytes / block_size as u64 > u32::MAX as u64 {
            return Err(Error::invalid("Too many blocks"));
        }
        let max_table_entries = be32(b, 28);
        if (max_table_entries as u64) * (block_size as u64) < total_bytes {
            return Err(Error::invalid("Page table too small"));
        }
        if max_table_entries > (i32::MAX / 4) as u32 {
            return Err(Error::invalid(format!(
                "Max Table Entries too large ({max_table_entries})"
            )));
        }
        Ok(DynHeader {
            table_offset: be64(b, 16),
            max_table_entries,
            block_size,
        })
    }

    /// A new dynamic header as QEMU writes it, for `entries` blocks.
    pub fn bytes(entries: u32) -> Vec<u8> {
        let mut b = vec![0u8; DYN_LEN];
        b[..8].copy_from_slice(DYN_COOKIE);
        b[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        b[16..24].copy_from_slice(&((FOOTER_LEN + DYN_LEN) as u64).to_be_bytes());
        b[24..28].copy_from_slice(&0x0001_0000u32.to_be_bytes());
        b[28..32].copy_from_slice(&entries.to_be_bytes());
        b[32..36].copy_from_slice(&BLOCK_SIZE.to_be_bytes());
        let sum = checksum(&b, 36);
        b[36..40].copy_from_slice(&sum.to_be_bytes());
        b
    }
}

/// The error QEMU gives for an image over its sector limit.
pub fn too_large() -> Error {
    Error::new(ErrorKind::Overflow, "File too large")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_as_qemu_computes_it() {
        // (requested bytes, C/H/S qemu-img chose, bytes it gave).
        for (bytes, c, h, s, got) in [
            (16u64 << 20, 482u16, 4u8, 17u8, 16_781_312u64),
            (100 << 20, 1004, 12, 17, 104_865_792),
            (1 << 30, 2081, 16, 63, 1_073_995_776),
        ] {
            let ts = bytes / 512;
            let mut i = 0;
            let chs = loop {
                let g = Chs::for_sectors(ts + i);
                if g.total() >= ts {
                    break g;
                }
                i += 1;
            };
            assert_eq!(
                chs,
                Chs {
                    cylinders: c,
                    heads: h,
                    sectors: s
                },
                "{bytes}"
            );
            assert_eq!(chs.total() * 512, got);
        }
    }

    #[test]
    fn a_new_footer_parses_and_checks() {
        let f = Footer::new(
            1 << 20,
            Chs::for_sectors(2048),
            TYPE_DYNAMIC,
            false,
            [7; 16],
            1_800_000_000,
        );
        let mut b = f.to_bytes().to_vec();
        assert_eq!(Footer::parse(&b).unwrap(), f);
        b[100] ^= 1;
        assert!(
            Footer::parse(&b)
                .unwrap_err()
                .to_string()
                .contains("checksum")
        );
    }
}
