//! Offset spaces and the geometry that maps between them.
//!
//! A guest offset is a byte in the disk the guest sees; a host offset is a
//! byte in the image file (or its external data file). They never mix: each
//! has its own type, and [`Geometry`] is the only place that turns one into
//! table indices.

use std::fmt;

use super::header::Header;

/// A byte offset in the guest's view of the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GuestOffset(pub u64);

/// A byte offset in the image file (or the external data file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostOffset(pub u64);

/// The index of a host cluster (host offset / cluster size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostCluster(pub u64);

impl fmt::Display for HostOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl std::ops::Add<u64> for HostOffset {
    type Output = HostOffset;

    /// The offset `n` bytes further on.
    fn add(self, n: u64) -> HostOffset {
        HostOffset(self.0 + n)
    }
}

/// The shape of an image: cluster size, L2 layout and virtual size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Whether L2 entries carry subcluster bitmaps.
    pub extended_l2: bool,
    /// Virtual size in bytes.
    pub size: u64,
}

/// Subclusters per cluster with extended L2 entries.
pub const SUBCLUSTERS: u64 = 32;

impl Geometry {
    /// The geometry described by a validated header.
    pub fn of(header: &Header) -> Geometry {
        Geometry {
            cluster_bits: header.cluster_bits,
            extended_l2: header.extended_l2(),
            size: header.size,
        }
    }

    /// Bytes per cluster.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Bytes of one L2 entry (8, or 16 with subcluster bitmaps).
    pub fn l2_entry_bytes(&self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// Entries per L2 table.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_bytes()
    }

    /// Guest bytes covered by one L2 table.
    pub fn l2_coverage(&self) -> u64 {
        self.l2_entries() << self.cluster_bits
    }

    /// Subclusters per cluster (1 without extended L2).
    pub fn subclusters(&self) -> u64 {
        if self.extended_l2 { SUBCLUSTERS } else { 1 }
    }

    /// Bytes per subcluster (the cluster size without extended L2).
    pub fn subcluster_size(&self) -> u64 {
        self.cluster_size() / self.subclusters()
    }

    /// The L1 index of a guest offset.
    pub fn l1_index(&self, g: GuestOffset) -> usize {
        (g.0 / self.l2_coverage()) as usize
    }

    /// The L2 index of a guest offset.
    pub fn l2_index(&self, g: GuestOffset) -> usize {
        ((g.0 >> self.cluster_bits) % self.l2_entries()) as usize
    }

    /// The guest cluster number of a guest offset.
    pub fn guest_cluster(&self, g: GuestOffset) -> u64 {
        g.0 >> self.cluster_bits
    }

    /// The offset of `g` within its cluster.
    pub fn in_cluster(&self, g: GuestOffset) -> u64 {
        g.0 & (self.cluster_size() - 1)
    }

    /// The start of the cluster holding `g`.
    pub fn cluster_start(&self, g: GuestOffset) -> GuestOffset {
        GuestOffset(g.0 & !(self.cluster_size() - 1))
    }

    /// The host cluster holding a host offset.
    pub fn host_cluster(&self, h: HostOffset) -> HostCluster {
        HostCluster(h.0 >> self.cluster_bits)
    }

    /// The first byte of a host cluster.
    pub fn host_offset(&self, c: HostCluster) -> HostOffset {
        HostOffset(c.0 << self.cluster_bits)
    }

    /// Whether a host offset is cluster aligned.
    pub fn is_cluster_aligned(&self, h: HostOffset) -> bool {
        h.0 & (self.cluster_size() - 1) == 0
    }

    /// L1 entries needed for the virtual size.
    pub fn l1_entries_needed(&self) -> u64 {
        self.size.div_ceil(self.l2_coverage())
    }
}
