//! Views of a qcow2 image's file (what a server splices into a socket
//! without copying): given out for a writable image only when nothing it
//! maps can be freed and given to other guest bytes while it is open
//! (trims and write-zeroes keep allocations, QEMU's `discard=ignore`).

use std::path::Path;
use std::sync::Arc;

use diskit_backends::FileDevice;
use diskit_core::{BlockDevice, StorageOptions, StorageRef, WriteFlags, ZeroFlags};
use diskit_formats::OptionList;
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::qcow2::{self, Qcow2, Qcow2Options};

const CLUSTER: u64 = 64 << 10;

/// A new 4 MiB qcow2 image at `path`, made by diskit's creator.
fn create(path: &Path) {
    let mut o = OptionList::new();
    o.parse_into("size=4M").unwrap();
    let opts = qcow2::create::Qcow2CreateOptions::parse(&o).unwrap();
    diskit_formats::creation::LocalFiles::new(path)
        .run(|t| qcow2::create::create(t, &opts))
        .unwrap();
}

fn open(path: &Path, writable: bool, keep_allocations: bool) -> Qcow2 {
    let opts = StorageOptions {
        writable,
        ..Default::default()
    };
    let storage: StorageRef = Arc::new(FileDevice::open(path, opts).unwrap());
    qcow2::open::open(
        storage,
        Qcow2Options {
            writable,
            keep_allocations,
            ..Default::default()
        },
        &mut NoImpliedFiles,
    )
    .unwrap()
}

/// The host offset a view of guest `offset` points at, if one is given.
fn view(q: &Qcow2, offset: u64, len: u64) -> Option<u64> {
    q.file_view(offset, len).map(|v| v.offset)
}

#[test]
fn a_writable_image_gives_views_only_while_it_keeps_its_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.qcow2");
    create(&path);
    let q = open(&path, true, false);
    q.write_at(&[0xab; 2 * CLUSTER as usize], 0, WriteFlags::NONE)
        .unwrap();
    // Trims may free clusters that later writes take: no views.
    assert_eq!(view(&q, 0, 4096), None);
    q.close().unwrap();
    drop(q);

    let q = open(&path, true, true);
    let host = view(&q, 0, 4096).expect("a view of a data cluster");
    assert_eq!(view(&q, 4096, CLUSTER), Some(host + 4096), "within the run");
    assert_eq!(view(&q, 3 * CLUSTER, 4096), None, "unallocated");
    // A trim does nothing and a zero that may trim keeps the cluster: the
    // space viewed is still the range's.
    q.trim(0, CLUSTER, WriteFlags::NONE).unwrap();
    let mut buf = vec![0; 16];
    q.read_at(&mut buf, 100).unwrap();
    assert_eq!(
        buf, [0xab; 16],
        "a trim that may not deallocate left the data"
    );
    q.write_zeroes(
        CLUSTER,
        CLUSTER,
        ZeroFlags {
            may_trim: true,
            ..Default::default()
        },
    )
    .unwrap();
    q.read_at(&mut buf, CLUSTER + 100).unwrap();
    assert_eq!(buf, [0; 16]);
    q.write_at(&[0xcd; 4096], CLUSTER, WriteFlags::NONE)
        .unwrap();
    assert_eq!(
        view(&q, CLUSTER, 4096),
        Some(host + CLUSTER),
        "the zeroed cluster was kept, and written in place"
    );
    // A new cluster does not take the kept ones' space.
    q.write_at(&[0xef; 4096], 2 * CLUSTER, WriteFlags::NONE)
        .unwrap();
    let new = view(&q, 2 * CLUSTER, 4096).unwrap();
    assert!(
        new >= host + 2 * CLUSTER || new + CLUSTER <= host,
        "{new} {host}"
    );
    q.close().unwrap();
}

#[test]
fn a_read_only_image_gives_views() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.qcow2");
    create(&path);
    let q = open(&path, true, false);
    q.write_at(&[1; 4096], 0, WriteFlags::NONE).unwrap();
    q.close().unwrap();
    drop(q);
    let q = open(&path, false, false);
    assert!(view(&q, 0, 4096).is_some());
}
