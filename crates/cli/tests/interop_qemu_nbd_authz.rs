//! `qemu-nbd --tls-authz`: the same command lines through the real
//! qemu-nbd and diskit as `qemu-nbd`, with authz-simple, authz-list
//! (key=value and JSON, exact and glob rules) and authz-list-file objects;
//! clients are nbdcopy and nbdinfo with the certificates of two clients
//! (one allowed, one not) made by one CA. Both servers must let the same
//! clients in and name a refused one by the same distinguished name.

mod common;

#[path = "../../nbd/tests/certs/mod.rs"]
mod certs;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use certs::DnType;
use common::*;

/// The subject of alice's certificate, as QEMU writes it (rcgen makes
/// the country a UTF8String, which GnuTLS shows in hex).
const ALICE: &str = "C=#0c024742,O=Example\\, Org,OU=Q\\+A,CN=diskit test client";
/// The subject of mallory's.
const MALLORY: &str = "O=Mallory Inc,CN=diskit test client";

/// A work directory with a 1 MiB image, a `bin/qemu-nbd` link to diskit,
/// and certificates: `server/` (the server's, with the CA), `alice/` and
/// `mallory/` (each a client's, with the CA).
struct Bench {
    dir: tempfile::TempDir,
}

impl Bench {
    fn new() -> Bench {
        let dir = workdir();
        let d = dir.path();
        std::fs::create_dir(d.join("bin")).unwrap();
        std::os::unix::fs::symlink(diskit_bin(), d.join("bin/qemu-nbd")).unwrap();
        let data: Vec<u8> = (0..1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(d.join("disk.raw"), data).unwrap();
        let ca = certs::Ca::new("diskit test CA");
        for name in ["server", "alice", "mallory"] {
            std::fs::create_dir(d.join(name)).unwrap();
            std::fs::write(d.join(name).join("ca-cert.pem"), ca.pem()).unwrap();
        }
        ca.leaf(&d.join("server"), "server");
        ca.leaf_with_subject(
            &d.join("alice"),
            "client",
            &[
                (DnType::CountryName, "GB"),
                (DnType::OrganizationName, "Example, Org"),
                (DnType::OrganizationalUnitName, "Q+A"),
            ],
        );
        ca.leaf_with_subject(
            &d.join("mallory"),
            "client",
            &[(DnType::OrganizationName, "Mallory Inc")],
        );
        Bench { dir }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The real qemu-nbd, then diskit under its name.
    fn both(&self) -> [PathBuf; 2] {
        [PathBuf::from("qemu-nbd"), self.file("bin/qemu-nbd")]
    }

    /// `which` serving disk.raw read-only on `sock` with TLS from `creds`
    /// and `--tls-authz auth0` defined by `authz` (several `--object`s
    /// with `extra`).
    fn serve(&self, which: &Path, creds: &str, authz: &str, authz_id: &str) -> Server {
        let sock = self.file("s.sock");
        let _ = std::fs::remove_file(&sock);
        let log = self.file("server.log");
        let mut cmd = timed(which, 60);
        cmd.args([
            "-t", "-r", "-f", "raw", "--object", creds, "--object", authz,
        ])
        .args([
            "--tls-creds",
            "tls0",
            "--tls-authz",
            authz_id,
            "-k",
            s(&sock),
        ])
        .arg("disk.raw")
        .current_dir(self.dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().unwrap();
        let t = Instant::now();
        while !sock.exists() {
            assert!(
                child.try_wait().unwrap().is_none(),
                "{which:?} exited: {}",
                std::fs::read_to_string(&log).unwrap()
            );
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{which:?} not listening"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Server { child, sock, log }
    }

    /// X.509 server credentials, verifying clients unless `verify` is off.
    fn x509(&self, verify: bool) -> String {
        format!(
            "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer={}",
            s(&self.file("server")),
            if verify { "on" } else { "off" }
        )
    }
}

/// A server, stopped when dropped.
struct Server {
    child: Child,
    sock: PathBuf,
    log: PathBuf,
}

impl Server {
    /// Whether the client with the certificates in `certs` reads the whole
    /// image intact (nbdcopy), and not merely connects.
    fn reads(&self, b: &Bench, certs: &Path) -> bool {
        let uri = format!(
            "nbds+unix:///?socket={}&tls-certificates={}",
            s(&self.sock),
            s(certs)
        );
        self.copies(b, &uri)
    }

    /// Whether nbdcopy from `uri` succeeds and brings disk.raw's bytes.
    fn copies(&self, b: &Bench, uri: &str) -> bool {
        let out = b.file("out.raw");
        let _ = std::fs::remove_file(&out);
        let o = timed("nbdcopy", 60).args([uri, s(&out)]).output().unwrap();
        o.status.success() && same_bytes(&b.file("disk.raw"), &out)
    }

    /// What the server wrote to standard error so far.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
    }

    /// The server's log once it says `line` (a refusal may be logged
    /// after the client saw the connection end), or after 10 s.
    fn log_with(&self, line: &str) -> String {
        let t = Instant::now();
        loop {
            let log = self.log();
            if log.contains(line) || t.elapsed() > Duration::from_secs(10) {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child, not reaped yet.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// `text` with its commas doubled, as an `--object` value must be.
fn commas(text: &str) -> String {
    text.replace(',', ",,")
}

/// Serves with `authz` through both servers and checks which of alice
/// and mallory get in (`expected`), and that a refusal names the client
/// as QEMU does.
fn both_decide(b: &Bench, authz: &str, expected: [bool; 2]) {
    for which in b.both() {
        let srv = b.serve(&which, &b.x509(true), authz, "auth0");
        for (who, subject, want) in [
            ("alice", ALICE, expected[0]),
            ("mallory", MALLORY, expected[1]),
        ] {
            let got = srv.reads(b, &b.file(who));
            assert_eq!(got, want, "{which:?} {authz}: {who}; {}", srv.log());
            if !want {
                let line = format!("TLS x509 authz check for {subject} is denied");
                assert_contains(&srv.log_with(&line), &line);
            }
        }
    }
}

#[test]
fn authz_simple_lets_in_one_identity() {
    let b = Bench::new();
    let authz = format!("authz-simple,id=auth0,identity={}", commas(ALICE));
    both_decide(&b, &authz, [true, false]);
}

#[test]
fn authz_list_rules_exact_and_glob_decide_in_order() {
    let b = Bench::new();
    // Exact rule for alice, the default policy (deny) for the others.
    let exact = format!(
        "authz-list,id=auth0,rules.0.match={},rules.0.policy=allow,rules.0.format=exact",
        commas(ALICE)
    );
    both_decide(&b, &exact, [true, false]);
    // Glob rules: the first that matches decides.
    let glob = "authz-list,id=auth0,policy=allow,\
                rules.0.match=O=Mallory*,rules.0.policy=deny,rules.0.format=glob,\
                rules.1.match=*,rules.1.policy=allow,rules.1.format=glob";
    both_decide(&b, glob, [true, false]);
    // The same as JSON, the other way round.
    let json = r#"{"qom-type":"authz-list","id":"auth0","policy":"allow",
        "rules":[{"match":"C=#0c*","policy":"deny","format":"glob"}]}"#;
    both_decide(&b, json, [false, true]);
}

/// authz-list-file: the rules in a JSON file, read again when it changes.
/// The installed qemu-nbd has no authz-list-file (it refuses the type),
/// so its answers are those of the same rules given as a JSON authz-list.
#[test]
fn authz_list_file_rules_decide_as_the_same_list_does() {
    let b = Bench::new();
    let rules = format!(
        r#"{{"rules":[{{"match":"{}","policy":"allow","format":"exact"}},
             {{"match":"*Mallory*","policy":"deny","format":"glob"}}],"policy":"deny"}}"#,
        ALICE.replace('\\', "\\\\")
    );
    let file = b.file("rules.json");
    std::fs::write(&file, &rules).unwrap();
    let as_list = format!(
        r#"{{"qom-type":"authz-list","id":"auth0",{}"#,
        rules.trim_start_matches('{')
    );
    let as_file = format!("authz-list-file,id=auth0,filename={}", s(&file));
    let [real, ours] = b.both();
    for (which, authz) in [(&real, &as_list), (&ours, &as_file)] {
        let srv = b.serve(which, &b.x509(true), authz, "auth0");
        assert!(srv.reads(&b, &b.file("alice")), "{which:?}: {}", srv.log());
        assert!(!srv.reads(&b, &b.file("mallory")), "{which:?}");
    }
    // diskit reads the file again at each client.
    let srv = b.serve(&ours, &b.x509(true), &as_file, "auth0");
    std::fs::write(&file, r#"{"policy":"allow"}"#).unwrap();
    assert!(srv.reads(&b, &b.file("mallory")), "{}", srv.log());
    drop(srv);
    let o = timed("qemu-nbd", 60)
        .args(["--object", &as_file, "-r", s(&b.file("disk.raw"))])
        .output()
        .unwrap();
    assert_contains(
        &stderr(&o),
        "Parameter 'qom-type' does not accept value 'authz-list-file'",
    );
}

/// As in QEMU, authorization asks about client certificates only: with
/// `verify-peer=off` or pre-shared keys every client the credentials let
/// in gets in. A missing object refuses every client.
#[test]
fn authz_applies_to_verified_certificates_and_a_missing_object_refuses() {
    let b = Bench::new();
    let nobody = "authz-simple,id=auth0,identity=CN=nobody";
    let keys = b.file("psk");
    std::fs::create_dir(&keys).unwrap();
    let key = "6b3a55e0261b4a8e1f6c0d1d6ee4c8a2f3c3a6b0b0a1d2c3e4f5061728394a5b";
    std::fs::write(keys.join("keys.psk"), format!("alice:{key}\n")).unwrap();
    let psk = format!("tls-creds-psk,id=tls0,endpoint=server,dir={}", s(&keys));
    for which in b.both() {
        let which = &which;
        let srv = b.serve(which, &b.x509(false), nobody, "auth0");
        assert!(srv.reads(&b, &b.file("alice")), "{which:?}: {}", srv.log());
        drop(srv);
        let srv = b.serve(which, &psk, nobody, "auth0");
        let uri = format!(
            "nbds+unix://alice@/?socket={}&tls-psk-file={}",
            s(&srv.sock),
            s(&keys.join("keys.psk"))
        );
        assert!(srv.copies(&b, &uri), "{which:?} PSK: {}", srv.log());
        drop(srv);
        let srv = b.serve(which, &b.x509(true), nobody, "nope");
        assert!(!srv.reads(&b, &b.file("alice")), "{which:?}");
        let line = "Cannot find QAuthZ object ID nope";
        assert_contains(&srv.log_with(line), line);
    }
}
