//! The readahead filter (nbdkit-readahead-filter): after each read, asks
//! the layer below to cache what the client is likely to read next, in the
//! background, so that a layer below that keeps data (the cache filter, the
//! cow filter with `cow-on-cache` or `cow-on-read`, or a device that
//! prefetches) has it by the time it is asked for.
//!
//! The guesses and the background threads are [`crate::prefetch`]'s
//! (sequential streams get a growing window ahead, any other read its
//! neighbourhood; several cache requests in flight at once; what is asked
//! for is bounded). Reads themselves pass straight through: the filter
//! never holds a lock around I/O. Over a device that does not cache, the
//! filter does nothing but pass requests through. The cache and cow
//! filters prefetch on their own over a slow device with `*-on-read`, so
//! the filter is not needed there, but it does no harm anywhere in the
//! stack: what it asks for is kept by the first layer below that keeps
//! data, and a layer above that keeps data is not held up by it.

use std::sync::Arc;

use crate::prefetch::Prefetcher;
use crate::registry::{Configure, over, unknown};
use diskit_core::{BlockDevice, DeviceRef, Filter, Result};

/// The keys the filter takes (none, as nbdkit's).
pub const KEYS: &[&str] = &[];

/// The filter.
#[derive(Debug)]
pub struct Readahead {
    prefetch: Prefetcher,
    size: u64,
    enabled: bool,
}

impl Readahead {
    /// The filter over `next`, with its background threads (none when
    /// `next` cannot cache).
    pub fn new(next: &DeviceRef) -> Result<Readahead> {
        let prefetch = Prefetcher::new();
        let enabled = next.capabilities().can_cache;
        if enabled {
            prefetch.start("readahead", Arc::downgrade(next), |dev, offset, len| {
                // A prediction that fails costs nothing but the
                // prediction.
                let _ = dev.cache(offset, len);
            })?;
        }
        Ok(Readahead {
            prefetch,
            size: next.size(),
            enabled,
        })
    }
}

impl Filter for Readahead {
    fn name(&self) -> &str {
        "readahead"
    }

    // No file view: reads spliced past the filter would go unpredicted.
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.enabled {
            self.prefetch
                .after_read(offset, buf.len() as u64, self.size);
        }
        next.read_at(buf, offset)
    }

    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        self.prefetch.stop();
        next.close()
    }
}

/// The filter's configuration: it takes no parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadaheadConfig;

impl Configure for ReadaheadConfig {
    fn set(&mut self, key: &str, _value: &str) -> Result<()> {
        Err(unknown("readahead", key))
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Readahead::new(&next)?, next))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Probe, wait_until};
    use diskit_core::{Capabilities, Filtered};
    use std::time::Duration;

    /// The filter over `size` bytes that record what they are asked to
    /// cache.
    fn setup(size: u64) -> (Arc<Probe>, Filtered<Readahead>) {
        let below = Arc::new(Probe::new(size));
        let next: DeviceRef = below.clone();
        (below, Filtered::new(Readahead::new(&next).unwrap(), next))
    }

    fn covered(c: &[(u64, u64)], off: u64, len: u64) -> bool {
        let mut at = off;
        loop {
            match c.iter().find(|&&(a, l)| a <= at && at < a + l) {
                Some(&(a, l)) => {
                    at = a + l;
                    if at >= off + len {
                        return true;
                    }
                }
                None => return false,
            }
        }
    }

    #[test]
    fn sequential_reads_get_a_growing_window_ahead() {
        let (below, d) = setup(256 << 20);
        let mut buf = vec![0u8; 64 << 10];
        for i in 0..20u64 {
            d.read_at(&mut buf, i * (64 << 10)).unwrap();
        }
        let end = 20 * (64 << 10);
        // Far past the last read: the window grew.
        wait_until(|| covered(&below.cached.lock().unwrap(), end, 8 << 20));
        assert_eq!(below.reads(), 20);
    }

    #[test]
    fn a_read_elsewhere_gets_its_neighbourhood_once() {
        let (below, d) = setup(64 << 20);
        let mut buf = vec![0u8; 4096];
        d.read_at(&mut buf, 30 << 20).unwrap();
        wait_until(|| covered(&below.cached.lock().unwrap(), (29 << 20) + 4096, 2 << 20));
        let n = below.cached.lock().unwrap().len();
        // Reading nearby again asks for nothing new.
        d.read_at(&mut buf, (30 << 20) + 100_000).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let again: u64 = below.cached.lock().unwrap()[n..].iter().map(|c| c.1).sum();
        assert!(again <= 200_000, "asked for {again} bytes again");
    }

    #[test]
    fn without_cache_below_it_only_passes_reads() {
        let below: DeviceRef = Arc::new(Probe::new(1 << 20).caps(|c| Capabilities {
            can_cache: false,
            ..c
        }));
        let d = Filtered::new(Readahead::new(&below).unwrap(), below);
        assert!(!d.filter().enabled);
        let mut buf = vec![1u8; 4096];
        d.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }
}
