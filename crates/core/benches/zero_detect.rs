//! Micro-benchmark: vectorised zero detection against the naive byte loop.
//!
//! Run with `cargo bench -p diskit-core --bench zero_detect`. Prints GiB/s
//! for each implementation on an all-zero 2 MiB buffer (the worst case: the
//! whole buffer must be scanned) and the speed-up.

use std::hint::black_box;
use std::time::{Duration, Instant};

use diskit_core::zero::{is_zero, is_zero_naive};

fn rate(f: impl Fn(&[u8]) -> bool, buf: &[u8]) -> f64 {
    // Median of several timed batches.
    let mut rates = Vec::new();
    for _ in 0..7 {
        let start = Instant::now();
        let mut bytes = 0u64;
        while start.elapsed() < Duration::from_millis(150) {
            assert!(black_box(f(black_box(buf))));
            bytes += buf.len() as u64;
        }
        rates.push(bytes as f64 / start.elapsed().as_secs_f64() / (1u64 << 30) as f64);
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

fn main() {
    for size in [4096usize, 64 * 1024, 2 * 1024 * 1024] {
        let buf = vec![0u8; size];
        let naive = rate(is_zero_naive, &buf);
        let fast = rate(is_zero, &buf);
        println!(
            "zero-detect {:>8} B: naive {naive:6.2} GiB/s, diskit {fast:6.2} GiB/s, speed-up {:.1}x",
            size,
            fast / naive
        );
    }
}
