//! `diskit serve` against the real NBD peers: nbdinfo, nbdcopy, qemu-img,
//! qemu-io, fio and libnbd's Python bindings. Every server runs under
//! `timeout`, on a private Unix socket (or 127.0.0.1), and stops with its
//! `--run` command, or (daemons and foreground servers) is killed by pid.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A 4 MiB sparse file: 64 KiB of 0x11 at 0, 64 KiB of 0x22 at 1 MiB.
fn test_file(dir: &Path) -> PathBuf {
    served_file(dir, 65536)
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}\n{}", stdout(o), stderr(o)))
}

#[test]
fn nbdinfo_reports_the_export_and_its_flags() {
    let o = ok(serve_run(
        &["-e", "disk", "--description", "a test disk"],
        &["memory", "size=8M"],
        "nbdinfo --json \"$uri\"",
    ));
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
        // As nbdkit's memory plugin: no-ops, but taken.
        ("can_flush", true),
        ("can_cache", true),
    ] {
        assert_eq!(e[flag], want, "{flag}");
    }
    assert_eq!(e["block_size_maximum"], 64 << 20);
    let contexts = e["contexts"].as_array().unwrap();
    assert!(contexts.iter().any(|c| c == "base:allocation"));
    assert!(contexts.iter().any(|c| c == "qemu:allocation-depth"));

    let dir = workdir();
    let f = test_file(dir.path());
    let o = ok(serve_run(
        &["-r"],
        &["file", s(&f)],
        "nbdinfo --json \"$uri\"",
    ));
    let e = &json(&o)["exports"][0];
    assert_eq!(e["is_read_only"], true);
    for flag in ["can_zero", "can_trim", "can_fua", "can_fast_zero"] {
        assert_eq!(e[flag], false, "{flag} on a read-only export");
    }
    let o = ok(serve_run(&[], &["file", s(&f)], "nbdinfo --json \"$uri\""));
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
    ok(serve_run(&["-r"], &["file", s(&src)], &cmd));
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
    ok(qemu_img(&argv(
        "create -q -f qcow2 -b",
        &[s(&base), "-F", "qcow2", s(&top)],
    )));
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x22 2M 1M", s(&top)],
    ));
    let out = dir.path().join("out.raw");
    let cmd = format!(
        "nbdinfo --map=qemu:allocation-depth \"$uri\" && qemu-img convert -O raw \"$uri\" {}",
        s(&out)
    );
    let o = ok(serve_run(&["-r"], &["image", s(&top)], &cmd));
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
    ok(qemu_img(&argv(
        "compare -f qcow2 -F raw",
        &[s(&top), s(&out)],
    )));

    // Writable: qemu-io writes through extended headers land in the qcow2.
    let cmd = "qemu-io -f raw -c 'write -P 0x33 3M 64k' -c 'write -z 0 64k' -c flush \"$uri\"";
    ok(serve_run(&[], &["image", s(&top), "format=qcow2"], cmd));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &[
                "read -P 0x33 3M 64k",
                "-c",
                "read -P 0 0 64k",
                "-c",
                "read -P 0x11 64k 64k",
                s(&top),
            ],
        ),
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
    ok(serve_run(&[], &["memory", "16M"], &cmd));
    assert!(same_bytes(&src, &out));
}

fn python_checks(mode: &str, serve_args: &[&str]) {
    let cmd = format!("{PYTHON} {} {mode} \"$uri\"", s(&nbd_script("checks.py")));
    let mut args = serve_args.to_vec();
    args.extend(["--run", &cmd]);
    let o = ok(serve(&args));
    assert_contains(&stdout(&o), "ok");
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
    let o = serve_run(
        &["-e", "x"],
        &["null", "1M"],
        "echo \"$uri|$nbd|$unixsocket|$port|$exportname\"; test -S \"$unixsocket\"; exit 3",
    );
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
    let o = ok(serve(&argv(
        "-p 0 -i 127.0.0.1 pattern 1M --run",
        &["echo \"$port $unixsocket\"; nbdinfo --size \"$uri\""],
    )));
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

/// Field `i` (0: the state) after the command name in /proc/PID/stat,
/// or None once the process is gone or a zombie.
fn proc_stat(pid: i32, i: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    (fields[0] != "Z").then(|| fields[i].to_string())
}

/// A daemonised server, killed by its pid (from its pid file) when dropped.
struct Daemon(i32);

impl Daemon {
    /// Sends SIGTERM and waits for the process to end.
    fn stop(&mut self) {
        // SAFETY: kill(2) on the pid the daemon wrote into its pid file.
        unsafe { libc::kill(self.0, libc::SIGTERM) };
        let start = Instant::now();
        while proc_stat(self.0, 0).is_some() {
            assert!(start.elapsed() < Duration::from_secs(20), "daemon lives on");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.0 = 0;
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.0 > 0 {
            // SAFETY: as in stop(); the test failed before stopping it.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

#[test]
fn daemon_mode_forks_once_listening_and_stops_by_pid_file() {
    let dir = workdir();
    let sock = dir.path().join("nbd.sock");
    let pidfile = dir.path().join("pid");
    let start = Instant::now();
    let o = serve(&argv(
        "--print-uri -U",
        &[s(&sock), "-P", s(&pidfile), "memory", "1M"],
    ));
    // The command returns once the daemon serves: the pid file and the
    // socket are there, and the URI was printed by the parent.
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .expect("pid file written before the command returned")
        .trim()
        .parse()
        .unwrap();
    let mut daemon = Daemon(pid);
    let o = ok(o);
    assert!(start.elapsed() < Duration::from_secs(20));
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    assert_eq!(stdout(&o).trim(), uri);
    assert!(sock.exists());
    // A new session (detached from the terminal), stdio on /dev/null.
    assert_eq!(proc_stat(pid, 3).as_deref(), Some(pid.to_string().as_str()));
    for fd in 0..3 {
        let target = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap();
        assert_eq!(target, Path::new("/dev/null"), "fd {fd}");
    }
    let o = ok(Command::new("timeout")
        .args(["30", "nbdinfo", "--size", &uri])
        .output()
        .unwrap());
    assert_eq!(stdout(&o).trim(), "1048576");

    // A daemon whose plugin starts threads (the nbd plugin's connections)
    // opens it after the fork, still in the caller's directory (relative
    // names work), and serves through them.
    let proxy_sock = dir.path().join("proxy.sock");
    let proxy_pid = dir.path().join("proxy.pid");
    let o = ok(Command::new(diskit_bin())
        .current_dir(dir.path())
        .args([
            "serve",
            "-U",
            "proxy.sock",
            "-P",
            "proxy.pid",
            "nbd",
            "socket=nbd.sock",
        ])
        .output()
        .unwrap());
    let mut proxy = Daemon(
        std::fs::read_to_string(&proxy_pid)
            .expect("proxy pid file")
            .trim()
            .parse()
            .unwrap(),
    );
    drop(o);
    let proxy_uri = format!("nbd+unix:///?socket={}", s(&proxy_sock));
    let o = ok(Command::new("timeout")
        .args(["30", "nbdinfo", "--size", &proxy_uri])
        .output()
        .unwrap());
    assert_eq!(stdout(&o).trim(), "1048576");
    proxy.stop();
    assert!(!proxy_sock.exists() && !proxy_pid.exists());
    // Its failure to connect below fails the command, with the reason on
    // the caller's stderr, and leaves no socket.
    let o = serve(&["-U", s(&proxy_sock), "nbd", "socket=/nonexistent/nbd.sock"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_stderr_has(&o, "/nonexistent/nbd.sock");
    assert!(!proxy_sock.exists(), "socket left behind");

    daemon.stop();
    assert!(
        !sock.exists() && !pidfile.exists(),
        "socket or pid file left behind"
    );

    // A start-up failure in the daemon fails the command, and nothing
    // keeps serving.
    let o = serve(&["-U", s(&sock), "-P", "/nonexistent/dir/pid", "null", "1M"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_stderr_has(&o, "pid file");
    assert!(!sock.exists(), "socket left behind");
}

#[test]
fn connection_limit_and_handshake_timeout() {
    let script = r#"
import nbd, socket, sys, time
uri, path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
def connect():
    h = nbd.NBD()
    h.connect_uri(uri)
    return h
if mode == "limit":
    h1 = connect()
    try:
        connect()
        sys.exit("a second connection was served")
    except nbd.Error:
        pass
    h1.shutdown()
    del h1
    for i in range(200):
        try:
            connect().shutdown()
            break
        except nbd.Error:
            time.sleep(0.05)
    else:
        sys.exit("the freed slot was never reused")
else:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.settimeout(30)
    t = time.time()
    got = b""
    while True:
        d = s.recv(100)
        if not d:
            break
        got += d
    took = time.time() - t
    assert len(got) == 18, got
    assert 0.9 < took < 20, took
    h = connect()
    assert h.get_size() == 1048576
    h.shutdown()
print("ok")
"#;
    let dir = workdir();
    let py = dir.path().join("limits.py");
    std::fs::write(&py, script).unwrap();
    for (mode, opts) in [
        ("limit", ["--max-connections", "1"]),
        ("timeout", ["--timeout", "1"]),
    ] {
        let cmd = format!("{PYTHON} {} \"$uri\" \"$unixsocket\" {mode}", s(&py));
        let mut args = vec!["-U", "-"];
        args.extend(opts);
        args.extend(["memory", "1M", "--run", &cmd]);
        let o = ok(serve(&args));
        assert_eq!(stdout(&o).trim(), "ok", "{mode}");
    }
}

#[test]
fn verbose_logs_one_line_per_connection_and_export_counters() {
    let script = "import nbd, sys\n\
                  h = nbd.NBD()\n\
                  h.connect_uri(sys.argv[1])\n\
                  h.pwrite(b'x' * 4096, 0)\n\
                  h.pread(4096, 0)\n\
                  h.pread(512, 8192)\n\
                  h.shutdown()\n";
    let cmd = format!("{PYTHON} -c \"{script}\" \"$uri\" && nbdinfo --size \"$uri\"");
    let o = ok(serve_run(&["-v", "-e", "d"], &["memory", "1M"], &cmd));
    let err = stderr(&o);
    let conns: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("diskit: connection "))
        .collect();
    assert_eq!(conns.len(), 2, "{err}");
    assert!(
        conns.iter().any(|l| l.contains(
            "export 'd', structured replies: 3 requests (read 2, write 1), 0 errors, \
             4608 bytes read, 4096 bytes written; client disconnected after"
        )),
        "{err}"
    );
    let export: Vec<&str> = err
        .lines()
        // The export is the plugin's default one, "" (-e only names it
        // for --run's URI, as nbdkit's -e); connections log the name asked.
        .filter(|l| l.starts_with("diskit: export '': "))
        .collect();
    assert_eq!(export.len(), 1, "{err}");
    assert!(
        export[0].starts_with(
            "diskit: export '': 2 connections, 3 requests (read 2, write 1), 0 errors, \
             4608 bytes read, 4096 bytes written"
        ),
        "{err}"
    );
}

/// Random 4 KiB writes at depth 32, read back and checked with crc32c.
fn fio_verify(serve_args: &[&str]) {
    let dir = workdir();
    let out = dir.path().join("fio.json");
    let cmd = format!(
        "fio --name=verify --ioengine=nbd --uri=\"$uri\" --rw=randwrite --bs=4k \
         --iodepth=32 --size=16M --verify=crc32c --do_verify=1 --verify_fatal=1 \
         --verify_state_save=0 \
         --output-format=json --output={}",
        s(&out)
    );
    let mut args = serve_args.to_vec();
    args.extend(["--run", &cmd]);
    ok(serve(&args));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["write"]["io_bytes"], 16 << 20);
    assert_eq!(job["read"]["io_bytes"], 16 << 20, "every block verified");
}

#[test]
fn fio_nbd_engine_with_verify_on_memory_and_qcow2() {
    fio_verify(&["-U", "-", "memory", "16M"]);
    let dir = workdir();
    let img = dir.path().join("f.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "16M"]));
    fio_verify(&["-U", "-", "image", s(&img)]);
    ok(qemu_img(&["check", s(&img)]));
}

#[test]
fn qemu_io_aio_reads_and_writes() {
    let dir = workdir();
    let img = dir.path().join("a.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "8M"]));
    let mut cmd = String::from("qemu-io -f raw");
    for i in 0..8 {
        cmd += &format!(" -c 'aio_write -P {} {}k 64k'", 0x10 + i, i * 64);
    }
    cmd += " -c aio_flush -c 'aio_write -z 128k 64k' -c aio_flush";
    for i in 0..8 {
        let p = if i == 2 { 0 } else { 0x10 + i };
        cmd += &format!(" -c 'aio_read -P {p} {}k 64k'", i * 64);
    }
    cmd += " -c aio_flush \"$uri\"";
    let o = ok(serve_run(&[], &["image", s(&img)], &cmd));
    let out = stdout(&o);
    assert!(!out.contains("fail") && !out.contains("error"), "{out}");
    assert_eq!(out.matches("read 65536/65536 bytes").count(), 8, "{out}");
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "read -P 0x17 448k 64k", s(&img)],
    ));
}

/// With `l2-cache-size` far below the image's L2 tables (512-byte clusters:
/// 128 tables for 4 MiB, 2 cached), writes all over the image still read
/// back, and the image is clean once the server has stopped.
#[test]
fn image_with_a_small_l2_cache() {
    let dir = workdir();
    let img = dir.path().join("small-cache.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o cluster_size=512",
        &[s(&img), "4M"],
    )));
    let mut cmd = String::from("qemu-io -f raw");
    for i in 0..16u32 {
        cmd += &format!(" -c 'write -P {} {}k 4k'", 0x20 + i, i * 256 + 3);
    }
    for i in 0..16u32 {
        cmd += &format!(" -c 'read -P {} {}k 4k'", 0x20 + i, i * 256 + 3);
    }
    cmd += " \"$uri\"";
    let o = ok(serve_run(
        &[],
        &["image", s(&img), "l2-cache-size=1K"],
        &cmd,
    ));
    let out = stdout(&o);
    assert_eq!(out.matches("read 4096/4096 bytes").count(), 16, "{out}");
    assert!(!out.contains("Pattern verification failed"), "{out}");
    ok(qemu_img(&["check", s(&img)]));
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "read -P 0x2f 3843k 4k", s(&img)],
    ));
}

#[test]
fn qemu_img_map_of_allocation_depth_matches_qemu_nbd() {
    let dir = workdir();
    let base = dir.path().join("base.qcow2");
    let top = dir.path().join("top.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &["write -P 0x11 0 1M", "-c", "write -z 3M 512k", s(&base)],
        ),
    ));
    ok(qemu_img(&argv(
        "create -q -f qcow2 -b",
        &[s(&base), "-F", "qcow2", s(&top)],
    )));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &["write -P 0x22 2M 1M", "-c", "write -z 512k 64k", s(&top)],
        ),
    ));
    let map = |sock: &Path| {
        let opts = format!(
            "driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:allocation-depth",
            s(sock)
        );
        stdout(&ok(Command::new("timeout")
            .args([
                "60",
                "qemu-img",
                "map",
                "--output=json",
                "--image-opts",
                &opts,
            ])
            .output()
            .unwrap()))
    };
    // qemu-nbd exposes allocation depth with -A and exits after its client.
    let qsock = dir.path().join("q.sock");
    let mut qemu_nbd = Command::new("timeout")
        .args([
            "-k", "5", "120", "qemu-nbd", "-A", "-r", "-f", "qcow2", "-k",
        ])
        .args([s(&qsock), s(&top)])
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !qsock.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "qemu-nbd did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let want = map(&qsock);
    let _ = qemu_nbd.kill();
    let _ = qemu_nbd.wait();

    let dsock = dir.path().join("d.sock");
    let cmd = format!(
        "qemu-img map --output=json --image-opts \
         driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:allocation-depth",
        s(&dsock)
    );
    let o = ok(serve(&[
        "-U",
        s(&dsock),
        "-r",
        "image",
        s(&top),
        "--run",
        &cmd,
    ]));
    assert_eq!(stdout(&o), want);
    assert!(want.matches("\"start\"").count() >= 5, "{want}");
}

/// `cache=none` (qemu-nbd's --cache=none): an overlay with 2 MiB clusters
/// over a backing file, both opened with O_DIRECT, takes aligned writes
/// into new and allocated clusters and unaligned ones (read-modify-write)
/// through the server's unaligned request buffers; everything reads back,
/// the image is clean and reads the same in qemu-io. A cache mode diskit
/// does not have is refused.
#[test]
fn image_served_with_cache_none() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = workdir();
    let probe = dir.path().join("probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    if std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_err()
    {
        eprintln!("the file system refuses O_DIRECT: skipped");
        return;
    }
    let base = dir.path().join("base.raw");
    let img = dir.path().join("direct.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "raw", s(&base), "8M"]));
    ok(peer(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5a 0 8M", s(&base)],
    ));
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o cluster_size=2M -b",
        &[s(&base), "-F", "raw", s(&img)],
    )));
    let writes = [
        (0x61, "4k", "4k"),
        (0x62, "2052k", "4k"),
        (0x63, "8k", "4k"),
        (0x64, "3000", "1000"),
        (0x65, "6M", "64k"),
    ];
    let mut cmd = String::from("qemu-io -f raw");
    for (p, off, len) in writes {
        cmd += &format!(" -c 'write -P {p} {off} {len}'");
    }
    for (p, off, len) in writes {
        cmd += &format!(" -c 'read -P {p} {off} {len}'");
    }
    cmd += " -c 'read -P 0x5a 5M 64k' \"$uri\"";
    let o = ok(serve_run(&[], &["image", s(&img), "cache=none"], &cmd));
    let out = stdout(&o);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert_eq!(out.matches("read ").count(), writes.len() + 1, "{out}");
    ok(qemu_img(&["check", s(&img)]));
    for (p, off, len) in writes {
        ok(peer(
            "qemu-io",
            &argv(
                "-f qcow2 -c",
                &[&format!("read -P {p} {off} {len}"), s(&img)],
            ),
        ));
    }
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "read -P 0x5a 12k 2036k", s(&img)],
    ));
    let o = serve_run(&[], &["image", s(&img), "cache=directsync"], "true");
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("cache=directsync: expected none, writeback or unsafe"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
