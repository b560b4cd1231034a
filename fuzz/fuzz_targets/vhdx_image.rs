//! VHDX images: any bytes opened as vhdx give an image or an error, and
//! reading, mapping and checking it give data or errors: never a panic, a
//! hang or unbounded memory (the log and the BAT must lie in the file).
//! Seeds (fuzz/seeds/vhdx_image) are small images laid out as qemu-img
//! lays them out, packed below 1.1 MiB (BAT and metadata under 1 MiB, no
//! log), one with a payload block and one without.
#![no_main]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, Storage, StorageRef};
use diskit_formats::check::Repair;
use diskit_formats::vhdx::{
    self,
    device::{Mode, Vhdx},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(data, 0).unwrap();
    let storage: StorageRef = mem;
    let _ = vhdx::check(&storage, Repair::None);
    let Ok(v) = Vhdx::open(storage, Mode::default()) else {
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
