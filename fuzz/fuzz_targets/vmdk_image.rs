//! VMDK disks: any bytes opened as a vmdk (a sparse file, a stream, or a
//! descriptor, whose extents cannot be opened here) give a disk or an
//! error, and reading, mapping and checking it give data or errors: never
//! a panic, a hang or unbounded memory. Seeds (fuzz/seeds/vmdk_image) are
//! small disks qemu-img and qemu-io wrote.
#![no_main]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, Storage, StorageRef};
use diskit_formats::check::Repair;
use diskit_formats::driver::{FormatDriver, Opening};
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::vmdk::{VmdkDriver, descriptor::Descriptor};
use diskit_formats::OpenOptions;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Descriptor::parse(data);
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(data, 0).unwrap();
    let storage: StorageRef = mem;
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
    let len = v.size().min(4 << 20);
    let mut buf = vec![0u8; 256 << 10];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        let _ = v.read_at(&mut buf[..n], off);
        off += n as u64;
    }
    let mut pos = 0;
    for _ in 0..64 {
        if pos >= len {
            break;
        }
        match v.extents(pos, len - pos) {
            Ok(e) if !e.is_empty() => {
                let step: u64 = e.iter().map(|x| x.length).sum();
                assert!(step > 0 && step <= len - pos, "extents stay in range");
                pos += step;
            }
            _ => break,
        }
    }
});
