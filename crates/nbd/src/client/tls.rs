//! TLS for the client (`nbds://`, `nbds+unix://`): NBD_OPT_STARTTLS right
//! after the greeting, then the TLS handshake over the same socket, then
//! the rest of the negotiation inside TLS. TLS is required: a server that
//! refuses STARTTLS is an error, never a fall back to plain text.
//!
//! As libnbd, with X.509 certificates (rustls) unless the URI names a
//! key file:
//!
//! - `tls-certificates=DIR` holds `ca-cert.pem`, the CA the server's
//!   certificate must chain to, and optionally `client-cert.pem` with
//!   `client-key.pem`, sent when the server asks for a client
//!   certificate. Without it the first of `$HOME/.pki/libnbd` and
//!   `$HOME/.config/pki/libnbd` (`/etc/pki/libnbd` for root) that holds a
//!   `ca-cert.pem` is used, else the system's CA bundle. Certificates in
//!   `ca-crl.pem`, when there is one, are refused. (libnbd also
//!   falls back to the system's CAs when `DIR` has no `ca-cert.pem`;
//!   diskit names the missing file instead.)
//! - `tls-verify-peer=false` accepts any server certificate (the default
//!   is to verify it); `DIR` then needs no `ca-cert.pem`. The name checked is `tls-hostname=` if given, else
//!   the URI's host; over a Unix socket without `tls-hostname` there is no
//!   name to check, and only the chain is (libnbd checks nothing there).
//! - `tls-psk-file=FILE`: pre-shared keys through the system's OpenSSL 3
//!   (loaded at the first use), from a key file of `username:hexkey` lines as
//!   nbdkit, qemu and psktool write them. The username is the URI's user
//!   part (`nbds://alice@host/`), else `$LOGNAME`, else the login name.
//!
//! The sessions run on the plumbing the server shares ([`crate::tls`]): a
//! reader thread and any number of writers use one session at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::{
    CertificateError, ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore,
    SignatureScheme,
};

use diskit_core::{Error, ErrorKind, Result};

use super::conn::Stream;
use super::handshake;
use super::uri::{Address, NbdUri};
use crate::tls::Session;
use crate::tls::x509::read_certs;
use crate::transport::Transport;

/// Where the system's CA bundle may be, by distribution (Debian, Fedora,
/// openSUSE, Alpine); `$SSL_CERT_FILE` comes first.
const SYSTEM_CA_FILES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// A client's TLS settings for one URI, ready for any number of
/// connections.
#[derive(Clone)]
pub struct ClientTls {
    engine: Engine,
    /// The server, in messages.
    server: String,
    /// Where the CA certificates come from, in messages (X.509 with
    /// verification only).
    trust: Option<PathBuf>,
}

#[derive(Clone)]
enum Engine {
    /// X.509 certificates, with rustls.
    X509 {
        config: Arc<ClientConfig>,
        name: ServerName<'static>,
    },
    /// Pre-shared keys, with OpenSSL.
    Psk(Arc<psk::PskClient>),
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let engine = match &self.engine {
            Engine::X509 { .. } => "X.509",
            Engine::Psk(_) => "PSK",
        };
        f.debug_struct("ClientTls")
            .field("server", &self.server)
            .field("engine", &engine)
            .finish_non_exhaustive()
    }
}

fn tls_err(kind: ErrorKind, msg: impl Into<String>) -> Error {
    Error::new(kind, format!("TLS: {}", msg.into()))
}

fn io_err(e: std::io::Error) -> Error {
    let kind = match e.kind() {
        std::io::ErrorKind::NotFound => ErrorKind::NotFound,
        std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
        _ => ErrorKind::Io,
    };
    let msg = e.to_string();
    if msg.starts_with("TLS") {
        Error::new(kind, msg)
    } else {
        tls_err(kind, msg)
    }
}

/// The server's address, in messages.
fn server_name(uri: &NbdUri) -> String {
    match &uri.address {
        Address::Tcp { host, port } if host.contains(':') => format!("[{host}]:{port}"),
        Address::Tcp { host, port } => format!("{host}:{port}"),
        Address::Unix(path) => format!("the server on {path}"),
    }
}

impl ClientTls {
    /// The TLS settings `uri` asks for: `None` for the `nbd` schemes
    /// (which never send STARTTLS), else the certificates or the key to
    /// use, checked now (a missing CA or key file is reported here).
    pub fn for_uri(uri: &NbdUri) -> Result<Option<ClientTls>> {
        if !uri.tls {
            return Ok(None);
        }
        let server = server_name(uri);
        if let Some(file) = &uri.tls_psk_file {
            return Self::psk(uri, Path::new(file), server).map(Some);
        }
        let verify = uri.tls_verify_peer.unwrap_or(true);
        let (config, trust) = x509_config(uri, verify)?;
        let name = match (&uri.tls_hostname, &uri.address) {
            (Some(h), _) | (None, Address::Tcp { host: h, .. }) => ServerName::try_from(h.clone())
                .map_err(|_| {
                    tls_err(
                        ErrorKind::InvalidInput,
                        format!("'{h}' is not a host name to check a certificate against"),
                    )
                })?,
            // Never checked (the verifier skips the name), never sent
            // (no SNI over a Unix socket).
            (None, Address::Unix(_)) => ServerName::try_from("localhost").expect("a valid name"),
        };
        Ok(Some(ClientTls {
            engine: Engine::X509 {
                config: Arc::new(config),
                name,
            },
            server,
            trust,
        }))
    }

    fn psk(uri: &NbdUri, file: &Path, server: String) -> Result<ClientTls> {
        let user = match &uri.user {
            Some(u) => u.clone(),
            None => login_name()?,
        };
        Ok(ClientTls {
            engine: Engine::Psk(Arc::new(psk::PskClient::new(file, &user)?)),
            server,
            trust: None,
        })
    }

    /// Upgrades a fresh connection whose fixed-newstyle greeting was
    /// answered: NBD_OPT_STARTTLS, then the TLS handshake. Returns the
    /// encrypted stream; the negotiation goes on over it. A server that
    /// refuses TLS is an error naming it.
    pub fn start(&self, mut stream: Stream) -> Result<Stream> {
        handshake::starttls(&mut stream).map_err(|e| {
            e.context(format!(
                "{} refused TLS, which the nbds URI requires (no fall back to plain text)",
                self.server
            ))
        })?;
        let plain: Box<dyn Transport> = match stream {
            Stream::Unix(s) => Box::new(s),
            Stream::Tcp(s) => Box::new(s),
            Stream::Tls(_) => {
                return Err(tls_err(
                    ErrorKind::InvalidInput,
                    "the stream is already TLS",
                ));
            }
        };
        let session: Box<dyn Session> = match &self.engine {
            Engine::X509 { config, name } => Box::new(
                ClientConnection::new(config.clone(), name.clone())
                    .map_err(|e| tls_err(ErrorKind::Io, format!("setup: {e}")))?,
            ),
            Engine::Psk(p) => p.session().map_err(io_err)?,
        };
        let tls = crate::tls::upgrade(plain, session, "server").map_err(|e| {
            let mut msg = e.to_string();
            if (msg.contains("UnknownIssuer") || msg.contains("BadSignature"))
                && let Some(ca) = &self.trust
            {
                msg += &format!(
                    " (the server's certificate is not signed by a CA in {})",
                    ca.display()
                );
            }
            if let Engine::Psk(p) = &self.engine
                && e.kind() == std::io::ErrorKind::UnexpectedEof
            {
                msg += &format!(" (does it know username {} with this key?)", p.username());
            }
            // Refused credentials on either side; anything else (garbage,
            // a hang-up) is an I/O error.
            let refused = e.kind() == std::io::ErrorKind::PermissionDenied
                || msg.contains("peer certificate")
                || msg.contains("alert");
            let kind = if refused {
                ErrorKind::PermissionDenied
            } else {
                ErrorKind::Io
            };
            Error::new(kind, format!("TLS handshake with {}: {msg}", self.server))
        })?;
        Ok(Stream::Tls(Box::new(tls)))
    }
}

/// The name libnbd uses when the URI has no user: `$LOGNAME`, else the
/// login name of the terminal.
fn login_name() -> Result<String> {
    if let Some(name) = std::env::var_os("LOGNAME").and_then(|n| n.into_string().ok())
        && !name.is_empty()
    {
        return Ok(name);
    }
    unsafe extern "C" {
        // POSIX; the libc crate does not declare it.
        fn getlogin_r(buf: *mut libc::c_char, size: libc::size_t) -> libc::c_int;
    }
    let mut buf = vec![0u8; 256];
    // SAFETY: getlogin_r writes at most `buf.len()` bytes, NUL included,
    // into the buffer we own.
    let r = unsafe { getlogin_r(buf.as_mut_ptr().cast(), buf.len()) };
    if r == 0
        && let Some(end) = buf.iter().position(|&b| b == 0)
        && end > 0
    {
        return String::from_utf8(buf[..end].to_vec()).map_err(|_| {
            tls_err(
                ErrorKind::InvalidInput,
                "the login name is not UTF-8: give the user name in the URI (nbds://USER@...)",
            )
        });
    }
    Err(tls_err(
        ErrorKind::InvalidInput,
        "no user name for the pre-shared key: give it in the URI (nbds://USER@...) \
         or in $LOGNAME",
    ))
}

/// The directories libnbd looks for certificates in, when the URI names
/// none.
fn default_dirs() -> Vec<PathBuf> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    match std::env::var_os("HOME") {
        Some(home) if !root => {
            let home = PathBuf::from(home);
            vec![home.join(".pki/libnbd"), home.join(".config/pki/libnbd")]
        }
        _ if root => vec![PathBuf::from("/etc/pki/libnbd")],
        _ => Vec::new(),
    }
}

/// The certificate directory to use: the URI's (which must hold
/// `ca-cert.pem` when the server is verified), else the first of
/// libnbd's that holds one; `None` when there is none.
fn certificate_dir(uri: &NbdUri, verify: bool) -> Result<Option<PathBuf>> {
    if let Some(dir) = &uri.tls_certificates {
        let dir = PathBuf::from(dir);
        if !dir.is_dir() {
            return Err(tls_err(
                ErrorKind::NotFound,
                format!("tls-certificates={}: no such directory", dir.display()),
            ));
        }
        if verify && !dir.join("ca-cert.pem").is_file() {
            return Err(tls_err(
                ErrorKind::NotFound,
                format!(
                    "tls-certificates={}: no ca-cert.pem (the CA to check the server against)",
                    dir.display()
                ),
            ));
        }
        return Ok(Some(dir));
    }
    Ok(default_dirs()
        .into_iter()
        .find(|d| d.join("ca-cert.pem").is_file()))
}

/// The system's CA certificates, from the first bundle found.
fn system_roots() -> Result<(PathBuf, Vec<CertificateDer<'static>>)> {
    let env = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from);
    for path in env
        .into_iter()
        .chain(SYSTEM_CA_FILES.iter().map(PathBuf::from))
    {
        if path.is_file() {
            let certs = read_certs(&path).map_err(io_err)?;
            return Ok((path, certs));
        }
    }
    Err(tls_err(
        ErrorKind::NotFound,
        "no CA certificates to check the server against: give tls-certificates=DIR \
         with DIR/ca-cert.pem, or tls-verify-peer=false",
    ))
}

/// The rustls client settings for `uri`, and the file the CA
/// certificates came from (when the server is verified).
fn x509_config(uri: &NbdUri, verify: bool) -> Result<(ClientConfig, Option<PathBuf>)> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let dir = certificate_dir(uri, verify)?;
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err(ErrorKind::Io, format!("setup: {e}")))?;
    let mut trust = None;
    let webpki = if verify {
        let (ca_path, certs) = match &dir {
            Some(d) => {
                let p = d.join("ca-cert.pem");
                let certs = read_certs(&p).map_err(io_err)?;
                (p, certs)
            }
            None => system_roots()?,
        };
        let mut roots = RootCertStore::empty();
        for cert in certs {
            roots.add(cert).map_err(|e| {
                tls_err(
                    ErrorKind::InvalidInput,
                    format!("{}: bad CA certificate: {e}", ca_path.display()),
                )
            })?;
        }
        let mut builder =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone());
        // As libnbd: certificates revoked by DIR/ca-crl.pem are refused;
        // a CA without a list revokes nothing.
        if let Some(d) = &dir {
            let crl = d.join("ca-crl.pem");
            if crl.is_file() {
                let crls = CertificateRevocationListDer::pem_file_iter(&crl)
                    .and_then(|i| i.collect::<std::result::Result<Vec<_>, _>>())
                    .map_err(|e| {
                        tls_err(
                            ErrorKind::InvalidInput,
                            format!("{}: bad PEM: {e}", crl.display()),
                        )
                    })?;
                builder = builder.with_crls(crls).allow_unknown_revocation_status();
            }
        }
        let webpki = builder.build().map_err(|e| {
            tls_err(
                ErrorKind::InvalidInput,
                format!("{}: {e}", ca_path.display()),
            )
        })?;
        trust = Some(ca_path);
        Some(webpki)
    } else {
        None
    };
    let named = uri.tls_hostname.is_some() || matches!(uri.address, Address::Tcp { .. });
    let verifier = Arc::new(Verifier {
        webpki,
        check_name: named,
        algorithms: provider.signature_verification_algorithms,
    });
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    // The client certificate, when the directory has one.
    let (cert, key) = match &dir {
        Some(d) => (d.join("client-cert.pem"), d.join("client-key.pem")),
        None => (PathBuf::new(), PathBuf::new()),
    };
    let mut config = if dir.is_some() && cert.is_file() && key.is_file() {
        let certs = read_certs(&cert).map_err(io_err)?;
        let private = PrivateKeyDer::from_pem_file(&key).map_err(|e| {
            tls_err(
                ErrorKind::InvalidInput,
                format!("{}: no usable private key: {e}", key.display()),
            )
        })?;
        builder.with_client_auth_cert(certs, private).map_err(|e| {
            tls_err(
                ErrorKind::InvalidInput,
                format!("{}, {}: {e}", cert.display(), key.display()),
            )
        })?
    } else {
        builder.with_no_client_auth()
    };
    // As libnbd: no SNI over a Unix socket, a full handshake (and a full
    // check of the certificate) on every connection.
    config.enable_sni = named;
    config.resumption = rustls::client::Resumption::disabled();
    Ok((config, trust))
}

/// How the server's certificate is checked.
#[derive(Debug)]
struct Verifier {
    /// Against the CA; `None`: not at all (`tls-verify-peer=false`).
    webpki: Option<Arc<WebPkiServerVerifier>>,
    /// Whether the certificate must name the server (not over a Unix
    /// socket without `tls-hostname`).
    check_name: bool,
    /// What checks the handshake's signatures, which are always checked.
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(webpki) = &self.webpki else {
            return Ok(ServerCertVerified::assertion());
        };
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            // The chain is checked before the name: a wrong name means a
            // good chain.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

mod psk {
    //! The client's PSK settings: one identity and its key, from the key
    //! file, with the context (OpenSSL, loaded here at the first use)
    //! that sessions are made from.

    use std::io;
    use std::path::Path;

    use diskit_core::{Error, ErrorKind, Result};

    use crate::tls::Session;
    use crate::tls::psk::{ClientRole, Context, client_context, read_key_file, show_identity};

    /// The context, the identity and its key.
    pub(super) struct PskClient {
        ctx: Context,
        identity: Vec<u8>,
        key: Vec<u8>,
    }

    impl PskClient {
        /// The key of `user` in the key file at `path`.
        pub(super) fn new(path: &Path, user: &str) -> Result<PskClient> {
            let entries = read_key_file(path)
                .map_err(|e| Error::new(ErrorKind::InvalidInput, format!("TLS-PSK: {e}")))?;
            let identity = user.as_bytes().to_vec();
            let entry = entries
                .into_iter()
                .find(|e| e.identity == identity)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotFound,
                        format!(
                            "TLS-PSK: {}: username {} is not in the key file",
                            path.display(),
                            show_identity(&identity)
                        ),
                    )
                })?;
            let ctx = client_context().map_err(to_error)?;
            Ok(PskClient {
                ctx,
                identity,
                key: entry.key,
            })
        }

        /// The username, quoted, for messages.
        pub(super) fn username(&self) -> String {
            show_identity(&self.identity)
        }

        /// A session for one connection.
        pub(super) fn session(&self) -> io::Result<Box<dyn Session>> {
            ClientRole::new(self.identity.clone(), self.key.clone()).connect(&self.ctx)
        }
    }

    fn to_error(e: io::Error) -> Error {
        let kind = match e.kind() {
            io::ErrorKind::Unsupported => ErrorKind::NotSupported,
            _ => ErrorKind::Io,
        };
        Error::new(kind, e.to_string())
    }
}
