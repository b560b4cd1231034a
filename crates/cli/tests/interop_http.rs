//! The http plugin and http(s) sources against nbdkit's curl plugin, over
//! a local range server (tests/http/range_server.py) that the tests start,
//! including ones that misbehave: no range support, failures that pass,
//! a resource that changes under the reader.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::*;

/// A running range server; killed when dropped.
struct RangeServer {
    child: Child,
    url: String,
}

impl RangeServer {
    fn start(file: &Path, mode: &str, tls: Option<(&Path, &Path)>) -> RangeServer {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/http/range_server.py");
        let mut c = Command::new(PYTHON);
        c.arg(&script).arg(file).args(["--mode", mode]);
        if let Some((cert, key)) = tls {
            c.arg("--tls").arg(cert).arg(key);
        }
        let mut child = c
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the range server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port: u16 = line.trim().parse().expect("the server's port");
        let scheme = if tls.is_some() { "https" } else { "http" };
        RangeServer {
            child,
            url: format!("{scheme}://127.0.0.1:{port}/disk.img"),
        }
    }
}

impl Drop for RangeServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A 3 MiB file of varied bytes (not a whole number of sectors).
fn source(dir: &Path) -> PathBuf {
    let p = dir.join("src.raw");
    let data: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&p, data).unwrap();
    p
}

/// Runs `SERVER -U - ARGS --run CMD` for nbdkit or diskit.
fn run_server(nbdkit: bool, args: &[&str], cmd: &str) -> std::process::Output {
    let mut c = if nbdkit {
        timed("nbdkit", 120)
    } else {
        let mut c = timed(diskit_bin(), 120);
        c.arg("serve");
        c
    };
    c.args(["-U", "-"]).args(args).args(["--run", cmd]);
    c.output().unwrap()
}

#[test]
fn http_plugin_serves_what_nbdkit_curl_serves() {
    let dir = workdir();
    let src = source(dir.path());
    let server = RangeServer::start(&src, "normal", None);
    for (nbdkit, plugin) in [(true, "curl"), (false, "http"), (false, "curl")] {
        let out = dir.path().join(format!("out-{plugin}-{nbdkit}.raw"));
        let cmd = format!(
            "nbdinfo --size \"$uri\" && nbdcopy \"$uri\" {} && nbdsh -u \"$uri\" -c 'print(h.is_read_only())'",
            s(&out)
        );
        let o = run_server(nbdkit, &[plugin, &server.url, "header=X-Test: 1"], &cmd);
        assert!(o.status.success(), "{plugin} {nbdkit}: {}", stderr(&o));
        let text = stdout(&o);
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        assert_eq!(lines[0], "3000000", "{plugin}");
        assert!(same_bytes(&src, &out), "{plugin} nbdkit={nbdkit}");
        if !nbdkit {
            // nbdkit 1.32's curl plugin offers writes (HTTP PUT); diskit's
            // source is read-only.
            assert_eq!(lines[1], "True");
        }
    }
}

#[test]
fn a_url_is_an_image_name_for_every_command() {
    let dir = workdir();
    let src = source(dir.path());
    let server = RangeServer::start(&src, "normal", None);
    let out = dir.path().join("copy.raw");
    ok(diskit(&["copy", &server.url, s(&out)]));
    assert!(same_bytes(&src, &out));
    let qcow = dir.path().join("c.qcow2");
    ok(diskit(&["convert", "-O", "qcow2", &server.url, s(&qcow)]));
    ok(qemu_img(&argv(
        "compare -f qcow2 -F raw",
        &[s(&qcow), s(&src)],
    )));
    ok(diskit(&["compare", &server.url, s(&src)]));
    let o = ok(diskit(&["info", "--output=json", &server.url]));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["virtual-size"], 3_000_000);
    assert_eq!(v["format"], "raw");
    // A URL names a source only.
    let o = diskit(&["copy", s(&src), &server.url]);
    assert_ne!(code(&o), 0);
    assert_stderr_has(&o, "only be a source");
}

#[test]
fn servers_without_ranges_are_refused_with_a_clear_message() {
    let dir = workdir();
    let src = source(dir.path());
    let server = RangeServer::start(&src, "norange", None);
    let o = diskit(&["copy", &server.url, "null:"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_stderr_has(&o, "does not support range requests");
    for nbdkit in [true, false] {
        let o = run_server(nbdkit, &["curl", &server.url], "nbdinfo --size \"$uri\"");
        assert!(
            !o.status.success(),
            "nbdkit={nbdkit} served a server without ranges"
        );
    }
}

#[test]
fn failures_that_pass_are_retried_and_changes_are_errors_not_data() {
    let dir = workdir();
    let src = source(dir.path());
    // 503s and bodies cut short: retried, the copy is exact.
    let server = RangeServer::start(&src, "flaky", None);
    let out = dir.path().join("flaky.raw");
    let o = diskit(&["copy", "--request-size=64k", &server.url, s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&src, &out));
    // A resource that shrinks or changes while it is read: an error that
    // says so, through copy and through the plugin.
    for (mode, says) in [("shrink", "changed size"), ("etag", "changed")] {
        let server = RangeServer::start(&src, mode, None);
        let o = diskit(&["copy", "--request-size=64k", &server.url, "null:"]);
        assert_eq!(code(&o), 1, "{mode}");
        assert!(stderr(&o).contains(says), "{mode}: {}", stderr(&o));
        let server = RangeServer::start(&src, mode, None);
        let o = run_server(false, &["http", &server.url], "nbdcopy \"$uri\" null:");
        assert!(!o.status.success(), "{mode}");
    }
}

#[test]
fn https_is_verified_against_the_given_certificates() {
    let dir = workdir();
    let src = source(dir.path());
    // A CA, and a certificate for 127.0.0.1 that it signs.
    let d = dir.path();
    let (ca, cert, key) = (d.join("ca.pem"), d.join("cert.pem"), d.join("key.pem"));
    std::fs::write(d.join("ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    for args in [
        "req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=test-ca -keyout ca.key -out ca.pem",
        "req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout key.pem -out req.csr",
        "x509 -req -in req.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out cert.pem -extfile ext",
    ] {
        ok(Command::new("openssl")
            .args(args.split(' '))
            .current_dir(d)
            .output()
            .unwrap());
    }
    let server = RangeServer::start(&src, "normal", Some((&cert, &key)));
    let cainfo = format!("cainfo={}", s(&ca));
    let size = "nbdinfo --size \"$uri\"";
    let o = run_server(false, &["http", &server.url, &cainfo], size);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "3000000");
    // Not trusted by the system: refused, unless verification is off.
    let o = run_server(false, &["http", &server.url], size);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).to_lowercase().contains("certificate"),
        "{}",
        stderr(&o)
    );
    let o = run_server(false, &["http", &server.url, "sslverify=false"], size);
    assert!(o.status.success(), "{}", stderr(&o));
    // nbdkit agrees.
    let o = run_server(true, &["curl", &server.url, &cainfo], size);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run_server(true, &["curl", &server.url], size);
    assert!(!o.status.success());
}
