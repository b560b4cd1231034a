//! The limit filter (nbdkit-limit-filter): limits the clients connected
//! at once.
//!
//! `limit=N` (default 1; 0: no limit). A client beyond the limit is
//! closed before its handshake ("limit: too many clients connected,
//! connection rejected"); the count is checked again when a client starts
//! transmission, so that a slow handshake cannot slip past it. A client
//! counts from its start of transmission to its end.

use std::sync::{Arc, Mutex};

use diskit_core::params::nbdkit_unsigned;
use diskit_core::sync::lock;
use diskit_core::{BlockDevice, DeviceRef, Error, ErrorKind, Filter, Peer, Result, Session};

use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["limit"];

/// The configuration: the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitConfig {
    /// `limit=`: 0 for none.
    pub limit: u64,
}

impl Default for LimitConfig {
    fn default() -> Self {
        LimitConfig { limit: 1 }
    }
}

impl Configure for LimitConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "limit" => {
                self.limit = nbdkit_unsigned("limit", value, u32::MAX.into())
                    .map_err(|e| e.context("limit"))?
            }
            _ => return Err(unknown("limit", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(
            Limit {
                limit: self.limit,
                open: Arc::default(),
                _ticket: None,
            },
            next,
        ))
    }
}

/// A connection counted: uncounted when dropped, at its end.
struct Ticket(Arc<Mutex<u64>>);

impl Drop for Ticket {
    fn drop(&mut self) {
        *lock(&self.0) -= 1;
    }
}

/// The filter: the limit and the connections open; a connection's view
/// holds its ticket.
pub struct Limit {
    limit: u64,
    open: Arc<Mutex<u64>>,
    /// Held, not read: its drop uncounts the connection.
    _ticket: Option<Ticket>,
}

/// The refusal.
fn too_many() -> Error {
    Error::new(
        ErrorKind::PermissionDenied,
        "limit: too many clients connected, connection rejected",
    )
}

impl Filter for Limit {
    fn name(&self) -> &str {
        "limit"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn submits_below(&self) -> bool {
        true
    }
    fn preconnect(&self, next: &dyn BlockDevice, peer: &Peer) -> Result<()> {
        next.preconnect(peer)?;
        if self.limit > 0 && *lock(&self.open) >= self.limit {
            return Err(too_many());
        }
        Ok(())
    }
    fn connect(&self, _next: &DeviceRef, _session: &Session) -> Result<Option<Limit>> {
        let mut open = lock(&self.open);
        if self.limit > 0 && *open >= self.limit {
            return Err(too_many());
        }
        *open += 1;
        Ok(Some(Limit {
            limit: self.limit,
            open: self.open.clone(),
            _ticket: Some(Ticket(self.open.clone())),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;

    #[test]
    fn clients_beyond_the_limit_are_refused_until_one_leaves() {
        let d: DeviceRef = Arc::new(Filtered::new(
            Limit {
                limit: 2,
                open: Arc::default(),
                _ticket: None,
            },
            Arc::new(MemoryDevice::new(4096)),
        ));
        let s = Session::default();
        let a = d.connect(&s).unwrap();
        d.preconnect(&Peer::Other).unwrap();
        let b = d.connect(&s).unwrap();
        let e = d.preconnect(&Peer::Other).unwrap_err();
        assert!(e.to_string().contains("too many clients"), "{e}");
        assert!(d.connect(&s).is_err());
        drop(a);
        d.preconnect(&Peer::Other).unwrap();
        drop(b);
    }
}
