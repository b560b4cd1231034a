//! The cacheextents filter (nbdkit-cacheextents-filter): keeps the
//! answer of the last extents request, for clients that ask one extent
//! at a time over a device that answers many for the price of one.
//!
//! Each request below asks for the whole range the client asked (one
//! extent or not); a later request that starts inside the answer kept is
//! answered from it. Any write, write-zeroes or trim drops it. It takes
//! no parameters.

use std::sync::Mutex;

use diskit_core::extent::clip;
use diskit_core::sync::lock;
use diskit_core::{BlockDevice, Extent, Filter, Request, Result, Route};
use diskit_core::{WriteFlags, ZeroFlags};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// The last answer: where it starts and its extents.
#[derive(Debug, Default)]
struct Kept {
    start: u64,
    extents: Vec<Extent>,
}

impl Kept {
    /// The extents from `offset` on, for `len` bytes at most, when
    /// `offset` is inside the answer.
    fn from(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let mut pos = self.start;
        for (i, e) in self.extents.iter().enumerate() {
            if offset < pos + e.length && offset >= pos {
                let mut rest = self.extents[i..].to_vec();
                rest[0].length = pos + e.length - offset;
                rest[0].host_offset = e.host_offset.map(|h| h + (offset - pos));
                return Some(clip(rest, len));
            }
            pos += e.length;
        }
        None
    }
}

/// The filter: the answer kept.
#[derive(Debug, Default)]
pub struct Cacheextents {
    kept: Mutex<Kept>,
}

impl Cacheextents {
    /// Drops the answer kept.
    fn forget(&self) {
        *lock(&self.kept) = Kept::default();
    }
}

impl Filter for Cacheextents {
    fn name(&self) -> &str {
        "cacheextents"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        // Reads go below; a write must forget the answer first.
        match req {
            Request::Read { .. } | Request::ReadTo { .. } => Route::Below(req),
            _ => {
                self.forget();
                Route::Below(req)
            }
        }
    }
    fn submits_below(&self) -> bool {
        true
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut kept = lock(&self.kept);
        if let Some(list) = kept.from(offset, len) {
            return Ok(list);
        }
        let list = next.extents(offset, len)?;
        *kept = Kept {
            start: offset,
            extents: list.clone(),
        };
        Ok(list)
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.forget();
        next.write_at(buf, offset, flags)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.forget();
        next.write_zeroes(offset, len, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.forget();
        next.trim(offset, len, flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts the extents requests that reach it.
    struct Asked(MemoryDevice, AtomicUsize);
    impl BlockDevice for Asked {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn capabilities(&self) -> diskit_core::Capabilities {
            self.0.capabilities()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
            self.0.write_at(buf, offset, flags)
        }
        fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.extents(offset, len)
        }
    }

    #[test]
    fn answers_from_the_last_extents_until_a_write() {
        let below = Arc::new(Asked(MemoryDevice::new(1 << 20), AtomicUsize::new(0)));
        below
            .write_at(&[1u8; 8192], 65536, WriteFlags::NONE)
            .unwrap();
        let d = Filtered::new(Cacheextents::default(), below.clone());
        let all = d.extents(0, 1 << 20).unwrap();
        let again = d.extents(65536 + 100, 4096).unwrap();
        assert_eq!(below.1.load(Ordering::SeqCst), 1);
        assert_eq!(again, below.0.extents(65536 + 100, 4096).unwrap());
        assert!(all.len() > 1);
        d.write_at(&[1u8; 10], 0, WriteFlags::NONE).unwrap();
        d.extents(65536, 10).unwrap();
        assert_eq!(below.1.load(Ordering::SeqCst), 2);
    }
}
