use std::sync::Arc;

use diskit_backends::{MemoryDevice, NullDevice, PatternDevice};
use diskit_core::{BlockDevice, WriteFlags};

use super::*;

fn assert_same(a: &dyn BlockDevice, b: &dyn BlockDevice) {
    let mut x = vec![0u8; 1 << 20];
    let mut y = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < a.size() {
        let n = (a.size() - off).min(x.len() as u64) as usize;
        a.read_at(&mut x[..n], off).unwrap();
        b.read_at(&mut y[..n], off).unwrap();
        assert!(x[..n] == y[..n], "differ in the MiB at {off}");
        off += n as u64;
    }
}

#[test]
fn copies_pattern_exactly_in_any_mode() {
    let src = PatternDevice::new((8 << 20) + 1234);
    for (workers, ordered, request) in [(1, false, 65536), (8, false, 1 << 20), (4, true, 100_000)]
    {
        let dst = MemoryDevice::new(src.size());
        let opts = CopyOptions {
            workers,
            ordered_writes: ordered,
            request_size: request,
            ..Default::default()
        };
        let p = Progress::default();
        let stats = copy(&src, &dst, &opts, &p).unwrap();
        assert_same(&src, &dst);
        assert_eq!(p.get(), (src.size(), src.size()));
        // The pattern's first word is offset 0: one zero block at most.
        assert!(stats.data_bytes >= src.size() - 8192);
    }
}

#[test]
fn holes_in_the_source_stay_holes() {
    let src = MemoryDevice::new(64 << 20);
    src.write_at(&[1u8; 65536], 32 << 20, WriteFlags::NONE)
        .unwrap();
    // A written zero block inside data is found by zero detection too.
    src.write_at(&[0u8; 8192], 40 << 20, WriteFlags::NONE)
        .unwrap();
    let dst = MemoryDevice::new(64 << 20);
    let opts = CopyOptions {
        target_is_zero: true,
        ..Default::default()
    };
    let stats = copy(&src, &dst, &opts, &Progress::default()).unwrap();
    assert_eq!(stats.data_bytes, 65536);
    assert_eq!(dst.allocated_bytes(), 65536);
    assert_same(&src, &dst);
}

#[test]
fn a_dirty_destination_gets_zeroed() {
    let src = MemoryDevice::new(4 << 20);
    src.write_at(&[5u8; 4096], 4096, WriteFlags::NONE).unwrap();
    let dst = MemoryDevice::new(4 << 20);
    dst.write_at(&vec![9u8; 4 << 20], 0, WriteFlags::NONE)
        .unwrap();
    let stats = copy(&src, &dst, &CopyOptions::default(), &Progress::default()).unwrap();
    assert_same(&src, &dst);
    assert!(stats.zeroed_bytes >= (4 << 20) - 8192);
}

#[test]
fn min_sparse_zero_writes_everything() {
    let src = NullDevice::new(1 << 20);
    let dst = MemoryDevice::new(1 << 20);
    let opts = CopyOptions {
        min_sparse: 0,
        ..Default::default()
    };
    copy(&src, &dst, &opts, &Progress::default()).unwrap();
    assert_same(&src, &dst);
}

#[test]
fn small_destination_and_read_errors_are_reported() {
    let src = Arc::new(PatternDevice::new(1 << 20));
    let dst = MemoryDevice::new(1 << 19);
    let e = copy(&*src, &dst, &CopyOptions::default(), &Progress::default()).unwrap_err();
    assert!(e.to_string().contains("smaller"));
    let ro = PatternDevice::new(1 << 20);
    assert!(copy(&*src, &ro, &CopyOptions::default(), &Progress::default()).is_err());
}

/// A small deterministic generator (xorshift), so randomised tests replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[test]
fn random_layouts_copy_exactly_with_minimal_allocation() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let size = 1 + rng.below(6 << 20);
        let src = MemoryDevice::new(size);
        // Random runs of data, of zeros written as data, and of holes.
        for _ in 0..rng.below(12) {
            let off = rng.below(size);
            let len = 1 + rng.below((size - off).min(300_000));
            let byte = if rng.below(3) == 0 {
                0
            } else {
                1 + rng.below(255) as u8
            };
            src.write_at(&vec![byte; len as usize], off, WriteFlags::NONE)
                .unwrap();
        }
        let dirty = rng.below(2) == 0;
        let dst = MemoryDevice::new(size + rng.below(10_000));
        if dirty {
            dst.write_at(&vec![0xee; dst.size() as usize], 0, WriteFlags::NONE)
                .unwrap();
        }
        let opts = CopyOptions {
            min_sparse: [0, 512, 4096, 65536][rng.below(4) as usize],
            workers: 1 + rng.below(8) as usize,
            request_size: 512 * (1 + rng.below(2048) as usize),
            target_is_zero: !dirty,
            ordered_writes: rng.below(2) == 0,
            flush: rng.below(2) == 0,
            zero_alignment: [1, 4096, 65536][rng.below(3) as usize],
        };
        let stats = copy(&src, &dst, &opts, &Progress::default())
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let mut a = vec![0u8; size as usize];
        let mut b = vec![0u8; size as usize];
        src.read_at(&mut a, 0).unwrap();
        dst.read_at(&mut b, 0).unwrap();
        assert!(a == b, "seed {seed} {opts:?}: content differs");
        // Everything is accounted for exactly once.
        assert_eq!(
            stats.data_bytes + stats.zeroed_bytes + stats.skipped_bytes,
            size,
            "seed {seed}"
        );
        if opts.min_sparse == 0 {
            assert_eq!(stats.skipped_bytes, 0, "seed {seed}: -S 0 skips nothing");
        }
    }
}
