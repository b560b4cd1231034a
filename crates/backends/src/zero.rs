//! nbdkit's zero plugin: a read-only device of no bytes, for the corner
//! cases of clients and servers.

use diskit_core::device::check_range;
use diskit_core::{BlockDevice, Capabilities, Result};

/// A device of size 0.
pub struct ZeroDevice;

impl BlockDevice for ZeroDevice {
    fn size(&self) -> u64 {
        0
    }
    fn capabilities(&self) -> Capabilities {
        // Read-only; caching is a no-op, as nbdkit's plugin says.
        Capabilities {
            can_cache: true,
            ..Capabilities::READ_ONLY
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(0, offset, buf.len() as u64)
    }
    fn describe(&self) -> String {
        "zero".into()
    }
}
