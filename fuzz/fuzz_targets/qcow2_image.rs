//! Whole-image reads: any bytes opened as qcow2 give an image or an error,
//! and reading and mapping it gives data or errors: never a panic, a hang
//! or unbounded memory. The image sits on memory storage, and the files it
//! names are refused (no host file is ever read). Seeds
//! (fuzz/seeds/qcow2_image) are small images qemu-img wrote: standard,
//! compressed (deflate, zstd), extended L2.
#![no_main]

use diskit_formats::implied::NoImpliedFiles;
use diskit_formats::qcow2::{self, Qcow2Options};
use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let storage = common::memory_storage(data);
    let Ok(q) = qcow2::open::open(storage, Qcow2Options::default(), &mut NoImpliedFiles) else {
        return;
    };
    // Read and map the start of the disk (bounded, whatever it claims).
    common::read_and_map(&q, 1 << 20, 64 << 10);
});
