//! File views of a read-only qcow2: the bytes a server would splice are the
//! bytes a read gives; ranges that are not one data run have none.

use std::os::unix::fs::FileExt;

use diskit_core::{BlockDevice, WriteFlags};
use diskit_formats::{Format, OpenOptions, OptionList, create_image};
use diskit_open::open_image;

#[test]
fn views_of_data_runs_read_as_the_image_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.qcow2");
    let name = path.to_str().unwrap();
    let mut o = OptionList::new();
    o.parse_into("cluster_size=65536").unwrap();
    create_image(&path, Format::QCOW2, Some(8 << 20), &o).unwrap();
    let img = open_image(
        name,
        Some(Format::QCOW2),
        OpenOptions {
            writable: true,
            ..Default::default()
        },
    )
    .unwrap();
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8 + 1).collect();
    img.device
        .write_at(&data, 1 << 20, WriteFlags::NONE)
        .unwrap();
    // Writable: mappings may move, so no view is given out.
    assert!(img.device.file_view(1 << 20, 65536).is_none());
    img.close().unwrap();
    drop(img);

    let img = open_image(name, Some(Format::QCOW2), OpenOptions::default()).unwrap();
    let dev = &img.device;
    for (off, len) in [(1u64 << 20, 1u64 << 20), ((1 << 20) + 4097, 300_000)] {
        let view = dev.file_view(off, len).expect("a data run has a view");
        let file = std::fs::File::from(view.fd.try_clone_to_owned().unwrap());
        let mut spliced = vec![0u8; len as usize];
        file.read_exact_at(&mut spliced, view.offset).unwrap();
        let mut read = vec![0u8; len as usize];
        dev.read_at(&mut read, off).unwrap();
        assert_eq!(spliced, read, "{off}+{len}");
    }
    // Unallocated, or straddling data and a hole: no view.
    assert!(dev.file_view(0, 65536).is_none());
    assert!(dev.file_view((2 << 20) - 4096, 8192).is_none());
    assert!(dev.file_view(8 << 20, 1).is_none());
}
