//! The client's end of a PSK session: one identity and its key, handed
//! to OpenSSL by its PSK client callback. The client's settings (which
//! key file, which user) are in [`crate::client::tls`].

use std::io;

use super::{
    Context, PskCallback, PskRole, PskSession, Side, Ssl, Version, context, setup_error,
    show_identity,
};
use crate::tls::{Session, TlsStream};
use crate::transport::Transport;

/// The settings of a client context (see [`super::context`]).
pub(crate) fn client_context() -> io::Result<Context> {
    context(Side::Client)
}

/// The client end: the identity it sends and its key.
pub(crate) struct ClientRole {
    identity: Vec<u8>,
    key: Vec<u8>,
}

impl ClientRole {
    /// The role of a client that authenticates as `identity` with `key`.
    pub(crate) fn new(identity: Vec<u8>, key: Vec<u8>) -> ClientRole {
        ClientRole { identity, key }
    }

    /// A session for one connection, its hello sealed, ready to go out.
    pub(crate) fn connect(self, ctx: &Context) -> io::Result<Box<dyn Session>> {
        let ssl = Ssl::new(ctx, self).map_err(setup_error)?;
        Ok(Box::new(PskSession::connect(ssl)?))
    }
}

impl PskCallback for ClientRole {
    fn client_key(&mut self, identity: &mut [u8], key: &mut [u8]) -> usize {
        // The identity goes out NUL-terminated.
        let id = &self.identity;
        if id.len() >= identity.len() || self.key.len() > key.len() {
            return 0;
        }
        identity[..id.len()].copy_from_slice(id);
        identity[id.len()] = 0;
        key[..self.key.len()].copy_from_slice(&self.key);
        self.key.len()
    }
}

impl PskRole for ClientRole {
    const PEER: &'static str = "server";

    fn why_failed(&self) -> String {
        format!(
            "the server did not accept the key of username {} (unknown username, \
             or another key?)",
            show_identity(&self.identity)
        )
    }

    fn identity(&self) -> String {
        show_identity(&self.identity)
    }
}

/// For tests of the server: a TLS-PSK client limited to one protocol
/// version (TLS 1.3 when `tls13`, else TLS 1.2) that authenticates as
/// `identity` with `key`, run over `plain` right after the server
/// acknowledged NBD_OPT_STARTTLS. [`TlsStream::negotiated`] starts with
/// the version ("TLSv1.3").
#[doc(hidden)]
pub fn pinned_client(
    plain: Box<dyn Transport>,
    tls13: bool,
    identity: &[u8],
    key: &[u8],
) -> io::Result<TlsStream> {
    let mut ctx = client_context()?;
    let version = if tls13 {
        Version::Tls13
    } else {
        Version::Tls12
    };
    ctx.set_min_version(version).map_err(setup_error)?;
    ctx.set_max_version(version).map_err(setup_error)?;
    let session = ClientRole::new(identity.to_vec(), key.to_vec()).connect(&ctx)?;
    crate::tls::upgrade(plain, session, "server")
}
