//! Where `qemu-img create -f qcow2` puts everything (the creation layout;
//! [`super::layout`] holds the offset types of open images).
//!
//! QEMU does not compute a qcow2 layout from a formula: it writes a minimal
//! image (header, a one-cluster refcount table, one empty refcount block),
//! opens it, and then *grows* it with its general-purpose allocator: the L1
//! table, refcount blocks allocated on demand (which restarts allocations),
//! refcount tables that are outgrown and replaced (leaving the old table's
//! bytes behind in a freed cluster), L2 tables and data clusters for
//! preallocation. The result is deterministic, so the only way to produce
//! the same bytes is to make the same decisions in the same order.
//!
//! [`Planner`] replays those decisions in memory, compactly: refcounts are
//! a set of cluster ranges (a new image only ever holds refcounts 0 and 1),
//! L2 tables are runs of guest→host mappings. Nothing is written here; the
//! result is a [`Plan`] from which the image and data file contents are
//! generated piece by piece.

use std::collections::BTreeMap;

mod alloc;
mod cluster_set;

use cluster_set::ClusterSet;

use super::header::{CompressionType, Header, HeaderExtension, autoclear, compat, ext, incompat};

/// Largest refcount table QEMU creates, in entries (its 8 MiB limit applied
/// to the entry count, as QEMU compares it).
const MAX_REFTABLE_ENTRIES: u64 = 8 << 20;
/// Largest active L1 table, in entries (32 MiB).
const MAX_L1_ENTRIES: u64 = (32 << 20) / 8;
/// Host offsets must stay below 2^56.
const MAX_CLUSTER_OFFSET: u64 = (1 << 56) - 1;
/// The largest request QEMU's block layer passes down (`BDRV_REQUEST_MAX_BYTES`).
const REQUEST_MAX_BYTES: u64 = ((i32::MAX as u64) >> 9) << 9;
/// L1/L2 "refcount is exactly one" flag.
const COPIED: u64 = 1 << 63;
/// Upper bound on allocation retries: QEMU's loops always terminate, this
/// only turns a bug into an error instead of a hang.
const MAX_RETRIES: u64 = 1 << 32;

/// Why a planning step failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// QEMU's -EAGAIN: metadata was allocated, restart the allocation.
    Again,
    /// QEMU's -EFBIG: the image needs tables larger than the format allows.
    TooBig,
    /// A state QEMU would report as corruption or a failed assertion.
    Internal(String),
}

type PResult<T> = std::result::Result<T, PlanError>;

fn internal(msg: impl Into<String>) -> PlanError {
    PlanError::Internal(msg.into())
}

pub use crate::prealloc::Prealloc;

/// The on-disk format parameters that shape the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// log2 of the refcount width (0..=6).
    pub refcount_order: u32,
    /// 128-bit L2 entries.
    pub extended_l2: bool,
}

impl Geometry {
    /// Cluster size in bytes.
    pub fn cluster_size(self) -> u64 {
        1 << self.cluster_bits
    }

    /// Bytes per L2 entry.
    pub fn l2_entry_size(self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// Entries per L2 table.
    pub fn l2_entries(self) -> u64 {
        self.cluster_size() / self.l2_entry_size()
    }

    /// Refcounts per refcount block.
    pub fn refblock_entries(self) -> u64 {
        (self.cluster_size() * 8) >> self.refcount_order
    }

    /// L1 entries needed for `size` bytes of guest disk (`size_to_l1`).
    pub fn l1_entries_for(self, size: u64) -> u64 {
        let per_l2 = self.cluster_size() as u128 * self.l2_entries() as u128;
        (size as u128).div_ceil(per_l2) as u64
    }
}

/// The number of refcount blocks and the bytes of refcount metadata (blocks
/// plus table) needed to refcount `clusters` clusters and the metadata
/// itself: QEMU's `qcow2_refcount_metadata_size`, a fixed-point iteration.
/// With `generous`, the table gets room for 50% more blocks.
pub fn refcount_metadata_size(
    clusters: u64,
    cluster_size: u64,
    refcount_order: u32,
    generous: bool,
) -> (u64, u64) {
    let per_table_cluster = (cluster_size / 8) as u128;
    let per_block = ((cluster_size * 8) >> refcount_order) as u128;
    let mut clusters = clusters as u128;
    let mut generous = generous;
    let (mut table, mut blocks, mut n) = (0u128, 0u128, 0u128);
    loop {
        let last = n;
        blocks = (clusters + table + blocks).div_ceil(per_block);
        table = blocks.div_ceil(per_table_cluster);
        n = clusters + blocks + table;
        if n == last && generous {
            clusters += table.div_ceil(2);
            n = 0;
            generous = false;
        }
        if n == last {
            break;
        }
    }
    let bytes = (blocks + table).saturating_mul(cluster_size as u128);
    (
        u64::try_from(blocks).unwrap_or(u64::MAX),
        u64::try_from(bytes).unwrap_or(u64::MAX),
    )
}

/// A write's copy-on-write tail (`cow_end`): bytes after the written range
/// up to the end of its (sub)cluster, read from the image (zeros during
/// creation) and written to the new cluster.
#[derive(Debug, Clone, Copy)]
struct L2Meta {
    /// Guest offset of the first cluster.
    guest: u64,
    /// Host offset of the first cluster.
    host: u64,
    /// Clusters mapped.
    clusters: u64,
    /// Copy-on-write tail: offset from `guest` and length.
    cow_end: (u64, u64),
}

/// Everything `qemu-img create -f qcow2` decides, for one set of options.
#[derive(Debug, Clone)]
pub struct Plan {
    geo: Geometry,
    data_file: bool,
    used: ClusterSet,
    reftable: Vec<u64>,
    reftable_offset: u64,
    max_reftable_index: usize,
    free_cluster_index: u64,
    l1: Vec<u64>,
    l1_offset: u64,
    /// guest cluster → (host offset of that cluster, clusters in the run).
    runs: BTreeMap<u64, (u64, u64)>,
    file_len: u64,
    stale: Vec<(u64, Vec<u8>)>,
    zero_writes: Vec<(u64, u64)>,
    reserved: Option<(u64, u64)>,
    data_len: u64,
    data_zero_writes: Vec<(u64, u64)>,
    data_reserved: Option<(u64, u64)>,
    data_first_block: bool,
    size: u64,
    retries: u64,
}

impl Plan {
    /// The state right after QEMU's `qcow2_co_create` wrote its minimal
    /// image (header cluster, a one-cluster refcount table pointing at an
    /// empty refcount block) and allocated those three clusters.
    fn new(geo: Geometry, data_file: bool) -> PResult<Plan> {
        let cs = geo.cluster_size();
        let mut reftable = vec![0u64; (cs / 8) as usize];
        reftable[0] = 2 * cs;
        let mut p = Plan {
            geo,
            data_file,
            used: ClusterSet::default(),
            reftable,
            reftable_offset: cs,
            max_reftable_index: 0,
            free_cluster_index: 0,
            l1: Vec::new(),
            l1_offset: 0,
            runs: BTreeMap::new(),
            file_len: 3 * cs,
            stale: Vec::new(),
            zero_writes: Vec::new(),
            reserved: None,
            data_len: 0,
            data_zero_writes: Vec::new(),
            data_reserved: None,
            data_first_block: false,
            size: 0,
            retries: 0,
        };
        let first = p.alloc_clusters(3 * cs)?;
        if first != 0 {
            return Err(internal("first cluster in empty image is already in use"));
        }
        Ok(p)
    }

    /// Plans a whole creation: QEMU's `qcow2_co_create` from the minimal
    /// image on, i.e. `qcow2_co_truncate(size, prealloc)` on it. `size` must
    /// be a multiple of 512.
    pub fn create(geo: Geometry, size: u64, prealloc: Prealloc, data_file: bool) -> PResult<Plan> {
        let mut p = Plan::new(geo, data_file)?;
        p.truncate(size, prealloc)?;
        Ok(p)
    }

    fn cs(&self) -> u64 {
        self.geo.cluster_size()
    }

    fn rb_bits(&self) -> u32 {
        self.geo.cluster_bits + 3 - self.geo.refcount_order
    }

    fn written(&mut self, offset: u64, len: u64) {
        self.file_len = self.file_len.max(offset + len);
    }

    fn retry(&mut self) -> PResult<()> {
        self.retries += 1;
        if self.retries > MAX_RETRIES {
            return Err(internal("allocation does not converge"));
        }
        Ok(())
    }

    // ---- results ---------------------------------------------------------

    /// The cluster size.
    pub fn cluster_size(&self) -> u64 {
        self.cs()
    }

    /// The image file's final length.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The external data file's final length.
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// Whether QEMU writes zeros over the data file's first block (it does
    /// when it grows an empty file without preallocation).
    pub fn data_first_block(&self) -> bool {
        self.data_first_block
    }

    /// The image file range whose space is reserved (falloc) or written
    /// with zeros (full) for the data clusters.
    pub fn reserved(&self) -> Option<(u64, u64)> {
        self.reserved
    }

    /// The data file range reserved or zero-written.
    pub fn data_reserved(&self) -> Option<(u64, u64)> {
        self.data_reserved
    }

    /// Zeros written to the image file by copy-on-write of a partial last
    /// (sub)cluster.
    pub fn zero_writes(&self) -> &[(u64, u64)] {
        &self.zero_writes
    }

    /// Zeros written to the data file by copy-on-write.
    pub fn data_zero_writes(&self) -> &[(u64, u64)] {
        &self.data_zero_writes
    }

    /// Bytes of outgrown refcount tables, left in freed clusters, oldest
    /// first (later metadata may overwrite them).
    pub fn stale(&self) -> &[(u64, Vec<u8>)] {
        &self.stale
    }

    /// Offset of the refcount table.
    pub fn reftable_offset(&self) -> u64 {
        self.reftable_offset
    }

    /// The refcount table's bytes.
    pub fn reftable_bytes(&self) -> Vec<u8> {
        self.reftable.iter().flat_map(|e| e.to_be_bytes()).collect()
    }

    /// Clusters of the refcount table.
    pub fn reftable_clusters(&self) -> u64 {
        self.reftable.len() as u64 * 8 / self.cs()
    }

    /// Offsets of the refcount blocks and their table indexes.
    pub fn refblocks(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.reftable
            .iter()
            .enumerate()
            .filter(|&(_, &b)| b != 0)
            .map(|(i, &b)| (i, b))
    }

    /// The contents of refcount block number `index`.
    pub fn refblock_bytes(&self, index: usize) -> Vec<u8> {
        let cs = self.cs() as usize;
        let per_block = self.geo.refblock_entries();
        let order = self.geo.refcount_order;
        let first = index as u64 * per_block;
        let mut block = vec![0u8; cs];
        for (s, e) in self.used.clipped(first, first + per_block) {
            for c in s..e {
                let j = (c - first) as usize;
                if order < 3 {
                    let bits = 1usize << order;
                    block[j * bits / 8] |= 1 << ((j * bits) % 8);
                } else {
                    let width = 1usize << (order - 3);
                    block[j * width + width - 1] = 1;
                }
            }
        }
        block
    }

    /// Offset and entries of the L1 table.
    pub fn l1(&self) -> (u64, usize) {
        (self.l1_offset, self.l1.len())
    }

    /// The L1 table's bytes from entry `from`, `count` entries.
    pub fn l1_bytes(&self, from: usize, count: usize) -> Vec<u8> {
        self.l1[from..from + count]
            .iter()
            .flat_map(|&e| if e == 0 { 0 } else { e | COPIED }.to_be_bytes())
            .collect()
    }

    /// The L2 tables: L1 index and offset.
    pub fn l2_tables(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.l1
            .iter()
            .enumerate()
            .filter(|&(_, &o)| o != 0)
            .map(|(i, &o)| (i, o))
    }

    /// The contents of the L2 table at L1 index `index`.
    pub fn l2_bytes(&self, index: usize) -> Vec<u8> {
        let cs = self.cs();
        let per = self.geo.l2_entries();
        let esize = self.geo.l2_entry_size() as usize;
        let first = index as u64 * per;
        let end = first + per;
        let mut table = vec![0u8; cs as usize];
        let start_key = self
            .runs
            .range(..=first)
            .next_back()
            .map(|(&k, _)| k)
            .unwrap_or(first);
        for (&g, &(h, n)) in self.runs.range(start_key..end) {
            for c in g.max(first)..(g + n).min(end) {
                let entry = (h + (c - g) * cs) | COPIED;
                let at = (c - first) as usize * esize;
                table[at..at + 8].copy_from_slice(&entry.to_be_bytes());
            }
        }
        table
    }

    /// The header as QEMU's last `qcow2_update_header` writes it.
    pub fn header(&self, spec: &HeaderSpec) -> Header {
        let mut incompatible = 0;
        if spec.data_file.is_some() {
            incompatible |= incompat::EXTERNAL_DATA;
        }
        if spec.compression == CompressionType::Zstd {
            incompatible |= incompat::COMPRESSION_TYPE;
        }
        if self.geo.extended_l2 {
            incompatible |= incompat::EXTENDED_L2;
        }
        let mut extensions = Vec::new();
        if let Some(f) = &spec.backing_format {
            extensions.push(HeaderExtension {
                kind: ext::BACKING_FORMAT,
                data: f.as_bytes().to_vec(),
            });
        }
        if let Some(d) = &spec.data_file {
            extensions.push(HeaderExtension {
                kind: ext::DATA_FILE,
                data: d.as_bytes().to_vec(),
            });
        }
        if spec.version >= 3 && self.cs() > 4096 {
            extensions.push(feature_table());
        }
        Header {
            version: spec.version,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits: self.geo.cluster_bits,
            size: self.size,
            crypt_method: 0,
            l1_size: self.l1.len() as u32,
            l1_table_offset: self.l1_offset,
            refcount_table_offset: self.reftable_offset,
            refcount_table_clusters: self.reftable_clusters() as u32,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: incompatible,
            compatible_features: if spec.lazy_refcounts {
                compat::LAZY_REFCOUNTS
            } else {
                0
            },
            autoclear_features: if spec.data_file_raw {
                autoclear::RAW_EXTERNAL
            } else {
                0
            },
            refcount_order: self.geo.refcount_order,
            header_length: if spec.version >= 3 { 112 } else { 72 },
            compression_type: spec.compression,
            extra_header: Vec::new(),
            extensions,
            backing_file: spec.backing_file.clone(),
        }
    }
}

/// What the header says beyond the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderSpec {
    /// 2 or 3.
    pub version: u32,
    /// Compression type of compressed clusters.
    pub compression: CompressionType,
    /// Compatible bit "lazy refcounts".
    pub lazy_refcounts: bool,
    /// External data file name, as given.
    pub data_file: Option<String>,
    /// Autoclear bit "raw external data".
    pub data_file_raw: bool,
    /// Backing file name, as given.
    pub backing_file: Option<String>,
    /// Backing file format.
    pub backing_format: Option<String>,
}

/// The feature name table QEMU writes into v3 images with clusters larger
/// than 4 KiB: every feature bit it knows, in its order.
pub fn feature_table() -> HeaderExtension {
    const FEATURES: [(u8, u8, &str); 8] = [
        (0, 0, "dirty bit"),
        (0, 1, "corrupt bit"),
        (0, 2, "external data file"),
        (0, 3, "compression type"),
        (0, 4, "extended L2 entries"),
        (1, 0, "lazy refcounts"),
        (2, 0, "bitmaps"),
        (2, 1, "raw external data"),
    ];
    let mut data = Vec::with_capacity(FEATURES.len() * 48);
    for (kind, bit, name) in FEATURES {
        let mut entry = [0u8; 48];
        entry[0] = kind;
        entry[1] = bit;
        entry[2..2 + name.len()].copy_from_slice(name.as_bytes());
        data.extend_from_slice(&entry);
    }
    HeaderExtension {
        kind: ext::FEATURE_TABLE,
        data,
    }
}

#[cfg(test)]
mod tests;
