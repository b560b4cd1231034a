//! A one-node Ceph cluster for the RBD and S3 tests
//! (scripts/ceph-cluster.sh: a monitor and one OSD on memstore, on a
//! loopback address of its own, with no authentication; a pool `rbd`
//! ready for images; radosgw, Ceph's S3 gateway, when asked), in a
//! temporary directory. Stopped (and its directory removed) when dropped.

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

/// scripts/ceph-cluster.sh, which starts and stops the cluster (the
/// benchmarks start theirs with it too).
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

impl Ceph {
    /// Starts a cluster with a pool `rbd`.
    pub fn start() -> Ceph {
        Ceph::start_with(&[])
    }

    /// Starts a cluster with a pool `rbd` and radosgw (see [`Ceph::s3_env`]).
    pub fn start_with_s3() -> Ceph {
        Ceph::start_with(&["rgw"])
    }

    fn start_with(extra: &[&str]) -> Ceph {
        let turn = take_turn();
        let dir = tempfile::Builder::new().prefix("ceph").tempdir().unwrap();
        let ceph = Ceph { dir, _turn: turn };
        let o = Command::new(script())
            .arg("start")
            .arg(ceph.dir.path())
            .args(extra)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script().display()));
        assert!(
            o.status.success(),
            "the test cluster did not start (scripts/test installs Ceph): {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        ceph
    }

    /// The configuration file clients read.
    pub fn conf(&self) -> PathBuf {
        self.dir.path().join("ceph.conf")
    }

    /// What an S3 client needs to reach radosgw (a cluster started by
    /// [`Ceph::start_with_s3`]): `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY` and `AWS_REGION`, as environment variables.
    pub fn s3_env(&self) -> Vec<(String, String)> {
        let text = std::fs::read_to_string(self.dir.path().join("s3.env"))
            .expect("the cluster was started with radosgw");
        text.lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// QEMU's name of image `image` in pool `rbd`.
    pub fn name(&self, image: &str) -> String {
        format!("rbd:rbd/{image}:conf={}", self.conf().display())
    }

    /// Sends `signal` to the OSD (SIGSTOP: it stops answering; SIGCONT:
    /// it goes on).
    pub fn signal_osd(&self, signal: i32) {
        let pid = std::fs::read_to_string(self.dir.path().join("run/osd.0.pid")).unwrap();
        let pid: i32 = pid.trim().parse().unwrap();
        // SAFETY: kill(2) on the pid this cluster's OSD wrote.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// The images in pool `rbd`.
    pub fn images(&self) -> Vec<String> {
        let o = self.rbd(&["ls"]);
        assert!(o.status.success(), "rbd ls: {o:?}");
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect()
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
        let _ = Command::new(script())
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}
