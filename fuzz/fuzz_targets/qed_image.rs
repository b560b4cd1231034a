//! QED images: any bytes opened as qed (writable, so that a need-check
//! image is checked and repaired at open) give an image or an error, and
//! reading, mapping, checking and writing it give data or errors: never a
//! panic, a hang or unbounded memory. The image sits on memory storage
//! and the files it names are refused. Seeds (fuzz/seeds/qed_image) are
//! small images qemu-img and qemu-io wrote.
#![no_main]

use diskit_core::{BlockDevice, WriteFlags};
use diskit_formats::OpenOptions;
use diskit_formats::check::Repair;
use diskit_formats::driver::{FormatDriver, Opening};
use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::qed::{self, QedDriver};
use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    // Tables are read whole: keep what a header can ask for bounded.
    if data.len() > 1 << 20 {
        return;
    }
    let storage = common::memory_storage(data);
    let _ = qed::check(&storage, Repair::None);
    let opts = OpenOptions {
        writable: true,
        ..Default::default()
    };
    let Ok(opened) = QedDriver.open(Opening {
        storage,
        opts: &opts,
        implied: &mut NoImpliedFiles,
    }) else {
        return;
    };
    let dev = opened.device;
    let len = dev.size().min(4 << 20);
    let mut buf = vec![0u8; 256 << 10];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        let _ = dev.read_at(&mut buf[..n], off);
        off += n as u64;
    }
    if len > 4096 {
        let _ = dev.write_at(&[0x5a; 3000], len / 3, WriteFlags::NONE);
        let _ = dev.read_at(&mut buf[..4096], len / 3 - 1000);
    }
    let _ = dev.extents(0, len.max(1).min(dev.size().max(1)));
});
