//! A one-node Ceph cluster for the RBD tests: a monitor and one OSD on
//! memstore, in a temporary directory, on a free loopback port, with no
//! authentication; a pool `rbd` ready for images. Stopped (and its
//! directory removed) when dropped.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The running cluster.
pub struct Ceph {
    dir: tempfile::TempDir,
    /// Held while the cluster runs: one test cluster at a time on the
    /// machine (two started side by side confuse each other's OSD
    /// registration, "wrong fsid", whatever their addresses).
    _turn: std::fs::File,
}

/// Waits for the machine-wide turn to run a test cluster.
fn take_turn() -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(std::env::temp_dir().join("diskit-test-ceph.lock"))
        .unwrap();
    // SAFETY: flock(2) on a descriptor this process owns.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(r, 0, "flock: {}", std::io::Error::last_os_error());
    f
}

fn run(dir: &Path, program: &str, args: &[&str]) {
    if let Err(e) = try_run(dir, program, args) {
        panic!("{e}");
    }
}

fn try_run(dir: &Path, program: &str, args: &[&str]) -> Result<(), String> {
    let logs = || {
        let mut out = String::new();
        for l in ["mon.a", "osd.0"] {
            if let Ok(t) = std::fs::read_to_string(dir.join("log").join(format!("{l}.log"))) {
                let tail: Vec<&str> = t.lines().rev().take(15).collect();
                out += &format!(
                    "\n--- {l}.log (last lines, newest first)\n{}",
                    tail.join("\n")
                );
            }
        }
        out
    };
    let o = Command::new("timeout")
        .arg("60")
        .arg(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} ({e}): scripts/test installs Ceph"));
    if o.status.success() {
        return Ok(());
    }
    Err(format!(
        "{program} {args:?}: {}{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        logs()
    ))
}

impl Ceph {
    /// Starts a cluster with a pool `rbd`.
    pub fn start() -> Ceph {
        let turn = take_turn();
        let dir = tempfile::Builder::new().prefix("ceph").tempdir().unwrap();
        let d = &dir.path().to_path_buf();
        // A loopback address of its own: clusters of tests running side by
        // side never meet on one port.
        let seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.subsec_nanos() as u64);
        let ip = format!(
            "127.{}.{}.{}",
            1 + seed % 250,
            (seed >> 8) % 256,
            1 + (seed >> 16) % 250
        );
        let port = std::net::TcpListener::bind((ip.as_str(), 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let fsid = std::fs::read_to_string("/proc/sys/kernel/random/uuid").unwrap();
        let fsid = fsid.trim();
        for sub in ["run", "log", "mon.a", "osd.0"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let conf = format!(
            "[global]
fsid = {fsid}
mon host = v1:{ip}:{port}
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
run dir = {d}/run
log file = {d}/log/$name.log
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
osd objectstore = memstore
memstore device bytes = 1073741824
mon data avail crit = 0
mon data avail warn = 0
ms bind ipv6 = false
[mon.a]
mon data = {d}/mon.a
public addr = {ip}:{port}
[osd.0]
osd data = {d}/osd.0
",
            d = d.display(),
        );
        std::fs::write(d.join("ceph.conf"), conf).unwrap();
        let c = d.join("ceph.conf");
        let c = c.to_str().unwrap();
        let ceph = Ceph { dir, _turn: turn };
        run(
            d,
            "monmaptool",
            &[
                "--create",
                "--fsid",
                fsid,
                "--addv",
                "a",
                &format!("[v1:{ip}:{port}]"),
                "monmap",
            ],
        );
        run(
            d,
            "ceph-mon",
            &["-c", c, "--mkfs", "-i", "a", "--monmap", "monmap"],
        );
        run(d, "ceph-mon", &["-c", c, "-i", "a"]);
        run(d, "ceph", &["-c", c, "osd", "create"]);
        run(d, "ceph-osd", &["-c", c, "-i", "0", "--mkfs"]);
        // The OSD may ask the monitor before it has the monitor's map,
        // with a null fsid ("wrong fsid"), and stop: a race in Ceph's
        // start-up; another start gets past it.
        let osd = ["-c", c, "-i", "0"];
        for attempt in 1.. {
            match try_run(d, "ceph-osd", &osd) {
                Ok(()) => break,
                Err(e) if attempt < 5 && e.contains("wrong fsid") => {
                    std::thread::sleep(std::time::Duration::from_millis(500));
                }
                Err(e) => panic!("{e}"),
            }
        }
        run(d, "ceph", &["-c", c, "osd", "pool", "create", "rbd", "8"]);
        run(d, "rbd", &["-c", c, "pool", "init", "rbd"]);
        ceph
    }

    /// The configuration file clients read.
    pub fn conf(&self) -> PathBuf {
        self.dir.path().join("ceph.conf")
    }

    /// QEMU's name of image `image` in pool `rbd`.
    pub fn name(&self, image: &str) -> String {
        format!("rbd:rbd/{image}:conf={}", self.conf().display())
    }

    /// Runs the `rbd` tool with `args` (the configuration given).
    pub fn rbd(&self, args: &[&str]) -> std::process::Output {
        Command::new("rbd")
            .arg("-c")
            .arg(self.conf())
            .args(args)
            .output()
            .expect("rbd is installed")
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        for daemon in ["osd.0", "mon.a"] {
            let pid = self.dir.path().join("run").join(format!("{daemon}.pid"));
            if let Ok(p) = std::fs::read_to_string(pid)
                && let Ok(p) = p.trim().parse::<i32>()
            {
                // SAFETY: kill(2) on a pid this cluster's daemon wrote.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
    }
}
