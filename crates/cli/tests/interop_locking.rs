//! QEMU's image locks, both ways: an image that qemu-nbd serves (or
//! qemu-io holds) is refused by diskit with qemu-img's message, and one
//! that `diskit serve` holds is refused by qemu-img and qemu-io; `-U`
//! reads anyway. (The lock bytes are QEMU's: 100 + permission for what a
//! process uses, 200 + permission for what it lets no one else use.)

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A server holding an image until dropped.
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn hold(program: &str, args: &[&str], sock: &Path) -> Holder {
    let _ = std::fs::remove_file(sock);
    let child = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !sock.exists() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(sock.exists(), "{program} did not start");
    Holder(child)
}

/// Standard error without the program's name.
fn message(o: &std::process::Output) -> String {
    stderr(o).replace("qemu-img: ", "").replace("diskit: ", "")
}

#[test]
fn diskit_and_qemu_respect_each_others_locks() {
    let dir = workdir();
    let img = dir.path().join("disk.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "4M"]));
    let sock = dir.path().join("s");
    {
        // qemu-nbd writes the image: readers and writers are refused, as
        // by qemu-img, unless they read with -U.
        let _q = hold("qemu-nbd", &["-f", "qcow2", "-k", s(&sock), s(&img)], &sock);
        for args in [
            vec!["info", s(&img)],
            vec!["map", s(&img)],
            vec!["check", s(&img)],
            vec!["check", "-r", "leaks", s(&img)],
            vec!["resize", s(&img), "8M"],
        ] {
            let (o, t) = (diskit(&args), qemu_img(&args));
            assert_eq!(code(&o), 1, "{args:?}");
            assert_eq!(code(&t), 1, "{args:?}");
            assert_eq!(message(&o), message(&t), "{args:?}");
        }
        ok(diskit(&["info", "-U", s(&img)]));
        ok(diskit(&["map", "-U", s(&img)]));
        ok(diskit(&["check", "-U", s(&img)]));
    }
    {
        // qemu-nbd -r reads it: readers go on, writers are refused.
        let _q = hold(
            "qemu-nbd",
            &["-r", "-f", "qcow2", "-k", s(&sock), s(&img)],
            &sock,
        );
        ok(diskit(&["info", s(&img)]));
        let args = ["resize", s(&img), "8M"];
        let (o, t) = (diskit(&args), qemu_img(&args));
        assert_eq!((code(&o), message(&o)), (code(&t), message(&t)));
        assert!(
            message(&o).contains("Failed to get \"write\" lock"),
            "{}",
            stderr(&o)
        );
    }
    {
        // diskit serves it, writable: qemu-img and qemu-io are refused.
        let _d = hold(
            diskit_bin().to_str().unwrap(),
            &["serve", "-f", "-U", s(&sock), "image", s(&img)],
            &sock,
        );
        let t = qemu_img(&["info", s(&img)]);
        assert_fails_with(&t, 1, "Failed to get shared \"write\" lock");
        let w = Command::new("qemu-io")
            .args(["-f", "qcow2", "-c", "write 0 4k", s(&img)])
            .output()
            .unwrap();
        assert!(
            stderr(&w).contains("Failed to get \"write\" lock")
                || stdout(&w).contains("Failed to get \"write\" lock"),
            "{}{}",
            stdout(&w),
            stderr(&w)
        );
        ok(qemu_img(&["info", "-U", s(&img)]));
        // And another diskit writer.
        let o = diskit(&["resize", s(&img), "16M"]);
        assert_eq!(code(&o), 1);
        assert!(
            message(&o).contains("Failed to get \"write\" lock"),
            "{}",
            stderr(&o)
        );
    }
    // Nobody holds it now.
    ok(diskit(&["resize", s(&img), "16M"]));
    ok(qemu_img(&["check", s(&img)]));
}

/// The lock bytes held on `file` (QEMU's: 100 + permission used, 200 +
/// permission kept from others), as a process other than the holder sees
/// them (F_OFD_GETLK through Python).
fn held_bytes(file: &Path) -> Vec<u64> {
    let script = r#"
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
held = []
for b in list(range(100, 104)) + list(range(200, 204)):
    lk = struct.pack('hhqqi', fcntl.F_WRLCK, 0, b, 1, 0)
    r = fcntl.fcntl(fd, 36, lk)  # F_OFD_GETLK
    if struct.unpack('hhqqi', r)[0] != fcntl.F_UNLCK:
        held.append(b)
print(' '.join(map(str, held)))
"#;
    let o = Command::new("python3")
        .args(["-c", script, s(file)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
        .split_whitespace()
        .map(|b| b.parse().unwrap())
        .collect()
}

#[test]
fn external_data_files_are_locked_as_qemu_locks_them() {
    let dir = workdir();
    let d = dir.path();
    let img = d.join("df.qcow2");
    let data = d.join("df.raw");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o",
        &[&format!("data_file={}", s(&data)), s(&img), "4M"],
    )));
    let sock = d.join("s");
    for read_only in [false, true] {
        let ro: &[&str] = if read_only { &["-r"] } else { &[] };
        // What qemu-nbd holds on the data file while it serves the image...
        let theirs = {
            let mut args = vec!["-f", "qcow2", "-k", s(&sock)];
            args.extend(ro);
            args.push(s(&img));
            let _q = hold("qemu-nbd", &args, &sock);
            held_bytes(&data)
        };
        // ...diskit holds too (in the foreground, so that dropping the
        // holder ends it).
        let ours = {
            let mut args = vec!["serve", "-f"];
            args.extend(ro);
            args.extend(["-U", s(&sock), "image", s(&img)]);
            let _q = hold(diskit_bin().to_str().unwrap(), &args, &sock);
            held_bytes(&data)
        };
        assert_eq!(theirs.contains(&101), !read_only, "{theirs:?}");
        assert_eq!(
            ours, theirs,
            "lock bytes on the data file (read-only: {read_only})"
        );
        assert!(held_bytes(&data).is_empty(), "locks left behind");
    }
}

#[test]
fn plugins_serving_files_writable_take_qemu_s_write_lock() {
    // file, split and partitioning write the files they serve: a file a
    // QEMU process writes is refused (qemu-img's message), and served
    // read-only (-r) it is not.
    let dir = workdir();
    let img = dir.path().join("disk.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "4M"]));
    let sock = dir.path().join("s");
    let _q = hold("qemu-nbd", &["-f", "qcow2", "-k", s(&sock), s(&img)], &sock);
    for plugin in ["file", "split", "partitioning"] {
        let o = diskit(&["serve", "-U", "-", plugin, s(&img), "--run", "true"]);
        assert_eq!(code(&o), 1, "{plugin} served a file qemu-nbd writes");
        assert!(
            message(&o).contains("Failed to get \"write\" lock"),
            "{plugin}: {}",
            stderr(&o)
        );
        ok(diskit(&[
            "serve",
            "-r",
            "-U",
            "-",
            plugin,
            s(&img),
            "--run",
            "true",
        ]));
    }
}
