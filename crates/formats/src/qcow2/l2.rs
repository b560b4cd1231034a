//! L1 and L2 entries: decoding them into what a guest range is made of.
//!
//! This is where "where does this guest range live?" is answered for one
//! cluster: a host extent, zeros, the backing file, or a compressed cluster.
//! Every entry is validated here before anyone follows it.

use diskit_core::Result;

use super::layout::{Geometry, HostOffset};
use super::table::corrupt;

/// L1 entry: the L2 table offset bits.
pub const L1E_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L1 entry: reserved bits.
pub const L1E_RESERVED: u64 = 0x7f00_0000_0000_01ff;
/// L1/L2 entry: the cluster's refcount is exactly one.
pub const COPIED: u64 = 1 << 63;
/// L2 entry: the cluster is compressed.
pub const COMPRESSED: u64 = 1 << 62;
/// Standard L2 descriptor: the cluster reads as zeros (v3).
pub const ZERO: u64 = 1;
/// L2 entry: host cluster offset bits.
pub const L2E_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L2 entry: reserved bits of a standard descriptor.
pub const L2E_RESERVED: u64 = 0x3f00_0000_0000_01fe;

/// A compressed cluster's location: a byte range in the image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compressed {
    /// First byte of the compressed stream.
    pub offset: HostOffset,
    /// Bytes to read (the stream may end earlier).
    pub size: u64,
}

impl Compressed {
    /// Decodes a compressed descriptor (bits 0..=61 of the entry).
    pub fn decode(geo: &Geometry, entry: u64) -> Compressed {
        let shift = 62 - (geo.cluster_bits - 8);
        let offset = entry & ((1u64 << shift) - 1);
        let mask = (1u64 << (geo.cluster_bits - 8)) - 1;
        let sectors = ((entry >> shift) & mask) + 1;
        Compressed {
            offset: HostOffset(offset),
            size: sectors * 512 - (offset & 511),
        }
    }

    /// Encodes a descriptor for `size` bytes at `offset`.
    pub fn encode(geo: &Geometry, offset: HostOffset, size: u64) -> u64 {
        let shift = 62 - (geo.cluster_bits - 8);
        let last = (offset.0 + size - 1) / 512;
        let sectors_after = last - offset.0 / 512;
        COMPRESSED | (sectors_after << shift) | offset.0
    }

    /// The host byte range it covers, rounded out to 512-byte sectors
    /// (what the refcounts account for).
    pub fn sector_range(&self) -> (u64, u64) {
        let start = self.offset.0 & !511;
        (start, self.offset.0 + self.size)
    }
}

/// What a whole cluster is, from its L2 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterKind {
    /// No host cluster; without extended L2, reads fall through to the backing file.
    Unallocated,
    /// Reads as zeros, no host cluster.
    ZeroPlain,
    /// Reads as zeros, host cluster kept (preallocated).
    ZeroAlloc(HostOffset),
    /// Guest data at this host cluster.
    Normal(HostOffset),
    /// A compressed cluster.
    Compressed(Compressed),
}

impl ClusterKind {
    /// The host cluster, for kinds that have one.
    pub fn host(&self) -> Option<HostOffset> {
        match *self {
            ClusterKind::ZeroAlloc(h) | ClusterKind::Normal(h) => Some(h),
            _ => None,
        }
    }
}

/// One L2 entry: the descriptor word and, with extended L2, the subcluster bitmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L2Entry {
    /// The 64-bit descriptor.
    pub word: u64,
    /// Subcluster bitmap (extended L2 only): bits 0..32 allocated, 32..64 zero.
    pub bitmap: u64,
}

/// Everything `decode` needs besides the entry.
#[derive(Debug, Clone, Copy)]
pub struct DecodeContext {
    /// The image's geometry.
    pub geo: Geometry,
    /// Image version (zero flag is v3 only).
    pub version: u32,
    /// Host cluster 0 is valid (external data file).
    pub external_data: bool,
}

impl L2Entry {
    /// Decodes the entry for the guest cluster starting at `guest`
    /// (used in messages), validating every bit.
    pub fn decode(&self, cx: &DecodeContext, guest: u64) -> Result<ClusterKind> {
        let w = self.word;
        if w & COMPRESSED != 0 {
            if w & COPIED != 0 {
                return Err(corrupt(format!(
                    "compressed cluster at guest offset {guest:#x} has the COPIED flag"
                )));
            }
            if cx.geo.extended_l2 && self.bitmap != 0 {
                return Err(corrupt(format!(
                    "compressed cluster at guest offset {guest:#x} has a subcluster bitmap"
                )));
            }
            if cx.external_data {
                return Err(corrupt(format!(
                    "compressed cluster at guest offset {guest:#x} in an image with an external data file"
                )));
            }
            return Ok(ClusterKind::Compressed(Compressed::decode(&cx.geo, w)));
        }
        if w & L2E_RESERVED != 0 {
            return Err(corrupt(format!(
                "L2 entry {w:#018x} for guest offset {guest:#x} has reserved bits set"
            )));
        }
        let zero = w & ZERO != 0;
        if zero && (cx.version < 3 || cx.geo.extended_l2) {
            return Err(corrupt(format!(
                "L2 entry {w:#018x} for guest offset {guest:#x} has the zero flag where it is not allowed"
            )));
        }
        let offset = w & L2E_OFFSET_MASK;
        let has_host = offset != 0 || (cx.external_data && w & COPIED != 0);
        if has_host && offset & (cx.geo.cluster_size() - 1) != 0 {
            return Err(corrupt(format!(
                "cluster allocation offset {offset:#x} for guest offset {guest:#x} is unaligned"
            )));
        }
        if offset != 0 && offset < cx.geo.cluster_size() && !cx.external_data {
            return Err(corrupt(format!(
                "guest offset {guest:#x} maps onto the image header"
            )));
        }
        if cx.geo.extended_l2 {
            let alloc = self.bitmap & 0xffff_ffff;
            let zeros = self.bitmap >> 32;
            if alloc & zeros != 0 {
                return Err(corrupt(format!(
                    "subcluster bitmap {:#018x} for guest offset {guest:#x} marks a subcluster both allocated and zero",
                    self.bitmap
                )));
            }
            if !has_host && alloc != 0 {
                return Err(corrupt(format!(
                    "subcluster bitmap {:#018x} for guest offset {guest:#x} allocates subclusters of an unallocated cluster",
                    self.bitmap
                )));
            }
        }
        Ok(match (has_host, zero) {
            (false, false) => ClusterKind::Unallocated,
            (false, true) => ClusterKind::ZeroPlain,
            (true, true) => ClusterKind::ZeroAlloc(HostOffset(offset)),
            (true, false) => ClusterKind::Normal(HostOffset(offset)),
        })
    }
}

/// What a guest range reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Guest data at this host offset.
    Data(HostOffset),
    /// Guest data at this host offset in a cluster other images share
    /// (its entry lacks the copied flag: a snapshot maps it too).
    Shared(HostOffset),
    /// Zeros; `alloc` is the host space kept for it, if any.
    Zero {
        /// Host bytes reserved for the range (preallocated zero clusters).
        alloc: Option<HostOffset>,
    },
    /// Not allocated here: the backing file (or zeros without one).
    Backing {
        /// Host bytes already allocated for the range (extended L2).
        alloc: Option<HostOffset>,
    },
    /// Inside a compressed cluster, `skip` bytes from its start.
    Compressed {
        /// The compressed stream.
        stream: Compressed,
        /// Offset of the range within the decompressed cluster.
        skip: u64,
    },
}

impl Mapping {
    /// The same mapping `n` bytes further on, if mappings of this kind
    /// continue naturally (host offsets advance).
    pub fn advanced(&self, n: u64) -> Mapping {
        let adv = |h: Option<HostOffset>| h.map(|h| h + n);
        match *self {
            Mapping::Data(h) => Mapping::Data(h + n),
            Mapping::Shared(h) => Mapping::Shared(h + n),
            Mapping::Zero { alloc } => Mapping::Zero { alloc: adv(alloc) },
            Mapping::Backing { alloc } => Mapping::Backing { alloc: adv(alloc) },
            Mapping::Compressed { stream, skip } => Mapping::Compressed {
                stream,
                skip: skip + n,
            },
        }
    }

    /// Whether `next` continues `self` after `len` bytes: the same kind,
    /// with host offsets (if any) contiguous.
    pub fn continues(&self, len: u64, next: &Mapping) -> bool {
        match (self, next) {
            (Mapping::Compressed { .. }, _) => false,
            _ => self.advanced(len) == *next,
        }
    }
}

/// The mapping of the bytes `in_cluster..` of a cluster, and how many bytes
/// (at most `max`) share it.
pub fn map_in_cluster(
    geo: &Geometry,
    entry: &L2Entry,
    kind: ClusterKind,
    in_cluster: u64,
    max: u64,
) -> (u64, Mapping) {
    let cs = geo.cluster_size();
    let rest = (cs - in_cluster).min(max);
    let simple = |m: Mapping| (rest, m);
    // Data of a cluster without the copied flag is shared with others.
    let data = |h: HostOffset| {
        if entry.word & COPIED != 0 {
            Mapping::Data(h)
        } else {
            Mapping::Shared(h)
        }
    };
    match kind {
        ClusterKind::Compressed(stream) => simple(Mapping::Compressed {
            stream,
            skip: in_cluster,
        }),
        _ if geo.extended_l2 => {
            let scs = geo.subcluster_size();
            let host = kind.host();
            let state = |sc: u64| -> u8 {
                if entry.bitmap & (1 << (32 + sc)) != 0 {
                    0
                } else if entry.bitmap & (1 << sc) != 0 {
                    1
                } else {
                    2
                }
            };
            let first = in_cluster / scs;
            let s = state(first);
            let mut end = (first + 1) * scs;
            while end < in_cluster + rest && state(end / scs) == s {
                end += scs;
            }
            let len = (end - in_cluster).min(rest);
            let at = host.map(|h| h + in_cluster);
            let m = match s {
                0 => Mapping::Zero { alloc: at },
                1 => data(at.expect("validated: allocated subclusters have a host")),
                _ => Mapping::Backing { alloc: at },
            };
            (len, m)
        }
        ClusterKind::Unallocated => simple(Mapping::Backing { alloc: None }),
        ClusterKind::ZeroPlain => simple(Mapping::Zero { alloc: None }),
        ClusterKind::ZeroAlloc(h) => simple(Mapping::Zero {
            alloc: Some(h + in_cluster),
        }),
        ClusterKind::Normal(h) => simple(data(h + in_cluster)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(bits: u32, ext: bool) -> Geometry {
        Geometry {
            cluster_bits: bits,
            extended_l2: ext,
            size: 1 << 30,
        }
    }

    #[test]
    fn compressed_descriptors_as_qemu_writes_them() {
        // Observed from qemu-img 7.2 with 64 KiB clusters.
        let g = geo(16, false);
        let c = Compressed::decode(&g, 0x5100000000050000 & !COMPRESSED);
        assert_eq!(c.offset, HostOffset(0x50000));
        assert_eq!(c.size, 69 * 512);
        let c = Compressed::decode(&g, 0x4B0000000005881A & !COMPRESSED);
        assert_eq!(c.offset, HostOffset(0x5881A));
        assert_eq!(c.size, 45 * 512 - 0x1A);
        for (off, size) in [(0x50000u64, 35328u64), (0x5881A, 100), (0x12345, 65535)] {
            let e = Compressed::encode(&g, HostOffset(off), size);
            let d = Compressed::decode(&g, e & !COMPRESSED);
            assert_eq!(d.offset.0, off);
            assert!(d.size >= size && d.size < size + 512);
        }
    }

    /// How a v3 image with its data in the image file decodes entries.
    fn v3(geo: Geometry) -> DecodeContext {
        DecodeContext {
            geo,
            version: 3,
            external_data: false,
        }
    }

    #[test]
    fn subcluster_runs() {
        let g = geo(17, true);
        let cx = v3(g);
        // 4 KiB written at 4 KiB, zeroes at 64 KiB, as qemu-io makes them.
        let e = L2Entry {
            word: COPIED | 0x60000,
            bitmap: 0x0001_0000_0000_0002,
        };
        let k = e.decode(&cx, 0).unwrap();
        assert_eq!(k, ClusterKind::Normal(HostOffset(0x60000)));
        let scs = g.subcluster_size();
        assert_eq!(scs, 4096);
        let (n, m) = map_in_cluster(&g, &e, k, 0, 1 << 20);
        assert_eq!(
            (n, m),
            (
                4096,
                Mapping::Backing {
                    alloc: Some(HostOffset(0x60000))
                }
            )
        );
        let (n, m) = map_in_cluster(&g, &e, k, 4096, 1 << 20);
        assert_eq!((n, m), (4096, Mapping::Data(HostOffset(0x61000))));
        let (n, _) = map_in_cluster(&g, &e, k, 8192, 1 << 20);
        assert_eq!(n, 64 * 1024 - 8192);
        let (n, m) = map_in_cluster(&g, &e, k, 65536, 1 << 20);
        assert_eq!(
            (n, m),
            (
                4096,
                Mapping::Zero {
                    alloc: Some(HostOffset(0x70000))
                }
            )
        );
        // Both bits for one subcluster: refused.
        let bad = L2Entry {
            word: COPIED | 0x60000,
            bitmap: 0x0000_0001_0000_0001,
        };
        assert!(bad.decode(&cx, 0).is_err());
        // Allocated subclusters without a host cluster: refused.
        let bad = L2Entry { word: 0, bitmap: 1 };
        assert!(bad.decode(&cx, 0).is_err());
    }

    #[test]
    fn hostile_entries_are_refused() {
        let g = geo(16, false);
        let cx = v3(g);
        for w in [
            0x1234_5600u64 | COPIED,
            0x2 | 0x50000,
            0x100 | COPIED,
            1 << 58,
        ] {
            assert!(
                L2Entry { word: w, bitmap: 0 }.decode(&cx, 0).is_err(),
                "{w:#x}"
            );
        }
        let v2 = DecodeContext { version: 2, ..cx };
        assert!(
            L2Entry {
                word: ZERO,
                bitmap: 0
            }
            .decode(&v2, 0)
            .is_err()
        );
        assert_eq!(
            L2Entry {
                word: ZERO,
                bitmap: 0
            }
            .decode(&cx, 0)
            .unwrap(),
            ClusterKind::ZeroPlain
        );
    }
}
