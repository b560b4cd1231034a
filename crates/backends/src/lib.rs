//! Storage backends: the devices at the bottom of every stack.
//!
//! - [`file::FileDevice`]: regular files and block devices, positional I/O,
//!   extents from SEEK_DATA/SEEK_HOLE (guarded), hole punching and zeroing.
//! - [`memory::MemoryDevice`]: a sparse RAM disk.
//! - [`null::NullDevice`]: reads zeros, discards writes.
//! - [`pattern::PatternDevice`]: deterministic data for tests.

pub mod file;
pub mod image_lock;
pub mod memory;
pub mod null;
pub mod pattern;
mod sys;

pub use file::{FileDevice, Preallocation};
pub use memory::MemoryDevice;
pub use null::NullDevice;
pub use pattern::PatternDevice;
