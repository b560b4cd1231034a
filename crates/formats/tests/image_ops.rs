//! The format-neutral image interface (`FormatImage`) over memory: qcow2's
//! operations reached through the driver table, raw's defaults.

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, ErrorKind, Storage, StorageRef};
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::{Capability, Format, InfoValue, OpenOptions, OptionList, Prealloc};

/// A new image of `format` (made in a file by its driver) copied into memory.
fn image_in_memory(format: Format, options: &str) -> Arc<MemoryDevice> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.img");
    let mut o = OptionList::new();
    o.parse_into(options).unwrap();
    let mut new = format.driver().parse_create(&o).unwrap();
    assert_eq!(new.size(), None);
    new.set_size(4 << 20);
    diskit_formats::creation::LocalFiles::new(&path)
        .run(|t| new.create(t))
        .unwrap();
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(&std::fs::read(&path).unwrap(), 0).unwrap();
    mem
}

fn open(format: Format, mem: &Arc<MemoryDevice>) -> diskit_formats::driver::Opened {
    let storage: StorageRef = mem.clone();
    let opts = OpenOptions {
        writable: true,
        ..Default::default()
    };
    format
        .driver()
        .open(diskit_formats::driver::Opening {
            storage,
            opts: &opts,
            implied: &mut NoImpliedFiles,
        })
        .unwrap()
}

#[test]
fn qcow2_offers_its_tools_through_the_interface() {
    let mem = image_in_memory(Format::QCOW2, "cluster_size=4096");
    let opened = open(Format::QCOW2, &mem);
    let img = &opened.image;
    assert_eq!(img.format(), Format::QCOW2);
    assert_eq!(img.cluster_size(), Some(4096));
    assert_eq!(img.external_data(), None);
    assert!(img.implied_names().is_empty());
    assert!(img.stores_bitmaps());
    assert!(img.bitmaps().unwrap().is_empty());

    img.create_snapshot("first", 1, 2).unwrap();
    let snaps = img.snapshots().unwrap();
    assert_eq!(snaps.len(), 1);
    assert_eq!(
        (snaps[0].id.as_str(), snaps[0].name.as_str()),
        ("1", "first")
    );

    let info = img.info().unwrap().unwrap();
    assert_eq!(info.cluster_size, Some(4096));
    assert_eq!(info.specific_type, "qcow2");
    assert_eq!(info.snapshots, snaps);
    let InfoValue::Dict(fields) = &info.specific else {
        panic!("format-specific data is an object");
    };
    assert_eq!(fields[0], ("compat".into(), InfoValue::Str("1.1".into())));

    img.delete_snapshot("first").unwrap();
    assert!(img.snapshots().unwrap().is_empty());
    img.check_resize(8 << 20, Some(Prealloc::Metadata)).unwrap();
    img.resize(8 << 20, false, Prealloc::Off).unwrap();
    assert_eq!(opened.device.size(), 8 << 20);
}

#[test]
fn raw_resizes_and_refuses_the_rest_by_name() {
    let mem = image_in_memory(Format::RAW, "");
    let opened = open(Format::RAW, &mem);
    let img = &opened.image;
    assert!(!Format::RAW.supports(Capability::Snapshots));
    assert!(Format::QCOW2.supports(Capability::Snapshots));
    assert_eq!(img.info().unwrap(), None);
    assert!(img.snapshots().unwrap().is_empty());
    let e = img.create_snapshot("s", 0, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    assert!(e.to_string().contains("'raw'"), "{e}");
    let e = img
        .check_resize(1 << 20, Some(Prealloc::Metadata))
        .unwrap_err();
    assert_eq!(e.to_string(), "Unsupported preallocation mode: metadata");
    assert!(img.check_resize(0, None).is_err());
    img.resize(1 << 20, true, Prealloc::Off).unwrap();
    assert_eq!(opened.device.size(), 1 << 20);
}
