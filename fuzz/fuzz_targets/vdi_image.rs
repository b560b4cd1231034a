//! VDI images: any bytes opened as vdi give an image or an error, and
//! reading, mapping and checking it give data or errors: never a panic, a
//! hang or unbounded memory (the block map must lie in the file). Seeds
//! (fuzz/seeds/vdi_image) are small images qemu-img and qemu-io wrote.
#![no_main]

use diskit_formats::check::Repair;
use diskit_formats::vdi::{self, device::Vdi};
use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let storage = common::memory_storage(data);
    let _ = vdi::check(&storage, Repair::None);
    let Ok(v) = Vdi::open(storage, false) else {
        return;
    };
    common::read_and_map(&v, 4 << 20, 256 << 10);
});
