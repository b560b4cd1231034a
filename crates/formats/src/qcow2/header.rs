//! The qcow2 header and its extensions: parsed and validated in one place.
//!
//! Incompatible feature bits are allow-listed: an image with any other bit
//! set is refused, naming the bit (by the image's own feature-name table
//! when it has one). Every offset and size is checked against the limits
//! QEMU enforces before it is used.

use super::table::{be32, be64};
use diskit_core::{Error, ErrorKind, Result};

/// The magic at the start of every qcow2 image: "QFI\xfb".
pub const MAGIC: [u8; 4] = *b"QFI\xfb";

/// Incompatible feature bits.
pub mod incompat {
    /// Refcounts may be stale (lazy refcounts in use).
    pub const DIRTY: u64 = 1 << 0;
    /// Metadata is known to be corrupt.
    pub const CORRUPT: u64 = 1 << 1;
    /// Guest data lives in an external data file.
    pub const EXTERNAL_DATA: u64 = 1 << 2;
    /// The compression type field is not zlib.
    pub const COMPRESSION_TYPE: u64 = 1 << 3;
    /// L2 entries are 128 bits with subcluster bitmaps.
    pub const EXTENDED_L2: u64 = 1 << 4;
    /// Every incompatible bit this implementation understands.
    pub const KNOWN: u64 = DIRTY | CORRUPT | EXTERNAL_DATA | COMPRESSION_TYPE | EXTENDED_L2;
}

/// Compatible feature bits.
pub mod compat {
    /// Refcount updates may be deferred.
    pub const LAZY_REFCOUNTS: u64 = 1 << 0;
}

/// Autoclear feature bits.
pub mod autoclear {
    /// The bitmaps extension is consistent.
    pub const BITMAPS: u64 = 1 << 0;
    /// The external data file is a valid raw image by itself.
    pub const RAW_EXTERNAL: u64 = 1 << 1;
    /// Every autoclear bit this implementation understands.
    pub const KNOWN: u64 = BITMAPS | RAW_EXTERNAL;
}

/// Header extension types.
pub mod ext {
    /// End of the extension area.
    pub const END: u32 = 0;
    /// Backing file format name.
    pub const BACKING_FORMAT: u32 = 0xE279_2ACA;
    /// Feature name table.
    pub const FEATURE_TABLE: u32 = 0x6803_F857;
    /// Persistent bitmaps.
    pub const BITMAPS: u32 = 0x2385_2875;
    /// Full disk encryption header pointer.
    pub const CRYPTO: u32 = 0x0537_BE77;
    /// External data file name.
    pub const DATA_FILE: u32 = 0x4441_5441;
}

/// Compression of compressed clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompressionType {
    /// Raw deflate with a 4 KiB window ("zlib").
    Zlib,
    /// One zstd frame per cluster.
    Zstd,
}

/// One header extension, kept verbatim so that unknown ones survive rewrites.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderExtension {
    /// Extension type.
    pub kind: u32,
    /// Payload (without padding).
    pub data: Vec<u8>,
}

/// A parsed, validated qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Offset of the backing file name in the file (0: none).
    pub backing_file_offset: u64,
    /// Length of the backing file name.
    pub backing_file_size: u32,
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// Virtual size in bytes.
    pub size: u64,
    /// Encryption method (0 none, 1 AES, 2 LUKS).
    pub crypt_method: u32,
    /// Active L1 entries.
    pub l1_size: u32,
    /// Offset of the active L1 table.
    pub l1_table_offset: u64,
    /// Offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Clusters of the refcount table.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// Offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Incompatible feature bits.
    pub incompatible_features: u64,
    /// Compatible feature bits.
    pub compatible_features: u64,
    /// Autoclear feature bits.
    pub autoclear_features: u64,
    /// log2 of the refcount width in bits (0..=6).
    pub refcount_order: u32,
    /// Length of the header proper.
    pub header_length: u32,
    /// Compression type of compressed clusters.
    pub compression_type: CompressionType,
    /// Header bytes past the fields this implementation knows (kept verbatim).
    pub extra_header: Vec<u8>,
    /// Header extensions, in file order.
    pub extensions: Vec<HeaderExtension>,
    /// Backing file name, if any.
    pub backing_file: Option<String>,
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::io(msg)
}

impl Header {
    /// The cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Whether L2 entries are extended (128-bit, with subclusters).
    pub fn extended_l2(&self) -> bool {
        self.incompatible_features & incompat::EXTENDED_L2 != 0
    }

    /// Entries per L2 table.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / if self.extended_l2() { 16 } else { 8 }
    }

    /// Refcount width in bits.
    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// The extension of type `kind`, if present.
    pub fn extension(&self, kind: u32) -> Option<&HeaderExtension> {
        self.extensions.iter().find(|e| e.kind == kind)
    }

    /// The backing file format named in the header, if any.
    pub fn backing_format(&self) -> Option<String> {
        self.extension(ext::BACKING_FORMAT)
            .map(|e| String::from_utf8_lossy(&e.data).into_owned())
    }

    /// The name the image's own feature table gives a feature bit.
    pub fn feature_name(&self, table_type: u8, bit: u8) -> Option<String> {
        let table = self.extension(ext::FEATURE_TABLE)?;
        table
            .data
            .chunks_exact(48)
            .find(|e| e[0] == table_type && e[1] == bit)
            .map(|e| {
                let name = &e[2..];
                let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
                String::from_utf8_lossy(&name[..end]).into_owned()
            })
    }

    /// Parses and validates a header from the first cluster of an image
    /// (`cluster0` must hold at least the first cluster, or the whole file
    /// if it is shorter).
    pub fn parse(cluster0: &[u8]) -> Result<Header> {
        if cluster0.len() < 72 || cluster0[..4] != MAGIC {
            return Err(Error::invalid("Image is not in qcow2 format"));
        }
        let version = be32(cluster0, 4);
        if version != 2 && version != 3 {
            return Err(Error::unsupported(format!(
                "Unsupported qcow2 version {version}"
            )));
        }
        let cluster_bits = be32(cluster0, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(corrupt(format!(
                "Unsupported cluster size: 2^{cluster_bits}"
            )));
        }
        let cluster_size = 1usize << cluster_bits;
        let mut h = Header {
            version,
            backing_file_offset: be64(cluster0, 8),
            backing_file_size: be32(cluster0, 16),
            cluster_bits,
            size: be64(cluster0, 24),
            crypt_method: be32(cluster0, 32),
            l1_size: be32(cluster0, 36),
            l1_table_offset: be64(cluster0, 40),
            refcount_table_offset: be64(cluster0, 48),
            refcount_table_clusters: be32(cluster0, 56),
            nb_snapshots: be32(cluster0, 60),
            snapshots_offset: be64(cluster0, 64),
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: 72,
            compression_type: CompressionType::Zlib,
            extra_header: Vec::new(),
            extensions: Vec::new(),
            backing_file: None,
        };
        if version == 3 {
            if cluster0.len() < 104 {
                return Err(corrupt("qcow2 header truncated"));
            }
            h.incompatible_features = be64(cluster0, 72);
            h.compatible_features = be64(cluster0, 80);
            h.autoclear_features = be64(cluster0, 88);
            h.refcount_order = be32(cluster0, 96);
            h.header_length = be32(cluster0, 100);
            if h.header_length < 104 || !h.header_length.is_multiple_of(8) {
                return Err(corrupt(format!(
                    "Invalid qcow2 header length {}",
                    h.header_length
                )));
            }
            if h.header_length as usize > cluster_size || h.header_length as usize > cluster0.len()
            {
                return Err(corrupt("qcow2 header exceeds cluster size"));
            }
            if h.header_length > 104 {
                h.compression_type = match cluster0[104] {
                    0 => CompressionType::Zlib,
                    1 => CompressionType::Zstd,
                    t => return Err(Error::unsupported(format!("Unknown compression type {t}"))),
                };
                let known_end = (h.header_length as usize).min(112);
                if cluster0[105..known_end].iter().any(|&b| b != 0) {
                    return Err(corrupt("qcow2 header padding is not zero"));
                }
                h.extra_header = cluster0[known_end..h.header_length as usize].to_vec();
            }
        }
        h.read_extensions(cluster0)?;
        h.validate(cluster0)?;
        Ok(h)
    }

    /// Serialises the header into cluster 0 as QEMU's `qcow2_update_header`
    /// writes it: the fixed fields (72 bytes for v2; for v3 112 bytes plus
    /// any unknown header bytes kept in [`Header::extra_header`]), the
    /// extensions in the order of [`Header::extensions`], the end marker,
    /// then the backing file name right after it. The rest of the cluster is
    /// zero. `header_length`, `backing_file_offset` and `backing_file_size`
    /// are computed, not taken from the struct.
    ///
    /// Fails with [`ErrorKind::NoSpace`](diskit_core::ErrorKind::NoSpace)
    /// when everything does not fit in one cluster, as QEMU does.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let no_space = || Error::from_kind(diskit_core::ErrorKind::NoSpace);
        if !(9..=21).contains(&self.cluster_bits) {
            return Err(Error::invalid(format!(
                "Unsupported cluster size: 2^{}",
                self.cluster_bits
            )));
        }
        let cluster_size = 1usize << self.cluster_bits;
        let mut buf = vec![0u8; cluster_size];
        let put32 =
            |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_be_bytes());
        let put64 =
            |b: &mut [u8], at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_be_bytes());
        buf[..4].copy_from_slice(&MAGIC);
        put32(&mut buf, 4, self.version);
        put32(&mut buf, 20, self.cluster_bits);
        put64(&mut buf, 24, self.size);
        put32(&mut buf, 32, self.crypt_method);
        put32(&mut buf, 36, self.l1_size);
        put64(&mut buf, 40, self.l1_table_offset);
        put64(&mut buf, 48, self.refcount_table_offset);
        put32(&mut buf, 56, self.refcount_table_clusters);
        put32(&mut buf, 60, self.nb_snapshots);
        put64(&mut buf, 64, self.snapshots_offset);
        let mut at = match self.version {
            2 => 72,
            3 => {
                let header_length = 112 + self.extra_header.len();
                if header_length > cluster_size {
                    return Err(no_space());
                }
                put64(&mut buf, 72, self.incompatible_features);
                put64(&mut buf, 80, self.compatible_features);
                put64(&mut buf, 88, self.autoclear_features);
                put32(&mut buf, 96, self.refcount_order);
                put32(&mut buf, 100, header_length as u32);
                buf[104] = match self.compression_type {
                    CompressionType::Zlib => 0,
                    CompressionType::Zstd => 1,
                };
                buf[112..header_length].copy_from_slice(&self.extra_header);
                header_length
            }
            v => {
                return Err(Error::unsupported(format!("Unsupported qcow2 version {v}")));
            }
        };
        let end = HeaderExtension {
            kind: ext::END,
            data: Vec::new(),
        };
        for e in self.extensions.iter().chain(std::iter::once(&end)) {
            let len = 8 + e.data.len().next_multiple_of(8);
            if cluster_size - at < len {
                return Err(no_space());
            }
            put32(&mut buf, at, e.kind);
            put32(&mut buf, at + 4, e.data.len() as u32);
            buf[at + 8..at + 8 + e.data.len()].copy_from_slice(&e.data);
            at += len;
        }
        if let Some(name) = &self.backing_file {
            let name = name.as_bytes();
            if cluster_size - at < name.len() {
                return Err(no_space());
            }
            buf[at..at + name.len()].copy_from_slice(name);
            put64(&mut buf, 8, at as u64);
            put32(&mut buf, 16, name.len() as u32);
        }
        Ok(buf)
    }

    fn read_extensions(&mut self, cluster0: &[u8]) -> Result<()> {
        let cluster_size = self.cluster_size() as usize;
        // The area ends at the backing file name, or at the end of cluster 0.
        let mut end = cluster0.len().min(cluster_size);
        if self.backing_file_offset != 0 && (self.backing_file_offset as usize) < end {
            end = self.backing_file_offset as usize;
        }
        let mut at = self.header_length as usize;
        while at + 8 <= end {
            let kind = be32(cluster0, at);
            let len = be32(cluster0, at + 4) as usize;
            at += 8;
            if kind == ext::END {
                break;
            }
            if len > end - at {
                return Err(corrupt(format!(
                    "qcow2 header extension 0x{kind:08x} overflows the header"
                )));
            }
            if self.extensions.iter().any(|e| e.kind == kind) {
                return Err(corrupt(format!(
                    "qcow2 header extension 0x{kind:08x} appears twice"
                )));
            }
            self.extensions.push(HeaderExtension {
                kind,
                data: cluster0[at..at + len].to_vec(),
            });
            at += len.next_multiple_of(8);
        }
        Ok(())
    }

    fn validate(&mut self, cluster0: &[u8]) -> Result<()> {
        let cs = self.cluster_size();
        // Feature bits: allow-list, naming any unknown bit.
        let unknown = self.incompatible_features & !incompat::KNOWN;
        if unknown != 0 {
            let names: Vec<String> = (0..64)
                .filter(|b| unknown & (1 << b) != 0)
                .map(|b| {
                    self.feature_name(0, b as u8)
                        .unwrap_or_else(|| format!("Unknown incompatible feature: {:x}", 1u64 << b))
                })
                .collect();
            return Err(Error::unsupported(format!(
                "Unsupported qcow2 feature(s): {}",
                names.join(", ")
            )));
        }
        if self.version == 2 && self.refcount_order != 4 {
            return Err(corrupt("qcow2 v2 images must use 16-bit refcounts"));
        }
        if self.refcount_order > 6 {
            return Err(corrupt(format!(
                "Invalid refcount order {}",
                self.refcount_order
            )));
        }
        let zstd = self.compression_type == CompressionType::Zstd;
        if zstd != (self.incompatible_features & incompat::COMPRESSION_TYPE != 0) {
            return Err(corrupt(
                "compression type bit and compression type field disagree",
            ));
        }
        if self.extended_l2() && self.cluster_bits < 14 {
            return Err(corrupt(
                "Extended L2 entries need clusters of at least 16 KiB",
            ));
        }
        if self.crypt_method > super::crypt::LUKS {
            return Err(Error::unsupported(format!(
                "Unsupported encryption method: {}",
                self.crypt_method
            )));
        }
        if self.size > i64::MAX as u64 {
            return Err(corrupt("Image size too large"));
        }
        // Table placement.
        for (what, off, empty_ok) in [
            // A zero-size image has no L1 table: QEMU writes offset 0.
            ("L1 table", self.l1_table_offset, self.l1_size == 0),
            ("refcount table", self.refcount_table_offset, false),
        ] {
            if off % cs != 0 || (off == 0 && !empty_ok) {
                return Err(corrupt(format!("{what} offset {off:#x} is invalid")));
            }
        }
        if self.nb_snapshots > 0
            && (!self.snapshots_offset.is_multiple_of(cs) || self.snapshots_offset == 0)
        {
            return Err(corrupt("snapshot table offset is invalid"));
        }
        if self.refcount_table_clusters == 0 {
            return Err(corrupt("Image does not contain a reference count table"));
        }
        if self.refcount_table_clusters as u64 * cs > 8 << 20 {
            return Err(corrupt("Reference count table too large"));
        }
        // L1 large enough for the size, and bounded.
        let per_l1 = cs * self.l2_entries();
        let needed = self.size.div_ceil(per_l1);
        // QEMU's order: a size no L1 table index can reach first.
        if needed > i32::MAX as u64 {
            return Err(Error::new(
                ErrorKind::Overflow,
                format!("Image is too big (virtual size {} bytes)", self.size),
            ));
        }
        if (self.l1_size as u64) < needed {
            return Err(corrupt("L1 table is too small"));
        }
        if self.l1_size as u64 * 8 > 32 << 20 {
            return Err(corrupt("Active L1 table too large"));
        }
        // Backing file name, inside cluster 0.
        if self.backing_file_offset != 0 {
            let start = self.backing_file_offset;
            let len = self.backing_file_size as u64;
            if len > 1023 || start > cs || start + len > cs || start + len > cluster0.len() as u64 {
                return Err(corrupt("Backing file name is invalid or too long"));
            }
            let name = &cluster0[start as usize..(start + len) as usize];
            self.backing_file = Some(String::from_utf8_lossy(name).into_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
