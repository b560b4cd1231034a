//! VHD images: any bytes opened as vpc give an image or an error, and
//! reading and mapping it give data or errors: never a panic, a hang or
//! unbounded memory (the allocation table must lie in the file). Seeds
//! (fuzz/seeds/vpc_image) are small images qemu-img and qemu-io wrote.
#![no_main]

use diskit_formats::vpc::device::Vpc;
use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let storage = common::memory_storage(data);
    let Ok(v) = Vpc::open(storage, false, Default::default(), false) else {
        return;
    };
    common::read_and_map(&v, 4 << 20, 256 << 10);
});
