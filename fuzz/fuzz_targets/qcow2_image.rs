//! Whole-image reads: any file opened as qcow2 gives an image or an error,
//! and reading and mapping it gives data or errors: never a panic, a hang
//! or unbounded memory. Seeds (fuzz/seeds/qcow2_image) are small images
//! qemu-img wrote: standard, compressed (deflate, zstd), extended L2.
#![no_main]

use std::io::Write;

use diskit_core::BlockDevice;
use diskit_formats::qcow2::Header;
use diskit_formats::{Format, OpenOptions, open_image};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Images that name other files would make the fuzzer read the host's
    // files: keep to self-contained ones.
    match Header::parse(&data[..data.len().min(2 << 20)]) {
        Ok(h) if h.backing_file.is_some() || h.extension(0x4441_5441).is_some() => return,
        _ => {}
    }
    let dir = std::env::temp_dir();
    let mut file = tempfile::Builder::new()
        .prefix("diskit-fuzz-")
        .tempfile_in(dir)
        .unwrap();
    file.write_all(data).unwrap();
    let Ok(img) = open_image(file.path(), Some(Format::Qcow2), OpenOptions::default()) else {
        return;
    };
    let dev = img.device.clone();
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
