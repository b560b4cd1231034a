//! The server's PSK settings: the key file nbdkit's `--tls-psk` and qemu's
//! `tls-creds-psk` read, looked up by OpenSSL's PSK server callback. The
//! engine itself (suites, sessions, the key file format, loading OpenSSL)
//! is shared with the client: [`crate::tls::psk`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::tls::Session;
use crate::tls::psk::{
    Context, OP_CIPHER_SERVER_PREFERENCE, PskCallback, PskRole, PskSession, Side, Ssl, context,
    read_key_file, setup_error, show_identity,
};
pub use crate::tls::psk::{MAX_IDENTITY_LEN, MAX_KEY_LEN, PskEntry, parse_key_file};

/// What the key lookup of one handshake found, kept with the connection
/// to explain a failed handshake and to name the client afterwards.
#[derive(Debug)]
enum Lookup {
    /// The identity has a key.
    Found(Vec<u8>),
    /// The identity is not in the key file.
    Unknown(Vec<u8>),
    /// The key is longer than OpenSSL takes.
    TooLong(Vec<u8>),
    /// The key file could not be read.
    FileError(String),
}

/// The PSK server settings.
pub struct PskConfig {
    ctx: Context,
    path: Arc<PathBuf>,
}

impl std::fmt::Debug for PskConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PskConfig")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl PskConfig {
    /// Settings for the key file at `path`, which must hold at least one
    /// valid key now. Loads OpenSSL 3: a system without it is an error
    /// here, at start-up.
    pub fn new(path: &Path) -> io::Result<PskConfig> {
        // Absolute: the server may change directory after this.
        let path: PathBuf = std::fs::canonicalize(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        read_key_file(&path).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;

        let mut ctx = context(Side::Server)?;
        ctx.set_options(OP_CIPHER_SERVER_PREFERENCE);
        // No resumption: nothing would use it, and no tickets to send.
        ctx.set_num_tickets(0).map_err(setup_error)?;
        Ok(PskConfig {
            ctx,
            path: Arc::new(path),
        })
    }

    /// A session for one client.
    pub(super) fn session(&self) -> io::Result<Box<dyn Session>> {
        let role = ServerRole {
            path: self.path.clone(),
            lookup: None,
        };
        let ssl = Ssl::new(&self.ctx, role).map_err(setup_error)?;
        Ok(Box::new(PskSession::accept(ssl)))
    }
}

/// The server end: looks the client's identity up in the key file (read
/// again at every handshake) and remembers what it found, which explains
/// a failed handshake.
struct ServerRole {
    path: Arc<PathBuf>,
    lookup: Option<Lookup>,
}

impl PskCallback for ServerRole {
    fn server_key(&mut self, identity: Option<&[u8]>, out: &mut [u8]) -> usize {
        let (found, len) = match identity {
            None => (Lookup::Unknown(Vec::new()), 0),
            Some(id) => match read_key_file(&self.path) {
                Err(e) => (Lookup::FileError(e), 0),
                Ok(entries) => match entries.iter().find(|e| e.identity == id) {
                    None => (Lookup::Unknown(id.to_vec()), 0),
                    Some(e) if e.key.len() > out.len() => (Lookup::TooLong(id.to_vec()), 0),
                    Some(e) => {
                        out[..e.key.len()].copy_from_slice(&e.key);
                        (Lookup::Found(id.to_vec()), e.key.len())
                    }
                },
            },
        };
        self.lookup = Some(found);
        len
    }
}

impl PskRole for ServerRole {
    const PEER: &'static str = "client";

    fn why_failed(&self) -> String {
        match &self.lookup {
            Some(Lookup::Unknown(id)) if id.is_empty() => "the client sent no PSK identity".into(),
            Some(Lookup::Unknown(id)) => format!("unknown PSK identity {}", show_identity(id)),
            Some(Lookup::TooLong(id)) => format!(
                "the key of PSK identity {} is too long for OpenSSL",
                show_identity(id)
            ),
            Some(Lookup::FileError(m)) => format!("cannot read the PSK key file: {m}"),
            Some(Lookup::Found(id)) => format!(
                "PSK identity {} is known but the handshake failed (wrong key?)",
                show_identity(id)
            ),
            None => "the client offered no pre-shared key".into(),
        }
    }

    fn identity(&self) -> String {
        match &self.lookup {
            Some(Lookup::Found(id)) => show_identity(id),
            _ => "?".into(),
        }
    }
}
