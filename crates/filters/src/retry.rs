//! The retry filter (nbdkit-retry-filter): a request that fails is tried
//! again after a delay, with the device below reopened first (an NBD
//! connection to a server that went away connects again), so that a long
//! copy survives a short outage.
//!
//! - `retries=N` (default 5; 0 turns the filter off): tries after the
//!   first, per request.
//! - `retry-delay=SECS` (default 2; `500ms` and fractions too): the wait
//!   before the first retry.
//! - `retry-exponential=BOOL` (default yes): the wait doubles after each
//!   retry.
//! - `retry-readonly=BOOL` (default no): after a first failure the
//!   connection is read-only: writes, zeroes and trims fail with EROFS
//!   (EPERM on the wire); a new connection starts writable again.
//!
//! As nbdkit, every error is retried, but for a fast zero that the device
//! below declines (ENOTSUP is its answer, not a failure); a request
//! outside the device fails at once. A reopen that fails counts as a
//! failed try.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use diskit_core::{
    BlockDevice, DeviceRef, Error, ErrorKind, Extent, Filter, Result, Session, WriteFlags,
    ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "retries",
    "retry-delay",
    "retry-exponential",
    "retry-readonly",
];

/// The parameters, as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryConfig {
    /// Tries after the first.
    pub retries: u32,
    /// The first wait.
    pub delay: Duration,
    /// Whether the wait doubles.
    pub exponential: bool,
    /// Whether a failure makes the connection read-only.
    pub readonly: bool,
}

impl Default for RetryConfig {
    fn default() -> RetryConfig {
        RetryConfig {
            retries: 5,
            delay: Duration::from_secs(2),
            exponential: true,
            readonly: false,
        }
    }
}

impl Configure for RetryConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "retries" => {
                self.retries = value.trim().parse().map_err(|_| {
                    Error::invalid(format!("retry: retries: could not parse '{value}'"))
                })?
            }
            "retry-delay" => {
                self.delay = params::delay("retry", key, value)?;
                if self.delay.is_zero() {
                    return Err(Error::invalid("retry: retry-delay cannot be 0"));
                }
            }
            "retry-exponential" => self.exponential = params::boolean("retry", key, value)?,
            "retry-readonly" => self.readonly = params::boolean("retry", key, value)?,
            _ => return Err(unknown("retry", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Retry::new(*self), next))
    }
}

/// The filter: the shared stack's, or one connection's view of it.
#[derive(Debug)]
pub struct Retry {
    config: RetryConfig,
    /// A request of this connection has failed (for `retry-readonly`).
    failed: AtomicBool,
    /// Reopens so far, over all connections.
    reopens: Arc<AtomicU64>,
}

impl Retry {
    /// The filter with no failure yet.
    pub fn new(config: RetryConfig) -> Retry {
        Retry {
            config,
            failed: AtomicBool::new(false),
            reopens: Arc::default(),
        }
    }

    /// How many times the device below was reopened.
    pub fn reopens(&self) -> u64 {
        self.reopens.load(Ordering::Relaxed)
    }

    /// Runs `op` until it succeeds or the tries run out: before each retry
    /// the wait, then a reopen of `next` (a failed reopen is a failed
    /// try). The last error is returned.
    fn run<T>(&self, next: &dyn BlockDevice, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let mut delay = self.config.delay;
        let mut err = match op() {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        for _ in 0..self.config.retries {
            self.failed.store(true, Ordering::Relaxed);
            std::thread::sleep(delay);
            if self.config.exponential {
                delay = delay.saturating_mul(2);
            }
            self.reopens.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = next.reopen() {
                err = e.context("retry: reopening");
                continue;
            }
            match op() {
                Ok(v) => return Ok(v),
                Err(e) => err = e,
            }
        }
        self.failed.store(true, Ordering::Relaxed);
        Err(err)
    }

    /// Whether writes are refused (`retry-readonly` after a failure).
    fn writable(&self) -> Result<()> {
        if self.config.readonly && self.failed.load(Ordering::Relaxed) {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "retry: read-only after a failed request (retry-readonly)",
            ));
        }
        Ok(())
    }
}

impl Filter for Retry {
    fn name(&self) -> &str {
        "retry"
    }
    fn connect(&self, _next: &DeviceRef, _session: &Session) -> Result<Option<Retry>> {
        Ok(Some(Retry {
            config: self.config,
            failed: AtomicBool::new(false),
            reopens: self.reopens.clone(),
        }))
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.run(next, || next.read_at(buf, offset))
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.writable()?;
        self.run(next, || {
            self.writable()?;
            next.write_at(buf, offset, flags)
        })
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.writable()?;
        if flags.fast {
            // Declining a fast zero is an answer: no retry.
            return match next.write_zeroes(offset, len, flags) {
                Err(e) if e.kind() == ErrorKind::NotSupported => Err(e),
                Ok(()) => Ok(()),
                Err(_) => self.run(next, || {
                    self.writable()?;
                    next.write_zeroes(offset, len, flags)
                }),
            };
        }
        self.run(next, || {
            self.writable()?;
            next.write_zeroes(offset, len, flags)
        })
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.writable()?;
        self.run(next, || {
            self.writable()?;
            next.trim(offset, len, flags)
        })
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        self.run(next, || next.flush())
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.run(next, || next.cache(offset, len))
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.run(next, || next.extents(offset, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::kv;
    use diskit_core::{Capabilities, Filtered};
    use std::sync::atomic::AtomicUsize;

    /// Fails the first `fail` requests, counting reopens.
    struct Flaky {
        fail: AtomicUsize,
        reopens: AtomicUsize,
        reopen_fails: bool,
    }

    impl BlockDevice for Flaky {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::IN_MEMORY
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            if self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(Error::new(ErrorKind::Io, "flaky"));
            }
            buf.fill(7);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
            let mut b = vec![0; buf.len()];
            self.read_at(&mut b, offset)
        }
        fn reopen(&self) -> Result<()> {
            self.reopens.fetch_add(1, Ordering::SeqCst);
            if self.reopen_fails {
                return Err(Error::new(ErrorKind::Io, "cannot reopen"));
            }
            Ok(())
        }
    }

    fn stack(fail: usize, params: &[(&str, &str)], reopen_fails: bool) -> (Arc<Flaky>, DeviceRef) {
        let flaky = Arc::new(Flaky {
            fail: AtomicUsize::new(fail),
            reopens: AtomicUsize::new(0),
            reopen_fails,
        });
        let config = RetryConfig::from_params(&kv(params)).unwrap();
        let dev = Arc::new(Filtered::new(
            Retry::new(config),
            flaky.clone() as DeviceRef,
        ));
        (flaky, dev)
    }

    #[test]
    fn failures_are_retried_after_a_reopen() {
        let (flaky, dev) = stack(3, &[("retry-delay", "1ms")], false);
        let mut buf = [0u8; 16];
        dev.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [7; 16]);
        assert_eq!(flaky.reopens.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn retries_run_out_with_the_last_error() {
        let (flaky, dev) = stack(10, &[("retry-delay", "1ms"), ("retries", "2")], false);
        let e = dev.read_at(&mut [0u8; 16], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        assert_eq!(flaky.reopens.load(Ordering::SeqCst), 2);
        // Three tries took three failures.
        assert_eq!(flaky.fail.load(Ordering::SeqCst), 7);
        // A failed reopen is a failed try.
        let (flaky, dev) = stack(1, &[("retry-delay", "1ms"), ("retries", "2")], true);
        let e = dev.read_at(&mut [0u8; 16], 0).unwrap_err();
        assert!(e.to_string().contains("cannot reopen"), "{e}");
        assert_eq!(flaky.fail.load(Ordering::SeqCst), 0);
        // retries=0: the filter is off.
        let (flaky, dev) = stack(1, &[("retries", "0")], false);
        assert!(dev.read_at(&mut [0u8; 16], 0).is_err());
        assert_eq!(flaky.reopens.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn readonly_after_a_failure_for_the_connection() {
        let (_, dev) = stack(
            1,
            &[("retry-delay", "1ms"), ("retry-readonly", "true")],
            false,
        );
        let conn = dev.connect(&Session::default()).unwrap().unwrap();
        conn.read_at(&mut [0u8; 16], 0).unwrap();
        let e = conn.write_at(&[1; 16], 0, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        // A new connection writes.
        let other = dev.connect(&Session::default()).unwrap().unwrap();
        other.write_at(&[1; 16], 0, WriteFlags::NONE).unwrap();
    }
}
