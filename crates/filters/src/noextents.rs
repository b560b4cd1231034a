//! The noextents filter (nbdkit-noextents-filter): hides allocation.
//!
//! The filter reports that it cannot describe extents, and describes any
//! range as one run of data, as a device without extents does: clients see
//! the whole disk allocated (nbdkit's server answers block status the same
//! way for a plugin without extents). Useful over files on file systems
//! where SEEK_DATA is slow (tmpfs), or to make a client copy every byte.
//! It takes no parameters.

use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;
use diskit_core::{BlockDevice, Capabilities, Extent, Filter, Result};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// The filter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Noextents;

impl Configure for Noextents {
    fn set(&mut self, key: &str, _value: &str) -> Result<()> {
        Err(unknown("noextents", key))
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(*self, next))
    }
}

impl Filter for Noextents {
    fn name(&self) -> &str {
        "noextents"
    }
    fn reads_unchanged(&self) -> bool {
        // Reads are untouched.
        true
    }
    fn submits_below(&self) -> bool {
        // So are writes and zeroes: submitted, they stay in flight below.
        true
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        Capabilities {
            can_extents: false,
            ..next.capabilities()
        }
    }
    fn extents(&self, _next: &dyn BlockDevice, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::data(len)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::NullDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;

    #[test]
    fn holes_become_data() {
        let null = Arc::new(NullDevice::new(1 << 20));
        assert!(null.extents(0, 4096).unwrap()[0].flags.zero);
        let d = Filtered::new(Noextents, null);
        assert!(!d.capabilities().can_extents);
        assert_eq!(
            d.extents(4096, 1 << 19).unwrap(),
            vec![Extent::data(1 << 19)]
        );
        assert!(d.extents(4096, 1 << 20).is_err());
        assert!(d.capabilities().can_write, "everything else passes through");
    }
}
