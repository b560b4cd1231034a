//! The generic write half on a toy format: one table of 4 KiB units,
//! new units at the end of its data storage.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use diskit_backends::MemoryDevice;
use diskit_core::sync::lock;
use diskit_core::{BlockDevice, ErrorKind, Result, WriteFlags, ZeroFlags};

use super::{Allocation, Backing, Fill, Layers, Mapped, MappedFormat, Place};

const UNIT: u64 = 4096;
const UNITS: u64 = 16;

/// A format with one table: each unit unallocated or at a host offset.
struct Toy {
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    map: Mutex<Vec<Option<u64>>>,
    next: AtomicU64,
    allocations: AtomicUsize,
    flushes: AtomicUsize,
}

fn toy(writable: bool, backing: Option<Backing>) -> Arc<Mapped<Toy>> {
    Arc::new(Mapped::new(Toy {
        layers: Layers {
            data: Arc::new(MemoryDevice::new(0)),
            backing,
            writable,
        },
        map: Mutex::new(vec![None; UNITS as usize]),
        next: AtomicU64::new(0),
        allocations: AtomicUsize::new(0),
        flushes: AtomicUsize::new(0),
    }))
}

impl MappedFormat for Toy {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        UNIT * UNITS
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        let n = (UNIT - g % UNIT).min(max);
        let place = match lock(&self.map)[(g / UNIT) as usize] {
            Some(h) => Place::Data(h + g % UNIT),
            None => Place::Unallocated { alloc: None },
        };
        Ok((n, place, None))
    }

    fn unit(&self) -> u64 {
        UNIT
    }

    fn describe(&self) -> String {
        String::from("toy")
    }

    fn allocate(&self, g: u64, _data: &[u8]) -> Result<Allocation> {
        self.allocations.fetch_add(1, Ordering::SeqCst);
        // Give a racing writer time to find the unit still unallocated.
        std::thread::sleep(std::time::Duration::from_millis(5));
        Ok(Allocation {
            guest: g / UNIT * UNIT,
            len: UNIT,
            host: self.next.fetch_add(UNIT, Ordering::SeqCst),
            fill: Fill::Whole,
        })
    }

    fn commit(&self, a: Allocation) -> Result<()> {
        lock(&self.map)[(a.guest / UNIT) as usize] = Some(a.host);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn concurrent_writes_to_one_unallocated_unit_allocate_it_once() {
    let t = toy(true, None);
    std::thread::scope(|s| {
        for i in 0..8u8 {
            let t = t.clone();
            s.spawn(move || {
                t.write_at(&[i + 1; 512], UNIT + i as u64 * 512, WriteFlags::NONE)
                    .unwrap()
            });
        }
    });
    assert_eq!(t.allocations.load(Ordering::SeqCst), 1);
    let mut b = vec![0u8; UNIT as usize];
    t.read_at(&mut b, UNIT).unwrap();
    for (i, piece) in b.chunks(512).enumerate() {
        assert!(piece.iter().all(|&x| x == i as u8 + 1), "piece {i}");
    }
}

#[test]
fn fua_flushes_once_after_the_request() {
    let t = toy(true, None);
    t.write_at(&[1; 100], 0, WriteFlags::NONE).unwrap();
    assert_eq!(t.flushes.load(Ordering::SeqCst), 0);
    t.write_at(&[1; 3 * UNIT as usize], 10, WriteFlags::FUA)
        .unwrap();
    assert_eq!(t.flushes.load(Ordering::SeqCst), 1);
    let fua = ZeroFlags {
        fua: true,
        ..ZeroFlags::default()
    };
    t.write_zeroes(0, 2 * UNIT, fua).unwrap();
    assert_eq!(t.flushes.load(Ordering::SeqCst), 2);
    t.trim(0, UNIT, WriteFlags::FUA).unwrap();
    assert_eq!(t.flushes.load(Ordering::SeqCst), 3);
}

#[test]
fn a_read_only_image_refuses_every_change() {
    let t = toy(false, None);
    let kind = |r: Result<()>| r.unwrap_err().kind();
    assert_eq!(
        kind(t.write_at(&[1; 10], 0, WriteFlags::NONE)),
        ErrorKind::PermissionDenied
    );
    assert_eq!(
        kind(t.write_zeroes(0, 10, ZeroFlags::default())),
        ErrorKind::PermissionDenied
    );
    assert_eq!(
        kind(t.trim(0, 10, WriteFlags::NONE)),
        ErrorKind::PermissionDenied
    );
    assert!(!t.capabilities().can_write);
    assert_eq!(t.allocations.load(Ordering::SeqCst), 0);
}

#[test]
fn requests_past_the_end_are_refused() {
    let t = toy(true, None);
    let end = t.size();
    let kind = |r: Result<()>| r.unwrap_err().kind();
    assert_eq!(
        kind(t.write_at(&[1; 20], end - 10, WriteFlags::NONE)),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        kind(t.write_zeroes(end, 1, ZeroFlags::default())),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        kind(t.trim(u64::MAX, 2, WriteFlags::NONE)),
        ErrorKind::InvalidInput
    );
    assert_eq!(t.allocations.load(Ordering::SeqCst), 0);
}

#[test]
fn copy_on_write_keeps_what_the_backing_image_holds_around_the_data() {
    let below = Arc::new(MemoryDevice::new(UNIT * UNITS));
    let pattern: Vec<u8> = (0..UNIT * UNITS).map(|i| (i % 251) as u8).collect();
    below.write_at(&pattern, 0, WriteFlags::NONE).unwrap();
    let t = toy(
        true,
        Some(Backing {
            device: below,
            size: UNIT * UNITS,
        }),
    );
    t.write_at(&[0xAA; 100], 2 * UNIT + 1000, WriteFlags::NONE)
        .unwrap();
    let mut b = vec![0u8; (UNIT * UNITS) as usize];
    t.read_at(&mut b, 0).unwrap();
    let mut want = pattern.clone();
    want[(2 * UNIT + 1000) as usize..(2 * UNIT + 1100) as usize].fill(0xAA);
    assert!(b == want, "the unit's other bytes come from below");
    // The whole unit was written to the new space.
    assert_eq!(t.data().size(), UNIT);
}

#[test]
fn zeroing_leaves_zeros_alone_and_writes_data_unless_fast() {
    let t = toy(true, None);
    t.write_zeroes(0, UNIT * UNITS, ZeroFlags::default())
        .unwrap();
    assert_eq!(t.allocations.load(Ordering::SeqCst), 0);
    t.write_at(&[7; 10], UNIT, WriteFlags::NONE).unwrap();
    let fast = ZeroFlags {
        fast: true,
        ..ZeroFlags::default()
    };
    assert_eq!(
        t.write_zeroes(UNIT, UNIT, fast).unwrap_err().kind(),
        ErrorKind::NotSupported
    );
    t.write_zeroes(UNIT + 5, 2, ZeroFlags::default()).unwrap();
    let mut b = [0u8; 10];
    t.read_at(&mut b, UNIT).unwrap();
    assert_eq!(b, [7, 7, 7, 7, 7, 0, 0, 7, 7, 7]);
    assert_eq!(t.allocations.load(Ordering::SeqCst), 1);
}
