use diskit_backends::FileDevice;
use diskit_core::StorageOptions;

use super::*;
use crate::qcow2::test_tools::{qemu_img, qemu_img_create};

#[test]
fn bitmap_space_is_what_qemu_img_measures() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("b.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, "100M"]);
    let open = || {
        FileDevice::open(
            &img,
            StorageOptions {
                writable: false,
                ..Default::default()
            },
        )
        .unwrap()
    };
    assert_eq!(
        source_bitmaps_size(&open(), 100 << 20, 65536).unwrap(),
        Some(0)
    );
    qemu_img(&["bitmap", "--add", "-g", "512", p, "small-granularity"]);
    qemu_img(&["bitmap", "--add", p, "b"]);
    qemu_img(&[
        "bitmap",
        "--add",
        "-g",
        "2G",
        p,
        "a-rather-long-bitmap-name",
    ]);
    for cluster_size in ["512", "65536", "2M"] {
        let out = qemu_img(&[
            "measure",
            "-O",
            "qcow2",
            "-o",
            &format!("cluster_size={cluster_size}"),
            "-f",
            "qcow2",
            p,
        ]);
        let want: u64 = out
            .lines()
            .find_map(|l| l.strip_prefix("bitmaps size: "))
            .expect("bitmaps size line")
            .parse()
            .unwrap();
        let cs = diskit_core::size::parse_size(cluster_size).unwrap();
        assert_eq!(
            source_bitmaps_size(&open(), 100 << 20, cs).unwrap(),
            Some(want),
            "cluster size {cluster_size}"
        );
    }
    let v2 = dir.path().join("v2.qcow2");
    qemu_img_create(&v2, "compat=0.10", "1M");
    let dev = FileDevice::open(&v2, StorageOptions::default()).unwrap();
    assert_eq!(source_bitmaps_size(&dev, 1 << 20, 65536).unwrap(), None);
}

#[test]
fn fully_allocated_sizes() {
    let g = |cluster_bits, refcount_order, extended_l2| Geometry {
        cluster_bits,
        refcount_order,
        extended_l2,
    };
    // Values printed by qemu-img measure.
    assert_eq!(
        fully_allocated_size(1 << 30, g(16, 4, false)),
        1_074_135_040
    );
    assert_eq!(fully_allocated_size(1 << 30, g(16, 4, true)), 1_074_266_112);
    assert_eq!(fully_allocated_size(10 << 20, g(16, 4, false)), 10_813_440);
    assert_eq!(
        fully_allocated_size(1 << 30, g(12, 4, false)),
        1_076_379_648
    );
    // No overflow at the extremes.
    assert!(fully_allocated_size(u64::MAX, g(9, 6, false)) > 0);
}
