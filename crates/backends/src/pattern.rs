//! The pattern device: read-only data where each 8-byte big-endian word
//! holds its own offset (as nbdkit's pattern plugin), so any misplaced byte
//! in a copy is caught.

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Result};

/// A read-only device whose every aligned 8-byte word is its offset.
pub struct PatternDevice {
    size: u64,
}

impl PatternDevice {
    /// A pattern device of `size` bytes.
    pub fn new(size: u64) -> PatternDevice {
        PatternDevice { size }
    }

    /// The byte at `offset` of the pattern.
    pub fn byte_at(offset: u64) -> u8 {
        (offset & !7).to_be_bytes()[(offset & 7) as usize]
    }
}

impl BlockDevice for PatternDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::READ_ONLY
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        let mut pos = 0usize;
        // Unaligned head byte by byte, then whole words.
        while pos < buf.len() && !(offset + pos as u64).is_multiple_of(8) {
            buf[pos] = Self::byte_at(offset + pos as u64);
            pos += 1;
        }
        let mut words = buf[pos..].chunks_exact_mut(8);
        let mut word = offset + pos as u64;
        for w in &mut words {
            w.copy_from_slice(&word.to_be_bytes());
            word += 8;
        }
        for (i, b) in words.into_remainder().iter_mut().enumerate() {
            *b = Self::byte_at(word + i as u64);
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("pattern({})", self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_offsets_at_any_alignment() {
        let p = PatternDevice::new(1 << 20);
        let mut b = vec![0u8; 37];
        p.read_at(&mut b, 4093).unwrap();
        for (i, &x) in b.iter().enumerate() {
            assert_eq!(x, PatternDevice::byte_at(4093 + i as u64));
        }
        let mut w = [0u8; 8];
        p.read_at(&mut w, 4096).unwrap();
        assert_eq!(u64::from_be_bytes(w), 4096);
    }
}
