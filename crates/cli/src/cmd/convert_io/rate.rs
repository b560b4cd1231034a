//! `convert -r RATE`: a source read at most RATE bytes a second, on
//! average from the start of the copy.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, Extent, FileView, Result,
};

/// A source read no faster than a rate.
pub struct RateLimited {
    inner: DeviceRef,
    bytes_per_sec: u64,
    /// When the copy started and the bytes read since.
    state: Mutex<(Instant, u64)>,
}

impl RateLimited {
    /// `inner`, read at most `bytes_per_sec` bytes a second.
    pub fn new(inner: DeviceRef, bytes_per_sec: u64) -> RateLimited {
        RateLimited {
            inner,
            bytes_per_sec: bytes_per_sec.max(1),
            state: Mutex::new((Instant::now(), 0)),
        }
    }

    /// Counts `n` more bytes: when they may have been read.
    fn due(&self, n: u64) -> Instant {
        let mut st = lock(&self.state);
        st.1 += n;
        let secs = st.1 as f64 / self.bytes_per_sec as f64;
        st.0 + Duration::from_secs_f64(secs)
    }

    /// Waits until `n` more bytes may be read.
    fn pace(&self, n: u64) {
        let due = self.due(n);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
    }
}

impl BlockDevice for RateLimited {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn block_size(&self) -> BlockSizeLimits {
        self.inner.block_size()
    }
    fn is_known_zero(&self) -> bool {
        self.inner.is_known_zero()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.pace(buf.len() as u64);
        self.inner.read_at(buf, offset)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.inner.extents(offset, len)
    }
    fn file_view(&self, _offset: u64, _len: u64) -> Option<FileView<'_>> {
        None
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use std::sync::Arc;

    #[test]
    fn bytes_are_due_at_the_rate() {
        let d = RateLimited::new(Arc::new(MemoryDevice::new(1 << 20)), 1 << 20);
        let start = lock(&d.state).0;
        assert_eq!(d.due(256 << 10), start + Duration::from_millis(250));
        assert_eq!(d.due(768 << 10), start + Duration::from_secs(1));
        let mut buf = vec![0u8; 16];
        d.read_at(&mut buf, 0).unwrap();
        assert_eq!(lock(&d.state).1, (1 << 20) + 16);
    }
}
