//! diskit-core: the one abstraction everything in diskit is built on.
//!
//! Everything is a [`BlockDevice`]: a file, an image format over a file, an
//! NBD connection, a filter over any of these. They all offer one set of
//! operations with the semantics of the NBD protocol (read, write with FUA,
//! write-zeroes with may-trim and fast-zero, trim, flush, cache, extents) and
//! one set of [`Capabilities`].
//!
//! Concurrency model: devices are `Send + Sync` and every operation takes
//! `&self`, so any number of threads may have requests in flight on one device
//! at once. Each request owns (or exclusively borrows) its buffer for its whole
//! duration; a request cannot outlive its buffer because the call returns only
//! when the I/O has completed.

pub mod aio;
pub mod bits;
pub mod buffer;
pub mod chunks;
pub mod concat;
pub mod device;
pub mod dynlib;
pub mod error;
pub mod extent;
pub mod filter;
pub mod params;
pub mod plugin_abi;
pub mod range_lock;
pub mod serving;
pub mod size;
pub mod storage;
pub mod sync;
#[cfg(test)]
mod testing;
pub mod workers;
pub mod zero;

pub use aio::{Completion, CompletionQueue, ReadSink, Request};
pub use device::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, ExportEntry, ExportQuery, FileView,
    Lent, Session, WriteFlags, ZeroFlags,
};
pub use error::{Error, ErrorKind, Result};
pub use extent::{Extent, ExtentFlags};
pub use filter::{Filter, Filtered, Route};
pub use serving::{Hangup, Peer, Serialize, ServerHandle, ServerRef};
pub use storage::{
    CacheMode, NodeInfo, Preallocation, SnapshotChange, Storage, StorageOptions, StorageRef,
};
