//! A small binding to the system's OpenSSL 3, loaded at run time: just
//! what TLS with pre-shared keys needs. `api` opens `libssl.so.3` at the
//! first use and checks every function; `context` and `ssl` wrap
//! `SSL_CTX` and `SSL` (over memory BIOs: no I/O) so that the rest of
//! the crate never touches a raw pointer; `error` turns OpenSSL's error
//! queue into one line.

mod api;
mod context;
mod error;
mod ssl;

pub(crate) use context::{
    Context, OP_CIPHER_SERVER_PREFERENCE, OP_NO_RENEGOTIATION, OP_NO_TICKET, Side, Version,
};
pub(crate) use error::{SslError, WANT_READ, ZERO_RETURN};
pub(crate) use ssl::{PskCallback, Ssl};
