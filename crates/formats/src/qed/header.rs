//! The QED header: parsed and validated in one place (QEMU's checks, in
//! its order, with its messages), and written. 64 bytes, little-endian;
//! the backing file name follows inside the header cluster.

use diskit_core::{Error, ErrorKind, Result};

/// "QED\0".
pub const MAGIC: u32 = 0x0044_4551;
/// Bytes of the header proper.
pub const HEADER_LEN: usize = 64;
/// The image has a backing file.
pub const F_BACKING_FILE: u64 = 1;
/// The image may be inconsistent (allocating writes were in flight).
pub const F_NEED_CHECK: u64 = 2;
/// The backing file is raw: do not probe it.
pub const F_BACKING_FORMAT_NO_PROBE: u64 = 4;
/// Every feature bit known.
pub const FEATURES: u64 = 7;
/// Cluster sizes allowed.
pub const MIN_CLUSTER: u32 = 4096;
/// The largest cluster.
pub const MAX_CLUSTER: u32 = 64 << 20;
/// The largest table size, in clusters.
pub const MAX_TABLE: u32 = 16;
/// The longest backing file name QEMU reads.
pub const MAX_BACKING_NAME: u32 = 4095;

/// A parsed, validated QED header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Bytes of a cluster.
    pub cluster_size: u32,
    /// Clusters of each L1 and L2 table.
    pub table_size: u32,
    /// Clusters of the header.
    pub header_size: u32,
    /// Feature bits.
    pub features: u64,
    /// Compatible feature bits (none defined).
    pub compat_features: u64,
    /// Autoclear feature bits (none defined).
    pub autoclear_features: u64,
    /// Where the L1 table is.
    pub l1_table_offset: u64,
    /// The virtual size.
    pub image_size: u64,
    /// Where the backing file name is.
    pub backing_filename_offset: u32,
    /// Its length.
    pub backing_filename_size: u32,
}

use crate::bytes::{le32, le64};

/// The largest virtual size for a geometry, computed as QEMU computes it
/// (in 64 bits, wrapping: large clusters give 0, and no size at all).
pub fn max_image_size(cluster_size: u32, table_size: u32) -> u64 {
    let entries = table_size as u64 * cluster_size as u64 / 8;
    entries
        .wrapping_mul(entries)
        .wrapping_mul(cluster_size as u64)
}

impl Header {
    /// Parses and validates the header in `b` (at least 64 bytes) of a
    /// file of `file_len` bytes.
    pub fn parse(b: &[u8], file_len: u64) -> Result<Header> {
        if b.len() < HEADER_LEN {
            return Err(Error::invalid("Failed to read QED header"));
        }
        if le32(b, 0) != MAGIC {
            return Err(Error::invalid("Image not in QED format"));
        }
        let h = Header {
            cluster_size: le32(b, 4),
            table_size: le32(b, 8),
            header_size: le32(b, 12),
            features: le64(b, 16),
            compat_features: le64(b, 24),
            autoclear_features: le64(b, 32),
            l1_table_offset: le64(b, 40),
            image_size: le64(b, 48),
            backing_filename_offset: le32(b, 56),
            backing_filename_size: le32(b, 60),
        };
        if h.features & !FEATURES != 0 {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!("Unsupported QED features: {:x}", h.features & !FEATURES),
            ));
        }
        let cs = h.cluster_size;
        if !cs.is_power_of_two() || !(MIN_CLUSTER..=MAX_CLUSTER).contains(&cs) {
            return Err(Error::invalid("QED cluster size is invalid"));
        }
        let file_size = file_len / cs as u64 * cs as u64;
        if !h.table_size.is_power_of_two() || h.table_size > MAX_TABLE {
            return Err(Error::invalid("QED table size is invalid"));
        }
        if !h.image_size.is_multiple_of(512) || h.image_size > max_image_size(cs, h.table_size) {
            return Err(Error::invalid("QED image size is invalid"));
        }
        if !h.table_offset_ok(h.l1_table_offset, file_size) {
            return Err(Error::invalid("QED table offset is invalid"));
        }
        if h.header_size as u64 > u32::MAX as u64 / cs as u64 {
            return Err(Error::invalid("QED header size is too large"));
        }
        if h.features & F_BACKING_FILE != 0 {
            let end = h.backing_filename_offset as u64 + h.backing_filename_size as u64;
            if end > cs as u64 * h.header_size as u64 {
                return Err(Error::invalid("QED backing filename offset is invalid"));
            }
            if h.backing_filename_size > MAX_BACKING_NAME {
                return Err(Error::invalid("Failed to read backing filename"));
            }
        }
        Ok(h)
    }

    /// Whether a table may start at `off` (QEMU's test: aligned, after the
    /// header, and the whole table before the end of the file; a table of
    /// one cluster fails it, as in QEMU).
    pub fn table_offset_ok(&self, off: u64, file_size: u64) -> bool {
        let cs = self.cluster_size as u64;
        let end = match off.checked_add((self.table_size as u64 - 1) * cs) {
            Some(e) if e > off => e,
            _ => return false,
        };
        off.is_multiple_of(cs)
            && off >= self.header_size as u64 * cs
            && off < file_size
            && end < file_size
    }

    /// Whether a data cluster may be at `off` (aligned, after the header,
    /// inside the file).
    pub fn cluster_offset_ok(&self, off: u64, file_size: u64) -> bool {
        let cs = self.cluster_size as u64;
        off.is_multiple_of(cs) && off >= self.header_size as u64 * cs && off < file_size
    }

    /// Entries of a table.
    pub fn table_entries(&self) -> u64 {
        self.table_size as u64 * self.cluster_size as u64 / 8
    }

    /// Bytes of a table.
    pub fn table_bytes(&self) -> u64 {
        self.table_size as u64 * self.cluster_size as u64
    }

    /// Guest bytes one L2 table maps.
    pub fn l2_span(&self) -> u64 {
        self.table_entries() * self.cluster_size as u64
    }

    /// The 64 bytes as stored.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.cluster_size.to_le_bytes());
        b[8..12].copy_from_slice(&self.table_size.to_le_bytes());
        b[12..16].copy_from_slice(&self.header_size.to_le_bytes());
        b[16..24].copy_from_slice(&self.features.to_le_bytes());
        b[24..32].copy_from_slice(&self.compat_features.to_le_bytes());
        b[32..40].copy_from_slice(&self.autoclear_features.to_le_bytes());
        b[40..48].copy_from_slice(&self.l1_table_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.image_size.to_le_bytes());
        b[56..60].copy_from_slice(&self.backing_filename_offset.to_le_bytes());
        b[60..64].copy_from_slice(&self.backing_filename_size.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Header {
        Header {
            cluster_size: 65536,
            table_size: 4,
            header_size: 1,
            features: 0,
            compat_features: 0,
            autoclear_features: 0,
            l1_table_offset: 65536,
            image_size: 16 << 20,
            backing_filename_offset: 0,
            backing_filename_size: 0,
        }
    }

    #[test]
    fn a_header_parses_back_and_hostile_fields_are_named() {
        let len = 5 * 65536;
        let h = good();
        assert_eq!(Header::parse(&h.to_bytes(), len).unwrap(), h);
        type Mutation = Box<dyn Fn(&mut Header)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("features: 8", Box::new(|h| h.features = 8)),
            ("cluster size", Box::new(|h| h.cluster_size = 1000)),
            ("table size", Box::new(|h| h.table_size = 3)),
            ("image size", Box::new(|h| h.image_size = 1 << 60)),
            ("image size", Box::new(|h| h.image_size = 1000)),
            ("table offset", Box::new(|h| h.l1_table_offset = 4096)),
            ("table offset", Box::new(|h| h.l1_table_offset = 1 << 40)),
            ("table offset", Box::new(|h| h.table_size = 1)),
            (
                "backing filename offset",
                Box::new(|h| {
                    h.features = 1;
                    h.backing_filename_offset = 65530;
                    h.backing_filename_size = 100;
                }),
            ),
        ];
        for (msg, mutate) in cases {
            let mut h = good();
            mutate(&mut h);
            let e = Header::parse(&h.to_bytes(), len).unwrap_err().to_string();
            assert!(e.contains(msg), "{msg}: {e}");
        }
        // QEMU's arithmetic wraps for the largest geometries.
        assert_eq!(max_image_size(64 << 20, 4), 0);
        assert_eq!(max_image_size(65536, 4), 1 << 46);
    }
}
