//! Format probing from the first bytes of an image.

use diskit_core::{BlockDevice, Result};

use crate::Format;

/// Guesses the format of an image from its header. Anything unrecognised
/// is raw.
pub fn probe(dev: &dyn BlockDevice) -> Result<Format> {
    let mut head = [0u8; 8];
    let n = head.len().min(dev.size() as usize);
    dev.read_at(&mut head[..n], 0)?;
    Ok(probe_bytes(&head[..n]))
}

/// Guesses a format from the first bytes of an image.
pub fn probe_bytes(head: &[u8]) -> Format {
    if head.len() >= 8 && head[..4] == *b"QFI\xfb" {
        let version = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
        if version >= 2 {
            return Format::Qcow2;
        }
    }
    Format::Raw
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qcow2_magic_is_recognised() {
        assert_eq!(probe_bytes(b"QFI\xfb\0\0\0\x03"), Format::Qcow2);
        assert_eq!(probe_bytes(b"QFI\xfb\0\0\0\x01"), Format::Raw);
        assert_eq!(probe_bytes(b"QFI"), Format::Raw);
        assert_eq!(probe_bytes(b""), Format::Raw);
    }
}
