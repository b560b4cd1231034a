//! VHD images: any bytes opened as vpc give an image or an error, and
//! reading and mapping it give data or errors: never a panic, a hang or
//! unbounded memory (the allocation table must lie in the file). Seeds
//! (fuzz/seeds/vpc_image) are small images qemu-img and qemu-io wrote.
#![no_main]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, Storage, StorageRef};
use diskit_formats::vpc::device::Vpc;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(data, 0).unwrap();
    let storage: StorageRef = mem;
    let Ok(v) = Vpc::open(storage, false, Default::default(), false) else {
        return;
    };
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
