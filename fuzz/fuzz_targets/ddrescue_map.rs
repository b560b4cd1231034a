//! The ddrescue filter's mapfile parser: whatever the text, sorted,
//! disjoint, non-empty rescued runs or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(runs) = diskit_filters::ddrescue::parse_mapfile(&text) {
        for r in &runs {
            assert!(r.start < r.end);
        }
        for w in runs.windows(2) {
            assert!(w[0].end < w[1].start);
        }
    }
});
