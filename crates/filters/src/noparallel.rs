//! The noparallel filter (nbdkit-noparallel-filter): serializes requests
//! or connections, to measure what parallelism is worth or to work
//! around a client that cannot take replies out of order.
//!
//! `serialize=requests` (the default): one request at a time per
//! connection, answered in order; `all-requests`: one request at a time
//! over every connection; `connections`: one client at a time (the next
//! waits until it leaves), and multi-conn is not advertised.

use std::sync::{Arc, Mutex};

use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Extent, Filter, Result, Serialize, WriteFlags, ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["serialize"];

/// What is serialized.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Requests of one connection.
    #[default]
    Requests,
    /// Requests of all connections.
    AllRequests,
    /// Connections.
    Connections,
}

/// The configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoparallelConfig {
    /// `serialize=`.
    pub mode: Mode,
}

impl Configure for NoparallelConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "serialize" => {
                self.mode = params::choice(
                    "noparallel",
                    key,
                    value,
                    &[
                        ("requests", Mode::Requests),
                        ("all-requests", Mode::AllRequests),
                        ("all_requests", Mode::AllRequests),
                        ("connections", Mode::Connections),
                    ],
                )?
            }
            _ => return Err(unknown("noparallel", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(
            Noparallel {
                mode: self.mode,
                one: Arc::default(),
            },
            next,
        ))
    }
}

/// The filter: its mode, and the lock every request of every connection
/// takes with `all-requests`.
pub struct Noparallel {
    mode: Mode,
    one: Arc<Mutex<()>>,
}

impl Noparallel {
    /// Runs `op` alone when every request is serialized.
    fn alone<T>(&self, op: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.mode == Mode::AllRequests {
            let _held = lock(&self.one);
            op()
        } else {
            op()
        }
    }
}

impl Filter for Noparallel {
    fn name(&self) -> &str {
        "noparallel"
    }
    fn serialize(&self, next: &dyn BlockDevice) -> Serialize {
        let mine = match self.mode {
            Mode::Requests | Mode::AllRequests => Serialize::Requests,
            Mode::Connections => Serialize::Connections,
        };
        mine.max(next.serialize())
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        let mut c = next.capabilities();
        if self.mode == Mode::Connections {
            c.can_multi_conn = false;
        }
        c
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.alone(|| next.read_at(buf, offset))
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.alone(|| next.write_at(buf, offset, flags))
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.alone(|| next.write_zeroes(offset, len, flags))
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.alone(|| next.trim(offset, len, flags))
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        self.alone(|| next.flush())
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.alone(|| next.cache(offset, len))
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.alone(|| next.extents(offset, len))
    }
}
