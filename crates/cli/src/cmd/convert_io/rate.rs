//! `convert -r RATE`: a source read at most RATE bytes a second, on
//! average from the start of the copy.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use diskit_core::sync::lock;
use diskit_core::{BlockDevice, Filter, Result};

/// A layer over the source that reads no faster than a rate.
pub struct RateLimited {
    bytes_per_sec: u64,
    /// When the copy started and the bytes read since.
    state: Mutex<(Instant, u64)>,
}

impl RateLimited {
    /// At most `bytes_per_sec` bytes a second.
    pub fn new(bytes_per_sec: u64) -> RateLimited {
        RateLimited {
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
}

impl Filter for RateLimited {
    fn name(&self) -> &str {
        "rate limit"
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let due = self.due(buf.len() as u64);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        next.read_at(buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;

    #[test]
    fn bytes_are_due_at_the_rate() {
        let d = Filtered::new(
            RateLimited::new(1 << 20),
            Arc::new(MemoryDevice::new(1 << 20)),
        );
        let start = lock(&d.filter().state).0;
        assert_eq!(
            d.filter().due(256 << 10),
            start + Duration::from_millis(250)
        );
        assert_eq!(d.filter().due(768 << 10), start + Duration::from_secs(1));
        let mut buf = vec![0u8; 16];
        d.read_at(&mut buf, 0).unwrap();
        assert_eq!(lock(&d.filter().state).1, (1 << 20) + 16);
    }
}
