//! diskit as a TLS client (`nbds+unix://` URIs) against the real servers:
//! `diskit serve`, nbdkit and qemu-nbd with X.509 certificates made in the
//! test, and nbdkit with pre-shared keys. The
//! clients are `diskit nbdinfo`, `diskit copy` and `diskit convert`. A
//! server that refuses TLS, or whose certificate does not check out, is a
//! clear error and a non-zero exit.

mod common;

#[path = "../../nbd/tests/certs/mod.rs"]
mod certs;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

/// A 4 MiB sparse file: 64 KiB of 0x11 at 0, 300000 bytes of 0x22 at 1 MiB.
fn test_file(dir: &Path) -> PathBuf {
    served_file(dir, 300_000)
}

/// A CA, server and client certificates in DIR/NAME.
fn pki(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir(&p).unwrap();
    certs::generate(&p);
    p
}

/// The nbds URI of the socket in `$unixsocket` (for `--run`) with
/// `query` after it.
fn run_uri(query: &str) -> String {
    format!("nbds+unix:///?socket=$unixsocket&{query}")
}

/// Runs nbdkit ARGS (its `--run` command included) under a timeout.
fn nbdkit(args: &[&str]) -> Output {
    timed("nbdkit", 120)
        .args(args)
        .output()
        .expect("nbdkit is installed")
}

#[test]
fn nbdinfo_copy_and_convert_from_diskit_serve_over_tls() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path(), "pki");
    let (copy, conv) = (dir.path().join("copy.raw"), dir.path().join("conv.raw"));
    let uri = run_uri(&format!("tls-certificates={}", s(&pki)));
    let bin = diskit_bin();
    let cmd = format!(
        "{d} nbdinfo --json \"{uri}\" && \
         {d} nbdinfo --is tls \"{uri}\" && \
         {d} copy \"{uri}\" {copy} && \
         {d} convert -O raw \"{uri}\" {conv}",
        d = s(&bin),
        copy = s(&copy),
        conv = s(&conv),
    );
    let o = ok(serve_certs(
        &["-v", "-r", "--tls=require"],
        &pki,
        &["file", s(&f)],
        &cmd,
    ));
    let text = stdout(&o);
    let json = &text[text.find('{').expect("nbdinfo JSON")..];
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("bad JSON ({e}): {json}"));
    assert_eq!(v["TLS"], true, "{v}");
    assert_eq!(v["exports"][0]["export-size"], 4 << 20);
    assert!(same_bytes(&f, &copy), "diskit copy read other bytes");
    assert!(same_bytes(&f, &conv), "diskit convert read other bytes");
    // Every connection the server logged was encrypted.
    let conns = connections(&o);
    assert!(!conns.is_empty(), "{}", stderr(&o));
    for c in &conns {
        assert_contains(c, "TLSv1.3");
    }
}

#[test]
fn copy_to_and_from_nbdkit_over_tls_with_a_client_certificate() {
    let dir = workdir();
    let pki = pki(dir.path(), "pki");
    // The right CA, but no client certificate.
    let anonymous = dir.path().join("anonymous");
    std::fs::create_dir(&anonymous).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();
    let src = dir.path().join("src.raw");
    let data: Vec<u8> = (0..(3u32 << 20) + 4096)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    let back = dir.path().join("back.raw");
    let good = run_uri(&format!("tls-certificates={}", s(&pki)));
    let anon = run_uri(&format!("tls-certificates={}", s(&anonymous)));
    let bin = diskit_bin();
    let cmd = format!(
        "{d} copy {src} \"{good}\"; echo in=$?; \
         {d} copy \"{good}\" {back}; echo out=$?; \
         {d} nbdinfo --size \"{anon}\"; echo anonymous=$?",
        d = s(&bin),
        src = s(&src),
        back = s(&back),
    );
    let o = ok(nbdkit(&argv(
        "-U - --tls=require --tls-verify-peer --tls-certificates",
        &[s(&pki), "memory", &format!("{}", data.len()), "--run", &cmd],
    )));
    assert_eq!(recorded(&o, "in"), "0", "{}", stderr(&o));
    assert_eq!(recorded(&o, "out"), "0", "{}", stderr(&o));
    assert_ne!(recorded(&o, "anonymous"), "0");
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the bytes did not survive the round trip"
    );
}

/// qemu-nbd with TLS serving `file` until dropped.
fn qemu_nbd_tls(dir: &Path, pki: &Path, file: &Path) -> QemuNbd {
    let creds = format!(
        "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer=off",
        s(pki)
    );
    let args = ["-r", "-f", "raw", "--object", &creds, "--tls-creds", "tls0"];
    QemuNbd::start(&dir.join("qemu.sock"), &[&args[..], &[s(file)]].concat())
}

#[test]
fn nbdinfo_and_convert_from_qemu_nbd_over_tls() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path(), "pki");
    let q = qemu_nbd_tls(dir.path(), &pki, &f);
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        s(&q.sock),
        s(&pki)
    );
    let o = ok(diskit(&["nbdinfo", "--size", &uri]));
    assert_eq!(stdout(&o).trim(), "4194304");
    let o = ok(diskit(&["nbdinfo", &uri]));
    assert_contains(&stdout(&o), "newstyle-fixed with TLS");
    let conv = dir.path().join("conv.raw");
    ok(diskit(&["convert", "-O", "raw", &uri, s(&conv)]));
    assert!(same_bytes(&f, &conv), "diskit convert read other bytes");
    // A plain client gets nothing from it.
    let o = diskit(&["nbdinfo", "--size", &q.uri]);
    assert_ne!(code(&o), 0, "{}", stdout(&o));
}

#[test]
fn servers_without_tls_are_refused_by_name() {
    let dir = workdir();
    let pki = pki(dir.path(), "pki");
    let uri = run_uri(&format!("tls-certificates={}", s(&pki)));
    let bin = diskit_bin();
    let out = dir.path().join("out.raw");
    let cmd = format!(
        "{d} nbdinfo --size \"{uri}\"; echo nbdinfo=$?; \
         {d} copy \"{uri}\" {out}; echo copy=$?",
        d = s(&bin),
        out = s(&out),
    );
    for server in ["nbdkit", "diskit"] {
        let args = ["-U", "-", "memory", "1M", "--run", &cmd];
        let o = if server == "nbdkit" {
            nbdkit(&args)
        } else {
            serve(&args)
        };
        for tool in ["nbdinfo", "copy"] {
            assert_ne!(
                recorded(&o, tool),
                "0",
                "{server}: {tool} went on in plain text"
            );
        }
        let err = stderr(&o);
        assert!(!stdout(&o).contains("1048576"), "{server}: {}", stdout(&o));
        assert!(
            err.contains("refused TLS, which the nbds URI requires")
                && err.contains("NBD_OPT_STARTTLS"),
            "{server}: {err}"
        );
        assert!(err.contains("the server on /"), "{server}: {err}");
        assert!(
            !out.exists() || std::fs::metadata(&out).unwrap().len() == 0,
            "{server}: data copied without TLS"
        );
    }
}

#[test]
fn certificates_that_do_not_check_out_are_refused() {
    let dir = workdir();
    let pki = pki(dir.path(), "pki");
    // Another CA altogether: the server's certificate is not signed by it.
    let other = pki_dir_with_ca_only(dir.path());
    // A directory without ca-cert.pem.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let bin = diskit_bin();
    let q = |query: &str| run_uri(query);
    let cmd = format!(
        "{d} nbdinfo --size \"{wrong}\"; echo wrong=$?; \
         {d} nbdinfo --size \"{unchecked}\"; echo unchecked=$?; \
         {d} nbdinfo --size \"{named}\"; echo named=$?; \
         {d} nbdinfo --size \"{misnamed}\"; echo misnamed=$?; \
         {d} nbdinfo --size \"{empty}\"; echo empty=$?",
        d = s(&bin),
        wrong = q(&format!("tls-certificates={}", s(&other))),
        unchecked = q(&format!(
            "tls-certificates={}&tls-verify-peer=false",
            s(&other)
        )),
        named = q(&format!(
            "tls-certificates={}&tls-hostname=localhost",
            s(&pki)
        )),
        misnamed = q(&format!(
            "tls-certificates={}&tls-hostname=elsewhere.example",
            s(&pki)
        )),
        empty = q(&format!("tls-certificates={}", s(&empty))),
    );
    let o = ok(serve_certs(
        &["--tls=require"],
        &pki,
        &["memory", "1M"],
        &cmd,
    ));
    let err = stderr(&o);
    assert_ne!(recorded(&o, "wrong"), "0");
    assert!(
        err.contains(&format!(
            "not signed by a CA in {}",
            s(&other.join("ca-cert.pem"))
        )),
        "{err}"
    );
    assert_eq!(recorded(&o, "unchecked"), "0", "{err}");
    assert_eq!(recorded(&o, "named"), "0", "{err}");
    assert_ne!(recorded(&o, "misnamed"), "0");
    assert_contains(&err, "elsewhere.example");
    assert_ne!(recorded(&o, "empty"), "0");
    assert_contains(&err, "no ca-cert.pem");
    assert_eq!(stdout(&o).matches("1048576").count(), 2, "{}", stdout(&o));
}

/// Over TCP the certificate must name the host of the URI (localhost and
/// 127.0.0.1 are in the test certificate), or `tls-hostname`.
#[test]
fn over_tcp_the_certificate_names_the_host() {
    let dir = workdir();
    let f = test_file(dir.path());
    let pki = pki(dir.path(), "pki");
    let copy = dir.path().join("copy.raw");
    let q = format!("tls-certificates={}", s(&pki));
    let cmd = format!(
        "{d} copy \"${{uri}}?{q}\" {copy}; echo by-name=$?; \
         {d} nbdinfo --size \"nbds://127.0.0.1:$port/?{q}\"; echo by-address=$?; \
         {d} nbdinfo --size \"nbds://127.0.0.1:$port/?{q}&tls-hostname=wrong.example\"; \
         echo wrong-name=$?",
        d = s(&diskit_bin()),
        copy = s(&copy),
    );
    let o = ok(serve(&argv(
        "-p 0 -i 127.0.0.1 -r --tls=require --tls-certificates",
        &[s(&pki), "file", s(&f), "--run", &cmd],
    )));
    let err = stderr(&o);
    assert_eq!(recorded(&o, "by-name"), "0", "{err}");
    assert!(same_bytes(&f, &copy), "diskit copy read other bytes");
    assert_eq!(recorded(&o, "by-address"), "0", "{err}");
    assert_ne!(recorded(&o, "wrong-name"), "0");
    assert_contains(&err, "wrong.example");
}

/// DIR/other holding only the certificate of a CA of its own.
fn pki_dir_with_ca_only(dir: &Path) -> PathBuf {
    let p = dir.join("other");
    std::fs::create_dir(&p).unwrap();
    std::fs::write(
        p.join("ca-cert.pem"),
        certs::Ca::new("another CA").pem().as_bytes(),
    )
    .unwrap();
    p
}

#[test]
fn copy_to_and_from_nbdkit_with_pre_shared_keys() {
    const ALICE: &str = "6b3a55e0261b4a8e1f6c0d1d6ee4c8a2f3c3a6b0b0a1d2c3e4f5061728394a5b";
    const WRONG: &str = "ffeeddccbbaa99887766554433221100";
    let dir = workdir();
    let f = test_file(dir.path());
    let server = dir.path().join("server.psk");
    std::fs::write(&server, format!("alice:{ALICE}\n")).unwrap();
    let wrong = dir.path().join("wrong.psk");
    std::fs::write(&wrong, format!("alice:{WRONG}\nmallory:{ALICE}\n")).unwrap();
    let back = dir.path().join("back.raw");
    let psk = |user: &str, keys: &Path| {
        format!(
            "nbds+unix://{user}@/?socket=$unixsocket&tls-psk-file={}",
            s(keys)
        )
    };
    let logname = format!(
        "nbds+unix:///?socket=$unixsocket&tls-psk-file={}",
        s(&server)
    );
    let bin = diskit_bin();
    let cmd = format!(
        "{d} copy {f} \"{alice}\"; echo in=$?; \
         {d} copy \"{alice}\" {back}; echo out=$?; \
         {d} nbdinfo \"{alice}\"; echo info=$?; \
         LOGNAME=alice {d} nbdinfo --size \"{logname}\"; echo logname=$?; \
         {d} nbdinfo --size \"{wrong_key}\"; echo wrong=$?; \
         {d} nbdinfo --size \"{mallory}\"; echo mallory=$?; \
         {d} nbdinfo --size \"{carol}\"; echo carol=$?",
        d = s(&bin),
        f = s(&f),
        back = s(&back),
        alice = psk("alice", &server),
        wrong_key = psk("alice", &wrong),
        mallory = psk("mallory", &wrong),
        carol = psk("carol", &server),
    );
    let o = ok(nbdkit(&argv(
        "-U - --tls=require",
        &[
            &format!("--tls-psk={}", s(&server)),
            "memory",
            "4M",
            "--run",
            &cmd,
        ],
    )));
    let err = stderr(&o);
    assert_eq!(recorded(&o, "in"), "0", "{err}");
    assert_eq!(recorded(&o, "out"), "0", "{err}");
    assert!(
        same_bytes(&f, &back),
        "the bytes did not survive the round trip"
    );
    assert_eq!(recorded(&o, "info"), "0", "{err}");
    assert_contains(&stdout(&o), "newstyle-fixed with TLS");
    assert_eq!(recorded(&o, "logname"), "0", "{err}");
    assert_ne!(recorded(&o, "wrong"), "0");
    assert_ne!(recorded(&o, "mallory"), "0");
    assert_contains(&err, "username \"mallory\"");
    assert_ne!(recorded(&o, "carol"), "0");
    assert_contains(&err, "username \"carol\" is not in the key file");
}

#[test]
fn pre_shared_keys_against_diskit_serve() {
    let dir = workdir();
    let f = test_file(dir.path());
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, "bob:00112233445566778899aabbccddeeff\n").unwrap();
    let copy = dir.path().join("copy.raw");
    let uri = format!(
        "nbds+unix://bob@/?socket=$unixsocket&tls-psk-file={}",
        s(&keys)
    );
    let cmd = format!(
        "{d} copy \"{uri}\" {copy}",
        d = s(&diskit_bin()),
        copy = s(&copy)
    );
    let o = ok(serve_psk(
        &["-v", "-r", "--tls=require"],
        &keys,
        &["file", s(&f)],
        &cmd,
    ));
    assert!(same_bytes(&f, &copy), "diskit copy read other bytes");
    assert_stderr_has(&o, "PSK identity \"bob\"");
}

/// The nbd plugin's `tls-psk=` (with `tls-username=`): a `diskit serve`
/// in front of a PSK server, as nbdkit's nbd plugin does it.
#[test]
fn the_nbd_plugin_connects_with_pre_shared_keys() {
    let dir = workdir();
    let f = test_file(dir.path());
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, "bob:00112233445566778899aabbccddeeff\n").unwrap();
    let copy = dir.path().join("copy.raw");
    let d = s(&diskit_bin()).to_string();
    // The outer shell fills the PSK server's socket in; the quoted inner
    // command sees the plugin server's own.
    let cmd = format!(
        "{d} serve -U - nbd socket=$unixsocket tls=require tls-psk={k} tls-username=bob \
         --run '{d} copy nbd+unix:///?socket=$unixsocket {c}'",
        k = s(&keys),
        c = s(&copy)
    );
    let o = ok(serve_psk(
        &["-v", "-r", "--tls=require"],
        &keys,
        &["file", s(&f)],
        &cmd,
    ));
    assert!(same_bytes(&f, &copy), "the copy through the plugin differs");
    assert_stderr_has(&o, "PSK identity \"bob\"");
}
