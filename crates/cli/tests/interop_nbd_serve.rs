//! `diskit serve` against the real NBD peers: nbdinfo, nbdcopy, qemu-img,
//! qemu-io and libnbd's Python bindings. Every server runs under
//! `timeout`, on a private Unix socket (or 127.0.0.1), and stops with its
//! `--run` command.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The Python with libnbd's `nbd` module (a pyenv python3 first on PATH may lack it).
const PYTHON: &str = "/usr/bin/python3";

/// PATH with /usr/bin first, so that nbdsh and friends find their Python.
fn path_env() -> String {
    format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default())
}

/// Runs `diskit serve ARGS` under a timeout and returns its output.
fn serve(args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["-k", "5", "120"])
        .arg(diskit_bin())
        .arg("serve")
        .args(args)
        .env("PATH", path_env())
        .output()
        .expect("run timeout diskit serve")
}

fn checks_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/nbd/checks.py")
}

/// A 4 MiB sparse file: 64 KiB of 0x11 at 0, 64 KiB of 0x22 at 1 MiB.
fn test_file(dir: &Path) -> PathBuf {
    let p = dir.join("t.raw");
    sparse_file(&p, 4 << 20, &[(0, 65536, 0x11), (1 << 20, 65536, 0x22)]);
    p
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}\n{}", stdout(o), stderr(o)))
}

#[test]
fn nbdinfo_reports_the_export_and_its_flags() {
    let o = ok(serve(&[
        "-U",
        "-",
        "-e",
        "disk",
        "--description",
        "a test disk",
        "memory",
        "size=8M",
        "--run",
        "nbdinfo --json \"$uri\"",
    ]));
    let v = json(&o);
    assert_eq!(v["protocol"], "newstyle-fixed");
    assert_eq!(v["structured"], true);
    let e = &v["exports"][0];
    assert_eq!(e["export-name"], "disk");
    assert_eq!(e["description"], "a test disk");
    assert_eq!(e["export-size"], 8 << 20);
    for (flag, want) in [
        ("is_read_only", false),
        ("can_zero", true),
        ("can_fast_zero", true),
        ("can_trim", true),
        ("can_fua", true),
        ("can_df", true),
        ("can_multi_conn", true),
        ("can_flush", false),
        ("can_cache", false),
    ] {
        assert_eq!(e[flag], want, "{flag}");
    }
    assert_eq!(e["block_size_maximum"], 32 << 20);
    let contexts = e["contexts"].as_array().unwrap();
    assert!(contexts.iter().any(|c| c == "base:allocation"));
    assert!(contexts.iter().any(|c| c == "qemu:allocation-depth"));

    let dir = workdir();
    let f = test_file(dir.path());
    let o = ok(serve(&[
        "-U",
        "-",
        "-r",
        "file",
        s(&f),
        "--run",
        "nbdinfo --json \"$uri\"",
    ]));
    let e = &json(&o)["exports"][0];
    assert_eq!(e["is_read_only"], true);
    for flag in ["can_zero", "can_trim", "can_fua", "can_fast_zero"] {
        assert_eq!(e[flag], false, "{flag} on a read-only export");
    }
    let o = ok(serve(&[
        "-U",
        "-",
        "file",
        s(&f),
        "--run",
        "nbdinfo --json \"$uri\"",
    ]));
    let e = &json(&o)["exports"][0];
    assert_eq!(e["can_flush"], true);
    assert_eq!(e["can_cache"], true);
}

#[test]
fn qemu_img_sees_the_same_bytes_and_extents_as_the_file() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(
        &src,
        8 << 20,
        &[
            (0, 300_000, 0xff),
            (1 << 20, 65536, 0x5a),
            (5 << 20, 200_000, 0xff),
        ],
    );
    let out = dir.path().join("out.raw");
    let map_nbd = dir.path().join("map.json");
    let cmd = format!(
        "qemu-img map --output=json -f raw \"$uri\" > {} && qemu-img convert -f raw -O raw \"$uri\" {}",
        s(&map_nbd),
        s(&out)
    );
    ok(serve(&["-U", "-", "-r", "file", s(&src), "--run", &cmd]));
    assert!(same_bytes(&src, &out));
    let direct = ok(qemu_img(&["map", "--output=json", "-f", "raw", s(&src)]));
    assert_eq!(std::fs::read_to_string(&map_nbd).unwrap(), stdout(&direct));
}

#[test]
fn qcow2_chain_through_the_image_plugin() {
    let dir = workdir();
    let base = dir.path().join("base.qcow2");
    let top = dir.path().join("top.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]));
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x11 0 1M", s(&base)],
    ));
    ok(qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        s(&base),
        "-F",
        "qcow2",
        s(&top),
    ]));
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x22 2M 1M", s(&top)],
    ));
    let out = dir.path().join("out.raw");
    let cmd = format!(
        "nbdinfo --map=qemu:allocation-depth \"$uri\" && qemu-img convert -O raw \"$uri\" {}",
        s(&out)
    );
    let o = ok(serve(&["-U", "-", "-r", "image", s(&top), "--run", &cmd]));
    let map: Vec<Vec<String>> = stdout(&o)
        .lines()
        .map(|l| l.split_whitespace().take(3).map(String::from).collect())
        .collect();
    let want = [
        ["0", "1048576", "2"],
        ["1048576", "1048576", "0"],
        ["2097152", "1048576", "1"],
        ["3145728", "1048576", "0"],
    ];
    assert_eq!(map, want.map(|r| r.map(String::from).to_vec()).to_vec());
    ok(qemu_img(&[
        "compare",
        "-f",
        "qcow2",
        "-F",
        "raw",
        s(&top),
        s(&out),
    ]));

    // Writable: qemu-io writes through extended headers land in the qcow2.
    let cmd = "qemu-io -f raw -c 'write -P 0x33 3M 64k' -c 'write -z 0 64k' -c flush \"$uri\"";
    ok(serve(&[
        "-U",
        "-",
        "image",
        s(&top),
        "format=qcow2",
        "--run",
        cmd,
    ]));
    ok(peer(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "read -P 0x33 3M 64k",
            "-c",
            "read -P 0 0 64k",
            "-c",
            "read -P 0x11 64k 64k",
            s(&top),
        ],
    ));
    ok(qemu_img(&["check", s(&top)]));
}

#[test]
fn nbdcopy_round_trip_with_many_requests_in_flight() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(
        &src,
        16 << 20,
        &[
            (0, 1 << 20, 0xff),
            (9 << 20, 3 << 20, 0xff),
            (15 << 20, 4096, 7),
        ],
    );
    let out = dir.path().join("out.raw");
    let cmd = format!(
        "nbdcopy -C 4 --requests 64 {src} \"$uri\" && nbdcopy -C 4 --requests 64 \"$uri\" {out}",
        src = s(&src),
        out = s(&out)
    );
    ok(serve(&["-U", "-", "memory", "16M", "--run", &cmd]));
    assert!(same_bytes(&src, &out));
}

fn python_checks(mode: &str, serve_args: &[&str]) {
    let cmd = format!("{PYTHON} {} {mode} \"$uri\"", s(&checks_script()));
    let mut args = serve_args.to_vec();
    args.extend(["--run", &cmd]);
    let o = ok(serve(&args));
    assert!(stdout(&o).contains("ok"), "{}", stdout(&o));
}

#[test]
fn libnbd_checks_on_a_writable_file() {
    let dir = workdir();
    let f = test_file(dir.path());
    python_checks("rw", &["-U", "-", "file", s(&f)]);
}

#[test]
fn libnbd_checks_on_a_read_only_export() {
    let dir = workdir();
    let f = test_file(dir.path());
    python_checks("ro", &["-U", "-", "-r", "file", s(&f)]);
}

#[test]
fn libnbd_checks_on_memory() {
    python_checks("mem", &["-U", "-", "memory", "8M"]);
}

#[test]
fn run_sets_the_environment_and_passes_the_exit_status() {
    let o = serve(&[
        "-U",
        "-",
        "-e",
        "x",
        "null",
        "1M",
        "--run",
        "echo \"$uri|$nbd|$unixsocket|$port|$exportname\"; test -S \"$unixsocket\"; exit 3",
    ]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let line = stdout(&o);
    let parts: Vec<&str> = line.trim().split('|').collect();
    assert!(parts[0].starts_with("nbd+unix:///x?socket=/"), "{line}");
    assert_eq!(parts[0], parts[1]);
    assert!(parts[2].ends_with("/socket"));
    assert_eq!(parts[3], "");
    assert_eq!(parts[4], "x");
    assert!(!Path::new(parts[2]).exists(), "private socket left behind");

    // TCP on loopback, any free port.
    let o = ok(serve(&[
        "-p",
        "0",
        "-i",
        "127.0.0.1",
        "pattern",
        "1M",
        "--run",
        "echo \"$port $unixsocket\"; nbdinfo --size \"$uri\"",
    ]));
    let out = stdout(&o);
    let mut lines = out.lines();
    let port: u16 = lines.next().unwrap().trim().parse().unwrap();
    assert_ne!(port, 0);
    assert_eq!(lines.next().unwrap().trim(), "1048576");
}

#[test]
fn pid_file_print_uri_and_clean_stop() {
    let dir = workdir();
    let sock = dir.path().join("nbd.sock");
    let pidfile = dir.path().join("pid");
    let mut child = Command::new(diskit_bin())
        .args([
            "serve",
            "-f",
            "--print-uri",
            "-U",
            s(&sock),
            "-P",
            s(&pidfile),
            "memory",
            "1M",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !pidfile.exists() {
        assert!(start.elapsed() < Duration::from_secs(20), "no pid file");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(pid as u32, child.id());
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let o = Command::new("timeout")
        .args(["30", "nbdinfo", "--size", &uri])
        .output()
        .unwrap();
    // SAFETY: kill(2) on the pid of a child we started and still own.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    assert_eq!(stdout(&o).trim(), "1048576", "{}", stderr(&o));
    assert!(status.success());
    let mut printed = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut printed).unwrap();
    assert_eq!(printed.trim(), uri);
    assert!(
        !sock.exists() && !pidfile.exists(),
        "socket or pid file left behind"
    );
}

#[test]
fn socket_activation_and_stdin_stdout() {
    // nbdinfo's [ CMD ] form starts the server with LISTEN_FDS.
    let o = Command::new("timeout")
        .args([
            "60",
            "nbdinfo",
            "--json",
            "--",
            "[",
            s(&diskit_bin()),
            "serve",
            "memory",
            "2M",
            "]",
        ])
        .env("PATH", path_env())
        .output()
        .unwrap();
    let v = json(&ok(o));
    assert_eq!(v["exports"][0]["export-size"], 2 << 20);

    // connect_command talks to the server's stdin and stdout.
    let script = format!(
        "import nbd\nh = nbd.NBD()\nh.connect_command([{:?}, 'serve', '-s', 'pattern', '1M'])\n\
         print(h.get_size(), h.pread(8, 4096).hex())",
        s(&diskit_bin())
    );
    let o = ok(Command::new("timeout")
        .args(["60", PYTHON, "-c", &script])
        .output()
        .unwrap());
    assert_eq!(stdout(&o).trim(), "1048576 0000000000001000");
}
