//! Zero detection: the hot loop of convert.
//!
//! [`is_zero`] is written so that the compiler vectorises it (OR-reduction of
//! 256-byte blocks with an early exit per block), and on x86-64 a copy is
//! compiled for AVX2 and chosen at run time. [`zero_runs`] splits a buffer
//! into data and zero runs the way `qemu-img convert -S` does.

/// Whether every byte of `buf` is zero.
pub fn is_zero(buf: &[u8]) -> bool {
    // Most data buffers fail on their first bytes: check them before
    // choosing an implementation.
    let head = buf.len().min(16);
    if buf[..head].iter().any(|&b| b != 0) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if buf.len() >= 1024 && std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { is_zero_avx2(buf) };
        }
    }
    is_zero_portable(buf)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn is_zero_avx2(buf: &[u8]) -> bool {
    is_zero_portable(buf)
}

/// The portable implementation: OR together 256-byte blocks as machine
/// words, bailing out after each block that is not zero.
#[inline(always)]
pub fn is_zero_portable(buf: &[u8]) -> bool {
    const BLOCK: usize = 256;
    let mut blocks = buf.chunks_exact(BLOCK);
    for block in &mut blocks {
        let mut acc = 0u64;
        for word in block.chunks_exact(8) {
            acc |= u64::from_ne_bytes(word.try_into().expect("8-byte chunk"));
        }
        if acc != 0 {
            return false;
        }
    }
    blocks.remainder().iter().all(|&b| b == 0)
}

/// The obvious byte loop, kept as the reference for tests and the benchmark.
pub fn is_zero_naive(buf: &[u8]) -> bool {
    buf.iter().all(|&b| b == 0)
}

/// A run within a buffer: `len` bytes starting at `start`, all zero or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Start within the buffer.
    pub start: usize,
    /// Length in bytes.
    pub len: usize,
    /// Whether the run is all zeros (and may become a hole).
    pub zero: bool,
}

/// Splits `buf`, which holds the device bytes at `offset`, into alternating
/// data and zero runs.
///
/// Zero runs are made of whole blocks of `granularity` bytes aligned to the
/// device (not the buffer), and any zero run shorter than `min_zero` bytes is
/// folded into the data around it, so that a hole is only ever made for an
/// aligned run of at least `min_zero` zeros. `granularity` must be a power of
/// two.
pub fn zero_runs(buf: &[u8], offset: u64, granularity: usize, min_zero: usize) -> Vec<Run> {
    debug_assert!(granularity.is_power_of_two());
    let mut runs: Vec<Run> = Vec::new();
    let mut pos = 0usize;
    while pos < buf.len() {
        let abs = offset + pos as u64;
        let to_boundary = granularity - (abs % granularity as u64) as usize;
        let n = to_boundary.min(buf.len() - pos);
        // Partial blocks at the edges can never become holes.
        let zero = n == granularity && is_zero(&buf[pos..pos + n]);
        match runs.last_mut() {
            Some(last) if last.zero == zero => last.len += n,
            _ => runs.push(Run {
                start: pos,
                len: n,
                zero,
            }),
        }
        pos += n;
    }
    // Fold short zero runs into data.
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for mut r in runs {
        if r.zero && r.len < min_zero {
            r.zero = false;
        }
        match out.last_mut() {
            Some(last) if last.zero == r.zero => last.len += r.len,
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agrees_with_the_naive_loop_on_every_position() {
        for len in [0usize, 1, 7, 16, 17, 255, 256, 257, 1023, 1024, 4096, 70000] {
            let mut buf = vec![0u8; len];
            assert!(is_zero(&buf), "len {len}");
            for pos in [0, len / 3, len.saturating_sub(1)] {
                if len == 0 {
                    continue;
                }
                buf[pos] = 0x80;
                assert_eq!(is_zero(&buf), is_zero_naive(&buf), "len {len} pos {pos}");
                assert!(!is_zero(&buf));
                buf[pos] = 0;
            }
        }
    }

    #[test]
    fn unaligned_slices_are_handled() {
        let mut buf = vec![0u8; 5000];
        buf[4999] = 1;
        for start in 0..17 {
            assert!(!is_zero(&buf[start..]));
            assert!(is_zero(&buf[start..4999]));
        }
    }

    #[test]
    fn zero_runs_make_aligned_holes_only() {
        let g = 4096;
        let mut buf = vec![0u8; 5 * g];
        buf[10] = 1; // block 0 data
        buf[3 * g + 5] = 1; // block 3 data
        let runs = zero_runs(&buf, 0, g, g);
        assert_eq!(
            runs,
            vec![
                Run {
                    start: 0,
                    len: g,
                    zero: false
                },
                Run {
                    start: g,
                    len: 2 * g,
                    zero: true
                },
                Run {
                    start: 3 * g,
                    len: g,
                    zero: false
                },
                Run {
                    start: 4 * g,
                    len: g,
                    zero: true
                },
            ]
        );
        // With a larger minimum the two-block hole stays, one block does not.
        let runs = zero_runs(&buf, 0, g, 2 * g);
        assert_eq!(runs.len(), 3);
        assert_eq!(
            runs[2],
            Run {
                start: 3 * g,
                len: 2 * g,
                zero: false
            }
        );
    }

    #[test]
    fn zero_runs_align_to_the_device_not_the_buffer() {
        let g = 4096;
        let buf = vec![0u8; 3 * g];
        // The buffer starts 512 bytes into a block: head and tail are partial.
        let runs = zero_runs(&buf, 512, g, g);
        assert_eq!(
            runs,
            vec![
                Run {
                    start: 0,
                    len: g - 512,
                    zero: false
                },
                Run {
                    start: g - 512,
                    len: 2 * g,
                    zero: true
                },
                Run {
                    start: 3 * g - 512,
                    len: 512,
                    zero: false
                },
            ]
        );
        let total: usize = runs.iter().map(|r| r.len).sum();
        assert_eq!(total, buf.len());
    }
}

#[cfg(test)]
mod properties {
    use super::*;

    #[test]
    fn zero_runs_invariants_hold_for_random_buffers() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut rand = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n.max(1)
        };
        for _ in 0..300 {
            let len = rand(70_000) as usize;
            let mut buf = vec![0u8; len];
            for _ in 0..rand(6) {
                let at = rand(len as u64) as usize;
                let n = (rand(9000) as usize).min(len - at);
                buf[at..at + n].fill(1 + rand(255) as u8);
            }
            let offset = rand(1 << 20);
            let granularity = 1usize << (9 + rand(4));
            let min_zero = granularity * (1 + rand(4) as usize);
            let runs = zero_runs(&buf, offset, granularity, min_zero);
            let mut pos = 0;
            for (i, r) in runs.iter().enumerate() {
                assert_eq!(r.start, pos, "runs are contiguous");
                assert!(r.len > 0);
                if i > 0 {
                    assert_ne!(runs[i - 1].zero, r.zero, "runs alternate");
                }
                if r.zero {
                    assert!(is_zero(&buf[r.start..r.start + r.len]));
                    assert!(r.len >= min_zero);
                    assert_eq!(
                        (offset + r.start as u64) % granularity as u64,
                        0,
                        "holes are aligned"
                    );
                    assert_eq!(r.len % granularity, 0);
                }
                pos += r.len;
            }
            assert_eq!(pos, len, "runs cover the buffer");
        }
    }
}
