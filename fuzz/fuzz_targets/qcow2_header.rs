//! The qcow2 header parser: any bytes give a header or an error, never a
//! panic, and an accepted header satisfies the limits it promises.
#![no_main]

use diskit_formats::qcow2::Header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Start from a valid v3 header so the fuzzer reaches the deep checks.
    let mut buf = vec![0u8; 65536];
    buf[..4].copy_from_slice(b"QFI\xfb");
    buf[4..8].copy_from_slice(&3u32.to_be_bytes());
    buf[20..24].copy_from_slice(&16u32.to_be_bytes());
    buf[96..100].copy_from_slice(&4u32.to_be_bytes());
    buf[100..104].copy_from_slice(&112u32.to_be_bytes());
    // The input overwrites a prefix of it.
    let n = data.len().min(buf.len());
    buf[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = Header::parse(&buf) {
        assert!((9..=21).contains(&h.cluster_bits));
        assert!(h.refcount_bits() <= 64);
        assert!(h.l1_size as u64 * 8 <= 32 << 20);
        assert!(h.l1_table_offset % h.cluster_size() == 0);
        assert!(h.backing_file.as_ref().is_none_or(|b| b.len() <= 1023 * 3));
    }
});
