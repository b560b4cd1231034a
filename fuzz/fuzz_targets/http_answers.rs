//! What the http source reads from servers and command lines: a
//! Content-Range value, an answer's header section (S3's direct range
//! GETs) and the curl plugin's key=value options. Whatever
//! the bytes, a value or an error, never a panic; a range it accepts is
//! well formed.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A header section as the direct range GETs read it.
    if diskit_http::direct::Answer::parse(data).is_some() {
        assert!(data.starts_with(b"HTTP/1.1 "));
    }
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
