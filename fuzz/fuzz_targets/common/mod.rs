//! What the whole-image fuzz targets share: the input as memory storage,
//! and a bounded walk that reads and maps the start of the opened disk.
//! (Each target is a binary of its own and uses what it needs.)

#![allow(dead_code)]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, Storage, StorageRef};

/// The fuzz input as the bytes of a memory device.
pub fn memory_storage(data: &[u8]) -> StorageRef {
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(data, 0).unwrap();
    mem
}

/// Reads the first `limit` bytes of `dev` (or all of a smaller disk) in
/// `chunk`-byte reads, then maps them with at most 64 extent calls; read
/// and map errors are fine, extents past the asked range are not.
pub fn read_and_map(dev: &dyn BlockDevice, limit: u64, chunk: usize) {
    let len = dev.size().min(limit);
    let mut buf = vec![0u8; chunk];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        let _ = dev.read_at(&mut buf[..n], off);
        off += n as u64;
    }
    let mut pos = 0;
    for _ in 0..64 {
        if pos >= len {
            break;
        }
        match dev.extents(pos, len - pos) {
            Ok(e) if !e.is_empty() => {
                let step: u64 = e.iter().map(|x| x.length).sum();
                assert!(step > 0 && step <= len - pos, "extents stay in range");
                pos += step;
            }
            _ => break,
        }
    }
}

/// Reads of `bytes` at an offset, as the table readers take them: a read
/// past the end is an error.
pub fn slice_reader(bytes: &[u8]) -> impl Fn(u64, &mut [u8]) -> diskit_core::Result<()> + '_ {
    move |off, buf| {
        let end = off
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= bytes.len() as u64)
            .ok_or_else(|| diskit_core::Error::invalid("read past the end"))?;
        buf.copy_from_slice(&bytes[off as usize..end as usize]);
        Ok(())
    }
}
