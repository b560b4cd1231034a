//! qcow2 over storage that is not a file: a sparse in-memory device.

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, Storage, StorageRef, WriteFlags, ZeroFlags};
use diskit_formats::OptionList;
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::qcow2::{self, Qcow2Options};

/// A new qcow2 image of `size` with 4 KiB clusters (made by diskit's
/// creator in a file) copied into memory.
fn image_in_memory(size: &str) -> Arc<MemoryDevice> {
    image_with(&format!("size={size},cluster_size=4096"))
}

/// A new qcow2 image made with `options`, copied into memory.
fn image_with(options: &str) -> Arc<MemoryDevice> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.qcow2");
    let mut o = OptionList::new();
    o.parse_into(options).unwrap();
    let opts = qcow2::create::Qcow2CreateOptions::parse(&o).unwrap();
    diskit_formats::creation::LocalFiles::new(&path)
        .run(|t| qcow2::create::create(t, &opts))
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(&bytes, 0).unwrap();
    mem
}

fn open(mem: &Arc<MemoryDevice>, writable: bool) -> qcow2::Qcow2 {
    let storage: StorageRef = mem.clone();
    qcow2::open::open(
        storage,
        Qcow2Options {
            writable,
            ..Default::default()
        },
        &mut NoImpliedFiles,
    )
    .unwrap()
}

#[test]
fn qcow2_reads_and_writes_over_memory() {
    let mem = image_in_memory("8M");
    let before = mem.size();
    let q = open(&mem, true);
    assert_eq!(q.size(), 8 << 20);
    q.write_at(&[0xab; 10000], 12345, WriteFlags::NONE).unwrap();
    q.write_at(&[0xcd; 4096], (8 << 20) - 4096, WriteFlags::FUA)
        .unwrap();
    q.write_zeroes(12345, 100, ZeroFlags::default()).unwrap();
    q.close().unwrap();
    drop(q);
    // The storage grew as clusters were allocated.
    assert!(mem.size() > before, "{} <= {before}", mem.size());

    let q = open(&mem, false);
    let mut buf = vec![0u8; 10000];
    q.read_at(&mut buf, 12345).unwrap();
    assert!(buf[..100].iter().all(|&b| b == 0));
    assert!(buf[100..].iter().all(|&b| b == 0xab));
    let mut tail = vec![0u8; 4096];
    q.read_at(&mut tail, (8 << 20) - 4096).unwrap();
    assert!(tail.iter().all(|&b| b == 0xcd));
    // Extents see the allocation; the rest is unallocated.
    let ext = q.extents(0, 8 << 20).unwrap();
    assert!(!ext[0].flags.data, "{ext:?}");
    let data: u64 = diskit_core::extent::walk(&q, 0, 8 << 20)
        .map(|e| e.unwrap())
        .filter(|e| e.flags.data)
        .map(|e| e.length)
        .sum();
    assert!(data >= 10000 + 4096 - 100, "{data}");
    // A read-only open refuses writes.
    assert!(q.write_at(&[1], 0, WriteFlags::NONE).is_err());
}

#[test]
fn a_qcow2_that_names_files_is_refused_without_an_opener() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.qcow2");
    let mut o = OptionList::new();
    o.parse_into("size=1M,backing_file=/etc/hostname,backing_fmt=raw")
        .unwrap();
    let opts = qcow2::create::Qcow2CreateOptions::parse(&o).unwrap();
    diskit_formats::creation::LocalFiles::new(&path)
        .run(|t| qcow2::create::create(t, &opts))
        .unwrap();
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(&std::fs::read(&path).unwrap(), 0).unwrap();
    let storage: StorageRef = mem;
    let e = qcow2::open::open(storage, Qcow2Options::default(), &mut NoImpliedFiles)
        .err()
        .unwrap();
    assert!(e.to_string().contains("/etc/hostname"), "{e}");
}

#[test]
fn writers_sharing_clusters_keep_each_others_bytes() {
    // Threads write interleaved 4 KiB blocks, so that every new cluster
    // (and with extended L2, every cluster's subclusters) is raced for by
    // several writers at once; then every block reads as its writer's.
    for options in [
        "size=4M",
        "size=4M,extended_l2=on,cluster_size=128k",
        "size=4M,cluster_size=4096",
    ] {
        let mem = image_with(options);
        let q = Arc::new(open(&mem, true));
        const THREADS: u64 = 4;
        const BLOCK: u64 = 4096;
        let blocks = q.size() / BLOCK;
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let q = q.clone();
                s.spawn(move || {
                    for b in (t..blocks).step_by(THREADS as usize) {
                        let fill = (b % 251) as u8 + 1;
                        q.write_at(&[fill; BLOCK as usize], b * BLOCK, WriteFlags::NONE)
                            .unwrap();
                    }
                });
            }
        });
        q.close().unwrap();
        drop(q);
        let q = open(&mem, false);
        let mut buf = vec![0u8; BLOCK as usize];
        for b in 0..blocks {
            q.read_at(&mut buf, b * BLOCK).unwrap();
            let fill = (b % 251) as u8 + 1;
            assert!(buf.iter().all(|&x| x == fill), "{options}: block {b}");
        }
    }
}
