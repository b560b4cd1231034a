//! Zero detection and run splitting agree with the naive definition.
#![no_main]

use diskit_core::zero::{is_zero, is_zero_naive, zero_runs};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let granularity = 512usize << (data[0] % 4);
    let offset = u64::from(data[1]) * 512;
    let min_zero = granularity * (1 + usize::from(data[2] % 4));
    // Sparse-ish buffers: expand each input byte into a 64-byte block.
    let buf: Vec<u8> = data[3..]
        .iter()
        .flat_map(|&b| std::iter::repeat_n(if b < 200 { 0 } else { b }, 64))
        .collect();
    assert_eq!(is_zero(&buf), is_zero_naive(&buf));
    let runs = zero_runs(&buf, offset, granularity, min_zero);
    let mut pos = 0;
    for r in runs {
        assert_eq!(r.start, pos);
        if r.zero {
            assert!(is_zero_naive(&buf[r.start..r.start + r.len]) && r.len >= min_zero);
        }
        pos += r.len;
    }
    assert_eq!(pos, buf.len());
});
