//! The X.509 engine: rustls with certificates in nbdkit's and qemu's
//! directory layout.

use std::fs;
use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use super::Session;

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

fn invalid(path: &Path, message: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: {message}", path.display()),
    )
}

fn read_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let pem =
        fs::read(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(path, format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "no certificate".into()));
    }
    Ok(certs)
}

/// A session for one client.
pub(super) fn session(config: &Arc<ServerConfig>) -> io::Result<Box<dyn Session>> {
    let conn = ServerConnection::new(config.clone())
        .map_err(|e| io::Error::other(format!("TLS setup: {e}")))?;
    Ok(Box::new(conn))
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl Session for ServerConnection {
    fn is_handshaking(&self) -> bool {
        let common: &rustls::CommonState = self;
        common.is_handshaking()
    }

    fn feed(&mut self, mut input: &[u8]) -> io::Result<usize> {
        let taken = self.read_tls(&mut input)?;
        self.process_new_packets().map_err(tls_error)?;
        Ok(taken)
    }

    fn read_plain(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.reader().read(out)
    }

    fn write_plain(&mut self, data: &[u8]) -> io::Result<usize> {
        self.writer().write(data)
    }

    fn take_sealed(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        while self.wants_write() {
            self.write_tls(out)?;
        }
        Ok(())
    }

    fn close_notify(&mut self) {
        self.send_close_notify();
    }

    fn describe(&self) -> String {
        let version = match self.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3".to_string(),
            Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2".to_string(),
            Some(v) => format!("{v:?}"),
            None => "TLS".to_string(),
        };
        match self.negotiated_cipher_suite() {
            Some(suite) => format!("{version} {:?}, X.509", suite.suite()),
            None => format!("{version}, X.509"),
        }
    }
}
