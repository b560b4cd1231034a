//! The client over TLS against diskit's own server over a socket pair,
//! with certificates made by rcgen: many threads with requests in flight
//! on one encrypted connection, client certificates, certificates that do
//! not check out, a server without TLS, and pre-shared keys.

mod certs;
mod common;

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, ErrorKind, WriteFlags, ZeroFlags};
use diskit_nbd::client::NbdClient;
use diskit_nbd::client::conn::Stream;
use diskit_nbd::client::tls::ClientTls;
use diskit_nbd::client::uri::NbdUri;
use diskit_nbd::server::{
    ConnectionEnd, Export, ExportSet, Server, ServerConfig, TlsConfig, TlsMode,
};

const SIZE: u64 = 8 << 20;

/// A server on one end of a socket pair, with `tls` (or none).
fn serve(tls: Option<TlsConfig>) -> (UnixStream, Arc<MemoryDevice>, JoinHandle<ConnectionEnd>) {
    let dev = Arc::new(MemoryDevice::new(SIZE));
    let mut exports = ExportSet::new();
    exports.add(Export::new("disk", dev.clone()));
    let mut server = Server::new(
        exports,
        ServerConfig {
            threads: 4,
            ..ServerConfig::default()
        },
    );
    if let Some(tls) = tls {
        server = server.with_tls(tls);
    }
    let (client, srv) = UnixStream::pair().unwrap();
    client
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let server = std::thread::spawn(move || server.serve(Box::new(srv)));
    (client, dev, server)
}

/// The client settings of an `nbds+unix` URI with `query`.
fn client_tls(query: &str) -> diskit_core::Result<ClientTls> {
    let uri = NbdUri::parse(&format!("nbds+unix:///disk?socket=/unused&{query}"))?;
    Ok(ClientTls::for_uri(&uri)?.expect("nbds asks for TLS"))
}

fn certs_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    certs::generate(dir.path());
    dir
}

fn x509(dir: &Path, verify_peer: bool) -> TlsConfig {
    TlsConfig::from_dir(TlsMode::Require, dir, verify_peer).unwrap()
}

/// Connects over TLS with the settings of `query`.
fn connect(
    server: Option<TlsConfig>,
    query: &str,
) -> (
    diskit_core::Result<NbdClient>,
    Arc<MemoryDevice>,
    JoinHandle<ConnectionEnd>,
) {
    let (sock, dev, server) = serve(server);
    let c = client_tls(query)
        .and_then(|tls| NbdClient::over_tls(Stream::Unix(sock), "test", "disk", &tls));
    (c, dev, server)
}

#[test]
fn many_threads_in_flight_over_one_tls_connection() {
    let dir = certs_dir();
    let query = format!("tls-certificates={}", dir.path().display());
    let (c, dev, server) = connect(Some(x509(dir.path(), false)), &query);
    let c = Arc::new(c.unwrap());
    // Blocks longer than a TLS record, and not a multiple of one.
    common::parallel_round_trips(&c, 24, 40960, 40000);
    c.write_zeroes(0, 4096, ZeroFlags::default()).unwrap();
    c.flush().unwrap();
    let extents = c.extents(0, SIZE).unwrap();
    assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), SIZE);
    let mut a = vec![0u8; SIZE as usize];
    let mut b = vec![0u8; SIZE as usize];
    c.read_at(&mut a, 0).unwrap();
    dev.read_at(&mut b, 0).unwrap();
    assert!(a == b, "the server's device holds other bytes");
    assert!(a[..4096].iter().all(|&x| x == 0));
    c.close().unwrap();
    drop(c);
    let end = server.join().unwrap();
    assert!(
        matches!(
            end,
            ConnectionEnd::Transmission(diskit_nbd::server::End::Disconnect)
        ),
        "{end}"
    );
}

#[test]
fn a_client_certificate_goes_to_a_server_that_wants_one() {
    let dir = certs_dir();
    let query = format!("tls-certificates={}", dir.path().display());
    let (c, _, _) = connect(Some(x509(dir.path(), true)), &query);
    let c = c.unwrap();
    assert_eq!(c.size(), SIZE);
    c.close().unwrap();

    // The CA alone: the server turns the client away.
    let anonymous = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir.path().join("ca-cert.pem"),
        anonymous.path().join("ca-cert.pem"),
    )
    .unwrap();
    let query = format!("tls-certificates={}", anonymous.path().display());
    let (c, _, _) = connect(Some(x509(dir.path(), true)), &query);
    let e = c.err().expect("a client without a certificate is refused");
    // The server may hang up before its alert is read: then the client
    // sees the socket close during the handshake instead.
    let msg = e.to_string();
    assert!(
        msg.contains("the server wants a client certificate")
            || msg.contains("Broken pipe")
            || msg.contains("Connection reset"),
        "{e}"
    );
}

#[test]
fn a_server_certificate_from_another_ca_is_refused() {
    let dir = certs_dir();
    let other = tempfile::tempdir().unwrap();
    std::fs::write(
        other.path().join("ca-cert.pem"),
        certs::Ca::new("another CA").pem(),
    )
    .unwrap();
    let query = format!("tls-certificates={}", other.path().display());
    let (c, _, _) = connect(Some(x509(dir.path(), false)), &query);
    let e = c.err().expect("the certificate does not check out");
    let text = e.to_string();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{text}");
    assert!(text.contains("UnknownIssuer"), "{text}");
    assert!(
        text.contains(&format!(
            "not signed by a CA in {}",
            other.path().join("ca-cert.pem").display()
        )),
        "{text}"
    );
    // Unless nothing is checked.
    let query = format!(
        "tls-certificates={}&tls-verify-peer=false",
        other.path().display()
    );
    let (c, _, _) = connect(Some(x509(dir.path(), false)), &query);
    assert_eq!(c.unwrap().size(), SIZE);
    // A name to check that the certificate does not have.
    let query = format!(
        "tls-certificates={}&tls-hostname=elsewhere.example",
        dir.path().display()
    );
    let (c, _, _) = connect(Some(x509(dir.path(), false)), &query);
    let e = c.err().expect("the name does not check out");
    assert!(e.to_string().contains("elsewhere.example"), "{e}");
}

#[test]
fn a_revoked_server_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = certs::generate(dir.path());
    // A list that revokes only the client's certificate changes nothing.
    ca.revoke(dir.path(), &["client"]);
    let query = format!("tls-certificates={}", dir.path().display());
    let (c, _, _) = connect(Some(x509(dir.path(), false)), &query);
    assert_eq!(c.unwrap().size(), SIZE);
    ca.revoke(dir.path(), &["server"]);
    let (c, _, _) = connect(Some(x509(dir.path(), false)), &query);
    let e = c.err().expect("a revoked certificate is refused");
    assert!(e.to_string().contains("Revoked"), "{e}");
}

#[test]
fn a_server_without_tls_is_an_error_not_a_downgrade() {
    let dir = certs_dir();
    let query = format!("tls-certificates={}", dir.path().display());
    let (c, dev, server) = connect(None, &query);
    let e = c.err().expect("no TLS, no connection");
    let text = e.to_string();
    assert!(
        text.contains("refused TLS, which the nbds URI requires")
            && text.contains("NBD_OPT_STARTTLS"),
        "{text}"
    );
    // Nothing was read or written in plain text.
    let end = server.join().unwrap();
    assert!(!matches!(end, ConnectionEnd::Transmission(_)), "{end}");
    drop(dev);
}

#[test]
fn bad_settings_are_named() {
    let e = client_tls("tls-certificates=/nonexistent/dir").unwrap_err();
    assert!(e.to_string().contains("/nonexistent/dir"), "{e}");
    let empty = tempfile::tempdir().unwrap();
    let e = client_tls(&format!("tls-certificates={}", empty.path().display())).unwrap_err();
    assert!(e.to_string().contains("no ca-cert.pem"), "{e}");
    // Nothing to check the server with is fine when nothing is checked.
    client_tls(&format!(
        "tls-certificates={}&tls-verify-peer=false",
        empty.path().display()
    ))
    .unwrap();
    std::fs::write(empty.path().join("ca-cert.pem"), "not PEM at all").unwrap();
    let e = client_tls(&format!("tls-certificates={}", empty.path().display())).unwrap_err();
    assert!(e.to_string().contains("ca-cert.pem"), "{e}");
    // Plain URIs have no TLS settings.
    let plain = NbdUri::parse("nbd+unix:///?socket=/s&tls-certificates=/nonexistent").unwrap();
    assert!(ClientTls::for_uri(&plain).unwrap().is_none());
}

mod psk {
    use super::*;

    fn keys(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    fn server(keys: &Path) -> TlsConfig {
        TlsConfig::from_psk_file(TlsMode::Require, keys).unwrap()
    }

    #[test]
    fn pre_shared_keys_carry_transmission() {
        let k = keys("alice:00112233445566778899aabbccddeeff\n");
        let query = format!("tls-psk-file={}", k.path().display());
        let (sock, dev, _) = serve(Some(server(k.path())));
        let uri =
            NbdUri::parse(&format!("nbds+unix://alice@/disk?socket=/unused&{query}")).unwrap();
        let tls = ClientTls::for_uri(&uri).unwrap().unwrap();
        let c = NbdClient::over_tls(Stream::Unix(sock), "test", "disk", &tls).unwrap();
        let data = vec![0x5a; 200_000];
        c.write_at(&data, 12345, WriteFlags::NONE).unwrap();
        let mut back = vec![0u8; data.len()];
        dev.read_at(&mut back, 12345).unwrap();
        assert!(back == data);
        c.read_at(&mut back, 12345).unwrap();
        assert!(back == data);
        c.close().unwrap();
    }

    #[test]
    fn a_key_the_server_does_not_have_is_refused() {
        let k = keys("alice:00112233445566778899aabbccddeeff\n");
        let wrong = keys("alice:ffeeddccbbaa99887766554433221100\n");
        let query = format!("tls-psk-file={}", wrong.path().display());
        let (sock, _, _) = serve(Some(server(k.path())));
        let uri =
            NbdUri::parse(&format!("nbds+unix://alice@/disk?socket=/unused&{query}")).unwrap();
        let tls = ClientTls::for_uri(&uri).unwrap().unwrap();
        let e = NbdClient::over_tls(Stream::Unix(sock), "test", "disk", &tls)
            .err()
            .expect("the handshake fails");
        assert!(e.to_string().contains("TLS handshake"), "{e}");
        // A user the key file lacks is named before connecting.
        let uri =
            NbdUri::parse(&format!("nbds+unix://carol@/disk?socket=/unused&{query}")).unwrap();
        let e = ClientTls::for_uri(&uri).unwrap_err();
        assert!(e.to_string().contains("\"carol\""), "{e}");
    }
}

/// A fake server: a fixed-newstyle greeting, then `after` once the
/// client's first option (STARTTLS) has come.
fn fake_server(
    flags: u16,
    after: impl FnOnce(&mut UnixStream) + Send + 'static,
) -> (UnixStream, JoinHandle<u32>) {
    use diskit_nbd::proto::consts::*;
    use std::io::{Read, Write};
    let (client, mut srv) = UnixStream::pair().unwrap();
    for s in [&client, &srv] {
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
    }
    let t = std::thread::spawn(move || {
        let mut hello = NBDMAGIC.to_be_bytes().to_vec();
        hello.extend(IHAVEOPT.to_be_bytes());
        hello.extend(flags.to_be_bytes());
        srv.write_all(&hello).unwrap();
        let mut client_flags = [0u8; 4];
        let mut option = [0u8; 16];
        if srv.read_exact(&mut client_flags).is_err() || srv.read_exact(&mut option).is_err() {
            return 0;
        }
        let code = u32::from_be_bytes(option[8..12].try_into().unwrap());
        after(&mut srv);
        code
    });
    (client, t)
}

/// The STARTTLS acknowledgement, then the client's hello, read whole.
fn ack(s: &mut UnixStream) {
    ack_only(s);
    let mut head = [0u8; 5];
    std::io::Read::read_exact(s, &mut head).unwrap();
    assert_eq!(head[0], 22, "a TLS handshake record");
    // All of it: unread bytes would make the hang-up a reset.
    let mut body = vec![0u8; usize::from(u16::from_be_bytes([head[3], head[4]]))];
    std::io::Read::read_exact(s, &mut body).unwrap();
}

/// The STARTTLS acknowledgement.
fn ack_only(s: &mut UnixStream) {
    use diskit_nbd::proto::consts::*;
    use std::io::Write;
    let mut r = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
    r.extend(OPT_STARTTLS.to_be_bytes());
    r.extend(REP_ACK.to_be_bytes());
    r.extend(0u32.to_be_bytes());
    s.write_all(&r).unwrap();
}

#[test]
fn a_server_that_breaks_off_the_tls_handshake_is_an_error() {
    use diskit_nbd::proto::consts::*;
    use std::io::Write;
    let dir = certs_dir();
    let tls = client_tls(&format!("tls-certificates={}", dir.path().display())).unwrap();
    let fixed = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
    // Garbage where the server's hello should be.
    let (sock, t) = fake_server(fixed, |s| {
        ack(s);
        let _ = s.write_all(&[0x42; 4096]);
    });
    let e = NbdClient::over_tls(Stream::Unix(sock), "test", "disk", &tls)
        .err()
        .expect("no TLS from garbage");
    assert!(e.to_string().contains("TLS handshake"), "{e}");
    assert_eq!(t.join().unwrap(), OPT_STARTTLS, "STARTTLS came first");
    // A hang-up instead of the server's hello.
    let (sock, t) = fake_server(fixed, ack);
    let e = NbdClient::over_tls(Stream::Unix(sock), "test", "disk", &tls)
        .err()
        .expect("no TLS from nothing");
    assert!(
        e.to_string()
            .contains("server closed the connection during the TLS handshake"),
        "{e}"
    );
    t.join().unwrap();
    // A server without fixed newstyle cannot do STARTTLS.
    let (sock, t) = fake_server(0, |_| {});
    let e = NbdClient::over_tls(Stream::Unix(sock), "test", "disk", &tls)
        .err()
        .expect("no TLS without fixed newstyle");
    assert!(e.to_string().contains("fixed newstyle"), "{e}");
    t.join().unwrap();
}
