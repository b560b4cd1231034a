//! What `convert` puts around its source and target and how it may copy:
//! `--salvage` (read errors become zeros), `-r` (a rate limit: the rate
//! filter), `-C` (copy offloading between files) and `-S 0` (zeros
//! written as data).

pub mod offload;
pub mod salvage;
pub mod zeroes_as_data;

use diskit_core::{DeviceRef, Result};
use diskit_filters::Configure;
use diskit_filters::rate::RateConfig;

/// How long a burst at full speed may be: one slice of qemu-img's rate
/// limit (100 ms), which lets a slice's worth through at once.
const RATE_BURST_SECS: f64 = 0.1;

/// `convert -r`: `src` read at most `bytes_per_sec` bytes a second, by
/// the rate filter (which counts bits); its requests stay in flight.
pub fn rate_limited(src: DeviceRef, bytes_per_sec: u64) -> Result<DeviceRef> {
    let config = RateConfig {
        rate: bytes_per_sec.saturating_mul(8),
        burstiness: RATE_BURST_SECS,
        ..RateConfig::default()
    };
    config.stack(src)
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn bytes_are_read_at_the_rate() {
        // 64 KiB a second, 100 ms of burst: 32 KiB take 0.4 s.
        let d = rate_limited(Arc::new(MemoryDevice::new(1 << 20)), 64 << 10).unwrap();
        let t0 = Instant::now();
        let mut buf = vec![0u8; 8 << 10];
        for i in 0..4 {
            d.read_at(&mut buf, i * (8 << 10)).unwrap();
        }
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(350), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
}
