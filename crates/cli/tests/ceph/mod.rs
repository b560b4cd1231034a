//! A one-node Ceph cluster for the RBD and S3 tests
//! (scripts/ceph-cluster.sh: a monitor and one OSD on memstore, on a
//! loopback address of its own, with no authentication; radosgw, Ceph's
//! S3 gateway), and a pool of the test's own in it.
//!
//! scripts/test starts one cluster for the whole run and names its
//! directory in `DISKIT_TEST_CEPH`: tests then share it, each with a pool
//! (and a bucket) of its own, deleted when the test ends. A test that
//! stops the cluster's daemons starts a cluster of its own
//! ([`Ceph::start_own`]), as every test does when the variable is not
//! set (`cargo test` by hand): in a temporary directory, with a pool
//! `rbd`, stopped (and its directory removed) when dropped.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A test's view of a running cluster: the cluster and the pool the
/// test's images go into.
pub struct Ceph {
    cluster: Cluster,
    pool: String,
}

/// Where the cluster comes from.
enum Cluster {
    /// Started by this test, stopped when it ends.
    Own {
        dir: tempfile::TempDir,
        /// Held while the cluster runs: one cluster of a test's own at a
        /// time on the machine.
        _turn: std::fs::File,
    },
    /// Started by scripts/test for the whole run (`DISKIT_TEST_CEPH`).
    Shared(PathBuf),
}

/// The variable in which scripts/test names its cluster's directory.
const SHARED: &str = "DISKIT_TEST_CEPH";

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
    /// A cluster with a pool of this test's own ([`Ceph::pool`]): the
    /// run's shared cluster where there is one, else a cluster of its own.
    pub fn start() -> Ceph {
        Ceph::start_with(&[])
    }

    /// As [`Ceph::start`], with radosgw (see [`Ceph::s3_env`]).
    pub fn start_with_s3() -> Ceph {
        Ceph::start_with(&["rgw"])
    }

    fn start_with(extra: &[&str]) -> Ceph {
        let Some(dir) = std::env::var_os(SHARED) else {
            return Ceph::start_own(extra);
        };
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ceph = Ceph {
            cluster: Cluster::Shared(PathBuf::from(dir)),
            pool: format!("t{}-{n}", std::process::id()),
        };
        let conf = ceph.conf();
        let conf = conf.to_str().unwrap();
        // A cluster that is not there fails the test in a minute, not hangs it.
        let wait = ["--client_mount_timeout", "60"];
        for args in [
            vec!["ceph", "-c", conf, "osd", "pool", "create", &ceph.pool, "8"],
            vec!["rbd", "-c", conf, "pool", "init", &ceph.pool],
        ] {
            let args = [&args[..], &wait[..]].concat();
            // A busy monitor may answer "EPERM: problem getting command
            // descriptions" for a moment: asked again, it takes the command.
            let mut tries = 0;
            loop {
                let o = Command::new(args[0]).args(&args[1..]).output().unwrap();
                if o.status.success() {
                    break;
                }
                tries += 1;
                let busy = String::from_utf8_lossy(&o.stderr).contains("command descriptions");
                assert!(busy && tries < 20, "{args:?}: {o:?}");
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
        }
        ceph
    }

    /// Starts a cluster of this test's own (with radosgw if `extra` says
    /// `rgw`), with a pool `rbd`: for a test that stops its daemons.
    pub fn start_own(extra: &[&str]) -> Ceph {
        let turn = take_turn();
        let dir = tempfile::Builder::new().prefix("ceph").tempdir().unwrap();
        let ceph = Ceph {
            cluster: Cluster::Own { dir, _turn: turn },
            pool: "rbd".into(),
        };
        let o = Command::new(script())
            .arg("start")
            .arg(ceph.dir())
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

    fn dir(&self) -> &Path {
        match &self.cluster {
            Cluster::Own { dir, .. } => dir.path(),
            Cluster::Shared(dir) => dir,
        }
    }

    /// The configuration file clients read.
    pub fn conf(&self) -> PathBuf {
        self.dir().join("ceph.conf")
    }

    /// The pool this test's images go into.
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// `POOL/IMAGE`, as the `rbd` tool and `serve rbd` name an image.
    pub fn at(&self, image: &str) -> String {
        format!("{}/{image}", self.pool)
    }

    /// A name unique to this test in the cluster (a bucket's, say).
    pub fn unique(&self, what: &str) -> String {
        format!("{what}-{}", self.pool)
    }

    /// What an S3 client needs to reach radosgw (a cluster started by
    /// [`Ceph::start_with_s3`]): `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY` and `AWS_REGION`, as environment variables.
    pub fn s3_env(&self) -> Vec<(String, String)> {
        let text = std::fs::read_to_string(self.dir().join("s3.env"))
            .expect("the cluster was started with radosgw");
        text.lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// QEMU's name of image `image` in this test's pool.
    pub fn name(&self, image: &str) -> String {
        format!("rbd:{}:conf={}", self.at(image), self.conf().display())
    }

    /// Sends `signal` to the OSD (SIGSTOP: it stops answering; SIGCONT:
    /// it goes on) of a cluster of the test's own.
    pub fn signal_osd(&self, signal: i32) {
        assert!(
            matches!(self.cluster, Cluster::Own { .. }),
            "only a test's own cluster is stopped"
        );
        let pid = std::fs::read_to_string(self.dir().join("run/osd.0.pid")).unwrap();
        let pid: i32 = pid.trim().parse().unwrap();
        // SAFETY: kill(2) on the pid this cluster's OSD wrote.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// The images in this test's pool.
    pub fn images(&self) -> Vec<String> {
        let o = self.rbd(&["ls", &self.pool]);
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
        match &self.cluster {
            Cluster::Own { dir, .. } => {
                let _ = Command::new(script()).arg("stop").arg(dir.path()).status();
            }
            Cluster::Shared(_) => {
                let _ = Command::new("ceph")
                    .arg("-c")
                    .arg(self.conf())
                    .args(["osd", "pool", "delete", &self.pool, &self.pool])
                    .arg("--yes-i-really-really-mean-it")
                    .output();
            }
        }
    }
}
