//! The partition filter's table reader: whatever the disk's bytes and the
//! partition asked for, a window inside the disk or an error, never a
//! panic or a loop.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let n = u32::from_le_bytes(data[..4].try_into().unwrap()) % 300 + 1;
    let disk = &data[4..];
    // A disk of at least 16 sectors: the bytes given, then zeros.
    let size = (disk.len() as u64).max(16 * 512);
    let read = |off: u64, buf: &mut [u8]| -> diskit_core::Result<()> {
        let end = off
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= size)
            .ok_or_else(|| diskit_core::Error::invalid("read past the end"))?;
        for (i, b) in buf.iter_mut().enumerate() {
            *b = disk.get(off as usize + i).copied().unwrap_or(0);
        }
        let _ = end;
        Ok(())
    };
    if let Ok((start, len)) = diskit_filters::partition::locate(&read, size, n) {
        assert!(start.checked_add(len).is_some_and(|e| e <= size));
    }
});
