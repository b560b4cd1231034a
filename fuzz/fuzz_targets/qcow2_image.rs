//! Whole-image reads: any bytes opened as qcow2 give an image or an error,
//! and reading and mapping it gives data or errors: never a panic, a hang
//! or unbounded memory. The image sits on memory storage, and the files it
//! names are refused (no host file is ever read). Seeds
//! (fuzz/seeds/qcow2_image) are small images qemu-img wrote: standard,
//! compressed (deflate, zstd), extended L2.
#![no_main]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, Storage, StorageRef};
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::qcow2::{self, Qcow2Options};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(data, 0).unwrap();
    let storage: StorageRef = mem;
    let Ok(q) = qcow2::open::open(storage, Qcow2Options::default(), &mut NoImpliedFiles) else {
        return;
    };
    let dev: Arc<dyn BlockDevice> = Arc::new(q);
    // Read and map the start of the disk (bounded, whatever it claims).
    let len = dev.size().min(1 << 20);
    let mut buf = vec![0u8; 64 << 10];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        let _ = dev.read_at(&mut buf[..n], off);
        off += n as u64;
    }
    let mut pos = 0;
    for _ in 0..64 {
        if pos >= len {
            break;
        }
        match dev.extents(pos, len - pos) {
            Ok(v) if !v.is_empty() => {
                let step: u64 = v.iter().map(|e| e.length).sum();
                assert!(step > 0 && step <= len - pos, "extents stay in range");
                pos += step;
            }
            _ => break,
        }
    }
});
