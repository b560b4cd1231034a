//! The delay filter (nbdkit-delay-filter): sleeps before passing requests
//! on, to simulate a slow or remote disk.
//!
//! - `rdelay=`, `delay-read=`: reads.
//! - `delay-write=`: writes.
//! - `delay-zero=`: write-zeroes.
//! - `delay-trim=`: trims.
//! - `delay-extents=`: extents (block status).
//! - `delay-cache=`: cache requests.
//! - `wdelay=`: writes, write-zeroes and trims at once (a later
//!   `delay-zero=` or `delay-trim=` overrides its part).
//! - `delay-fast-zero=BOOL` (default true): with false, a fast zero fails
//!   at once with ENOTSUP instead of waiting, and fast zero is offered
//!   whatever the device below says (when a zero delay is set).
//!
//! nbdkit's plural and alternative spellings (`delay-reads`,
//! `delay-writes`, `delay-zeroes`, `delay-trims`, `delay-discard(s)`,
//! `delay-extent`) are taken too. Delays are seconds, with an optional
//! fraction and unit: `2`, `1.5`, `1s`, `100ms`, `250us`, `1000ns`
//! (nbdkit 1.40's syntax; nbdkit 1.32 takes whole seconds and `NNms`).
//! `delay-open=` and `delay-close=` are refused: diskit's devices have no
//! per-connection open or close to delay. A read of 128 KiB or more may
//! ask for extents first (the server sends holes as such), so it waits for
//! `delay-extents` as well.

use std::time::Duration;

use diskit_core::{BlockDevice, Capabilities, Error, ErrorKind, Result};

use crate::call::{Call, Op};
use crate::gate::{Gate, Gated};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "rdelay",
    "delay-read",
    "delay-reads",
    "wdelay",
    "delay-write",
    "delay-writes",
    "delay-zero",
    "delay-zeroes",
    "delay-trim",
    "delay-trims",
    "delay-discard",
    "delay-discards",
    "delay-extent",
    "delay-extents",
    "delay-cache",
    "delay-fast-zero",
    "delay-open",
    "delay-close",
];

/// The filter: one delay per kind of request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delay {
    /// Before each read.
    pub read: Duration,
    /// Before each write.
    pub write: Duration,
    /// Before each write-zeroes.
    pub zero: Duration,
    /// Before each trim.
    pub trim: Duration,
    /// Before each extents query.
    pub extents: Duration,
    /// Before each cache request.
    pub cache: Duration,
    /// Whether fast zeros wait too (false: they fail at once).
    pub fast_zero: bool,
}

impl Default for Delay {
    fn default() -> Delay {
        Delay {
            read: Duration::ZERO,
            write: Duration::ZERO,
            zero: Duration::ZERO,
            trim: Duration::ZERO,
            extents: Duration::ZERO,
            cache: Duration::ZERO,
            fast_zero: true,
        }
    }
}

impl Configure for Delay {
    /// Takes a delay.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let t = || params::delay("delay", key, value);
        match key {
            "rdelay" | "delay-read" | "delay-reads" => self.read = t()?,
            "wdelay" => {
                self.write = t()?;
                self.zero = self.write;
                self.trim = self.write;
            }
            "delay-write" | "delay-writes" => self.write = t()?,
            "delay-zero" | "delay-zeroes" => self.zero = t()?,
            "delay-trim" | "delay-trims" | "delay-discard" | "delay-discards" => self.trim = t()?,
            "delay-extent" | "delay-extents" => self.extents = t()?,
            "delay-cache" => self.cache = t()?,
            "delay-fast-zero" => self.fast_zero = params::boolean("delay", key, value)?,
            "delay-open" | "delay-close" => {
                return Err(Error::unsupported(format!(
                    "delay: {key} is not supported (diskit has no per-connection open or close to delay)"
                )));
            }
            _ => return Err(unknown("delay", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Gated(*self), next))
    }
}

impl Delay {
    /// Whether fast zeros fail at once rather than wait.
    fn fails_fast_zero(&self) -> bool {
        !self.zero.is_zero() && !self.fast_zero
    }
}

impl Gate for Delay {
    const NAME: &'static str = "delay";

    /// Sleeps for the request's delay; a fast zero that fails at once
    /// fails.
    fn before(&self, call: &Call) -> Result<()> {
        let delay = match call.op {
            Op::Read => self.read,
            Op::Write => self.write,
            Op::Zero if call.flags.fast && self.fails_fast_zero() => {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
            Op::Zero => self.zero,
            Op::Trim => self.trim,
            Op::Extents => self.extents,
            Op::Cache => self.cache,
            Op::Flush => Duration::ZERO,
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        Ok(())
    }

    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        let c = next.capabilities();
        Capabilities {
            can_fast_zero: c.can_fast_zero || self.fails_fast_zero(),
            ..c
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FAST, kv};
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use diskit_core::{WriteFlags, ZeroFlags};
    use std::sync::Arc;

    fn parse(v: &[(&str, &str)]) -> Result<Delay> {
        Delay::from_params(&kv(v))
    }

    #[test]
    fn keys_set_their_delays_in_order() {
        let d = parse(&[("wdelay", "2ms"), ("delay-trim", "1"), ("rdelay", "1.5ms")]).unwrap();
        assert_eq!(d.write, Duration::from_millis(2));
        assert_eq!(d.zero, Duration::from_millis(2));
        assert_eq!(d.trim, Duration::from_secs(1));
        assert_eq!(d.read, Duration::from_micros(1500));
        let d = parse(&[("delay-trim", "1"), ("wdelay", "2ms")]).unwrap();
        assert_eq!(d.trim, Duration::from_millis(2), "wdelay comes later");
        let d = parse(&[
            ("delay-extent", "3ms"),
            ("delay-discards", "4ms"),
            ("delay-cache", "5ms"),
        ])
        .unwrap();
        assert_eq!(
            (d.extents, d.trim, d.cache),
            (
                Duration::from_millis(3),
                Duration::from_millis(4),
                Duration::from_millis(5)
            )
        );
        assert!(parse(&[("rdelay", "10s0")]).is_err());
        assert!(parse(&[("delay-fast-zero", "perhaps")]).is_err());
        let e = parse(&[("delay-open", "1")]).unwrap_err();
        assert!(e.to_string().contains("delay-open is not supported"), "{e}");
    }

    #[test]
    fn requests_pass_through_and_fast_zeros_fail_when_asked() {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let d = parse(&[
            ("rdelay", "1ms"),
            ("delay-zero", "1ms"),
            ("delay-fast-zero", "false"),
        ])
        .unwrap();
        assert!(d.fails_fast_zero());
        let dev = Filtered::new(Gated(d), mem.clone());
        dev.write_at(b"abc", 5, WriteFlags::NONE).unwrap();
        let mut b = [0u8; 3];
        dev.read_at(&mut b, 5).unwrap();
        assert_eq!(&b, b"abc");
        assert_eq!(
            dev.write_zeroes(0, 8, FAST).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
        dev.write_zeroes(0, 8, ZeroFlags::default()).unwrap();
        dev.read_at(&mut b, 5).unwrap();
        assert_eq!(b, [0; 3]);
        assert!(dev.capabilities().can_fast_zero);
        // With fast zeros waiting like the others, the device below decides.
        let d = parse(&[("delay-zero", "1ms")]).unwrap();
        assert!(!d.fails_fast_zero());
        Filtered::new(Gated(d), mem)
            .write_zeroes(0, 8, FAST)
            .unwrap();
    }
}
