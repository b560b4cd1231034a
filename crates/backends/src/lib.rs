//! Storage backends: the devices at the bottom of every stack.
//!
//! - [`file::FileDevice`]: regular files and block devices, positional I/O,
//!   extents from SEEK_DATA/SEEK_HOLE (guarded), hole punching and zeroing.
//! - [`memory::MemoryDevice`]: a sparse RAM disk.
//! - [`null::NullDevice`]: reads zeros (or one byte repeated: nbdkit's
//!   ones plugin), discards writes.
//! - [`pattern::PatternDevice`]: deterministic data for tests.
//! - nbdkit's synthetic disks: [`zero::ZeroDevice`] (no bytes),
//!   [`null::NullDevice::filled`] (one byte repeated), [`full::FullDevice`] (always
//!   full), [`random::RandomDevice`] and
//!   [`sparse_random::SparseRandomDevice`] (nbdkit's bytes for a seed, from
//!   [`nbdkit_random`]), [`data::DataDevice`] (a RAM disk from nbdkit's
//!   data language), [`split::SplitDevice`] (files end to end) and
//!   [`partitioning::PartitioningDevice`] (files as partitions), and
//!   [`tmpdisk::TmpDisk`] (a new filesystem for each client).
//! - nbdkit's plugin API as a device ([`callbacks::CallbackDevice`]), and
//!   the script plugins over it ([`script::ScriptPlugin`]: sh and eval) and
//!   the plugins built as shared objects ([`shared_plugin::SharedPlugin`]:
//!   python).

pub mod callbacks;
pub mod data;
pub mod file;
pub mod full;
pub mod image_lock;
pub mod memory;
pub mod nbdkit_random;
pub mod null;
pub mod partitioning;
pub mod pattern;
pub mod random;
pub mod script;
pub mod shared_plugin;
pub mod sparse_random;
pub mod split;
mod sys;
pub mod tmpdisk;
pub mod zero;

pub use file::{FileDevice, Preallocation};
pub use full::FullDevice;
pub use memory::MemoryDevice;
pub use null::NullDevice;
pub use pattern::PatternDevice;
pub use random::RandomDevice;
pub use sparse_random::{SparseRandomDevice, SparseRandomLayout};
pub use split::SplitDevice;
pub use zero::ZeroDevice;

/// What nbdkit offers for a plugin over files that writes but has no
/// zero of its own (split, partitioning, tmpdisk): writes when
/// `writable`, write-zeroes by writing zeros (so a fast zero is refused at
/// once), and nothing else; each plugin adds what it has.
fn zeroes_by_writing(writable: bool) -> diskit_core::Capabilities {
    diskit_core::Capabilities {
        can_write: writable,
        can_write_zeroes: writable,
        can_fast_zero: writable,
        can_multi_conn: false,
        ..diskit_core::Capabilities::READ_ONLY
    }
}
