//! The exitlast filter (nbdkit-exitlast-filter): the server stops when
//! its last client leaves (not before the first one comes). A client
//! counts once it opens the export (NBD_OPT_GO, or NBD_OPT_INFO, for
//! which the server opens it too, as nbdkit does); one that only lists
//! the exports does not. It takes no parameters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use diskit_core::{BlockDevice, DeviceRef, Filter, Result, ServerRef, Session};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// What every connection's view shares: the server, the count.
#[derive(Default)]
struct Shared {
    server: OnceLock<ServerRef>,
    open: AtomicU64,
}

/// The filter; a connection's view is counted until dropped.
#[derive(Default)]
pub struct Exitlast {
    shared: Arc<Shared>,
    counted: bool,
}

impl Drop for Exitlast {
    fn drop(&mut self) {
        if self.counted
            && self.shared.open.fetch_sub(1, Ordering::SeqCst) == 1
            && let Some(s) = self.shared.server.get()
        {
            s.shutdown();
        }
    }
}

impl Filter for Exitlast {
    fn name(&self) -> &str {
        "exitlast"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn submits_below(&self) -> bool {
        true
    }
    fn serving(&self, next: &dyn BlockDevice, server: &ServerRef) {
        let _ = self.shared.server.set(server.clone());
        next.serving(server)
    }
    fn connect(&self, _next: &DeviceRef, _session: &Session) -> Result<Option<Exitlast>> {
        self.shared.open.fetch_add(1, Ordering::SeqCst);
        Ok(Some(Exitlast {
            shared: self.shared.clone(),
            counted: true,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Stops;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;

    #[test]
    fn the_server_stops_when_the_last_client_leaves() {
        let stops = Arc::new(Stops::default());
        let d: DeviceRef = Arc::new(Filtered::new(
            Exitlast {
                shared: Arc::default(),
                counted: false,
            },
            Arc::new(MemoryDevice::new(4096)),
        ));
        d.serving(&(stops.clone() as ServerRef));
        let s = Session::default();
        let a = d.connect(&s).unwrap();
        let b = d.connect(&s).unwrap();
        drop(a);
        assert_eq!(stops.count(), 0);
        drop(b);
        assert_eq!(stops.count(), 1);
    }
}
