//! diskit-nbd: the Network Block Device protocol.
//!
//! - [`proto`]: the wire format, every message parsed and validated in one
//!   place, no I/O.
//! - [`server`]: a server exporting any [`diskit_core::BlockDevice`]: fixed
//!   newstyle negotiation, structured replies and extended headers, many
//!   requests in flight per connection answered out of order.

pub mod client;
pub mod proto;
pub mod server;
