//! What a device's layers see of the server that serves it, and may ask
//! of it: nbdkit's connection events (preconnect, open, close), its
//! `nbdkit_shutdown` and `nbdkit_disconnect`, and its thread model. The
//! guard filters (limit, ip, exitlast, exitwhen, time-limit, noparallel)
//! are made of these; every layer passes them through by default.
//!
//! - [`BlockDevice::serving`](crate::BlockDevice::serving): the server
//!   starts, and gives a [`ServerRef`] to stop it with.
//! - [`BlockDevice::preconnect`](crate::BlockDevice::preconnect): a
//!   client connects, before its handshake; an error closes it.
//! - [`BlockDevice::connect`](crate::BlockDevice::connect): the client
//!   starts transmission (a [`Session`](crate::Session), with its
//!   [`Peer`] and a [`Hangup`]); the connection's view of a layer is
//!   dropped when the connection ends.
//! - [`BlockDevice::serialize`](crate::BlockDevice::serialize): how many
//!   requests and connections the layers take at once.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Who is at the other end of a connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Peer {
    /// A TCP client.
    Ip(IpAddr),
    /// A client on a Unix socket, with its credentials where the system
    /// gives them (SO_PEERCRED).
    Unix {
        /// Its process id.
        pid: Option<u32>,
        /// Its user id.
        uid: Option<u32>,
        /// Its group id.
        gid: Option<u32>,
    },
    /// Anything else (standard input and output, a pipe).
    #[default]
    Other,
}

/// What a layer may ask of the server that serves it.
pub trait ServerHandle: Send + Sync {
    /// Stops accepting connections; the server stops once the connections
    /// open have ended (nbdkit_shutdown).
    fn shutdown(&self);
}

/// A shared [`ServerHandle`].
pub type ServerRef = Arc<dyn ServerHandle>;

/// A connection's hang-up request (nbdkit_disconnect): a layer raises it,
/// the server closes the connection after the request that raised it.
#[derive(Debug, Clone, Default)]
pub struct Hangup(Arc<AtomicBool>);

impl Hangup {
    /// Asks the server to close the connection.
    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether a layer asked.
    pub fn raised(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl PartialEq for Hangup {
    fn eq(&self, other: &Hangup) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Hangup {}

/// How many requests and connections the layers of a device take at once
/// (nbdkit's thread models), from the least strict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Serialize {
    /// Any number.
    #[default]
    Parallel,
    /// One request at a time per connection, answered in order.
    Requests,
    /// One connection at a time: the next waits until it ends.
    Connections,
}
