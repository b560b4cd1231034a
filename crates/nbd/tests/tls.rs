//! STARTTLS byte by byte over a socket pair, with a rustls client and
//! certificates made by rcgen: what require mode refuses, the handshake
//! starting over after STARTTLS, transmission over TLS, client
//! certificates, and garbage where TLS should be. Every socket read has a
//! timeout.

mod certs;
mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::BlockDevice;
use diskit_nbd::proto::option_reply::OPTION_REPLY_HEADER_LEN;
use diskit_nbd::proto::reply::SIMPLE_REPLY_LEN;
use diskit_nbd::proto::*;
use diskit_nbd::server::{
    ConnectionEnd, End, Export, ExportSet, HandshakeEnd, Server, ServerConfig, TlsConfig, TlsMode,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConnection, RootCertStore, StreamOwned};

use common::Peer;

const SIZE: u64 = 1 << 20;

fn start(tls: TlsConfig) -> Peer {
    let dev = Arc::new(MemoryDevice::new(SIZE));
    let mut exports = ExportSet::new();
    exports.add(Export::new("a", dev.clone()));
    let server = Server::new(
        exports,
        ServerConfig {
            threads: 4,
            ..ServerConfig::default()
        },
    )
    .with_tls(tls);
    common::connect(server, dev)
}

fn read_n(s: &mut impl Read, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).expect("read from server");
    v
}

fn greet(s: &mut (impl Read + Write)) {
    let g = read_n(s, 18);
    assert_eq!(&g[..8], &NBDMAGIC.to_be_bytes());
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
}

fn raw_opt(s: &mut impl Write, option: u32, data: &[u8]) {
    let h = OptionHeader {
        option,
        length: data.len() as u32,
    };
    // One write: the server may hang up once it has seen the header.
    let mut buf = h.encode().to_vec();
    buf.extend_from_slice(data);
    s.write_all(&buf).unwrap();
    s.flush().unwrap();
}

fn opt(s: &mut impl Write, o: &ClientOption) {
    s.write_all(&o.encode()).unwrap();
    s.flush().unwrap();
}

fn reply(s: &mut impl Read) -> OptionReply {
    let mut buf = read_n(s, OPTION_REPLY_HEADER_LEN);
    let (_, _, len) = OptionReply::parse_header(buf[..].try_into().unwrap()).unwrap();
    buf.extend(read_n(s, len as usize));
    OptionReply::parse(&buf).unwrap().0
}

/// Replies up to and including the final one.
fn replies(s: &mut impl Read) -> Vec<OptionReply> {
    let mut v = Vec::new();
    loop {
        let r = reply(s);
        let last = r.kind == REP_ACK || r.is_error();
        v.push(r);
        if last {
            return v;
        }
    }
}

fn go_request(name: &str) -> ClientOption {
    ClientOption::Go(InfoRequest {
        name: name.into(),
        requests: vec![],
    })
}

fn certs_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    certs::generate(dir.path());
    dir
}

fn config(dir: &Path, mode: TlsMode, verify_peer: bool) -> TlsConfig {
    TlsConfig::from_dir(mode, dir, verify_peer).unwrap()
}

/// A rustls client trusting the test CA, with the client certificate from
/// `dir` when `client_cert`.
fn client(
    dir: &Path,
    sock: UnixStream,
    client_cert: bool,
) -> StreamOwned<ClientConnection, UnixStream> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca-cert.pem")).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let cfg = if client_cert {
        builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_file(dir.join("client-cert.pem")).unwrap()],
                PrivateKeyDer::from_pem_file(dir.join("client-key.pem")).unwrap(),
            )
            .unwrap()
    } else {
        builder.with_no_client_auth()
    };
    let conn =
        ClientConnection::new(Arc::new(cfg), ServerName::try_from("localhost").unwrap()).unwrap();
    StreamOwned::new(conn, sock)
}

fn starttls(p: &mut Peer) {
    raw_opt(&mut p.sock, OPT_STARTTLS, &[]);
    let r = reply(&mut p.sock);
    assert_eq!((r.option, r.kind), (OPT_STARTTLS, REP_ACK));
}

/// Reads what the server still sends (a TLS alert, say) until it closes,
/// and returns how its thread ended.
fn expect_closed(mut p: Peer) -> (Vec<u8>, ConnectionEnd) {
    let mut rest = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        match p.sock.read(&mut b) {
            Ok(0) => break,
            Ok(n) => {
                rest.extend_from_slice(&b[..n]);
                assert!(rest.len() < 1 << 16, "connection still open");
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("connection still open: {e}"),
        }
    }
    (rest, p.server.join().unwrap())
}

#[test]
fn require_refuses_every_option_but_starttls_and_abort() {
    let dir = certs_dir();
    let mut p = start(config(dir.path(), TlsMode::Require, false));
    greet(&mut p.sock);
    for (option, data) in [
        (OPT_LIST, Vec::new()),
        (OPT_STRUCTURED_REPLY, Vec::new()),
        (OPT_EXTENDED_HEADERS, Vec::new()),
        (OPT_INFO, go_request("a").encode()[16..].to_vec()),
        (OPT_GO, go_request("a").encode()[16..].to_vec()),
        (OPT_SET_META_CONTEXT, vec![0; 8]),
        (99, b"whatever".to_vec()),
    ] {
        raw_opt(&mut p.sock, option, &data);
        let r = reply(&mut p.sock);
        assert_eq!(
            (r.option, r.kind),
            (option, REP_ERR_TLS_REQD),
            "option {option}"
        );
    }
    // STARTTLS carries no data.
    raw_opt(&mut p.sock, OPT_STARTTLS, b"x");
    assert_eq!(reply(&mut p.sock).kind, REP_ERR_INVALID);
    // EXPORT_NAME cannot be refused: the server hangs up.
    raw_opt(&mut p.sock, OPT_EXPORT_NAME, b"a");
    let (rest, end) = expect_closed(p);
    assert!(rest.is_empty(), "{rest:?}");
    match end {
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(m)) => assert!(m.contains("TLS"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn abort_before_starttls_is_allowed() {
    let dir = certs_dir();
    let mut p = start(config(dir.path(), TlsMode::Require, false));
    greet(&mut p.sock);
    raw_opt(&mut p.sock, OPT_ABORT, &[]);
    assert_eq!(reply(&mut p.sock).kind, REP_ACK);
    assert!(matches!(
        expect_closed(p).1,
        ConnectionEnd::Handshake(HandshakeEnd::Aborted)
    ));
}

#[test]
fn starttls_restarts_negotiation_and_transmission_runs_over_tls() {
    let dir = certs_dir();
    let mut p = start(config(dir.path(), TlsMode::Allow, false));
    greet(&mut p.sock);
    // Structured replies in plain text: forgotten after STARTTLS.
    raw_opt(&mut p.sock, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(reply(&mut p.sock).kind, REP_ACK);
    starttls(&mut p);
    let mut t = client(dir.path(), p.sock.try_clone().unwrap(), false);
    opt(
        &mut t,
        &ClientOption::SetMetaContext(MetaRequest {
            export: "a".into(),
            queries: vec!["base:allocation".into()],
        }),
    );
    assert_eq!(
        reply(&mut t).kind,
        REP_ERR_INVALID,
        "state survived STARTTLS"
    );
    raw_opt(&mut t, OPT_STARTTLS, &[]);
    assert_eq!(reply(&mut t).kind, REP_ERR_INVALID, "second STARTTLS");
    raw_opt(&mut t, OPT_LIST, &[]);
    let r = replies(&mut t);
    assert_eq!(r.len(), 2, "{r:?}");
    opt(&mut t, &go_request("a"));
    assert_eq!(replies(&mut t).last().unwrap().kind, REP_ACK);

    // Writes then reads, pipelined, with simple replies (no structured
    // replies were negotiated over TLS).
    let data: Vec<u8> = (0..256 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let mut out = Vec::new();
    for i in 0..4u64 {
        let chunk = &data[i as usize * 65536..(i as usize + 1) * 65536];
        out.extend(
            RequestHeader {
                flags: 0,
                command: CMD_WRITE,
                cookie: i,
                offset: i * 65536,
                length: 65536,
                extended: false,
            }
            .encode(),
        );
        out.extend_from_slice(chunk);
    }
    t.write_all(&out).unwrap();
    t.flush().unwrap();
    let mut cookies = Vec::new();
    for _ in 0..4 {
        let (h, _) = ReplyHeader::parse(&read_n(&mut t, SIMPLE_REPLY_LEN)).unwrap();
        let ReplyHeader::Simple { error, cookie } = h else {
            panic!("{h:?}")
        };
        assert_eq!(error, 0);
        cookies.push(cookie);
    }
    cookies.sort();
    assert_eq!(cookies, [0, 1, 2, 3]);
    let read = RequestHeader {
        flags: 0,
        command: CMD_READ,
        cookie: 9,
        offset: 0,
        length: data.len() as u64,
        extended: false,
    };
    t.write_all(&read.encode()).unwrap();
    t.flush().unwrap();
    let (h, _) = ReplyHeader::parse(&read_n(&mut t, SIMPLE_REPLY_LEN)).unwrap();
    assert!(
        matches!(
            h,
            ReplyHeader::Simple {
                error: 0,
                cookie: 9
            }
        ),
        "{h:?}"
    );
    assert_eq!(read_n(&mut t, data.len()), data);
    let disc = RequestHeader {
        flags: 0,
        command: CMD_DISC,
        cookie: 10,
        offset: 0,
        length: 0,
        extended: false,
    };
    t.write_all(&disc.encode()).unwrap();
    t.flush().unwrap();
    // The server says goodbye with close_notify: a clean end of stream.
    let mut rest = Vec::new();
    t.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    let end = p.server.join().unwrap();
    assert!(
        matches!(end, ConnectionEnd::Transmission(End::Disconnect)),
        "{end:?}"
    );
    let mut back = vec![0u8; data.len()];
    p.dev.read_at(&mut back, 0).unwrap();
    assert_eq!(back, data);
}

#[test]
fn allow_serves_plain_clients() {
    let dir = certs_dir();
    let mut p = start(config(dir.path(), TlsMode::Allow, false));
    greet(&mut p.sock);
    opt(&mut p.sock, &go_request("a"));
    assert_eq!(replies(&mut p.sock).last().unwrap().kind, REP_ACK);
}

#[test]
fn garbage_instead_of_a_tls_handshake_ends_only_that_connection() {
    let dir = certs_dir();
    let tls = config(dir.path(), TlsMode::Require, false);
    for garbage in [
        &b"GET / HTTP/1.0\r\n\r\n"[..],
        &[0x16, 0x03, 0x01, 0x40, 0x00, 0xff, 0xff][..],
        &[0u8; 4096][..],
        &[][..],
    ] {
        let mut p = start(tls.clone());
        greet(&mut p.sock);
        starttls(&mut p);
        p.sock.write_all(garbage).unwrap();
        p.sock.shutdown(std::net::Shutdown::Write).unwrap();
        let (rest, end) = expect_closed(p);
        // Nothing, or a TLS alert record.
        assert!(rest.is_empty() || rest[0] == 0x15, "{rest:?}");
        match end {
            ConnectionEnd::Handshake(HandshakeEnd::Protocol(m)) => {
                assert!(m.contains("TLS handshake failed"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn garbage_in_place_of_tls_records_during_transmission() {
    let dir = certs_dir();
    let mut p = start(config(dir.path(), TlsMode::Require, false));
    greet(&mut p.sock);
    starttls(&mut p);
    let mut t = client(dir.path(), p.sock.try_clone().unwrap(), false);
    opt(&mut t, &go_request("a"));
    assert_eq!(replies(&mut t).last().unwrap().kind, REP_ACK);
    // A plain-text request where TLS records belong.
    let read = RequestHeader {
        flags: 0,
        command: CMD_READ,
        cookie: 1,
        offset: 0,
        length: 512,
        extended: false,
    };
    p.sock.write_all(&read.encode()).unwrap();
    let (rest, end) = expect_closed(p);
    // Nothing, or an alert (encrypted: TLS 1.3 calls it application data).
    assert!(
        rest.is_empty() || [0x15, 0x17].contains(&rest[0]),
        "{rest:?}"
    );
    assert!(
        matches!(
            end,
            ConnectionEnd::Transmission(End::Io(_) | End::Protocol(_))
        ),
        "{end:?}"
    );
}

#[test]
fn verify_peer_needs_a_client_certificate() {
    let dir = certs_dir();
    let tls = config(dir.path(), TlsMode::Require, true);

    let mut p = start(tls.clone());
    greet(&mut p.sock);
    starttls(&mut p);
    let mut t = client(dir.path(), p.sock.try_clone().unwrap(), true);
    opt(&mut t, &go_request("a"));
    assert_eq!(replies(&mut t).last().unwrap().kind, REP_ACK);
    drop(t);
    let Peer { sock, server, .. } = p;
    drop(sock);
    assert!(matches!(
        server.join().unwrap(),
        ConnectionEnd::Transmission(_)
    ));

    let mut p = start(tls);
    greet(&mut p.sock);
    starttls(&mut p);
    let mut t = client(dir.path(), p.sock.try_clone().unwrap(), false);
    // The server may have hung up already.
    let _ = t.write_all(&go_request("a").encode());
    let _ = t.flush();
    let mut b = [0u8; 1];
    let r = t.read(&mut b);
    assert!(matches!(r, Err(_) | Ok(0)), "{r:?}");
    match p.server.join().unwrap() {
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(m)) => {
            assert!(m.contains("TLS handshake failed"), "{m}")
        }
        other => panic!("{other:?}"),
    }
}

/// TLS-PSK with an OpenSSL client (the system's OpenSSL 3, through
/// diskit's own binding), over TLS 1.3 and 1.2: known identities get in,
/// unknown ones and wrong keys do not, and the key file is read again at
/// each handshake.
mod psk {
    use super::*;
    use diskit_nbd::tls::TlsStream;
    use diskit_nbd::tls::psk::pinned_client;

    const ALICE: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const BOB: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f0";
    const TLS13: &str = "TLSv1.3";
    const TLS12: &str = "TLSv1.2";

    fn key_file(dir: &Path, text: &str) -> std::path::PathBuf {
        let p = dir.join("keys.psk");
        std::fs::write(&p, text).unwrap();
        p
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// A TLS-PSK client limited to `version` (`TLS13` or `TLS12`), over
    /// `sock`.
    fn psk_client(
        sock: UnixStream,
        version: &str,
        identity: &str,
        key: &str,
    ) -> Result<TlsStream, String> {
        pinned_client(
            Box::new(sock),
            version == TLS13,
            identity.as_bytes(),
            &hex(key),
        )
        .map_err(|e| e.to_string())
    }

    fn psk_start(keys: &Path, mode: TlsMode) -> Peer {
        let mut p = start(TlsConfig::from_psk_file(mode, keys).unwrap());
        greet(&mut p.sock);
        starttls(&mut p);
        p
    }

    /// The handshake error the server ended with.
    fn refused(p: Peer) -> String {
        match expect_closed(p).1 {
            ConnectionEnd::Handshake(HandshakeEnd::Protocol(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn known_identities_are_served_over_tls13_and_tls12() {
        let dir = tempfile::tempdir().unwrap();
        let keys = key_file(dir.path(), &format!("alice:{ALICE}\nbob:{BOB}\n"));
        for version in [TLS13, TLS12] {
            for (who, key) in [("alice", ALICE), ("bob", BOB)] {
                let p = psk_start(&keys, TlsMode::Require);
                let mut t = psk_client(p.sock.try_clone().unwrap(), version, who, key)
                    .unwrap_or_else(|e| panic!("{version} {who}: {e}"));
                assert!(t.negotiated().starts_with(version), "{}", t.negotiated());
                opt(&mut t, &go_request("a"));
                assert_eq!(replies(&mut t).last().unwrap().kind, REP_ACK);
                let mut data = vec![0x5a; 4096];
                data[0] = 1;
                let mut req = RequestHeader {
                    flags: 0,
                    command: CMD_WRITE,
                    cookie: 1,
                    offset: 8192,
                    length: 4096,
                    extended: false,
                }
                .encode();
                req.extend_from_slice(&data);
                t.write_all(&req).unwrap();
                let (h, _) = ReplyHeader::parse(&read_n(&mut t, SIMPLE_REPLY_LEN)).unwrap();
                assert!(matches!(h, ReplyHeader::Simple { error: 0, .. }), "{h:?}");
                let mut back = vec![0u8; 4096];
                p.dev.read_at(&mut back, 8192).unwrap();
                assert_eq!(back, data);
                drop(t);
                let Peer { sock, server, .. } = p;
                drop(sock);
                let end = server.join().unwrap();
                assert!(matches!(end, ConnectionEnd::Transmission(_)), "{end:?}");
            }
        }
    }

    #[test]
    fn unknown_identities_and_wrong_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let keys = key_file(dir.path(), &format!("alice:{ALICE}\n"));
        for version in [TLS13, TLS12] {
            let p = psk_start(&keys, TlsMode::Allow);
            let r = psk_client(p.sock.try_clone().unwrap(), version, "mallory", ALICE);
            assert!(r.is_err(), "{version}: unknown identity got in");
            let m = refused(p);
            assert!(m.contains("unknown PSK identity \"mallory\""), "{m}");

            let p = psk_start(&keys, TlsMode::Allow);
            let r = psk_client(p.sock.try_clone().unwrap(), version, "alice", BOB);
            // TLS 1.2 fails on the client's Finished: the client may see
            // its handshake complete before the server's alert arrives.
            if let Ok(mut t) = r {
                let _ = t.write_all(&go_request("a").encode());
                let mut b = [0u8; 1];
                assert!(
                    !matches!(t.read(&mut b), Ok(1)),
                    "{version}: wrong key got in"
                );
            }
            let m = refused(p);
            assert!(
                m.contains("\"alice\" is known but the handshake failed"),
                "{m}"
            );
        }
    }

    #[test]
    fn the_key_file_is_read_again_at_each_handshake() {
        let dir = tempfile::tempdir().unwrap();
        let keys = key_file(dir.path(), &format!("alice:{ALICE}\n"));
        let config = TlsConfig::from_psk_file(TlsMode::Require, &keys).unwrap();
        // Alice revoked, Bob added.
        key_file(dir.path(), &format!("bob:{BOB}\n"));
        let mut p = start(config.clone());
        greet(&mut p.sock);
        starttls(&mut p);
        let r = psk_client(p.sock.try_clone().unwrap(), TLS13, "alice", ALICE);
        assert!(r.is_err());
        assert!(refused(p).contains("unknown PSK identity"));
        let mut p = start(config.clone());
        greet(&mut p.sock);
        starttls(&mut p);
        let mut t = psk_client(p.sock.try_clone().unwrap(), TLS13, "bob", BOB).unwrap();
        opt(&mut t, &go_request("a"));
        assert_eq!(replies(&mut t).last().unwrap().kind, REP_ACK);
        drop(t);
        // A key file gone bad refuses everyone, saying why.
        key_file(dir.path(), "bob\n");
        let mut p = start(config);
        greet(&mut p.sock);
        starttls(&mut p);
        assert!(psk_client(p.sock.try_clone().unwrap(), TLS13, "bob", BOB).is_err());
        let m = refused(p);
        assert!(
            m.contains("cannot read the PSK key file") && m.contains("line 1"),
            "{m}"
        );
    }

    #[test]
    fn a_certificate_client_gets_nothing_from_a_psk_server() {
        let dir = certs_dir();
        let keys = key_file(dir.path(), &format!("alice:{ALICE}\n"));
        let p = psk_start(&keys, TlsMode::Require);
        let mut t = client(dir.path(), p.sock.try_clone().unwrap(), false);
        let _ = t.write_all(&go_request("a").encode());
        let _ = t.flush();
        let mut b = [0u8; 1];
        assert!(!matches!(t.read(&mut b), Ok(1)));
        drop(t);
        let m = refused(p);
        assert!(m.contains("TLS handshake failed"), "{m}");
    }

    #[test]
    fn bad_key_files_are_refused_at_startup() {
        let dir = tempfile::tempdir().unwrap();
        let e = TlsConfig::from_psk_file(TlsMode::Allow, &dir.path().join("nope")).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let keys = key_file(dir.path(), "alice:00\nbob:xyz\n");
        let e = TlsConfig::from_psk_file(TlsMode::Allow, &keys).unwrap_err();
        assert!(e.to_string().contains("keys.psk: line 2"), "{e}");
    }
}
