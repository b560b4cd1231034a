//! A sparse RAM disk. Storage is allocated in 64 KiB pages on first write
//! and freed again by trim and by zeroing whole pages; pages are spread
//! over independently locked shards so that requests run in parallel.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use diskit_core::device::check_range;
use diskit_core::extent::push_merged;
use diskit_core::{
    BlockDevice, Capabilities, Error, ErrorKind, Extent, Preallocation, Result, Storage,
    WriteFlags, ZeroFlags,
};

const PAGE: u64 = 64 * 1024;
const SHARDS: usize = 64;

type Page = Box<[u8]>;

/// A sparse in-memory device.
pub struct MemoryDevice {
    /// The size; it changes only through [`Storage`]'s growing writes and
    /// resize.
    size: AtomicU64,
    shards: Vec<RwLock<HashMap<u64, Page>>>,
}

impl MemoryDevice {
    /// A device of `size` bytes that reads as zeros.
    pub fn new(size: u64) -> MemoryDevice {
        MemoryDevice {
            size: AtomicU64::new(size),
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, page: u64) -> &RwLock<HashMap<u64, Page>> {
        &self.shards[(page % SHARDS as u64) as usize]
    }

    /// Bytes of memory in use for data.
    pub fn allocated_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.read().map(|m| m.len()).unwrap_or(0) as u64 * PAGE)
            .sum()
    }

    /// Calls `f(page, offset in page, offset in request, length)` for each
    /// page-sized piece of a request.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(u64, usize, usize, usize)) {
        let mut done = 0u64;
        while done < len {
            let pos = offset + done;
            let page = pos / PAGE;
            let in_page = (pos % PAGE) as usize;
            let n = (PAGE as usize - in_page).min((len - done) as usize);
            f(page, in_page, done as usize, n);
            done += n as u64;
        }
    }

    fn zero_range(&self, offset: u64, len: u64) {
        Self::pieces(offset, len, |page, in_page, _, n| {
            let mut shard = diskit_core::sync::write(self.shard(page));
            if n as u64 == PAGE {
                shard.remove(&page);
            } else if let Some(p) = shard.get_mut(&page) {
                p[in_page..in_page + n].fill(0);
            }
        });
    }
}

impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::IN_MEMORY
    }

    fn is_known_zero(&self) -> bool {
        self.allocated_bytes() == 0
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        Self::pieces(offset, buf.len() as u64, |page, in_page, at, n| {
            let shard = diskit_core::sync::read(self.shard(page));
            match shard.get(&page) {
                Some(p) => buf[at..at + n].copy_from_slice(&p[in_page..in_page + n]),
                None => buf[at..at + n].fill(0),
            }
        });
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        Self::pieces(offset, buf.len() as u64, |page, in_page, at, n| {
            let mut shard = diskit_core::sync::write(self.shard(page));
            let p = shard
                .entry(page)
                .or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice());
            p[in_page..in_page + n].copy_from_slice(&buf[at..at + n]);
        });
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size(), offset, len)?;
        self.zero_range(offset, len);
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size(), offset, len)?;
        self.zero_range(offset, len);
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size(), offset, len)?;
        let mut out = Vec::new();
        // Bound the work per call: callers loop for the rest.
        let len = len.min(PAGE * 4096);
        Self::pieces(offset, len, |page, _, _, n| {
            let present = self
                .shard(page)
                .read()
                .map(|s| s.contains_key(&page))
                .unwrap_or(true);
            let e = if present {
                Extent::data(n as u64)
            } else {
                Extent::hole(n as u64)
            };
            push_merged(&mut out, e);
        });
        Ok(out)
    }

    fn describe(&self) -> String {
        format!("memory({})", self.size())
    }
}

/// Memory as storage under an image format: it grows as the format
/// allocates, and shrinking frees the pages past the new end.
impl Storage for MemoryDevice {
    fn location(&self) -> &str {
        "memory"
    }

    fn protocol(&self) -> &'static str {
        "memory"
    }

    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::new(ErrorKind::Overflow, "write past the largest offset"))?;
        self.size.fetch_max(end, Ordering::AcqRel);
        self.write_at(buf, offset, WriteFlags::NONE)
    }

    fn resize(&self, new_len: u64, _prealloc: Preallocation) -> Result<()> {
        let old = self.size();
        if new_len < old {
            // Zero the cut-off tail so that growing again reads zeros.
            self.zero_range(new_len, old - new_len);
        }
        self.size.store(new_len, Ordering::Release);
        Ok(())
    }

    fn allocated_bytes(&self) -> Option<u64> {
        Some(MemoryDevice::allocated_bytes(self))
    }

    fn is_fixed_size(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_writes_zeroes_and_extents() {
        let m = MemoryDevice::new(1 << 30);
        assert!(m.is_known_zero());
        m.write_at(b"hello", PAGE - 2, WriteFlags::NONE).unwrap();
        let mut b = [0u8; 7];
        m.read_at(&mut b, PAGE - 3).unwrap();
        assert_eq!(&b, b"\0hello\0");
        assert_eq!(m.allocated_bytes(), 2 * PAGE);
        let ex = m.extents(0, 4 * PAGE).unwrap();
        assert_eq!(ex.len(), 2);
        assert!(ex[0].flags.data && ex[0].length == 2 * PAGE);
        assert!(ex[1].flags.zero && ex[1].length == 2 * PAGE);
        m.write_zeroes(0, 2 * PAGE, ZeroFlags::default()).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        assert!(m.read_at(&mut b, (1 << 30) - 3).is_err());
    }
}
