//! The count filter (nbdkit-count-filter, nbdkit 1.46): counts the bytes
//! read, written, zeroed and trimmed, and writes the four totals to
//! standard error when the stack closes (when the server stops):
//! `count bytes: read N, written N, zeroed N, trimmed N`. Only requests
//! that succeed count. It takes no parameters; for more, see the stats
//! and log filters.

use std::sync::atomic::{AtomicU64, Ordering};

use diskit_core::{BlockDevice, Filter, Result, WriteFlags, ZeroFlags};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// The filter: its totals.
#[derive(Debug, Default)]
pub struct Count {
    read: AtomicU64,
    written: AtomicU64,
    zeroed: AtomicU64,
    trimmed: AtomicU64,
}

/// Adds `n` to `total` when `r` succeeded; returns `r`.
fn counted(r: Result<()>, total: &AtomicU64, n: u64) -> Result<()> {
    if r.is_ok() {
        total.fetch_add(n, Ordering::Relaxed);
    }
    r
}

impl Count {
    /// The totals line.
    pub fn summary(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "count bytes: read {}, written {}, zeroed {}, trimmed {}",
            get(&self.read),
            get(&self.written),
            get(&self.zeroed),
            get(&self.trimmed)
        )
    }
}

impl Filter for Count {
    fn name(&self) -> &str {
        "count"
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        counted(next.read_at(buf, offset), &self.read, buf.len() as u64)
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        counted(
            next.write_at(buf, offset, flags),
            &self.written,
            buf.len() as u64,
        )
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        counted(next.write_zeroes(offset, len, flags), &self.zeroed, len)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        counted(next.trim(offset, len, flags), &self.trimmed, len)
    }
    fn extents_before_reads(&self, _next: &dyn BlockDevice) -> bool {
        // What is counted is what the client asked for.
        false
    }
    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        eprintln!("{}", self.summary());
        next.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;

    #[test]
    fn successful_requests_count() {
        let d = Filtered::new(Count::default(), Arc::new(MemoryDevice::new(1 << 20)));
        let mut b = [0u8; 100];
        d.read_at(&mut b, 0).unwrap();
        d.write_at(&b[..10], 0, WriteFlags::NONE).unwrap();
        d.write_zeroes(0, 4096, ZeroFlags::default()).unwrap();
        d.trim(0, 512, WriteFlags::NONE).unwrap();
        assert!(d.read_at(&mut b, (1 << 20) - 10).is_err());
        assert_eq!(
            d.filter().summary(),
            "count bytes: read 100, written 10, zeroed 4096, trimmed 512"
        );
    }
}
