//! VHDX images: any bytes opened as vhdx give an image or an error, and
//! reading, mapping and checking it give data or errors: never a panic, a
//! hang or unbounded memory (the log and the BAT must lie in the file).
//! Seeds (fuzz/seeds/vhdx_image) are small images laid out as qemu-img
//! lays them out, packed below 1.1 MiB (BAT and metadata under 1 MiB, no
//! log), one with a payload block and one without.
#![no_main]

use diskit_formats::check::Repair;
use diskit_formats::vhdx::{
    self,
    device::{Mode, Vhdx},
};
use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let storage = common::memory_storage(data);
    let _ = vhdx::check(&storage, Repair::None);
    let Ok(v) = Vhdx::open(storage, Mode::default()) else {
        return;
    };
    common::read_and_map(&v, 4 << 20, 256 << 10);
});
