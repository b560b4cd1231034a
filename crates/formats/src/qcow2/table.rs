//! Big-endian fields and u64 tables (L1 tables, the refcount table) and
//! the error for metadata that breaks the format's rules, shared by the
//! modules that read and write them.

use diskit_core::Storage;
use diskit_core::{Error, ErrorKind, Result};

/// An error for metadata that breaks the format's rules.
pub fn corrupt(msg: String) -> Error {
    Error::new(ErrorKind::Io, format!("qcow2 image is corrupt: {msg}"))
}

/// Reads a table of `entries` big-endian u64s at `offset` (zeros past the
/// end of the file).
pub fn read_u64_table(file: &dyn Storage, offset: u64, entries: u64) -> Result<Vec<u64>> {
    let mut raw = vec![0u8; entries as usize * 8];
    file.read_padded(&mut raw, offset)?;
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// The on-disk bytes of a table of u64s, padded with zeros to `len` bytes
/// (at least the table itself).
pub fn u64_table_bytes(entries: &[u64], len: usize) -> Vec<u8> {
    let mut raw = Vec::with_capacity(len.max(entries.len() * 8));
    for e in entries {
        raw.extend_from_slice(&e.to_be_bytes());
    }
    raw.resize(len.max(raw.len()), 0);
    raw
}

pub(crate) use crate::bytes::be16;
pub use crate::bytes::{be32, be64};
