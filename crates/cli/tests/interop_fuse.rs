//! `diskit fuse` and diskit under the name `nbdfuse` against libnbd's
//! nbdfuse: the same command lines mount the same exports (qemu-nbd's,
//! nbdkit's, servers run for the mount), the files read and write the
//! same bytes, refuse the same writes, and the processes end alike when
//! unmounted. Every mount is unmounted by a guard, whatever happens.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Why FUSE tests cannot run here, if they cannot.
fn missing_fuse() -> Option<&'static str> {
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is missing");
    }
    let found = Command::new("fusermount3")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    (!found).then_some("fusermount3 is missing (Debian package fuse3)")
}

/// Returns early from a test, saying why, when FUSE cannot be used.
macro_rules! need_fuse {
    () => {
        if let Some(why) = missing_fuse() {
            eprintln!("skipped: {why}");
            return;
        }
    };
}

/// A work directory with a link named `nbdfuse` to the binary under test.
struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let dir = workdir();
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        std::os::unix::fs::symlink(diskit_bin(), dir.path().join("bin/nbdfuse")).unwrap();
        Setup { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn at(&self, name: &str) -> PathBuf {
        self.path().join(name)
    }

    /// The two nbdfuses: libnbd's and diskit's under that name.
    fn nbdfuses(&self) -> [(&'static str, PathBuf); 2] {
        [
            ("nbdfuse", PathBuf::from("nbdfuse")),
            ("diskit as nbdfuse", self.at("bin/nbdfuse")),
        ]
    }

    /// `src.raw` ([`patterned`], SIZE) and `want.raw`: it with `data`
    /// written at `offset`, what a write through the mount must make.
    fn source_and_want(&self, offset: u64, data: &[u8]) -> (PathBuf, PathBuf) {
        let (src, want) = (self.patterned_source(), self.at("want.raw"));
        std::fs::copy(&src, &want).unwrap();
        write_through(&want, offset, data);
        (src, want)
    }

    /// `src.raw`: [`patterned`], SIZE.
    fn patterned_source(&self) -> PathBuf {
        let src = self.at("src.raw");
        patterned(&src, SIZE);
        src
    }

    /// A new empty directory to mount on.
    fn mountpoint(&self, name: &str) -> PathBuf {
        let p = self.at(name);
        std::fs::create_dir(&p).unwrap();
        p
    }
}

/// A mounted file, served by a process in the foreground; unmounted
/// (and the process stopped) when dropped.
struct Mount {
    child: Option<Child>,
    mountpoint: PathBuf,
    what: String,
}

impl Mount {
    /// Runs `program PRE... -P PIDFILE ARGS` (PRE: a subcommand's name;
    /// ARGS: the rest, the mount point first) and waits until the pid
    /// file says it serves.
    fn start(program: &Path, pre: &[&str], mountpoint: &Path, args: &[&str]) -> Mount {
        let pidfile = mountpoint.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        let mut cmd = Command::new(program);
        cmd.args(pre)
            .arg("-P")
            .arg(&pidfile)
            .args(args)
            .env("PATH", path_env())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let child = cmd.spawn().expect("run the nbdfuse");
        let mut m = Mount {
            child: Some(child),
            mountpoint: mountpoint.to_path_buf(),
            what: format!("{} {}", program.display(), args.join(" ")),
        };
        let t = Instant::now();
        loop {
            // nbdfuse writes the number without a newline, at once.
            if std::fs::read_to_string(&pidfile).is_ok_and(|s| s.trim().parse::<u32>().is_ok()) {
                return m;
            }
            if let Some(status) = m.child.as_mut().unwrap().try_wait().unwrap() {
                let out = m.child.take().unwrap().wait_with_output().unwrap();
                panic!("{}: {status}: {}", m.what, stderr(&out));
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{} did not mount",
                m.what
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Unmounts with fusermount3 -u and returns how the process ended.
    fn unmount(self) -> ExitStatus {
        let out = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.mountpoint)
            .output()
            .unwrap();
        assert!(out.status.success(), "fusermount3 -u: {}", stderr(&out));
        self.ended().status
    }

    /// Sends the process `signal`.
    fn signal(&self, signal: i32) {
        let pid = self.child.as_ref().unwrap().id() as i32;
        // SAFETY: kill(2) on our own child's pid, which is not reaped yet.
        unsafe { libc::kill(pid, signal) };
    }

    /// Waits for the process to end (the guard unmounts if it does not).
    fn ended(mut self) -> std::process::Output {
        let t = Instant::now();
        while self.child.as_mut().unwrap().try_wait().unwrap().is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{} did not end",
                self.what
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.mountpoint)
                .stderr(Stdio::null())
                .status();
            std::thread::sleep(Duration::from_millis(100));
            let _ = child.kill();
            let _ = child.wait();
            // A process killed while mounted leaves a dead mount.
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.mountpoint)
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A raw file of `size` bytes with a byte pattern (qemu-io's -P) in
/// three runs and holes between.
fn patterned(path: &Path, size: u64) {
    sparse_file(
        path,
        size,
        &[
            (0, 65536, 0x11),
            (size / 2, 100_000, 0x22),
            (size - 4096, 4096, 0x33),
        ],
    );
}

/// Writes `bytes` at `offset` of `file` and fsyncs it.
fn write_through(file: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

/// Runs qemu-img compare on two images (formats probed) and asserts they
/// are the same.
fn assert_identical(a: &Path, b: &Path) {
    let o = qemu_img(&["compare", s(a), s(b)]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
}

const SIZE: u64 = 4 << 20;

#[test]
fn reads_and_writes_a_qemu_nbd_export_as_nbdfuse_does() {
    need_fuse!();
    let t = Setup::new();
    let data = vec![0x5a; 200_000];
    let (src, want) = t.source_and_want(1_000_000, &data);
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        let served = t.at(&format!("served{i}.raw"));
        std::fs::copy(&src, &served).unwrap();
        let server = QemuNbd::start(&t.at(&format!("q{i}.sock")), &["-f", "raw", s(&served)]);
        let mp = t.mountpoint(&format!("mp{i}"));
        let m = Mount::start(&prog, &[], &mp, &[s(&mp), &server.uri]);
        let file = mp.join("nbd");
        assert_eq!(std::fs::metadata(&file).unwrap().len(), SIZE, "{name}");
        assert!(
            same_bytes(&file, &src),
            "{name}: the file reads as the export"
        );
        // dd with large blocks and O_DIRECT reads alike.
        let o = Command::new("dd")
            .args([
                &format!("if={}", s(&file)),
                "bs=1M",
                "iflag=direct",
                "status=none",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: dd: {}", stderr(&o));
        assert_eq!(o.stdout, std::fs::read(&src).unwrap(), "{name}: dd");
        write_through(&file, 1_000_000, &data);
        assert_eq!(m.unmount().code(), Some(0), "{name}: exit status");
        drop(server);
        assert_identical(&served, &want);
    }
}

/// `len` bytes of `byte` in a buffer aligned for O_DIRECT.
fn aligned(len: usize, byte: u8) -> (Vec<u8>, usize) {
    let v = vec![byte; len + 4096];
    let at = v.as_ptr().align_offset(4096);
    (v, at)
}

/// Reads `len` bytes at `offset` of `f`.
fn bytes_at(f: &std::fs::File, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, offset).unwrap();
    b
}

#[test]
fn sequential_reads_see_writes_made_meanwhile_as_nbdfuse_does() {
    need_fuse!();
    // diskit reads ahead of a sequential reader: what it read ahead must
    // not outlive a write through the mount, nor, for the next opening,
    // one by another client of the export.
    let t = Setup::new();
    let src = t.patterned_source();
    const K64: usize = 64 << 10;
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        let served = t.at(&format!("served{i}.raw"));
        std::fs::copy(&src, &served).unwrap();
        let sock = t.at(&format!("q{i}.sock"));
        let server = QemuNbd::start(&sock, &["-f", "raw", "-e", "8", s(&served)]);
        let mp = t.mountpoint(&format!("mp{i}"));
        let m = Mount::start(&prog, &[], &mp, &[s(&mp), &server.uri]);
        let file = mp.join("nbd");
        // A write through the mount, after the reader went past half a
        // MiB, to a place ahead of it (the kernel's cache bypassed).
        let w = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&file)
            .unwrap();
        let r = std::fs::File::open(&file).unwrap();
        for k in 0..8 {
            bytes_at(&r, k * K64 as u64, K64);
        }
        let (buf, at) = aligned(K64, 0x77);
        w.write_all_at(&buf[at..at + K64], 1 << 20).unwrap();
        assert_eq!(bytes_at(&r, 1 << 20, K64), vec![0x77; K64], "{name}");
        drop((r, w));
        // Another client's write between two openings.
        let r = std::fs::File::open(&file).unwrap();
        for k in 0..8 {
            bytes_at(&r, (2 << 20) + k * K64 as u64, K64);
        }
        drop(r);
        let o = peer(
            "qemu-io",
            &qemu_io_args(Some("raw"), &["write -P 0x66 3M 64k"], &server.uri),
        );
        assert!(o.status.success(), "qemu-io: {}", stderr(&o));
        let r = std::fs::File::open(&file).unwrap();
        assert_eq!(bytes_at(&r, 3 << 20, K64), vec![0x66; K64], "{name}");
        drop(r);
        assert_eq!(m.unmount().code(), Some(0), "{name}: exit status");
    }
}

#[test]
fn runs_a_server_for_the_mount_in_brackets_and_with_command() {
    need_fuse!();
    let t = Setup::new();
    let data = vec![0xc3; 70_000];
    let (src, want) = t.source_and_want(3_000_000, &data);
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        // qemu-nbd run with socket activation, over a qcow2 image.
        let img = t.at(&format!("img{i}.qcow2"));
        ok(qemu_img(&["convert", "-O", "qcow2", s(&src), s(&img)]));
        let mp = t.mountpoint(&format!("mp{i}"));
        let m = Mount::start(
            &prog,
            &[],
            &mp,
            &[s(&mp), "[", "qemu-nbd", "-f", "qcow2", s(&img), "]"],
        );
        assert!(same_bytes(&mp.join("nbd"), &src), "{name}: [ qemu-nbd ]");
        write_through(&mp.join("nbd"), 3_000_000, &data);
        assert_eq!(m.unmount().code(), Some(0), "{name}: exit status");
        ok(qemu_img(&["check", s(&img)]));
        assert_identical(&img, &want);

        // nbdkit on the standard streams, the file named in the directory.
        let mp = t.mountpoint(&format!("cmd{i}"));
        let file = mp.join("ram.disk");
        let m = Mount::start(
            &prog,
            &[],
            &mp,
            &[
                s(&file),
                "--command",
                "nbdkit",
                "-s",
                "--exit-with-parent",
                "memory",
                "1M",
            ],
        );
        let names: Vec<_> = std::fs::read_dir(&mp)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["ram.disk"], "{name}");
        assert_eq!(std::fs::read(&file).unwrap(), vec![0; 1 << 20], "{name}");
        write_through(&file, 4096, b"written");
        let back = std::fs::read(&file).unwrap();
        assert_eq!(&back[4096..4103], b"written", "{name}");
        assert_eq!(m.unmount().code(), Some(0), "{name}: exit status");
    }
}

#[test]
fn read_only_refuses_writes_as_nbdfuse_does() {
    need_fuse!();
    let t = Setup::new();
    let src = t.patterned_source();
    let mut refusals = Vec::new();
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        let sock = t.at(&format!("k{i}.sock"));
        let _server = start_server("nbdkit", &["-f", "-U", s(&sock), "file", s(&src)], || {
            sock.exists()
        });
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        let mp = t.mountpoint(&format!("mp{i}"));
        let m = Mount::start(&prog, &[], &mp, &["-r", s(&mp), &uri]);
        let file = mp.join("nbd");
        assert!(same_bytes(&file, &src), "{name}");
        let meta = std::fs::metadata(&file).unwrap();
        assert!(meta.permissions().readonly(), "{name}: mode {:o}", {
            use std::os::unix::fs::PermissionsExt;
            meta.permissions().mode()
        });
        let e = OpenOptions::new().write(true).open(&file).unwrap_err();
        refusals.push(e.raw_os_error());
        assert_eq!(m.unmount().code(), Some(0), "{name}: exit status");
    }
    assert!(refusals[0].is_some());
    assert_eq!(refusals[0], refusals[1], "the same errno as nbdfuse");
    assert!(same_bytes(&src, &src), "unchanged");
}

/// The map nbdinfo shows of an export: `(offset, length, description)`.
fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, String)> {
    let o = ok(peer("nbdinfo", &["--map", uri]));
    stdout(&o)
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (
                w[0].parse().unwrap(),
                w[1].parse().unwrap(),
                w[3..].join(" "),
            )
        })
        .collect()
}

#[test]
fn fallocate_punches_holes_and_zeroes_ranges_on_the_server() {
    need_fuse!();
    let t = Setup::new();
    let src = t.at("src.raw");
    sparse_file(&src, SIZE, &[(0, SIZE as usize, 0x77)]);
    let mut maps = Vec::new();
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        let served = t.at(&format!("served{i}.raw"));
        std::fs::copy(&src, &served).unwrap();
        let server = QemuNbd::start(
            &t.at(&format!("q{i}.sock")),
            &["-e", "8", "--discard=unmap", "-f", "raw", s(&served)],
        );
        let mp = t.mountpoint(&format!("mp{i}"));
        let m = Mount::start(&prog, &[], &mp, &[s(&mp), &server.uri]);
        let file = mp.join("nbd");
        let fallocate = |args: &[&str]| {
            let o = Command::new("fallocate")
                .args(args)
                .arg(&file)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{name}: fallocate {args:?}: {}",
                stderr(&o)
            );
        };
        fallocate(&["-p", "-o", "1M", "-l", "1M"]);
        fallocate(&["-z", "-o", "3M", "-l", "64K"]);
        let f = std::fs::read(&file).unwrap();
        assert!(
            f[1 << 20..2 << 20].iter().all(|&b| b == 0),
            "{name}: punched"
        );
        assert!(
            f[3 << 20..(3 << 20) + 65536].iter().all(|&b| b == 0),
            "{name}: zeroed"
        );
        assert!(f[..1 << 20].iter().all(|&b| b == 0x77), "{name}");
        let map = nbdinfo_map(&server.uri);
        assert!(
            map.iter()
                .any(|(o, l, d)| *o <= 1 << 20 && o + l >= 2 << 20 && d.contains("hole")),
            "{name}: the punched range is a hole on the server: {map:?}"
        );
        maps.push(map);
        assert_eq!(m.unmount().code(), Some(0), "{name}: exit status");
    }
    assert_eq!(maps[0], maps[1], "the server's map as nbdfuse leaves it");
}

#[test]
fn unix_tcp_and_fd_modes_read_as_nbdfuse_does() {
    need_fuse!();
    let t = Setup::new();
    let sock = t.at("p.sock");
    let port = free_port().to_string();
    let _unix = start_server("nbdkit", &["-f", "-U", s(&sock), "pattern", "1M"], || {
        sock.exists()
    });
    let addr = format!("127.0.0.1:{port}");
    let _tcp = start_server(
        "nbdkit",
        &["-f", "-i", "127.0.0.1", "-p", &port, "pattern", "1M"],
        || std::net::TcpStream::connect(&addr).is_ok(),
    );
    let mut read = Vec::new();
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        // A connected socket handed over as a descriptor the child keeps.
        let conn = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&conn);
        // SAFETY: fcntl on a descriptor this test owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
        let fd = fd.to_string();
        for (mode, args) in [
            ("unix", vec!["--unix", s(&sock)]),
            ("tcp", vec!["--tcp", "127.0.0.1", &port]),
            ("fd", vec!["--fd", &fd]),
        ] {
            let mp = t.mountpoint(&format!("{mode}{i}"));
            let m = Mount::start(&prog, &[], &mp, &[&[s(&mp)], &args[..]].concat());
            read.push((name, mode, std::fs::read(mp.join("nbd")).unwrap()));
            assert_eq!(m.unmount().code(), Some(0), "{name} {mode}");
        }
        drop(conn);
    }
    // nbdkit's pattern: each 8-byte word is its offset, big-endian.
    let want: Vec<u8> = (0..1u64 << 17)
        .flat_map(|w| (w * 8).to_be_bytes())
        .collect();
    for (name, mode, bytes) in &read {
        assert!(bytes == &want, "{name} --{mode}");
    }
}

#[test]
fn a_signal_unmounts_and_fails_as_nbdfuse_does() {
    need_fuse!();
    let t = Setup::new();
    for (i, (name, prog)) in t.nbdfuses().into_iter().enumerate() {
        let mp = t.mountpoint(&format!("mp{i}"));
        let server = ["[", "nbdkit", "--exit-with-parent", "memory", "1M", "]"];
        let m = Mount::start(&prog, &[], &mp, &[&[s(&mp)], &server[..]].concat());
        m.signal(libc::SIGTERM);
        let out = m.ended();
        assert_eq!(out.status.code(), Some(1), "{name}");
        assert_contains(&stderr(&out), "terminated by signal 15");
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        assert!(!mounts.contains(s(&mp)), "{name}: still mounted");
    }
}

#[test]
fn a_missing_server_fails_with_one_line() {
    need_fuse!();
    let t = Setup::new();
    let gone = format!("nbd+unix:///?socket={}", s(&t.at("none.sock")));
    for (name, prog) in t.nbdfuses() {
        let mp = t.mountpoint(&format!("mp-{}", name.len()));
        for args in [
            vec![s(&mp), gone.as_str()],
            vec![s(&mp), "[", "false", "]"],
            vec!["no/such/dir", gone.as_str()],
        ] {
            let o = timed(&prog, 30).args(&args).output().unwrap();
            assert_ne!(code(&o), 0, "{name} {args:?}");
            let err = stderr(&o);
            assert_eq!(err.trim_end().lines().count(), 1, "{name} {args:?}: {err}");
        }
        // Nothing was left mounted.
        assert!(std::fs::read_dir(&mp).unwrap().next().is_none(), "{name}");
    }
    let mp = t.mountpoint("img");
    let o = diskit(&["fuse", s(&mp), s(&t.at("missing.qcow2"))]);
    assert_ne!(code(&o), 0);
    assert_eq!(stderr(&o).trim_end().lines().count(), 1, "{}", stderr(&o));
    assert_contains(&stderr(&o), "missing.qcow2");
}

#[test]
fn diskit_fuse_mounts_a_qcow2_image_read_write() {
    need_fuse!();
    let t = Setup::new();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (src, want) = t.source_and_want(123_456, &data);
    let img = t.at("disk.qcow2");
    ok(qemu_img(&["convert", "-O", "qcow2", s(&src), s(&img)]));
    let mp = t.mountpoint("mp");
    let m = Mount::start(
        &diskit_bin(),
        &["fuse"],
        &mp,
        &[s(&mp.join("disk.raw")), s(&img)],
    );
    let file = mp.join("disk.raw");
    assert!(same_bytes(&file, &src));
    write_through(&file, 123_456, &data);
    // Several readers at once read what was written.
    std::thread::scope(|sc| {
        for k in 0..4u64 {
            let (file, want) = (&file, &want);
            sc.spawn(move || {
                let f = std::fs::File::open(file).unwrap();
                let w = std::fs::read(want).unwrap();
                let mut buf = vec![0; 256 << 10];
                for off in (k * 65536..SIZE).step_by(1 << 20) {
                    let n = buf.len().min((SIZE - off) as usize);
                    f.read_exact_at(&mut buf[..n], off).unwrap();
                    assert_eq!(&buf[..n], &w[off as usize..off as usize + n], "at {off}");
                }
            });
        }
    });
    // Past the end: no space, as a block device.
    let f = OpenOptions::new().write(true).open(&file).unwrap();
    let e = f.write_at(b"x", SIZE).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    drop(f);
    assert_eq!(m.unmount().code(), Some(0));
    ok(qemu_img(&["check", s(&img)]));
    assert_identical(&img, &want);
}
