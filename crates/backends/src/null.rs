//! The null device: reads zeros, accepts and discards writes (a sink for
//! benchmarks and a source of an empty disk).

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Extent, Result, Storage, WriteFlags, ZeroFlags};

/// A device of a given size that stores nothing.
pub struct NullDevice {
    size: u64,
    /// Whether extents promise zeros (QEMU's `read-zeroes`); without it they
    /// say nothing is known of the contents, as QEMU's null-co does.
    zeroes_known: bool,
    /// The name it shows (QEMU's `null-co://`, or its options in full).
    location: String,
}

impl NullDevice {
    /// A null device of `size` bytes whose extents say it reads as zeros.
    pub fn new(size: u64) -> NullDevice {
        NullDevice {
            size,
            zeroes_known: true,
            location: "null-co://".into(),
        }
    }

    /// A null device whose contents are reported unknown: not allocated
    /// and not known to be zero (QEMU's null-co without `read-zeroes`).
    /// It still reads zeros.
    pub fn unknown_contents(size: u64) -> NullDevice {
        NullDevice {
            size,
            zeroes_known: false,
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
        self.zeroes_known
    }
    fn discards_writes(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        buf.fill(0);
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
        if !self.zeroes_known {
            let mut e = Extent::hole(len);
            e.flags.zero = false;
            e.flags.present = false;
            return Ok(vec![e]);
        }
        Ok(vec![Extent::hole(len).at_host(offset)])
    }
    fn describe(&self) -> String {
        format!("null({})", self.size)
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
