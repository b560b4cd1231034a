//! The null device: reads one byte repeated (zeros, or nbdkit's ones
//! plugin's byte), accepts and discards writes (a sink for benchmarks and
//! a source of an empty disk).

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Extent, Result, Storage, WriteFlags, ZeroFlags};

/// What a null device reads, and what its extents say of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contents {
    /// Zeros, promised by the extents (QEMU's `read-zeroes`) or not (they
    /// then say nothing is known of the contents, as QEMU's null-co does).
    Zeros { known: bool },
    /// This byte everywhere, all of it data (nbdkit's ones plugin).
    Filled(u8),
}

/// A device of a given size that stores nothing.
pub struct NullDevice {
    size: u64,
    contents: Contents,
    /// The name it shows (QEMU's `null-co://`, or its options in full).
    location: String,
}

impl NullDevice {
    /// A null device of `size` bytes whose extents say it reads as zeros.
    pub fn new(size: u64) -> NullDevice {
        NullDevice {
            size,
            contents: Contents::Zeros { known: true },
            location: "null-co://".into(),
        }
    }

    /// `size` bytes of `byte`, all data; writes, zeroes and trims are
    /// accepted and dropped (nbdkit's ones plugin).
    pub fn filled(size: u64, byte: u8) -> NullDevice {
        NullDevice {
            size,
            contents: Contents::Filled(byte),
            location: format!("ones({size}, {byte:#04x})"),
        }
    }

    /// A null device whose contents are reported unknown: not allocated
    /// and not known to be zero (QEMU's null-co without `read-zeroes`).
    /// It still reads zeros.
    pub fn unknown_contents(size: u64) -> NullDevice {
        NullDevice {
            size,
            contents: Contents::Zeros { known: false },
            location: "null-co://".into(),
        }
    }

    /// The same device shown by another name (its options, when they are
    /// not the defaults a plain `null-co://` stands for).
    pub fn named(self, location: String) -> NullDevice {
        NullDevice { location, ..self }
    }
}

impl BlockDevice for NullDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::IN_MEMORY
    }
    fn is_known_zero(&self) -> bool {
        self.contents == Contents::Zeros { known: true }
    }
    fn discards_writes(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        buf.fill(match self.contents {
            Contents::Zeros { .. } => 0,
            Contents::Filled(byte) => byte,
        });
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size, offset, len)
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size, offset, len)?;
        Ok(vec![match self.contents {
            Contents::Zeros { known: true } => Extent::hole(len).at_host(offset),
            Contents::Zeros { known: false } => {
                let mut e = Extent::hole(len);
                e.flags.zero = false;
                e.flags.present = false;
                e
            }
            Contents::Filled(_) => Extent::data(len),
        }])
    }
    fn describe(&self) -> String {
        match self.contents {
            Contents::Filled(_) => self.location.clone(),
            Contents::Zeros { .. } => format!("null({})", self.size),
        }
    }
}

/// The null device as storage: QEMU's `null-co://` protocol. It has a fixed
/// size; a format on it reads zeros.
impl Storage for NullDevice {
    fn location(&self) -> &str {
        &self.location
    }

    fn protocol(&self) -> &'static str {
        "null-co"
    }

    fn allocated_bytes(&self) -> Option<u64> {
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_device_reads_its_byte_as_data_and_drops_writes() {
        let d = NullDevice::filled(4096, 0x5a);
        d.write_at(&[0; 16], 8, WriteFlags::NONE).unwrap();
        let mut b = [0u8; 32];
        d.read_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a));
        assert!(d.read_at(&mut b, 4090).is_err());
        let e = d.extents(0, 4096).unwrap();
        assert!(e.len() == 1 && !e[0].flags.zero, "{e:?}");
        assert!(!d.is_known_zero());
    }
}
