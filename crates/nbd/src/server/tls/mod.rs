//! The server's TLS (NBD_OPT_STARTTLS) over any [`Transport`], with one
//! of two engines: rustls for X.509 certificates (`x509`) and the
//! system's OpenSSL 3, loaded at the first use, for pre-shared keys
//! ([`psk`]; rustls has no external PSK key exchange).
//!
//! This module holds the server's settings and makes one session per
//! client; the sessions run on the plumbing the client shares
//! ([`crate::tls`]): the socket split in halves, the session behind a
//! mutex held only for CPU work, so that the request reader and the
//! workers use one session at once.

pub mod psk;
mod x509;

use std::io;
use std::path::Path;
use std::sync::Arc;

use super::transport::Transport;
use crate::tls::Session;

/// When clients must use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// TLS is offered; plain-text clients are served too (`--tls=on`).
    Allow,
    /// Nothing is served before STARTTLS (`--tls=require`): every other
    /// option is refused with NBD_REP_ERR_TLS_REQD.
    Require,
}

/// Decides whether a TLS client may go on, by the identity its
/// certificate proves (QEMU's authorization objects, `--tls-authz`).
pub trait Authorizer: Send + Sync {
    /// Whether `identity` (the subject of the client's certificate, as
    /// [`crate::tls::dn`] writes it) is allowed; an error when the
    /// question cannot be answered (which refuses the client too).
    fn is_allowed(&self, identity: &str) -> diskit_core::Result<bool>;
}

/// A server's TLS settings: the mode, how clients are authenticated and
/// which are let in.
#[derive(Clone)]
pub struct TlsConfig {
    mode: TlsMode,
    engine: Engine,
    authz: Option<Arc<dyn Authorizer>>,
}

/// What makes a TLS session for each client.
#[derive(Clone)]
enum Engine {
    /// X.509 certificates, with rustls.
    X509(Arc<rustls::ServerConfig>),
    /// Pre-shared keys, with OpenSSL (loaded at run time).
    Psk(Arc<psk::PskConfig>),
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let engine = match &self.engine {
            Engine::X509(_) => "X.509",
            Engine::Psk(_) => "PSK",
        };
        f.debug_struct("TlsConfig")
            .field("mode", &self.mode)
            .field("engine", &engine)
            .finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// TLS in `mode` with a ready rustls configuration.
    pub fn new(mode: TlsMode, rustls: Arc<rustls::ServerConfig>) -> TlsConfig {
        TlsConfig {
            mode,
            engine: Engine::X509(rustls),
            authz: None,
        }
    }

    /// X.509 certificates from a directory laid out like nbdkit's and
    /// qemu's: `server-cert.pem` (the certificate, chain after it),
    /// `server-key.pem`, and with `verify_peer` `ca-cert.pem`, against
    /// which every client must present a valid certificate.
    pub fn from_dir(mode: TlsMode, dir: &Path, verify_peer: bool) -> io::Result<TlsConfig> {
        Ok(TlsConfig::new(
            mode,
            Arc::new(x509::config(dir, verify_peer)?),
        ))
    }

    /// Pre-shared keys from a key file in the format of nbdkit's and
    /// qemu's (GnuTLS's): `identity:hexkey` lines. The file is checked
    /// now and read again at every TLS handshake, as GnuTLS does, so keys
    /// can be added or revoked while the server runs.
    pub fn from_psk_file(mode: TlsMode, path: &Path) -> io::Result<TlsConfig> {
        Ok(TlsConfig {
            mode,
            engine: Engine::Psk(Arc::new(psk::PskConfig::new(path)?)),
            authz: None,
        })
    }

    /// Lets in only the clients `authz` allows. As in QEMU, what it is
    /// asked about is the subject of a client certificate: it has no say
    /// over clients that present none (pre-shared keys, or certificates
    /// without `verify_peer`).
    pub fn with_authz(mut self, authz: Arc<dyn Authorizer>) -> TlsConfig {
        self.authz = Some(authz);
        self
    }

    /// The mode.
    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// A fresh server session for one client.
    fn session(&self) -> io::Result<Box<dyn Session>> {
        match &self.engine {
            Engine::X509(config) => x509::session(config),
            Engine::Psk(config) => config.session(),
        }
    }
}

/// A client the authorizer refused, in QEMU's words: the error inside
/// the `PermissionDenied` that [`upgrade`] returns for it (other failed
/// handshakes are `PermissionDenied` too, a bad PSK say).
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

impl Refused {
    /// Whether `e` is an authorizer's refusal.
    pub fn is(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|inner| inner.is::<Refused>())
    }
}

/// Runs the server side of a TLS handshake over `plain` (right after the
/// STARTTLS acknowledgement), checks the client's identity against the
/// authorizer if there is one, and returns the encrypted transport. A
/// client the authorizer refuses is a `PermissionDenied` error holding a
/// [`Refused`], in QEMU's words.
pub fn upgrade(plain: Box<dyn Transport>, config: &TlsConfig) -> io::Result<Box<dyn Transport>> {
    let session = config.session()?;
    let stream = crate::tls::upgrade(plain, session, "client")?;
    if let (Some(authz), Some(subject)) = (&config.authz, stream.peer_subject()) {
        let refusal = match authz.is_allowed(&subject) {
            Ok(true) => None,
            Ok(false) => Some(format!("TLS x509 authz check for {subject} is denied")),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = refusal {
            stream.close();
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                Refused(why),
            ));
        }
    }
    Ok(Box::new(stream))
}
