//! The xz filter's map of a file (stream footers, indexes, headers, read
//! backwards from the end): whatever the bytes, blocks that lie inside
//! the file and add up to its uncompressed size, or an error, never a
//! panic, a loop or a huge allocation. Half the runs parse the bytes as
//! one index alone.
#![no_main]

use libfuzzer_sys::fuzz_target;

mod common;

use diskit_filters::xz::index;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, file)) = data.split_first() else {
        return;
    };
    if mode & 1 == 1 {
        let _ = index::records(file);
        return;
    }
    let size = file.len() as u64;
    let read = common::slice_reader(file);
    if let Ok(ix) = index::parse(&read, size) {
        let mut at = 0u64;
        for b in &ix.blocks {
            assert_eq!(b.start, at);
            assert!(b.size > 0 && b.stream < ix.streams.len());
            assert!(b.offset.checked_add(b.padded()).is_some_and(|e| e <= size));
            at += b.size;
        }
        assert!(at <= ix.size);
    }
});
