//! What checking an image finds and repairs, in qemu-img's terms (the
//! formats that can be checked fill it in).

/// What to repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// Report only.
    None,
    /// Drop references counted but not made (leaks).
    Leaks,
    /// Leaks and every other refcount or COPIED flag error.
    All,
}

/// The outcome of a check, in qemu-img's terms.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// Errors that may corrupt data.
    pub corruptions: u64,
    /// Clusters with more references counted than made.
    pub leaks: u64,
    /// Errors that stopped the check itself.
    pub check_errors: u64,
    /// Corruptions repaired.
    pub corruptions_fixed: u64,
    /// Leaks repaired.
    pub leaks_fixed: u64,
    /// One past the last byte in use.
    pub image_end_offset: u64,
    /// Guest clusters of the virtual disk.
    pub total_clusters: u64,
    /// Guest clusters with host storage.
    pub allocated_clusters: u64,
    /// Allocated clusters not following their predecessor on the host.
    pub fragmented_clusters: u64,
    /// Compressed guest clusters.
    pub compressed_clusters: u64,
    /// One line per problem found (qemu-img prints them on stderr).
    pub messages: Vec<String>,
    /// Why the check stopped short, when it did (qemu-img then prints
    /// this and no report, and exits 1).
    pub failed: Option<String>,
}
