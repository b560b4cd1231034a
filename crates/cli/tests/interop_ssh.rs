//! nbdkit's ssh plugin under nbdkit 1.32 and under `diskit serve` on the
//! same command lines, against a real OpenSSH server this test starts on
//! loopback (its own host key, authorized key and known-hosts file, SFTP
//! by internal-sftp): the same flags and bytes, writes landing in the
//! remote file, `create=true`, and the same refusals (a changed host key,
//! a missing file, a password the server does not take).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SSHD: &str = "/usr/sbin/sshd";

/// An sshd on 127.0.0.1, stopped when dropped.
struct Sshd {
    dir: PathBuf,
    port: u16,
    child: Child,
}

impl Sshd {
    /// Starts one whose keys live in `dir`; `None` (the test says why)
    /// when OpenSSH's server is not installed.
    fn start(dir: &Path) -> Option<Sshd> {
        if !Path::new(SSHD).exists() {
            eprintln!("skipped: {SSHD} is missing (Debian's openssh-server)");
            return None;
        }
        for key in ["hostkey", "userkey", "otherkey"] {
            let st = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(dir.join(key))
                .status()
                .unwrap();
            assert!(st.success());
        }
        std::fs::copy(dir.join("userkey.pub"), dir.join("authorized_keys")).unwrap();
        let port = free_port();
        let d = dir.display();
        std::fs::write(
            dir.join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/hostkey\nPidFile none\n\
                 AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
                 PermitRootLogin prohibit-password\nSubsystem sftp internal-sftp\n"
            ),
        )
        .unwrap();
        // The privilege separation directory sshd insists on.
        let _ = std::fs::create_dir_all("/run/sshd");
        let child = Command::new(SSHD)
            .args(["-D", "-e", "-f"])
            .arg(dir.join("sshd_config"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let host = std::fs::read_to_string(dir.join("hostkey.pub")).unwrap();
        let key: Vec<&str> = host.split_whitespace().take(2).collect();
        std::fs::write(
            dir.join("known_hosts"),
            format!("[127.0.0.1]:{port} {}\n", key.join(" ")),
        )
        .unwrap();
        let other = std::fs::read_to_string(dir.join("otherkey.pub")).unwrap();
        let other: Vec<&str> = other.split_whitespace().take(2).collect();
        std::fs::write(
            dir.join("wrong_known_hosts"),
            format!("[127.0.0.1]:{port} {}\n", other.join(" ")),
        )
        .unwrap();
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "sshd did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Sshd {
            dir: dir.to_path_buf(),
            port,
            child,
        })
    }

    /// The plugin's arguments for `path`, with the test's identity and
    /// known hosts, plus `more`.
    fn args(&self, path: &Path, more: &[&str]) -> Vec<String> {
        let d = self.dir.display();
        let mut a = vec![
            "ssh".to_string(),
            "host=127.0.0.1".into(),
            format!("port={}", self.port),
            s(path).to_string(),
            format!("identity={d}/userkey"),
        ];
        if !more.iter().any(|m| m.starts_with("known-hosts=")) {
            a.push(format!("known-hosts={d}/known_hosts"));
        }
        a.extend(more.iter().map(|m| m.to_string()));
        a
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_remote_file_reads_and_writes_as_under_nbdkit() {
    let dir = workdir();
    let Some(sshd) = Sshd::start(dir.path()) else {
        return;
    };
    let pristine = dir.path().join("pristine.img");
    let remote = dir.path().join("remote.img");
    data_then_hole(&pristine, 65536, 2 << 20);
    std::fs::copy(&pristine, &remote).unwrap();
    let args = sshd.args(&remote, &[]);
    let dk = same_flags(dir.path(), &strs(&args), &[]);
    assert_eq!(dk["export-size"], 2 << 20);
    assert_eq!(dk["can_multi_conn"], true, "OpenSSH has fsync@openssh.com");
    same_bytes_and_map(dir.path(), &strs(&args));
    // The same requests from the same file under each server; the remote
    // file ends the same.
    same_answers_and_file(dir.path(), &strs(&args), &pristine, &remote, 4096, 70000);
    // Read-only: the file opened for reading, writes refused.
    let ro = [strs(&args), vec!["-r"]].concat();
    let dk = same_flags(dir.path(), &ro, &[]);
    assert_eq!(dk["is_read_only"], true);
}

#[test]
fn create_makes_the_remote_file() {
    let dir = workdir();
    let Some(sshd) = Sshd::start(dir.path()) else {
        return;
    };
    for server in SERVERS {
        let made = dir.path().join(format!("new.{}", server.name()));
        let args = sshd.args(
            &made,
            &["create=true", "create-size=3M", "create-mode=0640"],
        );
        let cmd = "nbdsh -u \"$uri\" -c 'h.pwrite(b\"new\", 1048576); h.flush()'";
        ok(run(server, dir.path(), &strs(&args), cmd));
        let meta = std::fs::metadata(&made).unwrap();
        assert_eq!(meta.len(), 3 << 20, "{}", server.name());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            meta.permissions().mode() & 0o777,
            0o640,
            "{}",
            server.name()
        );
        let bytes = std::fs::read(&made).unwrap();
        assert_eq!(&bytes[1 << 20..(1 << 20) + 3], b"new");
    }
}

#[test]
fn bad_hosts_files_and_passwords_are_refused_as_by_nbdkit() {
    let dir = workdir();
    let Some(sshd) = Sshd::start(dir.path()) else {
        return;
    };
    let remote = dir.path().join("remote.img");
    data_then_hole(&remote, 65536, 2 << 20);
    let wrong = format!("known-hosts={}/wrong_known_hosts", sshd.dir.display());
    let nbdinfo = "nbdinfo \"$uri\"";
    for (more, msg) in [
        (vec![wrong.as_str()], "host key for server changed"),
        (vec![], "cannot open file for writing"),
    ] {
        let path = if msg.contains("cannot open") {
            dir.path().join("missing.img")
        } else {
            remote.clone()
        };
        let args = sshd.args(&path, &more);
        for server in SERVERS {
            let o = run(server, dir.path(), &strs(&args), nbdinfo);
            assert_ne!(code(&o), 0, "{} accepted {args:?}", server.name());
            assert_stderr_has(&o, msg);
        }
    }
    // No check of the host at all: the wrong file does not matter.
    let args = sshd.args(&remote, &[&wrong, "verify-remote-host=false"]);
    both_ok(dir.path(), &strs(&args), nbdinfo);
    // A password where the server takes none (and no key given).
    let pw = dir.path().join("pw");
    std::fs::write(&pw, "secret\n").unwrap();
    let d = sshd.dir.display();
    let args = [
        "ssh",
        "host=127.0.0.1",
        &format!("port={}", sshd.port),
        s(&remote),
        &format!("known-hosts={d}/known_hosts"),
        &format!("password=+{}", pw.display()),
        "config=",
    ]
    .map(|a| a.to_string());
    // (nbdkit 1.32 says only that every method failed; later nbdkits,
    // as diskit, say why.)
    for (server, msg) in [
        (Server::Nbdkit, "authentication methods failed"),
        (
            Server::Diskit,
            "the server does not offer password authentication",
        ),
    ] {
        let o = run(server, dir.path(), &strs(&args), nbdinfo);
        assert_ne!(code(&o), 0, "{} accepted a password", server.name());
        assert_stderr_has(&o, msg);
    }
    both_refuse(
        dir.path(),
        &["ssh", "host=127.0.0.1"],
        "you must supply the host and path parameters",
    );
}
