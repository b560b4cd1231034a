//! `diskit serve --tls` against the real peers: nbdinfo, qemu-img, qemu-io
//! and libnbd's Python bindings, with X.509 certificates made in the test.
//! Every server runs under `timeout` on a private Unix socket and stops
//! with its `--run` command.

mod common;

#[path = "../../nbd/tests/certs/mod.rs"]
mod certs;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

/// A 4 MiB sparse file: 64 KiB of 0x11 at 0, 64 KiB of 0x22 at 1 MiB.
fn test_file(dir: &Path) -> PathBuf {
    served_file(dir, 65536)
}

/// Certificates in DIR/pki.
fn pki(dir: &Path) -> PathBuf {
    let p = dir.join("pki");
    std::fs::create_dir(&p).unwrap();
    certs::generate(&p);
    p
}

/// The TLS URI of the served socket, with libnbd's certificate directory.
fn tls_uri(pki: &Path) -> String {
    format!(
        "nbds+unix:///?socket=$unixsocket&tls-certificates={}",
        s(pki)
    )
}

/// qemu's client options for TLS (it wants a hostname to check the
/// certificate against, which a Unix socket does not give).
fn qemu_tls(pki: &Path) -> String {
    format!(
        "--object tls-creds-x509,id=tls0,endpoint=client,dir={} --image-opts \
         driver=nbd,server.type=unix,server.path=$unixsocket,tls-creds=tls0,tls-hostname=localhost",
        s(pki)
    )
}

#[test]
fn require_serves_nbdinfo_qemu_img_and_qemu_io_over_tls() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path());
    let out = dir.path().join("out.raw");
    let uri_file = dir.path().join("uri");
    let cmd = format!(
        "echo \"$uri\" > {uri_file} && \
         nbdinfo --json \"{uri}\" && \
         nbdinfo --is tls \"{uri}\" && \
         qemu-img convert {qemu} -O raw {out} && \
         qemu-io -r {qemu} -c 'read -P 0x22 1M 64k' -c 'read -P 0 2M 64k' >&2",
        uri_file = s(&uri_file),
        uri = tls_uri(&pki),
        qemu = qemu_tls(&pki),
        out = s(&out),
    );
    let o = ok(serve_certs(
        &["-r", "--tls=require"],
        &pki,
        &["file", s(&f)],
        &cmd,
    ));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", stdout(&o)));
    assert_eq!(v["TLS"], true, "{v}");
    assert_eq!(v["exports"][0]["export-size"], 4 << 20);
    assert!(same_bytes(&f, &out), "qemu-img read other bytes over TLS");
    assert!(!stderr(&o).contains("Pattern verification failed"));
    let uri = std::fs::read_to_string(&uri_file).unwrap();
    assert!(uri.starts_with("nbds+unix:///?socket="), "{uri}");
}

#[test]
fn require_gives_plain_clients_nothing() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path());
    let out = dir.path().join("out.raw");
    // Each plain client must fail; the command records what each did.
    let cmd = format!(
        "nbdinfo --json \"nbd+unix:///?socket=$unixsocket\"; echo nbdinfo=$?; \
         nbdinfo --list \"nbd+unix:///?socket=$unixsocket\"; echo list=$?; \
         qemu-img convert -f raw \"nbd+unix:///?socket=$unixsocket\" -O raw {out}; echo qemu=$?",
        out = s(&out)
    );
    let o = ok(serve_certs(
        &["--tls=require"],
        &pki,
        &["file", s(&f)],
        &cmd,
    ));
    let text = stdout(&o);
    for tool in ["nbdinfo", "list", "qemu"] {
        assert_ne!(recorded(&o, tool), "0", "{tool} succeeded in plain text");
    }
    assert!(!text.contains("export-size"), "{text}");
    assert!(
        !out.exists() || std::fs::metadata(&out).unwrap().len() == 0,
        "qemu-img got data without TLS"
    );
    assert!(
        stderr(&o).contains("TLS") || stderr(&o).contains("tls"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn on_serves_plain_and_tls_clients() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path());
    let cmd = format!(
        "nbdinfo --size \"nbd+unix:///?socket=$unixsocket\" && \
         nbdinfo --size \"{uri}\" && \
         nbdinfo --is tls \"{uri}\" && \
         {{ nbdinfo --is tls \"nbd+unix:///?socket=$unixsocket\"; echo plain-tls=$?; }}",
        uri = tls_uri(&pki)
    );
    let o = ok(serve_certs(&["--tls=on"], &pki, &["file", s(&f)], &cmd));
    let text = stdout(&o);
    assert_eq!(text.matches("4194304").count(), 2, "{text}");
    assert_contains(&text, "plain-tls=2");
}

#[test]
fn verify_peer_wants_a_client_certificate_from_the_ca() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path());
    // The same CA, no client certificate.
    let anonymous = dir.path().join("anonymous");
    std::fs::create_dir(&anonymous).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();
    // The right CA to check the server, a client certificate from another.
    let rogue = dir.path().join("rogue");
    std::fs::create_dir(&rogue).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), rogue.join("ca-cert.pem")).unwrap();
    certs::Ca::new("another CA").leaf(&rogue, "client");
    let cmd = format!(
        "nbdinfo --size \"{good}\"; echo good=$?; \
         nbdinfo --size \"{anon}\"; echo anonymous=$?; \
         nbdinfo --size \"{rogue}\"; echo rogue=$?; \
         qemu-io -r {qemu} -c 'read -P 0x11 0 64k'; echo qemu=$?",
        good = tls_uri(&pki),
        anon = tls_uri(&anonymous),
        rogue = tls_uri(&rogue),
        qemu = qemu_tls(&pki),
    );
    let o = ok(serve_certs(
        &["--tls=require", "--tls-verify-peer"],
        &pki,
        &["file", s(&f)],
        &cmd,
    ));
    let text = stdout(&o);
    assert_contains(&text, "4194304\ngood=0");
    assert_contains(&text, "qemu=0");
    assert!(!text.contains("anonymous=0"), "{text}");
    assert!(!text.contains("rogue=0"), "{text}");
    assert_eq!(text.matches("4194304").count(), 1, "{text}");
}

/// The whole libnbd check suite (structured reads, block status, 256
/// writes in flight, disconnect with writes in flight, multi-conn...) over
/// TLS.
#[test]
fn libnbd_checks_over_tls() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path());
    let script = nbd_script("checks.py");
    let cmd = format!("{PYTHON} {} rw \"{}\"", s(&script), tls_uri(&pki));
    let o = ok(serve_certs(
        &["--tls=require"],
        &pki,
        &["file", s(&f)],
        &cmd,
    ));
    assert_contains(&stdout(&o), "ok");
}

#[test]
fn bad_tls_settings_are_refused_at_startup() {
    let dir = workdir();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let o = serve_certs(&["--tls=on"], &empty, &["memory", "1M"], "true");
    assert_ne!(code(&o), 0);
    assert_stderr_has(&o, "server-cert.pem");
}

/// `$tls` in `--run`'s environment: unset, 1 or 2 for off, on and
/// require, as nbdkit (the oracle) sets it; with TLS off a `tls` the
/// server inherited is not passed on either.
#[test]
fn run_sets_tls_as_nbdkit_does() {
    let dir = workdir();
    let pki = pki(dir.path());
    let cmd = "echo \"tls=${tls-unset} uri=$uri\"";
    let run = |argv: &[&str], mode: &str, inherited: Option<&str>| {
        let mut c = timed(argv[0], 60);
        c.args(&argv[1..]).args([
            "-U",
            "-",
            &format!("--tls={mode}"),
            "--tls-certificates",
            s(&pki),
            "null",
            "1M",
            "--run",
            cmd,
        ]);
        match inherited {
            Some(v) => c.env("tls", v),
            None => c.env_remove("tls"),
        };
        ok(c.output().expect("run a server"))
    };
    let tls_of = |o: &Output| {
        let text = stdout(o);
        text.split_whitespace()
            .find_map(|w| w.strip_prefix("tls="))
            .unwrap_or_else(|| panic!("no tls= in {text}"))
            .to_string()
    };
    let bin = diskit_bin();
    let diskit = [s(&bin), "serve"];
    for (mode, want) in [("off", "unset"), ("on", "1"), ("require", "2")] {
        let d = run(&diskit, mode, None);
        assert_eq!(tls_of(&d), want, "--tls={mode}");
        let n = run(&["nbdkit"], mode, None);
        assert_eq!(tls_of(&n), tls_of(&d), "nbdkit disagrees on --tls={mode}");
        let scheme = if mode == "require" {
            "nbds+unix:"
        } else {
            "nbd+unix:"
        };
        assert_contains(&stdout(&d), &format!("uri={scheme}"));
    }
    assert_eq!(tls_of(&run(&diskit, "off", Some("stale"))), "unset");
    assert_eq!(tls_of(&run(&diskit, "on", Some("stale"))), "1");
}

/// A certificate directory made by certtool (GnuTLS), as nbdkit's and
/// qemu's documentation make them: a CA, and a server key of `key_args`
/// with its certificate for localhost.
fn certtool_pki(dir: &Path, key_args: &[&str]) -> PathBuf {
    let run = |args: &[&str]| {
        let o = std::process::Command::new("certtool")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("certtool is installed (gnutls-bin)");
        assert!(o.status.success(), "certtool {args:?}: {}", stderr(&o));
    };
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    std::fs::write(
        dir.join("ca.info"),
        "cn = test CA\nca\ncert_signing_key\nexpiration_days = 3650\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("server.info"),
        "organization = test\ncn = localhost\ndns_name = localhost\ntls_www_server\n\
         encryption_key\nsigning_key\nexpiration_days = 3650\n",
    )
    .unwrap();
    run(&["--generate-privkey", "--outfile", "ca-key.pem"]);
    run(&words(
        "--generate-self-signed --load-privkey ca-key.pem --template ca.info --outfile pki/ca-cert.pem",
    ));
    let mut key = vec!["--generate-privkey"];
    key.extend_from_slice(key_args);
    key.extend(["--outfile", "pki/server-key.pem"]);
    run(&key);
    run(&words(
        "--generate-certificate --load-privkey pki/server-key.pem --load-ca-certificate pki/ca-cert.pem --load-ca-privkey ca-key.pem --template server.info --outfile pki/server-cert.pem",
    ));
    pki
}

/// Keys of the sizes and kinds certtool and openssl make, which GnuTLS
/// servers load: RSA of any size (PKCS#1 and PKCS#8), ECDSA, Ed25519.
#[test]
fn server_keys_of_any_size_and_kind_load() {
    let kinds: &[&[&str]] = &[
        &["--key-type", "rsa", "--bits", "2432"],
        &[
            "--key-type",
            "rsa",
            "--bits",
            "2056",
            "--pkcs8",
            "--password",
            "",
        ],
        &["--key-type", "rsa", "--bits", "3584"],
        &["--key-type", "ecdsa", "--curve", "secp384r1"],
        &["--key-type", "ed25519"],
    ];
    for kind in kinds {
        let dir = workdir();
        let pki = certtool_pki(dir.path(), kind);
        let o = serve_certs(
            &["--tls=require"],
            &pki,
            &["memory", "1M"],
            &format!("nbdinfo --size \"{}\"", tls_uri(&pki)),
        );
        assert!(o.status.success(), "{kind:?}: {}", stderr(&o));
        assert_eq!(stdout(&o).trim(), "1048576", "{kind:?}");
    }
}

/// A key the server cannot use is named in the error, not the certificate.
#[test]
fn an_unusable_key_is_named() {
    let dir = workdir();
    let pki = pki(dir.path());
    std::fs::write(
        pki.join("server-key.pem"),
        "-----BEGIN PRIVATE KEY-----\nMAA=\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let o = serve_certs(&["--tls=require"], &pki, &["memory", "1M"], "true");
    assert_ne!(code(&o), 0);
    assert_stderr_has(&o, "server-key.pem");
}

/// qemu-img's command lines with `--object tls-creds-x509` and an nbd node
/// naming it (`tls-creds=`), by `--image-opts` and by `json:`, print the
/// same and read the same bytes through qemu-img and through diskit; an
/// unknown id, or credentials for the server's end, are refused alike.
#[test]
fn tls_creds_objects_open_nbd_exports_as_qemu_img_opens_them() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path());
    let out = dir.path().join("out.raw");
    let script = r#"
O="--object tls-creds-x509,id=tls0,endpoint=client,dir=$PKI"
N="driver=nbd,server.type=unix,server.path=$unixsocket,tls-creds=tls0,tls-hostname=localhost"
$T info $O --image-opts "$N" 2>&1 | sed 's/^[a-z-]*: //'; echo "rc=${PIPESTATUS[0]}"
$T convert $O --image-opts "$N" -O raw "$OUT"; echo "rc=$?"; cmp "$OUT" "$F" && echo same
rm -f "$OUT"
$T convert $O "json:{'driver':'nbd','server':{'type':'unix','path':'$unixsocket'},'tls-creds':'tls0','tls-hostname':'localhost'}" -O raw "$OUT"
cmp "$OUT" "$F" && echo same
rm -f "$OUT"
$T info $O --image-opts "driver=nbd,path=$unixsocket,tls-creds=nope" 2>&1 | sed 's/^[a-z-]*: //'
$T info --object "tls-creds-x509,id=tls1,endpoint=server,dir=$PKI" --image-opts \
   "driver=nbd,path=$unixsocket,tls-creds=tls1" 2>&1 | sed 's/^[a-z-]*: //'
"#;
    let ours = alike_under_serve(
        dir.path(),
        &argv(
            "-U - -r --tls=require --tls-certificates",
            &[s(&pki), "file", s(&f)],
        ),
        script,
        &[("PKI", s(&pki)), ("F", s(&f)), ("OUT", s(&out))],
    );
    assert_eq!(ours.matches("same").count(), 2, "{ours}");
    assert_contains(&ours, "file format: nbd\n");
    assert_contains(&ours, "No TLS credentials with id 'nope'");
    assert_contains(&ours, "Expected TLS credentials for a client endpoint");
}
