//! The nocache filter (nbdkit-nocache-filter): changes how cache
//! (prefetch) requests are handled, to measure what they are worth.
//!
//! `cachemode=none` (the default): cache is not offered; `emulate`:
//! offered, and done here by reading the range and dropping the bytes,
//! whatever the device below does; `nop` (or `no-op`): offered, and
//! every request succeeds at once, doing nothing.

use diskit_core::{BlockDevice, Capabilities, DeviceRef, Filter, Result};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["cachemode"];

/// How cache requests are handled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Nocache {
    /// Not offered.
    #[default]
    None,
    /// Done by reading.
    Emulate,
    /// Accepted and ignored.
    Nop,
}

/// The most read at once when emulating.
const CHUNK: u64 = 4 << 20;

impl Configure for Nocache {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "cachemode" => {
                *self = params::choice(
                    "nocache",
                    key,
                    value,
                    &[
                        ("none", Nocache::None),
                        ("emulate", Nocache::Emulate),
                        ("nop", Nocache::Nop),
                        ("no-op", Nocache::Nop),
                    ],
                )?
            }
            _ => return Err(unknown("nocache", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(*self, next))
    }
}

impl Filter for Nocache {
    fn name(&self) -> &str {
        "nocache"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn submits_below(&self) -> bool {
        // Reads, writes and zeroes are untouched.
        true
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        Capabilities {
            can_cache: *self != Nocache::None,
            ..next.capabilities()
        }
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        match self {
            Nocache::None => next.cache(offset, len),
            Nocache::Nop => Ok(()),
            Nocache::Emulate => {
                let mut buf = vec![0u8; len.min(CHUNK) as usize];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(CHUNK) as usize;
                    next.read_at(&mut buf[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
        }
    }
}
