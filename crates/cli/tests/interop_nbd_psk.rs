//! `diskit serve --tls-psk` against the GnuTLS clients that matter:
//! nbdinfo and nbdcopy (libnbd) and qemu-img, over TLS 1.3 and, with the
//! clients' GnuTLS told to leave 1.3 out, TLS 1.2. The server's `-v` log
//! names the protocol version, cipher suite and identity of each
//! connection. Every server runs under `timeout` on a private Unix socket
//! and stops with its `--run` command.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const ALICE: &str = "6b3a55e0261b4a8e1f6c0d1d6ee4c8a2f3c3a6b0b0a1d2c3e4f5061728394a5b";
const BOB: &str = "00112233445566778899aabbccddeeff";
const MALLORY: &str = "ffeeddccbbaa99887766554433221100";

/// A 4 MiB sparse file with data at 0 and at 1 MiB.
fn test_file(dir: &Path) -> PathBuf {
    served_file(dir, 300_000)
}

/// DIR/NAME/keys.psk holding `text` (qemu wants the file under that name
/// in a directory of its own). Returns the directory.
fn keys(dir: &Path, name: &str, text: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("keys.psk"), text).unwrap();
    d
}

/// The server's key file: alice and bob.
fn server_keys(dir: &Path) -> PathBuf {
    keys(dir, "server", &format!("alice:{ALICE}\nbob:{BOB}\n")).join("keys.psk")
}

/// libnbd's URI for the served socket as `user`, with the key file in
/// `keys` (the user name goes in the URI's user part).
fn psk_uri(user: &str, keys: &Path) -> String {
    format!(
        "nbds+unix://{user}@/?socket=$unixsocket&tls-psk-file={}",
        s(&keys.join("keys.psk"))
    )
}

/// qemu's client options for the served socket as `user`, with
/// `keys`/keys.psk.
fn qemu_psk(user: &str, keys: &Path) -> String {
    format!(
        "--object tls-creds-psk,id=tls0,endpoint=client,dir={},username={user} --image-opts \
         driver=nbd,path=$unixsocket,tls-creds=tls0",
        s(keys)
    )
}

#[test]
fn nbdinfo_nbdcopy_and_qemu_img_read_the_file_over_tls13() {
    let dir = workdir();
    let f = test_file(dir.path());
    let server = server_keys(dir.path());
    let client = server.parent().unwrap();
    let (copy, conv) = (dir.path().join("copy.raw"), dir.path().join("conv.raw"));
    let cmd = format!(
        "echo \"uri=$uri tls=$tls\" && \
         nbdinfo --json \"{uri}\" && \
         nbdcopy \"{uri}\" {copy} && \
         qemu-img convert {qemu} -O raw {conv} && \
         qemu-img compare {qemu} driver=file,filename={f} >&2",
        uri = psk_uri("alice", client),
        qemu = qemu_psk("bob", client),
        copy = s(&copy),
        conv = s(&conv),
        f = s(&f),
    );
    let o = ok(serve_psk(
        &["-v", "-r", "--tls=require"],
        &server,
        &["file", s(&f)],
        &cmd,
    ));
    let text = stdout(&o);
    assert_contains(&text, "uri=nbds+unix:///?socket=");
    assert_contains(&text, " tls=2\n");
    let json = &text[text.find('{').expect("nbdinfo JSON")..];
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("bad JSON ({e}): {json}"));
    assert_eq!(v["TLS"], true, "{v}");
    assert_eq!(v["exports"][0]["export-size"], 4 << 20);
    assert!(same_bytes(&f, &copy), "nbdcopy read other bytes");
    assert!(same_bytes(&f, &conv), "qemu-img read other bytes");
    assert_stderr_has(&o, "Images are identical");
    let conns = connections(&o);
    // nbdinfo, nbdcopy (one or more connections), convert, compare.
    assert!(conns.len() >= 4, "{conns:?}");
    for c in &conns {
        assert_contains(c, "TLSv1.3 TLS_");
    }
    assert!(conns.iter().any(|c| c.contains("PSK identity \"alice\"")));
    assert!(conns.iter().any(|c| c.contains("PSK identity \"bob\"")));
}

#[test]
fn gnutls_clients_limited_to_tls12_get_ecdhe_psk() {
    let dir = workdir();
    let f = test_file(dir.path());
    let server = server_keys(dir.path());
    let client = server.parent().unwrap();
    // GnuTLS's system-wide settings, for the clients only.
    let no13 = dir.path().join("gnutls.conf");
    std::fs::write(&no13, "[overrides]\ndisabled-version = tls1.3\n").unwrap();
    let conv = dir.path().join("conv.raw");
    let cmd = format!(
        "export GNUTLS_SYSTEM_PRIORITY_FILE={no13} && \
         nbdinfo --size \"{uri}\" && \
         qemu-img convert {qemu} -O raw {conv}",
        no13 = s(&no13),
        uri = psk_uri("alice", client),
        qemu = qemu_psk("alice", client),
        conv = s(&conv),
    );
    let o = ok(serve_psk(
        &["-v", "--tls=require"],
        &server,
        &["file", s(&f)],
        &cmd,
    ));
    assert_eq!(stdout(&o).trim(), "4194304");
    assert!(same_bytes(&f, &conv), "qemu-img read other bytes");
    let conns = connections(&o);
    assert_eq!(conns.len(), 2, "{conns:?}");
    for c in &conns {
        assert!(
            c.contains("TLSv1.2 ECDHE-PSK-") && c.contains("PSK identity \"alice\""),
            "{c}"
        );
    }
}

#[test]
fn unknown_users_wrong_keys_and_plain_clients_are_refused() {
    let dir = workdir();
    let f = test_file(dir.path());
    let server = server_keys(dir.path());
    let good = server.parent().unwrap();
    // A user the server does not know, and alice with another key.
    let stranger = keys(dir.path(), "stranger", &format!("mallory:{MALLORY}\n"));
    let wrong = keys(dir.path(), "wrong", &format!("alice:{MALLORY}\n"));
    let out = dir.path().join("out.raw");
    let cmd = format!(
        "nbdinfo --size \"{unknown}\"; echo unknown=$?; \
         nbdinfo --size \"{wrong}\"; echo wrong=$?; \
         qemu-img convert {qemu_unknown} -O raw {out}; echo qemu-unknown=$?; \
         qemu-img convert {qemu_wrong} -O raw {out}; echo qemu-wrong=$?; \
         nbdinfo --size \"nbd+unix:///?socket=$unixsocket\"; echo plain=$?; \
         qemu-img info -f raw \"nbd+unix:///?socket=$unixsocket\"; echo qemu-plain=$?; \
         nbdinfo --size \"{good}\"; echo good=$?",
        unknown = psk_uri("mallory", &stranger),
        wrong = psk_uri("alice", &wrong),
        qemu_unknown = qemu_psk("mallory", &stranger),
        qemu_wrong = qemu_psk("alice", &wrong),
        good = psk_uri("bob", good),
        out = s(&out),
    );
    let o = ok(serve_psk(
        &["-v", "--tls=require"],
        &server,
        &["file", s(&f)],
        &cmd,
    ));
    for tool in [
        "unknown",
        "wrong",
        "qemu-unknown",
        "qemu-wrong",
        "plain",
        "qemu-plain",
    ] {
        assert_ne!(recorded(&o, tool), "0", "{tool} got in: {}", stdout(&o));
    }
    // The server lived on.
    assert_eq!(recorded(&o, "good"), "0");
    assert_contains(&stdout(&o), "4194304\ngood=0");
    assert!(
        !out.exists() || std::fs::metadata(&out).unwrap().len() == 0,
        "qemu-img got data"
    );
    let log = stderr(&o);
    assert_eq!(
        log.matches("unknown PSK identity \"mallory\"").count(),
        2,
        "{log}"
    );
    assert_eq!(
        log.matches("PSK identity \"alice\" is known but the handshake failed")
            .count(),
        2,
        "{log}"
    );
}

#[test]
fn tls_psk_alone_offers_tls_as_nbdkit_does() {
    let dir = workdir();
    let f = test_file(dir.path());
    let server = server_keys(dir.path());
    let client = server.parent().unwrap();
    let cmd = format!(
        "echo \"uri=$uri tls=$tls\"; \
         nbdinfo --size \"nbd+unix:///?socket=$unixsocket\"; echo plain=$?; \
         nbdinfo --is tls \"{uri}\"; echo psk=$?",
        uri = psk_uri("alice", client),
    );
    let run = |argv: &[&str]| {
        timed(argv[0], 120)
            .args(&argv[1..])
            .args(["-f", "-U", "-", "--tls-psk", s(&server), "file", s(&f)])
            .args(["--run", &cmd])
            .output()
            .expect("run the server")
    };
    let bin = diskit_bin();
    let o = ok(run(&[s(&bin), "serve"]));
    let text = stdout(&o);
    assert_contains(&text, "uri=nbd+unix:///?socket=");
    assert_contains(&text, " tls=1\n");
    assert_eq!(recorded(&o, "plain"), "0", "{text}");
    assert_eq!(recorded(&o, "psk"), "0", "{text}");
    // nbdkit, the oracle, agrees on all but the URI's spelling.
    let n = ok(run(&["nbdkit"]));
    for key in ["plain", "psk"] {
        assert_eq!(recorded(&n, key), recorded(&o, key), "{key}");
    }
    assert_contains(&stdout(&n), " tls=1\n");
}

#[test]
fn psk_overrides_certificates_with_a_warning() {
    let dir = workdir();
    let f = test_file(dir.path());
    let server = server_keys(dir.path());
    let client = server.parent().unwrap();
    let cmd = format!("nbdinfo --size \"{}\"", psk_uri("alice", client));
    let o = ok(serve_psk(
        &[
            "--tls=require",
            "--tls-certificates",
            "/nonexistent",
            "--tls-verify-peer",
        ],
        &server,
        &["file", s(&f)],
        &cmd,
    ));
    assert_eq!(stdout(&o).trim(), "4194304");
    assert_stderr_has(&o, "--tls-psk overrides");
}

#[test]
fn bad_key_files_stop_the_server_at_startup() {
    let dir = workdir();
    let bad = keys(dir.path(), "bad", &format!("alice:{ALICE}\nbob {BOB}\n")).join("keys.psk");
    let missing = dir.path().join("missing.psk");
    for (file, what) in [
        (bad, "keys.psk: line 2: no ':'".to_string()),
        (missing.clone(), format!("{}", missing.display())),
    ] {
        let o = serve_psk(&["--tls=on"], &file, &["memory", "1M"], "echo started");
        assert_ne!(code(&o), 0);
        assert!(!stdout(&o).contains("started"));
        assert_stderr_has(&o, &what);
        assert!(!stderr(&o).contains(BOB), "the key was shown");
    }
}

/// The whole libnbd check suite (structured reads, block status, 256
/// writes in flight, disconnect with writes in flight, multi-conn...) over
/// TLS-PSK: reads and writes share the OpenSSL session from many threads.
#[test]
fn libnbd_checks_over_psk() {
    let dir = workdir();
    // The layout checks.py expects.
    let f = dir.path().join("checks.raw");
    sparse_file(&f, 4 << 20, &[(0, 65536, 0x11), (1 << 20, 65536, 0x22)]);
    let server = server_keys(dir.path());
    let script = nbd_script("checks.py");
    let cmd = format!(
        "{PYTHON} {} rw \"{}\"",
        s(&script),
        psk_uri("alice", server.parent().unwrap())
    );
    let o = ok(serve_psk(
        &["--tls=require"],
        &server,
        &["file", s(&f)],
        &cmd,
    ));
    assert_contains(&stdout(&o), "ok");
}

/// Without OpenSSL (libssl.so.3 hidden in a mount namespace of its own,
/// /dev/null bound over it) the commands that do not use pre-shared keys
/// still run: diskit does not link it. PSK, on the server and the client,
/// is a one-line error naming the library.
#[test]
fn without_openssl_only_psk_fails_and_says_why() {
    // SAFETY: geteuid has no preconditions.
    let flags = if unsafe { libc::geteuid() } == 0 {
        "-m"
    } else {
        "-rm"
    };
    let works = std::process::Command::new("unshare")
        .args([flags, "true"])
        .status()
        .is_ok_and(|st| st.success());
    if !works {
        eprintln!("skipped: unshare cannot make a mount namespace here");
        return;
    }
    let dir = workdir();
    let keys = server_keys(dir.path());
    let d = diskit_bin();
    let script = format!(
        r#"for f in $(/sbin/ldconfig -p | awk '/libssl\.so\.3 /{{print $NF}}'); do
             mount --bind /dev/null "$(readlink -f "$f")" || exit 99
           done
           {d} --version || exit 98
           {d} serve -U - memory 1M --run 'echo plain served' || exit 97
           {d} serve -U - --tls-psk {k} memory 1M --run 'echo psk served' && exit 96
           {d} nbdinfo --size 'nbds+unix://alice@/?socket=/nonexistent&tls-psk-file={k}' && exit 95
           exit 0"#,
        d = s(&d),
        k = s(&keys)
    );
    let o = timed("unshare", 60)
        .args([flags, "sh", "-c", &script])
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert_contains(&stdout(&o), "plain served");
    assert!(!stdout(&o).contains("psk served"), "{}", stdout(&o));
    let err = stderr(&o);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].starts_with("diskit: --tls-psk: TLS-PSK needs OpenSSL 3 (libssl.so.3): "),
        "{err}"
    );
    assert!(
        lines[1].starts_with("diskit: nbdinfo: TLS-PSK needs OpenSSL 3 (libssl.so.3): "),
        "{err}"
    );
}

/// qemu-img's command line with `--object tls-creds-psk` (a user name and
/// a directory holding keys.psk) runs the same through diskit: the same
/// bytes, the same refusal of a user the server does not know.
#[test]
fn tls_creds_psk_objects_open_nbd_exports_as_qemu_img_opens_them() {
    let dir = workdir();
    let f = test_file(dir.path());
    let server = server_keys(dir.path());
    let client = server.parent().unwrap();
    let out = dir.path().join("out.raw");
    let script = r#"
N="driver=nbd,path=$unixsocket,tls-creds=tls0"
$T convert --object "tls-creds-psk,id=tls0,endpoint=client,dir=$K,username=bob" --image-opts "$N" -O raw "$OUT"
echo "rc=$?"; cmp "$OUT" "$F" && echo same; rm -f "$OUT"
$T convert --object "tls-creds-psk,id=tls0,endpoint=client,dir=$K,username=eve" --image-opts "$N" -O raw "$OUT" 2>/dev/null
echo "rc=$?"; test -e "$OUT" || echo "no target"
"#;
    let ours = alike_under_serve(
        dir.path(),
        &argv(
            "-U - -r --tls=require --tls-psk",
            &[s(&server), "file", s(&f)],
        ),
        script,
        &[("K", s(client)), ("F", s(&f)), ("OUT", s(&out))],
    );
    assert_eq!(ours, "rc=0\nsame\nrc=1\nno target\n");
}
