//! VMDK disks: any bytes opened as a vmdk (a sparse file, a stream, or a
//! descriptor, whose extents cannot be opened here) give a disk or an
//! error, and reading, mapping and checking it give data or errors: never
//! a panic, a hang or unbounded memory. Seeds (fuzz/seeds/vmdk_image) are
//! small disks qemu-img and qemu-io wrote.
#![no_main]

use diskit_formats::OpenOptions;
use diskit_formats::check::Repair;
use diskit_formats::driver::{FormatDriver, Opening};
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::vmdk::{VmdkDriver, descriptor::Descriptor};
use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let _ = Descriptor::parse(data);
    let storage = common::memory_storage(data);
    let Ok(opened) = VmdkDriver.open(Opening {
        storage,
        opts: &OpenOptions::default(),
        implied: &mut NoImpliedFiles,
    }) else {
        return;
    };
    let _ = opened.image.info();
    let _ = opened.image.check(Repair::None);
    let v = opened.device;
    common::read_and_map(&*v, 4 << 20, 256 << 10);
});
