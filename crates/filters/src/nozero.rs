//! The nozero filter (nbdkit-nozero-filter): hides or degrades
//! write-zeroes, to compare sparse-aware and naive clients.
//!
//! `zeromode=`:
//! - `none` (the default): write-zeroes is not offered (nor fast zero);
//!   clients write zeros like any other data.
//! - `emulate`: offered, but done here as plain writes of zero buffers,
//!   whatever the device below could do better. A fast zero always fails
//!   at once with ENOTSUP (writing zeros is never fast), whatever
//!   `fastzeromode` says: nbdkit 1.32 behaves the same.
//! - `notrim`: passed down without the may-trim flag, so the range stays
//!   allocated.
//! - `plugin`: passed down unchanged (useful with `fastzeromode`).
//!
//! `notrim` and `plugin` need a device below that takes write-zeroes
//! (checked when the filter is stacked on a writable device).
//!
//! `fastzeromode=`:
//! - `default`: with `emulate` fast zero is offered and always fails; with
//!   `notrim` and `plugin` the device below decides.
//! - `none`: fast zero is not offered.
//! - `slow`: offered, and every fast zero fails at once with ENOTSUP.
//! - `ignore`: offered, and the fast flag is dropped: the zeroing is done
//!   even when slow (against the NBD spec, for comparisons only).

use diskit_core::{BlockDevice, Capabilities, Error, ErrorKind, Filter, Result, ZeroFlags};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;
use diskit_core::device::write_zero_buffer;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["zeromode", "fastzeromode"];

/// How write-zeroes is offered and done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ZeroMode {
    /// Not offered.
    #[default]
    None,
    /// Offered, done as writes of zeros.
    Emulate,
    /// Passed down without may-trim.
    Notrim,
    /// Passed down unchanged.
    Plugin,
}

/// How fast zero is offered and done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FastZeroMode {
    /// As the zero mode implies.
    #[default]
    Default,
    /// Not offered.
    None,
    /// Offered, always fails.
    Slow,
    /// Offered, the flag is dropped.
    Ignore,
}

/// The filter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Nozero {
    /// `zeromode=`.
    pub zero: ZeroMode,
    /// `fastzeromode=`.
    pub fast: FastZeroMode,
}

impl Configure for Nozero {
    /// Takes `zeromode=` and `fastzeromode=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "zeromode" => {
                self.zero = params::choice(
                    "nozero",
                    key,
                    value,
                    &[
                        ("none", ZeroMode::None),
                        ("emulate", ZeroMode::Emulate),
                        ("notrim", ZeroMode::Notrim),
                        ("plugin", ZeroMode::Plugin),
                    ],
                )?
            }
            "fastzeromode" => {
                self.fast = params::choice(
                    "nozero",
                    key,
                    value,
                    &[
                        ("default", FastZeroMode::Default),
                        ("none", FastZeroMode::None),
                        ("slow", FastZeroMode::Slow),
                        ("ignore", FastZeroMode::Ignore),
                    ],
                )?
            }
            _ => return Err(unknown("nozero", key)),
        }
        Ok(())
    }

    fn check_below(&self, next: &dyn BlockDevice) -> Result<()> {
        let name = match self.zero {
            ZeroMode::Notrim => "notrim",
            ZeroMode::Plugin => "plugin",
            ZeroMode::None | ZeroMode::Emulate => return Ok(()),
        };
        let c = next.capabilities();
        if c.can_write && c.can_write_zeroes {
            Ok(())
        } else {
            Err(Error::unsupported(format!(
                "nozero: zeromode '{name}' requires plugin zero support"
            )))
        }
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(*self, next))
    }
}

impl Filter for Nozero {
    fn name(&self) -> &str {
        "nozero"
    }
    fn reads_unchanged(&self) -> bool {
        // Reads are untouched.
        true
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        let mut c = next.capabilities();
        match self.zero {
            ZeroMode::None => {
                c.can_write_zeroes = false;
                c.can_zero = false;
                c.can_fast_zero = false;
            }
            ZeroMode::Emulate => {
                c.can_write_zeroes = c.can_write;
                c.can_zero = false;
                c.can_fast_zero = self.fast != FastZeroMode::None;
            }
            ZeroMode::Notrim | ZeroMode::Plugin => {
                if self.fast != FastZeroMode::Default {
                    c.can_fast_zero = self.fast != FastZeroMode::None;
                }
            }
        }
        c
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        mut flags: ZeroFlags,
    ) -> Result<()> {
        if flags.fast {
            match (self.zero, self.fast) {
                // Zeroing by writing is never fast.
                (ZeroMode::None | ZeroMode::Emulate, _) | (_, FastZeroMode::Slow) => {
                    return Err(Error::from_kind(ErrorKind::NotSupported));
                }
                (_, FastZeroMode::Ignore) => flags.fast = false,
                _ => {}
            }
        }
        match self.zero {
            // `None` is not offered; a caller that zeroes anyway gets zeros written.
            ZeroMode::None | ZeroMode::Emulate => write_zero_buffer(next, offset, len, flags.fua),
            ZeroMode::Notrim => next.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    may_trim: false,
                    ..flags
                },
            ),
            ZeroMode::Plugin => next.write_zeroes(offset, len, flags),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, kv};
    use diskit_backends::{MemoryDevice, PatternDevice};
    use diskit_core::{Filtered, WriteFlags};
    use std::sync::Arc;

    fn parse(v: &[(&str, &str)]) -> Result<Nozero> {
        Nozero::from_params(&kv(v))
    }

    fn stacked(zm: &str, fzm: &str) -> (Arc<MemoryDevice>, Filtered<Nozero>) {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let n = parse(&[("zeromode", zm), ("fastzeromode", fzm)]).unwrap();
        n.check_below(&*mem).unwrap();
        (mem.clone(), Filtered::new(n, mem))
    }

    /// A fast zero that may trim.
    const FAST: ZeroFlags = ZeroFlags {
        may_trim: true,
        ..testing::FAST
    };

    #[test]
    fn capabilities_per_mode() {
        let caps = |zm, fzm| stacked(zm, fzm).1.capabilities();
        let c = caps("none", "default");
        assert!(!c.can_write_zeroes && !c.can_fast_zero && !c.can_zero);
        let c = caps("emulate", "default");
        assert!(c.can_write_zeroes && c.can_fast_zero && !c.can_zero);
        assert!(!caps("emulate", "none").can_fast_zero);
        assert!(
            caps("plugin", "default").can_fast_zero,
            "memory zeroes fast"
        );
        assert!(!caps("plugin", "none").can_fast_zero);
        assert!(caps("notrim", "slow").can_fast_zero);
        assert!(caps("notrim", "default").can_zero);
    }

    #[test]
    fn zeroing_per_mode() {
        // emulate: written as data, so the memory pages stay allocated.
        let (mem, d) = stacked("emulate", "ignore");
        mem.write_at(&[5u8; 65536], 0, WriteFlags::NONE).unwrap();
        assert_eq!(
            d.write_zeroes(0, 65536, FAST).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
        d.write_zeroes(0, 65536, ZeroFlags::default()).unwrap();
        assert_eq!(mem.allocated_bytes(), 65536);
        let mut b = [1u8; 4];
        mem.read_at(&mut b, 100).unwrap();
        assert_eq!(b, [0; 4]);
        // plugin: memory frees the page; slow fails fast zeros, ignore does them.
        let (mem, d) = stacked("plugin", "slow");
        mem.write_at(&[5u8; 65536], 0, WriteFlags::NONE).unwrap();
        assert_eq!(
            d.write_zeroes(0, 65536, FAST).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
        d.write_zeroes(0, 65536, ZeroFlags::default()).unwrap();
        assert_eq!(mem.allocated_bytes(), 0);
        let (mem, d) = stacked("plugin", "ignore");
        mem.write_at(&[5u8; 65536], 0, WriteFlags::NONE).unwrap();
        d.write_zeroes(0, 65536, FAST).unwrap();
        assert_eq!(mem.allocated_bytes(), 0);
        let (_, d) = stacked("none", "default");
        assert!(d.write_zeroes(0, 10, FAST).is_err());
        d.write_zeroes(0, 10, ZeroFlags::default()).unwrap();
    }

    #[test]
    fn plugin_modes_need_a_device_that_zeroes() {
        let pat = PatternDevice::new(4096);
        let n = parse(&[("zeromode", "notrim")]).unwrap();
        let e = n.check_below(&pat).unwrap_err();
        assert!(
            e.to_string()
                .contains("zeromode 'notrim' requires plugin zero support"),
            "{e}"
        );
        parse(&[("zeromode", "emulate")])
            .unwrap()
            .check_below(&pat)
            .unwrap();
        assert!(parse(&[("zeromode", "fast")]).is_err());
        assert!(parse(&[("fastzeromode", "quick")]).is_err());
        assert_eq!(parse(&[]).unwrap(), Nozero::default());
    }
}
