//! LUKS headers: any bytes parse to a validated header or an error, a
//! parsed header writes back to bytes that parse to the same header, and
//! unlocking a volume made of the bytes (key slots and all, iteration
//! counts capped low so that each run stays fast) gives a key or an
//! error: never a panic, a hang or unbounded memory. Seeds
//! (fuzz/seeds/luks_header) are headers qemu-img wrote.
#![no_main]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::Storage;
use diskit_formats::crypto::{Secret, Secrets};
use diskit_formats::luks::header::{HEADER_LEN, Header};
use diskit_formats::luks::keys;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Header::parse(data, 2000) else {
        return;
    };
    let again = Header::parse(&h.to_bytes(), 2000).expect("a written header parses");
    assert_eq!(again, h);
    // The volume: these bytes, at most 4 MiB of key material after them.
    let mem = Arc::new(MemoryDevice::new(0));
    mem.write_extend(&data[..data.len().min(4 << 20)], 0)
        .unwrap();
    let _ = Secrets::global().insert("fuzz", Secret::new(b"fuzz".to_vec()));
    let pass = Secrets::global().get("fuzz").unwrap();
    let _ = keys::unlock(&h, &*mem, 0, pass.bytes(), None);
    assert!(HEADER_LEN <= data.len());
});
