//! The PSK engine: TLS with pre-shared keys through the system's OpenSSL 3,
//! loaded at the first use (`openssl`: diskit does not link it), for the key
//! files nbdkit's `--tls-psk` and qemu's `tls-creds-psk` read (and
//! libnbd's `tls-psk-file`), for either end of a connection: the server's
//! settings are in [`crate::server::tls::psk`], the client's in
//! [`crate::client::tls`].
//!
//! The clients that matter (libnbd, qemu, nbdkit's nbd plugin) use
//! GnuTLS with `NORMAL:+ECDHE-PSK:+DHE-PSK:+PSK`. Over TLS 1.3 they offer
//! the key with a SHA-256 binder (psk_dhe_ke mode); OpenSSL takes keys
//! from its PSK server callback as SHA-256 keys, which only the SHA-256
//! suites can use, so only those are enabled (GnuTLS 3.7 then picks
//! TLS_AES_128_GCM_SHA256). Over TLS 1.2 the ECDHE-PSK suites come first
//! (forward secrecy), then plain PSK, as GnuTLS orders them (GnuTLS 3.7
//! picks ECDHE-PSK-CHACHA20-POLY1305). No DHE-PSK: GnuTLS clients always
//! offer ECDHE-PSK too.
//!
//! The servers that matter (nbdkit, qemu-nbd) use GnuTLS with the same
//! priorities: diskit's client offers the same suites, and sends the
//! SHA-256 key from its PSK client callback.
//!
//! A server reads the key file again at every handshake, as GnuTLS does
//! for nbdkit and qemu: keys can be added or revoked while it runs.
//!
//! Modules: `keys` reads key files, `session` is the sans-I/O
//! `Session`, `client` the client's end (the server's is
//! [`crate::server::tls::psk`]), `openssl` the binding.

mod client;
mod keys;
mod openssl;
mod session;

use std::io;

pub use client::pinned_client;
pub(crate) use client::{ClientRole, client_context};
pub use keys::{MAX_IDENTITY_LEN, MAX_KEY_LEN, PskEntry, parse_key_file};
pub(crate) use keys::{read_key_file, show_identity};
pub(crate) use openssl::{Context, OP_CIPHER_SERVER_PREFERENCE, PskCallback, Side, Ssl, Version};
pub(crate) use session::{PskRole, PskSession};

/// TLS 1.3 suites: those with SHA-256, the hash of OpenSSL's keys from
/// the PSK server callback (and of GnuTLS's binders).
const TLS13_SUITES: &std::ffi::CStr = c"TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";

/// TLS 1.2 suites, best first: ECDHE-PSK, then plain PSK.
const TLS12_SUITES: &std::ffi::CStr = c"ECDHE-PSK-CHACHA20-POLY1305:ECDHE-PSK-AES256-CBC-SHA384:\
ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256:PSK-CHACHA20-POLY1305";

/// Settings both ends share: TLS 1.2 at least, the suites above, no
/// renegotiation, no tickets and no resumption (nothing would use them).
/// Loads OpenSSL at the first call: a system without it is an error here.
pub(crate) fn context(side: Side) -> io::Result<Context> {
    let mut c = Context::new(side).map_err(|e| io::Error::new(io::ErrorKind::Unsupported, e))?;
    c.set_min_version(Version::Tls12).map_err(setup_error)?;
    c.set_ciphersuites(TLS13_SUITES).map_err(setup_error)?;
    c.set_cipher_list(TLS12_SUITES).map_err(setup_error)?;
    c.set_options(openssl::OP_NO_RENEGOTIATION | openssl::OP_NO_TICKET);
    c.disable_session_cache();
    Ok(c)
}

/// An OpenSSL error in setting a session up.
pub(crate) fn setup_error(e: openssl::SslError) -> io::Error {
    io::Error::other(format!("TLS-PSK setup (OpenSSL): {e}"))
}
