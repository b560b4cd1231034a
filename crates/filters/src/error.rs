//! The error filter (nbdkit-error-filter): injects errors into requests, at
//! random, for testing how clients handle them.
//!
//! - `error=EPERM|EIO|ENOMEM|EINVAL|ENOSPC|ESHUTDOWN`: the error returned
//!   (default EIO).
//! - `error-rate=R`: the chance of an error per request, as `10%`, `0.1`
//!   or `1:10` (default 0: the filter does nothing).
//! - `error-file=PATH`: errors are injected only while PATH exists.
//! - `error-pread`, `error-pwrite`, `error-trim`, `error-zero`,
//!   `error-extents`, `error-cache` (each also with `-rate` and `-file`):
//!   the same for one kind of request only.
//!
//! Parameters apply in order, as in nbdkit: `error-rate=` sets every kind,
//! and a later `error-pread-rate=` changes reads alone. Flushes never fail.
//! Each injected error is a request that fails before it reaches the
//! device below, with the chosen errno as the client's error code.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use diskit_core::{Error, ErrorKind, Result};

use crate::call::{Call, Op};
use crate::gate::{Gate, Gated};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "error",
    "error-rate",
    "error-file",
    "error-pread",
    "error-pread-rate",
    "error-pread-file",
    "error-pwrite",
    "error-pwrite-rate",
    "error-pwrite-file",
    "error-trim",
    "error-trim-rate",
    "error-trim-file",
    "error-zero",
    "error-zero-rate",
    "error-zero-file",
    "error-extents",
    "error-extents-rate",
    "error-extents-file",
    "error-cache",
    "error-cache-rate",
    "error-cache-file",
];

/// The kinds of request the filter can fail, as nbdkit names them.
const OPS: [&str; 6] = ["pread", "pwrite", "trim", "zero", "extents", "cache"];

/// The errors the filter may inject (those with an NBD error code).
const ERRORS: &[(&str, ErrorKind)] = &[
    ("EPERM", ErrorKind::PermissionDenied),
    ("EIO", ErrorKind::Io),
    ("ENOMEM", ErrorKind::OutOfMemory),
    ("EINVAL", ErrorKind::InvalidInput),
    ("ENOSPC", ErrorKind::NoSpace),
    ("ESHUTDOWN", ErrorKind::Shutdown),
];

/// What to inject into one kind of request.
#[derive(Debug, Clone, PartialEq)]
pub struct Injection {
    /// The error.
    pub error: ErrorKind,
    /// Its chance per request, 0 to 1.
    pub rate: f64,
    /// Errors only while this file exists.
    pub file: Option<PathBuf>,
}

impl Default for Injection {
    fn default() -> Injection {
        Injection {
            error: ErrorKind::Io,
            rate: 0.0,
            file: None,
        }
    }
}

/// The filter's settings: one [`Injection`] per kind of request, in the
/// order of [`OPS`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ErrorConfig {
    /// Reads, writes, trims, zeroes, extents, cache.
    pub ops: [Injection; 6],
}

impl Configure for ErrorConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let rest = key
            .strip_prefix("error")
            .ok_or_else(|| unknown("error", key))?;
        // "error", "error-rate", "error-file", "error-OP", "error-OP-rate", ...
        let (op, what) = match rest.strip_prefix('-') {
            None if rest.is_empty() => (None, ""),
            Some(r) => match r.split_once('-') {
                Some((op, what)) if OPS.contains(&op) => (Some(op), what),
                None if OPS.contains(&r) => (Some(r), ""),
                None => (None, r),
                Some(_) => return Err(unknown("error", key)),
            },
            None => return Err(unknown("error", key)),
        };
        let targets: Vec<usize> = match op {
            Some(op) => vec![OPS.iter().position(|o| *o == op).expect("checked")],
            None => (0..OPS.len()).collect(),
        };
        for i in targets {
            let inj = &mut self.ops[i];
            match what {
                "" => inj.error = params::choice("error", key, value, ERRORS)?,
                "rate" => inj.rate = rate(key, value)?,
                "file" => inj.file = Some(PathBuf::from(value)),
                _ => return Err(unknown("error", key)),
            }
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Gated(ErrorFilter::new(self.clone())), next))
    }
}

/// A rate as nbdkit reads it: `N%`, a fraction `0.N`, or `1:N`.
fn rate(key: &str, value: &str) -> Result<f64> {
    let bad = || Error::invalid(format!("error: {key}: could not parse rate '{value}'"));
    let number = |s: &str| s.trim().parse::<f64>().ok().filter(|x| x.is_finite());
    let r = if let Some(p) = value.strip_suffix('%') {
        number(p).ok_or_else(bad)? / 100.0
    } else if let Some((a, b)) = value.split_once(':') {
        let (a, b) = (number(a).ok_or_else(bad)?, number(b).ok_or_else(bad)?);
        if b == 0.0 {
            return Err(bad());
        }
        a / b
    } else {
        number(value).ok_or_else(bad)?
    };
    if !(0.0..=1.0).contains(&r) {
        return Err(Error::invalid(format!(
            "error: {key}: rate out of range: '{value}' (0 to 1, or 0% to 100%)"
        )));
    }
    Ok(r)
}

/// The filter: fails requests at random as configured.
#[derive(Debug)]
pub struct ErrorFilter {
    config: ErrorConfig,
    /// xorshift64* state, shared by every thread.
    state: AtomicU64,
}

impl ErrorFilter {
    /// The filter with `config`, seeded from the clock and the process.
    pub fn new(config: ErrorConfig) -> ErrorFilter {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = t ^ (u64::from(std::process::id()) << 32) | 1;
        ErrorFilter {
            config,
            state: AtomicU64::new(seed),
        }
    }

    /// A uniform random number in [0, 1).
    fn random(&self) -> f64 {
        let step = |mut x: u64| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x
        };
        let prev = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| Some(step(x)))
            .unwrap_or(1);
        let x = step(prev).wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Fails request kind `op` (an index into [`OPS`], which lists them
    /// in [`Op`]'s order) when the dice say so.
    fn check(&self, op: usize) -> Result<()> {
        let inj = &self.config.ops[op];
        if inj.rate <= 0.0 {
            return Ok(());
        }
        if let Some(f) = &inj.file
            && !f.exists()
        {
            return Ok(());
        }
        if inj.rate >= 1.0 || self.random() < inj.rate {
            let name = ERRORS
                .iter()
                .find(|(_, k)| *k == inj.error)
                .map_or("EIO", |(n, _)| n);
            return Err(Error::new(
                inj.error,
                format!("error filter: injecting {name} into {}", OPS[op]),
            ));
        }
        Ok(())
    }
}

impl Gate for ErrorFilter {
    const NAME: &'static str = "error";

    /// Fails the request when the dice say so; flushes never fail.
    fn before(&self, call: &Call) -> Result<()> {
        if call.op == Op::Flush {
            return Ok(());
        }
        self.check(call.op as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use diskit_core::{BlockDevice, WriteFlags};
    use std::sync::Arc;

    use crate::testing::kv;

    #[test]
    fn parameters_apply_in_order() {
        let c = ErrorConfig::from_params(&kv(&[
            ("error", "ENOSPC"),
            ("error-rate", "10%"),
            ("error-pread-rate", "1:4"),
            ("error-zero", "EPERM"),
            ("error-cache-file", "/x"),
        ]))
        .unwrap();
        assert_eq!(c.ops[0].rate, 0.25);
        assert_eq!(c.ops[1].rate, 0.1);
        assert_eq!(c.ops[1].error, ErrorKind::NoSpace);
        assert_eq!(c.ops[3].error, ErrorKind::PermissionDenied);
        assert_eq!(c.ops[5].file.as_deref(), Some(std::path::Path::new("/x")));
        assert_eq!(c.ops[4].file, None);
        // A general key after a specific one overrides it.
        let c = ErrorConfig::from_params(&kv(&[("error-pread-rate", "1"), ("error-rate", "0.5")]))
            .unwrap();
        assert_eq!(c.ops[0].rate, 0.5);
    }

    #[test]
    fn injects_at_the_rate_asked_with_the_errno_asked() {
        let mem: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 20));
        let always =
            ErrorConfig::from_params(&kv(&[("error", "ENOSPC"), ("error-pwrite-rate", "100%")]))
                .unwrap();
        let d = Filtered::new(Gated(ErrorFilter::new(always)), mem.clone());
        let e = d.write_at(&[1; 512], 0, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(e.to_string().contains("ENOSPC"), "{e}");
        // Other kinds of request go through, and nothing was written.
        let mut b = [9u8; 512];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [0u8; 512]);
        d.flush().unwrap();
        // 30%: between 20% and 40% of 2000 reads fail.
        let some = ErrorConfig::from_params(&kv(&[("error-rate", "30%")])).unwrap();
        let d = Filtered::new(Gated(ErrorFilter::new(some)), mem.clone());
        let failed = (0..2000).filter(|_| d.read_at(&mut b, 0).is_err()).count();
        assert!((400..800).contains(&failed), "{failed} of 2000");
        // Rate 0: never.
        let d = Filtered::new(Gated(ErrorFilter::new(ErrorConfig::default())), mem);
        assert!((0..1000).all(|_| d.read_at(&mut b, 0).is_ok()));
    }

    #[test]
    fn error_file_switches_injection_on_and_off() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("inject");
        let mem: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 20));
        let c = ErrorConfig::from_params(&kv(&[
            ("error-rate", "1"),
            ("error-file", flag.to_str().unwrap()),
        ]))
        .unwrap();
        let d = Filtered::new(Gated(ErrorFilter::new(c)), mem);
        let mut b = [0u8; 512];
        d.read_at(&mut b, 0).unwrap();
        std::fs::write(&flag, b"").unwrap();
        assert_eq!(d.read_at(&mut b, 0).unwrap_err().kind(), ErrorKind::Io);
        std::fs::remove_file(&flag).unwrap();
        d.read_at(&mut b, 0).unwrap();
    }
}
