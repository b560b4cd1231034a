//! The time-limit filter (nbdkit-time-limit-filter, nbdkit 1.42): limits
//! how long a client stays connected.
//!
//! `time-limit=TIME` (also spelled `time_limit=`, `timelimit=`; seconds,
//! or with a unit as the delay filter reads them; default 60; 0: no
//! limit). The time counts from the start of transmission; the first
//! request after it fails with ESHUTDOWN and the connection is closed.
//! As in nbdkit, an idle client is not cut off until it sends a request.

use std::time::{Duration, Instant};

use diskit_core::{DeviceRef, Error, ErrorKind, Hangup, Result, Session};

use crate::call::Call;
use crate::gate::{Gate, Gated};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["time-limit", "time_limit", "timelimit"];

/// The configuration: the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeLimitConfig {
    /// `time-limit=`: zero for none.
    pub limit: Duration,
}

impl Default for TimeLimitConfig {
    fn default() -> Self {
        TimeLimitConfig {
            limit: Duration::from_secs(60),
        }
    }
}

impl Configure for TimeLimitConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "time-limit" | "time_limit" | "timelimit" => {
                self.limit = params::delay("time-limit", key, value)?
            }
            _ => return Err(unknown("time-limit", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(
            Gated(TimeLimit {
                limit: self.limit,
                connection: None,
            }),
            next,
        ))
    }
}

/// The filter; a connection's view knows when it started and how to
/// hang up.
pub struct TimeLimit {
    limit: Duration,
    connection: Option<(Instant, Hangup)>,
}

impl TimeLimit {
    /// Fails, and hangs up, once the connection is over its time.
    fn check(&self) -> Result<()> {
        match &self.connection {
            Some((start, hangup)) if !self.limit.is_zero() && start.elapsed() > self.limit => {
                hangup.raise();
                Err(Error::new(
                    ErrorKind::Shutdown,
                    "time-limit: time limit exceeded, connection closed",
                ))
            }
            _ => Ok(()),
        }
    }
}

impl Gate for TimeLimit {
    const NAME: &'static str = "time-limit";

    fn before(&self, _call: &Call) -> Result<()> {
        self.check()
    }
    fn connect(&self, _next: &DeviceRef, session: &Session) -> Result<Option<TimeLimit>> {
        Ok(Some(TimeLimit {
            limit: self.limit,
            connection: Some((Instant::now(), session.hangup.clone())),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::{BlockDevice, Filtered};
    use std::sync::Arc;

    #[test]
    fn requests_after_the_limit_fail_and_hang_up() {
        let d: DeviceRef = Arc::new(Filtered::new(
            Gated(TimeLimit {
                limit: Duration::from_nanos(1),
                connection: None,
            }),
            Arc::new(MemoryDevice::new(4096)),
        ));
        let mut b = [0u8; 16];
        d.read_at(&mut b, 0).unwrap();
        let s = Session::default();
        let view = d.connect(&s).unwrap().unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let e = view.read_at(&mut b, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shutdown);
        assert!(s.hangup.raised());
    }
}
