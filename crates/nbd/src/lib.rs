//! diskit-nbd: the Network Block Device protocol.
//!
//! - [`proto`]: the wire format, every message parsed and validated in one
//!   place, no I/O.
//! - [`server`]: a server exporting any [`diskit_core::BlockDevice`]: fixed
//!   newstyle negotiation, structured replies and extended headers, many
//!   requests in flight per connection answered out of order.
//! - [`client`]: a client, an export of any NBD server as a block device.
//! - [`tls`] and [`transport`]: TLS sessions and the byte streams under
//!   them, shared by the server (STARTTLS answered) and the client
//!   (`nbds://`).

pub mod client;
pub mod proto;
pub mod server;
pub mod tls;
pub mod transport;
