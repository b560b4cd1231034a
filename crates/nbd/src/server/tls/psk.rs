//! The server's PSK settings: the key file nbdkit's `--tls-psk` and qemu's
//! `tls-creds-psk` read, looked up by OpenSSL's PSK server callback. The
//! engine itself (suites, sessions, the key file format) is shared with
//! the client: [`crate::tls::psk`].

use std::io;
use std::path::{Path, PathBuf};

use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslContext, SslMethod, SslOptions, SslRef};

use crate::tls::Session;
pub use crate::tls::psk::{MAX_IDENTITY_LEN, MAX_KEY_LEN, PskEntry, parse_key_file};
use crate::tls::psk::{PskRole, PskSession, context, read_key_file, setup_error, show_identity};

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
    ctx: SslContext,
    lookup: Index<Ssl, Lookup>,
}

impl std::fmt::Debug for PskConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PskConfig").finish_non_exhaustive()
    }
}

impl PskConfig {
    /// Settings for the key file at `path`, which must hold at least one
    /// valid key now.
    pub fn new(path: &Path) -> io::Result<PskConfig> {
        // Absolute: the server may change directory after this.
        let path: PathBuf = std::fs::canonicalize(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        read_key_file(&path).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;

        let lookup = Ssl::new_ex_index::<Lookup>().map_err(setup_error)?;
        let mut b = context(SslMethod::tls_server())?;
        b.set_options(SslOptions::CIPHER_SERVER_PREFERENCE);
        // No resumption: nothing would use it, and no tickets to send.
        b.set_num_tickets(0).map_err(setup_error)?;
        b.set_psk_server_callback(move |ssl, identity, out| {
            let found = match identity {
                None => Lookup::Unknown(Vec::new()),
                Some(id) => match read_key_file(&path) {
                    Err(e) => Lookup::FileError(e),
                    Ok(entries) => match entries.iter().find(|e| e.identity == id) {
                        None => Lookup::Unknown(id.to_vec()),
                        Some(e) if e.key.len() > out.len() => Lookup::TooLong(id.to_vec()),
                        Some(e) => {
                            out[..e.key.len()].copy_from_slice(&e.key);
                            ssl.set_ex_data(lookup, Lookup::Found(id.to_vec()));
                            return Ok(e.key.len());
                        }
                    },
                },
            };
            ssl.set_ex_data(lookup, found);
            Ok(0)
        });
        Ok(PskConfig {
            ctx: b.build(),
            lookup,
        })
    }

    /// A session for one client.
    pub(super) fn session(&self) -> io::Result<Box<dyn Session>> {
        let ssl = Ssl::new(&self.ctx).map_err(setup_error)?;
        Ok(Box::new(PskSession::accept(
            ssl,
            ServerRole {
                lookup: self.lookup,
            },
        )?))
    }
}

/// The server end: the key lookup explains a failed handshake.
struct ServerRole {
    lookup: Index<Ssl, Lookup>,
}

impl PskRole for ServerRole {
    const PEER: &'static str = "client";

    fn why_failed(&self, ssl: &SslRef) -> String {
        match ssl.ex_data(self.lookup) {
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

    fn identity(&self, ssl: &SslRef) -> String {
        match ssl.ex_data(self.lookup) {
            Some(Lookup::Found(id)) => show_identity(id),
            _ => "?".into(),
        }
    }
}
