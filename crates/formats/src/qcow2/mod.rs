//! qcow2: QEMU's copy-on-write format (docs/interop/qcow2.rst).
//!
//! On-disk structures are parsed in one place ([`header`]), with every field
//! validated before anything else uses it.

pub mod create;
pub mod header;
pub mod layout;
pub mod measure;

pub use header::{Header, HeaderExtension};
