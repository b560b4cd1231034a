//! What the http source reads from servers and command lines: a
//! Content-Range value and the curl plugin's key=value options. Whatever
//! the bytes, a value or an error, never a panic; a range it accepts is
//! well formed.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some((a, b, total)) = diskit_http::parse_content_range(text) {
        assert!(a <= b);
        let _ = total;
    }
    let mut opts = diskit_http::HttpOptions::default();
    for line in text.lines() {
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        // A password or cookie read from a file names any file: not here.
        if v.starts_with('+') {
            continue;
        }
        let _ = opts.set(k, v);
    }
});
