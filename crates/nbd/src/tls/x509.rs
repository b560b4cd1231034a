//! The X.509 engine: rustls sessions for either end, and the PEM files of
//! the certificate directories nbdkit, qemu and libnbd read.

use std::fs;
use std::io::{self, IoSlice, Read, Write};
use std::path::Path;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConnection, ServerConnection};

use super::Session;

/// An error about the file at `path`.
pub(crate) fn invalid(path: &Path, message: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: {message}", path.display()),
    )
}

/// The certificates in the PEM file at `path` (at least one).
pub(crate) fn read_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let pem =
        fs::read(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(path, format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "no certificate"));
    }
    Ok(certs)
}

/// A rustls error as an I/O error.
pub(crate) fn tls_error(e: rustls::Error) -> io::Error {
    if let rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired) = e {
        // Only a client gets this (over TLS 1.3, at its first read).
        return io::Error::new(
            io::ErrorKind::PermissionDenied,
            "TLS: the server wants a client certificate (client-cert.pem and \
             client-key.pem in the certificate directory)",
        );
    }
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

/// The protocol version and cipher suite of a rustls session.
fn describe(common: &rustls::CommonState) -> String {
    let version = match common.protocol_version() {
        Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3".to_string(),
        Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2".to_string(),
        Some(v) => format!("{v:?}"),
        None => "TLS".to_string(),
    };
    match common.negotiated_cipher_suite() {
        Some(suite) => format!("{version} {:?}, X.509", suite.suite()),
        None => format!("{version}, X.509"),
    }
}

/// [`Session`] for a rustls connection of either side (they share their
/// methods through `Deref` to `ConnectionCommon`, not through a trait).
macro_rules! rustls_session {
    ($conn:ty) => {
        impl Session for $conn {
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

            fn write_plain_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
                self.writer().write_vectored(bufs)
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
                describe(self)
            }

            fn peer_subject(&self) -> Option<String> {
                let leaf = self.peer_certificates()?.first()?;
                super::dn::certificate_subject(leaf.as_ref())
            }
        }
    };
}

rustls_session!(ServerConnection);
rustls_session!(ClientConnection);
