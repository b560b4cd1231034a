//! Sizes, `-o` option lists and format probing: whatever the bytes, a value
//! or an error, never a panic; and parsed sizes stay in range.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(n) = diskit_core::size::parse_size(s) {
            assert!(n <= i64::MAX as u64);
        }
        let _ = diskit_core::size::human_size(data.len() as u64 * 0x1_0000_0001);
        let mut o = diskit_formats::OptionList::new();
        if o.parse_into(s).is_ok() {
            let _ = o.check_known(&["size", "preallocation"]);
        }
    }
    let _ = diskit_formats::probe::probe_bytes(data, "fuzz.dmg");
});
