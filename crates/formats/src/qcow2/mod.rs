//! qcow2: QEMU's copy-on-write format (docs/interop/qcow2.rst).
//!
//! On-disk structures are parsed in one place ([`header`], [`l2`],
//! [`refcount`]), with every field validated before anything else uses it.
//! The metadata answers "where does this guest range live?" ([`l2::Mapping`])
//! and one generic layer ([`device`]) moves the bytes.

pub mod amend;
pub mod amend_refcount;
pub mod amend_zero;
pub mod backing;
pub mod bitmap;
pub mod bitmap_bits;
pub mod bitmap_store;
pub mod cache;
pub mod check;
pub mod compress;
pub mod compressed;
pub mod create;
pub mod create_layout;
pub mod crypt;
pub mod device;
pub mod driver;
pub mod empty;
pub mod header;
pub mod info;
pub mod l2;
pub mod layout;
pub mod measure;
pub mod meta;
pub mod open;
pub mod ops;
pub mod rebuild;
pub mod refcount;
pub mod resize;
pub mod snapshot;
pub mod snapshot_ops;
pub mod snapshot_refs;
pub mod table;
#[cfg(test)]
mod test_tools;

pub use device::Qcow2;
pub use header::{Header, HeaderExtension};
pub use open::Qcow2Options;
