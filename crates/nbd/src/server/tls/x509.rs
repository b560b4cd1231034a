//! The server's X.509 settings: rustls with certificates in nbdkit's and
//! qemu's directory layout.

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use crate::tls::Session;
use crate::tls::x509::{invalid, read_certs};

/// The rustls configuration for the certificates in `dir`:
/// `server-cert.pem` (chain after it), `server-key.pem`, and with
/// `verify_peer` `ca-cert.pem` to check client certificates against.
pub(super) fn config(dir: &Path, verify_peer: bool) -> io::Result<ServerConfig> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let certs = read_certs(&dir.join("server-cert.pem"))?;
    let key_path = dir.join("server-key.pem");
    let key = PrivateKeyDer::from_pem_file(&key_path)
        .map_err(|e| invalid(&key_path, format!("no usable private key: {e}")))?;
    // Loaded here first so that a key the provider cannot use is reported
    // against its own file.
    provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| invalid(&key_path, format!("unusable private key: {e}")))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| io::Error::other(format!("TLS setup: {e}")))?;
    let builder = if verify_peer {
        let ca_path = dir.join("ca-cert.pem");
        let mut roots = RootCertStore::empty();
        for cert in read_certs(&ca_path)? {
            roots
                .add(cert)
                .map_err(|e| invalid(&ca_path, format!("bad CA certificate: {e}")))?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| invalid(&ca_path, e.to_string()))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    builder
        .with_single_cert(certs, key)
        .map_err(|e| invalid(&dir.join("server-cert.pem"), e.to_string()))
}

/// A session for one client.
pub(super) fn session(config: &Arc<ServerConfig>) -> io::Result<Box<dyn Session>> {
    let conn = ServerConnection::new(config.clone())
        .map_err(|e| io::Error::other(format!("TLS setup: {e}")))?;
    Ok(Box::new(conn))
}
