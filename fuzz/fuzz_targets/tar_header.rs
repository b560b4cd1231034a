//! The tar filter's header reader: whatever the tarball's bytes and the
//! entry asked for, a window inside the tarball or an error, never a
//! panic, a loop or a huge allocation. The first byte picks the entry
//! among a few names (a long one too) and a limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

mod common;

const NAMES: [&[u8]; 4] = [
    b"disk.img",
    b"a/b/c.vmdk",
    b"",
    b"a-directory-with-a-rather-long-name/and-another-one-below-it-also-quite-long/x.img",
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, tar)) = data.split_first() else {
        return;
    };
    let name = NAMES[usize::from(pick & 3)];
    let limit = u64::from(pick >> 2) * 512;
    let size = tar.len() as u64;
    let read = common::slice_reader(tar);
    if let Ok((offset, len)) = diskit_filters::tar::locate(&read, size, name, limit) {
        assert!(offset.checked_add(len).is_some_and(|e| e <= size));
        assert!(offset % 512 == 0 && offset >= 512);
    }
});
