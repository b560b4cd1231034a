//! What `diskit serve` parses from its command line and files: filter
//! parameters (every filter, stacked over a small RAM disk and exercised
//! with a few requests) and TLS-PSK key files. Whatever the bytes, a value
//! or an error: never a panic, a hang or a huge allocation.
#![no_main]

use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, DeviceRef, WriteFlags, ZeroFlags};
use diskit_filters::{FILTERS, FilterSpec};
use libfuzzer_sys::fuzz_target;

/// The most bytes one exercised request touches.
const MAX_IO: u64 = 64 << 10;

fn exercise(dev: &dyn BlockDevice, seed: u64) {
    let size = dev.size();
    if size == 0 {
        return;
    }
    let offset = seed % size;
    let len = (size - offset).min(MAX_IO).min(1 + seed % 9000);
    let mut buf = vec![0u8; len as usize];
    let _ = dev.read_at(&mut buf, offset);
    if !dev.capabilities().can_write {
        let _ = dev.extents(offset, len);
        return;
    }
    buf.fill(0x5a);
    let _ = dev.write_at(&buf, offset, WriteFlags { fua: seed & 1 == 1 });
    let _ = dev.write_zeroes(offset, len, ZeroFlags::default());
    let _ = dev.trim(offset, len, WriteFlags::NONE);
    let _ = dev.extents(offset, len);
    let _ = dev.flush();
}

fuzz_target!(|data: &[u8]| {
    let _ = diskit_nbd::server::tls::psk::parse_key_file(data);

    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let info = &FILTERS[which as usize % FILTERS.len()];
    let params: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let Ok(spec) = FilterSpec::parse(info.name, &params) else {
        return;
    };
    // Parsed, not stacked: delays and rates are honoured (a parsed delay
    // of hours would stall the run), and files named by the input (log
    // and stats files, log scripts, cow-file overlays) would be created
    // or run wherever the input says.
    if matches!(info.name, "delay" | "rate" | "log" | "stats")
        || params.iter().any(|(k, _)| k == "cow-file")
    {
        return;
    }
    let disk: DeviceRef = Arc::new(MemoryDevice::new(1 << 20));
    let read_only = which & 0x80 != 0;
    if let Ok(dev) = spec.stack(disk, read_only) {
        let seed = rest
            .iter()
            .fold(0u64, |a, &b| a.wrapping_mul(31).wrapping_add(b.into()));
        exercise(&*dev, seed);
    }
});
