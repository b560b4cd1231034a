//! Nothing lost: no command changes an image another process uses, or a
//! file that is its own source (by any name), and a failed command
//! removes only what it made. Each case runs through diskit and, where
//! qemu-img has the command, through qemu-img: both refuse, with the same
//! message, and the files keep their bytes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A process holding an image open until dropped.
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `holder` has the file open with QEMU's locks, seen in
/// /proc/locks by the file's inode.
fn wait_for_locks(holder: Child, file: &Path) -> Holder {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(file).unwrap().ino();
    let needle = format!(":{ino} ");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
        if locks.lines().any(|l| l.contains(&needle)) {
            return Holder(holder);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{} was not locked in time", file.display());
}

/// The three kinds of holder: qemu-nbd serving the image, qemu-io with it
/// open (reading commands from a pipe that stays open), and diskit serve.
fn hold(kind: &str, dir: &Path, image: &Path) -> Holder {
    let sock = dir.join(format!("{kind}.sock"));
    let mut cmd = match kind {
        "qemu-nbd" => {
            let mut c = Command::new("qemu-nbd");
            c.args(["-f", "qcow2", "-k", s(&sock), s(image)]);
            c
        }
        "qemu-io" => {
            let mut c = Command::new("qemu-io");
            c.args(["-f", "qcow2", s(image)]).stdin(Stdio::piped());
            c
        }
        _ => {
            let mut c = Command::new(diskit_bin());
            c.args(["serve", "-f", "-U", s(&sock), "image", s(image)]);
            c
        }
    };
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_locks(child, image)
}

/// The bytes of each file, to show that nothing changed.
fn contents(files: &[&Path]) -> Vec<Vec<u8>> {
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

/// Standard error without the program's name.
fn message(o: &std::process::Output) -> String {
    stderr(o).replace("qemu-img: ", "").replace("diskit: ", "")
}

/// An overlay with data over a base, and another image to copy from.
fn images(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let base = dir.join("base.qcow2");
    let vm = dir.join("vm.qcow2");
    let other = dir.join("other.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]));
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x11 1M 1M", s(&base)],
    ));
    ok(qemu_img(&argv(
        "create -q -f qcow2 -F qcow2 -b",
        &[s(&base), s(&vm)],
    )));
    ok(peer(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x55 0 1M", s(&vm)],
    ));
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&other), "4M"]));
    (base, vm, other)
}

#[test]
fn no_command_changes_an_image_in_use() {
    let dir = workdir();
    let (base, vm, other) = images(dir.path());
    let (vm_s, other_s) = (s(&vm), s(&other));
    // Every command that writes an image, the image being held.
    let commands: Vec<Vec<&str>> = vec![
        vec!["create", "-f", "qcow2", vm_s, "1M"],
        vec!["convert", "-O", "qcow2", other_s, vm_s],
        vec!["convert", "-n", "-O", "qcow2", other_s, vm_s],
        vec!["dd", "-O", "qcow2", "bs=64k"],
        vec!["commit", vm_s],
        vec!["rebase", "-u", "-b", other_s, "-F", "qcow2", vm_s],
        vec!["resize", vm_s, "8M"],
        vec!["amend", "-o", "lazy_refcounts=on", vm_s],
        vec!["snapshot", "-c", "s1", vm_s],
        vec!["bitmap", "--add", vm_s, "b0"],
        vec!["create", "-f", "qcow2", s(&base), "1M"],
    ];
    let (dd_in, dd_out) = (format!("if={other_s}"), format!("of={vm_s}"));
    for kind in ["qemu-nbd", "qemu-io", "diskit"] {
        let before = contents(&[&vm, &base]);
        let _holder = hold(kind, dir.path(), &vm);
        for args in &commands {
            let mut args = args.clone();
            if args[0] == "dd" {
                args.extend([dd_in.as_str(), dd_out.as_str()]);
            }
            let (ours, theirs) = (diskit(&args), qemu_img(&args));
            assert_eq!(code(&ours), 1, "{kind}: {args:?}: {}", stderr(&ours));
            assert_eq!(code(&theirs), 1, "{kind}: {args:?}: {}", stderr(&theirs));
            assert_eq!(message(&ours), message(&theirs), "{kind}: {args:?}");
            assert!(message(&ours).contains("lock"), "{kind}: {args:?}");
            assert!(
                contents(&[&vm, &base]) == before,
                "{kind}: {args:?} changed the image"
            );
        }
        // diskit copy (nbdcopy) into a held file is refused the same way.
        let o = diskit(&["copy", other_s, vm_s]);
        assert_eq!(code(&o), 1, "{kind}: copy");
        assert!(
            stderr(&o).contains("Failed to get \"write\" lock"),
            "{kind}: {}",
            stderr(&o)
        );
        assert!(
            contents(&[&vm, &base]) == before,
            "{kind}: copy changed the image"
        );
    }
}

#[test]
fn no_command_writes_its_own_source_by_any_name() {
    let dir = workdir();
    let d = dir.path();
    let src = d.join("a.raw");
    sparse_file(&src, 1 << 20, &[(0, 65536, 0xff), (512 << 10, 4096, 0x42)]);
    std::os::unix::fs::symlink("a.raw", d.join("link.raw")).unwrap();
    std::fs::hard_link(&src, d.join("hard.raw")).unwrap();
    // An overlay whose backing file is the raw source.
    let ov = d.join("ov.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -F raw -b a.raw",
        &[s(&ov)],
    )));
    let before = std::fs::read(&src).unwrap();
    let names = ["a.raw", "link.raw", "hard.raw"];
    let mut cases: Vec<Vec<String>> = Vec::new();
    for target in names {
        for extra in [&[][..], &["-n"], &["-U"], &["-U", "-n"]] {
            let mut args = vec!["convert".to_string()];
            args.extend(extra.iter().map(|x| x.to_string()));
            args.extend(["-O", "raw", "a.raw", target].map(String::from));
            cases.push(args);
            // The source's backing file as the target.
            let mut args = vec!["convert".to_string()];
            args.extend(extra.iter().map(|x| x.to_string()));
            args.extend(["-O", "raw", "ov.qcow2", target].map(String::from));
            cases.push(args);
        }
        cases.push(vec!["dd".into(), "if=a.raw".into(), format!("of={target}")]);
        cases.push(vec![
            "dd".into(),
            "if=ov.qcow2".into(),
            format!("of={target}"),
        ]);
        cases.push(vec![
            "create".into(),
            "-f".into(),
            "qcow2".into(),
            "-F".into(),
            "raw".into(),
            "-b".into(),
            "a.raw".into(),
            target.into(),
        ]);
    }
    for args in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let ours = tool_in(d, "diskit", &args);
        assert_eq!(code(&ours), 1, "{args:?}: {}", stderr(&ours));
        assert_eq!(
            std::fs::read(&src).unwrap(),
            before,
            "{args:?} wrote its source"
        );
        // Where qemu-img refuses too (its locks see the source), the
        // message is its own; where it would write its source (-U, dd,
        // a backing file named as the new image), diskit names the source.
        let theirs = tool_in(d, "qemu-img", &args);
        if code(&theirs) == 1 {
            assert_eq!(message(&ours), message(&theirs), "{args:?}");
        } else {
            assert!(
                message(&ours).contains("a source of this command"),
                "{args:?}: {}",
                message(&ours)
            );
            // qemu-img wrote it: put the source back for the next case.
            std::fs::write(&src, &before).unwrap();
        }
    }
    // nbdcopy's command line: the destination is the source's other name.
    for target in names {
        let o = tool_in(d, "diskit", &["copy", "a.raw", target]);
        assert_eq!(code(&o), 1, "copy to {target}");
        assert_stderr_has(&o, "a source of this command");
        assert_eq!(std::fs::read(&src).unwrap(), before, "copy to {target}");
    }
}

/// How `unshare` makes a mount namespace here: as root directly, else
/// inside a user namespace; `None` when neither is allowed.
fn mount_namespace_flags() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let flags = if root { "-m" } else { "-rm" };
    let works = Command::new("unshare")
        .args([flags, "true"])
        .status()
        .is_ok_and(|st| st.success());
    works.then_some(flags)
}

#[test]
fn a_full_disk_fails_create_and_convert_and_leaves_other_files_intact() {
    let Some(flags) = mount_namespace_flags() else {
        eprintln!("skipped: unshare cannot make a mount namespace here");
        return;
    };
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 8 << 20, &[(0, 8 << 20, 0xff)]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    // On a 4 MiB tmpfs: a file that must survive, an image that exists
    // before each command (its name stays), and new names (they go).
    let script = format!(
        r#"set -u
mount -t tmpfs -o size=4M tmpfs {m} || exit 99
cd {m}
head -c 1048576 /dev/urandom > keep.bin
sum=$(sha1sum keep.bin)
qemu-img create -q -f qcow2 old.qcow2 1M
run() {{ "$@" >/dev/null 2>{err}; echo "rc=$? $(head -c 300 {err} | tr '\n' ' ')"; }}
run {d} convert -O raw {src} new.raw
run {d} convert -O qcow2 {src} old.qcow2
run {d} create -f raw -o preallocation=full new2.raw 8M
run {d} create -f qcow2 -o preallocation=full old.qcow2 8M
run {d} copy {src} new3.raw
ls
[ "$(sha1sum keep.bin)" = "$sum" ] && echo keep intact
"#,
        m = s(&mnt),
        d = diskit_bin().display(),
        src = s(&src),
        // Messages go outside the full file system.
        err = s(&dir.path().join("err")),
    );
    let o = timed("unshare", 120)
        .args([flags, "sh", "-c", &script])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    let lines: Vec<&str> = out.lines().collect();
    for l in &lines[..5] {
        assert!(l.starts_with("rc=1 "), "a command did not fail: {out}");
        assert!(l.contains("No space left on device"), "{out}");
        assert!(!l.contains("panic"), "{out}");
    }
    let files: Vec<&str> = lines[5..lines.len() - 1].to_vec();
    assert_eq!(files, ["keep.bin", "old.qcow2"], "{out}");
    assert_eq!(lines.last(), Some(&"keep intact"), "{out}");
}
