//! diskit as `qemu-nbd` (a link named so to the binary under test, and
//! `diskit qemu-nbd`) beside the real qemu-nbd: the same invocations, the
//! same answers to nbdinfo (`--json`, `--map`), qemu-io and qemu-img, the
//! same lifecycle (one client at a time unless `-e`, exit after the last
//! client unless `-t`, `--fork` and `--pid-file`), `-L` printing alike,
//! and the same refusals of bad command lines.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Which qemu-nbd runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    /// QEMU's.
    Real,
    /// diskit under the name.
    Ours,
}

const BOTH: [Which; 2] = [Which::Real, Which::Ours];

/// A work directory with a `bin/qemu-nbd` link to diskit.
struct Bench {
    dir: tempfile::TempDir,
}

impl Bench {
    fn new() -> Bench {
        let dir = workdir();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(diskit_bin(), bin.join("qemu-nbd")).unwrap();
        Bench { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path().join(name)
    }

    /// The program run as `which`.
    fn program(&self, which: Which) -> PathBuf {
        match which {
            Which::Real => PathBuf::from("qemu-nbd"),
            Which::Ours => self.file("bin/qemu-nbd"),
        }
    }

    /// A command running `which` with `args` in the work directory.
    fn command(&self, which: Which, args: &[&str]) -> Command {
        let mut c = timed(self.program(which), 60);
        c.args(args).current_dir(self.path());
        c
    }

    /// Runs `which` with `args` to its end.
    fn run(&self, which: Which, args: &[&str]) -> Output {
        self.command(which, args).output().unwrap()
    }

    /// Starts `which` serving with `args` on the socket `sock` (given as
    /// `-k SOCK` after the other arguments: getopt takes options after
    /// the file) and waits until it listens.
    fn serve(&self, which: Which, sock: &str, args: &[&str]) -> Server {
        let sock = self.file(sock);
        let mut cmd = self.command(which, args);
        cmd.args(["-k", s(&sock)]);
        Server::start(cmd, sock)
    }

    /// `image` copied to `name` in the work directory.
    fn copy(&self, image: &str, name: &str) -> PathBuf {
        let to = self.file(name);
        std::fs::copy(self.file(image), &to).unwrap();
        to
    }
}

/// A server, stopped (SIGTERM) when dropped if still running.
struct Server {
    child: Child,
    sock: PathBuf,
}

impl Server {
    /// Runs `cmd`, a server that listens on `sock`, and waits until it
    /// does.
    fn start(mut cmd: Command, sock: PathBuf) -> Server {
        let _ = std::fs::remove_file(&sock);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut server = Server { child, sock };
        let t = Instant::now();
        while !server.sock.exists() {
            assert!(server.running(), "{cmd:?} exited");
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{cmd:?}: not listening"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        server
    }

    /// Its export's URI.
    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", s(&self.sock))
    }

    /// Waits for the server to exit on its own.
    fn exits(mut self) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "the server stays");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether it is still running.
    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
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

/// Runs a peer client (nbdinfo, qemu-io, nbdsh) under a timeout.
fn client(tool: &str, args: &[&str]) -> Output {
    timed(tool, 60).args(args).output().unwrap()
}

/// The test images: `base.qcow2` (data, zeros, holes), `top.qcow2` over
/// it with data of its own and an internal snapshot `snap1` taken before
/// a last write, and `disk.raw` (sparse).
fn images(b: &Bench) {
    let d = b.path();
    good_in(
        d,
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "base.qcow2", "4M"],
    );
    qemu_io_in(
        d,
        "qcow2",
        "base.qcow2",
        &["write -P 1 0 1M", "write -z 2M 512k"],
    );
    let backing = ["-b", "base.qcow2", "-F", "qcow2"];
    good_in(
        d,
        "qemu-img",
        &argv(
            "create -q -f qcow2",
            &[&backing[..], &["top.qcow2"]].concat(),
        ),
    );
    qemu_io_in(d, "qcow2", "top.qcow2", &["write -P 2 512k 1M"]);
    good_in(d, "qemu-img", &["snapshot", "-c", "snap1", "top.qcow2"]);
    qemu_io_in(d, "qcow2", "top.qcow2", &["write -P 3 3M 64k"]);
    sparse_file(
        &b.file("disk.raw"),
        4 << 20,
        &[(0, 65536, 0x11), (1 << 20, 300_000, 0xff)],
    );
}

/// nbdinfo's JSON for `uri`, the URI itself left out (its socket differs).
fn info_json(uri: &str) -> serde_json::Value {
    let o = client("nbdinfo", &["--json", uri]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for e in v["exports"].as_array_mut().unwrap() {
        e.as_object_mut().unwrap().remove("uri");
    }
    v
}

/// What a client sees of an export: nbdinfo's JSON and maps (allocation
/// depth too when offered).
fn seen(uri: &str) -> String {
    let json = info_json(uri);
    let mut out = serde_json::to_string_pretty(&json).unwrap();
    out.push_str(&stdout(&client("nbdinfo", &["--map", uri])));
    let contexts = json["exports"][0]["contexts"].to_string();
    if contexts.contains("qemu:allocation-depth") {
        out.push_str(&stdout(&client(
            "nbdinfo",
            &["--map=qemu:allocation-depth", uri],
        )));
    }
    out
}

#[test]
fn exports_look_the_same_to_nbdinfo() {
    let b = Bench::new();
    images(&b);
    let cases: &[(&[&str], &str)] = &[
        (&["-t", "-f", "qcow2", "top.qcow2"], ""),
        (&["-t", "-r", "-A", "-f", "qcow2", "top.qcow2"], ""),
        (
            &[
                "-t",
                "-e",
                "3",
                "-x",
                "disk",
                "-D",
                "a test disk",
                "-f",
                "raw",
                "disk.raw",
            ],
            "disk",
        ),
        // The format probed: raw, whose requests QEMU aligns to sectors.
        (&["disk.raw", "-t", "--shared=0", "-r"], ""),
        // A temporary overlay: the image is the backing, one level down.
        (&["-t", "-s", "-A", "-f", "qcow2", "top.qcow2"], ""),
        (&["-t", "-l", "snap1", "-A", "-f", "qcow2", "top.qcow2"], ""),
        (
            &["-t", "--load-snapshot=snapshot.name=snap1", "top.qcow2"],
            "",
        ),
        (
            &[
                "-t",
                "--cache=none",
                "--aio=native",
                "--discard=unmap",
                "top.qcow2",
            ],
            "",
        ),
    ];
    for (args, export) in cases {
        let mut views = Vec::new();
        for which in BOTH {
            let srv = b.serve(which, "s.sock", args);
            views.push(seen(&srv.uri(export)));
        }
        assert_eq!(views[0], views[1], "qemu-nbd {args:?}: real, then ours");
    }
}

/// qemu-io's commands on the export of `which` serving `image` (a copy of
/// `from`, made for it) with `args`; the image afterwards.
fn written(b: &Bench, which: Which, from: &str, args: &[&str], cmds: &[&str]) -> PathBuf {
    let image = b.copy(from, &format!("{which:?}-{from}"));
    let all = [args, &[s(&image)]].concat();
    let srv = b.serve(which, "w.sock", &all);
    let uri = srv.uri("");
    let o = client("qemu-io", &qemu_io_args(Some("raw"), cmds, &uri));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("fail"), "{}", stdout(&o));
    // Its last client gone, the server closes the image and exits.
    assert!(srv.exits().success());
    image
}

/// What qemu-img map says of `image`: runs of (length, zero, data, depth).
/// Where the host data lies is left out, and whether a zero run is a
/// zero cluster or unallocated ("present"): after a discard QEMU's qcow2
/// marks v3 clusters zero where diskit's leaves them unallocated, both
/// reading as zeros.
fn allocation(image: &str, fmt: &str) -> Vec<(u64, bool, bool, u64)> {
    let o = qemu_img(&["map", "--output=json", "-f", fmt, image]);
    let map: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut runs: Vec<(u64, bool, bool, u64)> = Vec::new();
    for e in map.as_array().unwrap() {
        let (len, zero, data, depth) = (
            e["length"].as_u64().unwrap(),
            e["zero"].as_bool().unwrap(),
            e["data"].as_bool().unwrap(),
            e["depth"].as_u64().unwrap(),
        );
        match runs.last_mut() {
            Some(r) if (r.1, r.2, r.3) == (zero, data, depth) => r.0 += len,
            _ => runs.push((len, zero, data, depth)),
        }
    }
    runs
}

#[test]
fn writes_land_alike_and_read_back() {
    let b = Bench::new();
    images(&b);
    let cmds = [
        "write -P 7 64k 192k",
        "write -z 1M 64k",
        "write -z -u 1152k 64k",
        "discard 0 64k",
        "write -f -P 8 3M 4k",
        "flush",
        "read -P 7 64k 192k",
        "read -P 8 3M 4k",
    ];
    // QEMU's default discard mode ignores trims and keeps zeroed ranges
    // allocated; --discard=unmap and --detect-zeroes change that.
    let modes: &[&[&str]] = &[
        &["-f", "qcow2"],
        &["-f", "qcow2", "--discard=unmap"],
        &["-f", "qcow2", "--discard=unmap", "--detect-zeroes=unmap"],
        &["-f", "raw", "--cache=writethrough"],
    ];
    for args in modes {
        // (base.qcow2: top.qcow2's clusters are shared with its snapshot,
        // which diskit's qcow2 unshares when zeroing them.)
        let from = if args[1] == "raw" {
            "disk.raw"
        } else {
            "base.qcow2"
        };
        let fmt = args[1];
        let imgs: Vec<PathBuf> = BOTH
            .iter()
            .map(|w| written(&b, *w, from, args, &cmds))
            .collect();
        let (real, ours) = (s(&imgs[0]), s(&imgs[1]));
        let o = qemu_img(&["compare", "-f", fmt, "-F", fmt, real, ours]);
        assert!(o.status.success(), "{args:?}: {}", stdout(&o));
        assert_eq!(allocation(real, fmt), allocation(ours, fmt), "{args:?}");
    }
}

#[test]
fn snapshot_overlays_vanish_and_read_only_refuses_writes() {
    let b = Bench::new();
    images(&b);
    let tmp = b.file("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let before = std::fs::read(b.file("top.qcow2")).unwrap();
    for which in BOTH {
        let srv = b.serve(which, "s.sock", &["-s", "-f", "qcow2", "top.qcow2"]);
        let o = client(
            "qemu-io",
            &qemu_io_args(
                Some("raw"),
                &["write -P 5 0 1M", "read -P 5 0 1M"],
                &srv.uri(""),
            ),
        );
        assert!(!stdout(&o).contains("fail"), "{which:?}: {}", stdout(&o));
        assert!(srv.exits().success());
        assert_eq!(
            std::fs::read(b.file("top.qcow2")).unwrap(),
            before,
            "{which:?}"
        );

        // -l: the snapshot's data (before 3M was written), read-only.
        let srv = b.serve(
            which,
            "l.sock",
            &["-l", "snap1", "-f", "qcow2", "top.qcow2"],
        );
        let reads = ["read -P 2 512k 1M", "read -P 0 3M 64k"];
        let uri = srv.uri("");
        let o = client(
            "qemu-io",
            &[&["-r"][..], &qemu_io_args(Some("raw"), &reads, &uri)].concat(),
        );
        assert!(o.status.success(), "{which:?}: {}", stderr(&o));
        assert!(!stdout(&o).contains("fail"), "{which:?}: {}", stdout(&o));
        drop(srv);

        let srv = b.serve(which, "r.sock", &["-t", "-r", "-f", "qcow2", "top.qcow2"]);
        let o = client(
            "nbdsh",
            &["-u", &srv.uri(""), "-c", "h.pwrite(b'x' * 512, 0)"],
        );
        assert!(!o.status.success(), "{which:?} took a write");
        assert_contains(&stderr(&o), "Operation not permitted");
    }
    // Overlays go to $TMPDIR, and go.
    let sock = b.file("t.sock");
    let mut cmd = b.command(
        Which::Ours,
        &["-s", "-f", "qcow2", "top.qcow2", "-k", s(&sock)],
    );
    cmd.env("TMPDIR", &tmp);
    let srv = Server::start(cmd, sock);
    let o = client("nbdinfo", &["--size", &srv.uri("")]);
    assert_eq!(stdout(&o).trim(), "4194304");
    assert!(srv.exits().success());
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "an overlay left"
    );
}

#[test]
fn the_last_client_ends_the_server_unless_persistent() {
    let b = Bench::new();
    images(&b);
    for which in BOTH {
        let srv = b.serve(which, "s.sock", &["-f", "raw", "disk.raw"]);
        // Listing exports does not count as a client.
        let o = b.run(which, &["-L", "-k", s(&srv.sock)]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            stdout(&client("nbdinfo", &["--size", &srv.uri("")])).trim(),
            "4194304"
        );
        assert!(srv.exits().success(), "{which:?}");
        assert!(!b.file("s.sock").exists(), "{which:?} left its socket");

        let mut srv = b.serve(which, "s.sock", &["-t", "-f", "raw", "disk.raw"]);
        for _ in 0..2 {
            let o = client("nbdinfo", &["--size", &srv.uri("")]);
            assert!(o.status.success(), "{which:?}: {}", stderr(&o));
        }
        assert!(srv.running(), "{which:?} -t stopped");
    }
}

/// An nbdsh client holding a connection to `uri` until `release` exists;
/// returns once it is connected.
fn holder(uri: &str, release: &Path) -> Child {
    let ready = release.with_extension("ready");
    let script = format!(
        "import os, time\nopen('{}', 'w').close()\nwhile not os.path.exists('{}'): time.sleep(0.02)",
        s(&ready),
        s(release)
    );
    let mut c = timed("nbdsh", 60)
        .args(["-u", uri, "-c", &script])
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ready.exists() {
        assert!(c.try_wait().unwrap().is_none(), "nbdsh could not connect");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "nbdsh never connected"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    c
}

#[test]
fn shared_says_how_many_clients_are_served_at_once() {
    let b = Bench::new();
    images(&b);
    for which in BOTH {
        for shared in ["1", "2"] {
            let srv = b.serve(
                which,
                "s.sock",
                &["-t", "-e", shared, "-f", "raw", "disk.raw"],
            );
            let release = b.file(&format!("release-{which:?}-{shared}"));
            let mut first = holder(&srv.uri(""), &release);
            let mut second = timed("nbdinfo", 60)
                .args(["--size", &srv.uri("")])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            if shared == "1" {
                // Held back while the first is served.
                std::thread::sleep(Duration::from_millis(500));
                assert!(
                    second.try_wait().unwrap().is_none(),
                    "{which:?}: two at once"
                );
            } else {
                assert!(second.wait().unwrap().success(), "{which:?}");
            }
            std::fs::write(&release, "").unwrap();
            assert!(first.wait().unwrap().success());
            assert!(second.wait().unwrap().success(), "{which:?} -e {shared}");
        }
    }
}

/// Whether process `pid` runs (exists, and is not a zombie waiting for a
/// reaper).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        st.rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
    })
}

#[test]
fn fork_returns_once_serving_with_the_pid_file_written() {
    let b = Bench::new();
    images(&b);
    for which in BOTH {
        let pidfile = b.file(&format!("{which:?}.pid"));
        let sock = b.file("f.sock");
        // The daemon keeps the standard error: not a pipe read to its end.
        let errors = std::fs::File::create(b.file("fork.err")).unwrap();
        let st = b
            .command(
                which,
                &[
                    "--fork",
                    "--pid-file",
                    s(&pidfile),
                    "-k",
                    s(&sock),
                    "-f",
                    "raw",
                    "disk.raw",
                ],
            )
            .stdout(Stdio::null())
            .stderr(errors)
            .status()
            .unwrap();
        assert!(st.success(), "{which:?}");
        let pid: u32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(alive(pid), "{which:?}: no daemon");
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        assert_eq!(
            stdout(&client("nbdinfo", &["--size", &uri])).trim(),
            "4194304"
        );
        // It goes with its last client; the pid file stays, as QEMU's.
        let t = Instant::now();
        while alive(pid) {
            assert!(t.elapsed() < Duration::from_secs(30), "{which:?} stays");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(pidfile.exists() && !sock.exists(), "{which:?}");
    }
}

#[test]
fn list_prints_what_qemu_nbd_prints() {
    let b = Bench::new();
    images(&b);
    for server in BOTH {
        let args = [
            "-t",
            "-x",
            "disk",
            "-D",
            "a test disk",
            "-A",
            "-f",
            "qcow2",
            "top.qcow2",
        ];
        let srv = b.serve(server, "s.sock", &args);
        let lists: Vec<Output> = BOTH
            .iter()
            .map(|w| b.run(*w, &["-L", "-k", s(&srv.sock)]))
            .collect();
        assert!(lists[0].status.success());
        assert_eq!(stdout(&lists[0]), stdout(&lists[1]), "listing {server:?}");
        assert_contains(&stdout(&lists[1]), "  description: a test disk\n");
    }
    // Nothing there: the same message and status.
    let gone = s(&b.file("gone.sock")).to_string();
    let out: Vec<Output> = BOTH
        .iter()
        .map(|w| b.run(*w, &["-L", "-k", &gone]))
        .collect();
    assert_eq!(stderr(&out[0]), stderr(&out[1]));
    assert_eq!(code(&out[0]), code(&out[1]));
}

#[test]
fn tls_with_pre_shared_keys_serves_and_lists_alike() {
    let b = Bench::new();
    images(&b);
    let keys = b.file("psk");
    std::fs::create_dir(&keys).unwrap();
    let key = "6b3a55e0261b4a8e1f6c0d1d6ee4c8a2f3c3a6b0b0a1d2c3e4f5061728394a5b";
    std::fs::write(keys.join("keys.psk"), format!("alice:{key}\n")).unwrap();
    let server_obj = format!("tls-creds-psk,id=tls0,endpoint=server,dir={}", s(&keys));
    let client_obj = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        s(&keys)
    );
    for which in BOTH {
        let args = [
            "-t",
            "--object",
            &server_obj,
            "--tls-creds",
            "tls0",
            "-r",
            "disk.raw",
        ];
        let srv = b.serve(which, "s.sock", &args);
        let tls = format!(
            "nbds+unix://alice@/?socket={}&tls-psk-file={}",
            s(&srv.sock),
            s(&keys.join("keys.psk"))
        );
        assert_eq!(
            stdout(&client("nbdinfo", &["--size", &tls])).trim(),
            "4194304"
        );
        let plain = client("nbdinfo", &["--size", &srv.uri("")]);
        assert!(!plain.status.success(), "{which:?} served plain text");
        let list = [
            "-L",
            "--object",
            &client_obj,
            "--tls-creds",
            "tls0",
            "-k",
            s(&srv.sock),
        ];
        let lists: Vec<Output> = BOTH.iter().map(|w| b.run(*w, &list)).collect();
        assert!(lists[1].status.success(), "{}", stderr(&lists[1]));
        assert_eq!(stdout(&lists[0]), stdout(&lists[1]), "listing {which:?}");
    }
}

#[test]
fn version_line_names_qemus_version_and_diskits() {
    let b = Bench::new();
    let real = stdout(&b.run(Which::Real, &["--version"]));
    let ours = stdout(&b.run(Which::Ours, &["--version"]));
    let version = |text: &str| {
        let first = text.lines().next().unwrap_or_default().to_string();
        first.split(" (").next().unwrap_or_default().to_string()
    };
    assert_eq!(version(&real), version(&ours));
    assert!(version(&ours).starts_with("qemu-nbd 10."), "{ours}");
    assert!(
        ours.starts_with(&format!("{} (diskit ", version(&ours))),
        "{ours}"
    );
    let sub = ok(diskit(&["qemu-nbd", "-V"]));
    assert_eq!(stdout(&sub), ours);
}

#[test]
fn connect_needs_the_kernel_driver_and_is_refused() {
    let b = Bench::new();
    images(&b);
    for args in [&["-c", "/dev/nbd0", "disk.raw"][..], &["-d", "/dev/nbd0"]] {
        let o = b.run(Which::Ours, args);
        assert_eq!(code(&o), 1, "{args:?}");
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
        assert_contains(&stderr(&o), "kernel's NBD client");
    }
}

#[test]
fn bad_command_lines_are_refused_in_qemu_nbds_words() {
    let b = Bench::new();
    images(&b);
    let sock = s(&b.file("bad.sock")).to_string();
    let cases: &[&[&str]] = &[
        &["--bogus", "disk.raw"],
        &["-Z", "disk.raw"],
        &[],
        &["disk.raw", "top.qcow2"],
        &["-p"],
        &["disk.raw", "--port"],
        &["-e", "x", "disk.raw"],
        &["disk.raw", "-e", "-1"],
        &["--cache=bad", "disk.raw"],
        &["--aio=bad", "disk.raw"],
        &["--discard=bad", "disk.raw"],
        &["--detect-zeroes=bad", "disk.raw"],
        &["--detect-zeroes=unmap", "disk.raw"],
        &["-n", "--cache=none", "disk.raw"],
        &["--aio=native", "disk.raw", "-k", &sock],
        &["-k", "relative.sock", "disk.raw"],
        &["-f", "nope", "disk.raw", "-k", &sock],
        &["missing.qcow2", "-k", &sock],
        &["-B", "nobitmap", "-f", "qcow2", "top.qcow2", "-k", &sock],
        &["-l", "nosnap", "-f", "qcow2", "top.qcow2", "-k", &sock],
        &["--handshake-limit=x", "disk.raw"],
        &["-o", "x", "disk.raw"],
        &["--tls-creds=x", "disk.raw"],
        &["--tls-hostname=x", "disk.raw"],
        &["-L", "disk.raw"],
        &["-L", "-x", "foo"],
        &["-L", "--fork"],
        &["--image-opts", "-f", "raw", "disk.raw", "-k", &sock],
    ];
    for args in cases {
        let out: Vec<Output> = BOTH.iter().map(|w| b.run(*w, args)).collect();
        assert_eq!(stderr(&out[0]), stderr(&out[1]), "qemu-nbd {args:?}");
        assert_eq!(code(&out[0]), code(&out[1]), "qemu-nbd {args:?}");
        assert_ne!(code(&out[1]), 0, "qemu-nbd {args:?}");
    }
}

#[test]
fn diskit_qemu_nbd_is_the_same_command() {
    let b = Bench::new();
    images(&b);
    let sock = b.file("d.sock");
    let args = ["-t", "-A", "-f", "qcow2", "top.qcow2", "-k", s(&sock)];
    // One at a time: each holds the image's write lock.
    let want = seen(&b.serve(Which::Real, "r.sock", &args[..5]).uri(""));
    let mut cmd = timed(diskit_bin(), 60);
    cmd.arg("qemu-nbd").args(args).current_dir(b.path());
    let srv = Server::start(cmd, sock);
    assert_eq!(seen(&srv.uri("")), want);
}
