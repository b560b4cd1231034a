//! Persistent dirty bitmaps, with QEMU as the oracle: the same writes made
//! by qemu-io on one copy and by diskit on another must leave the same
//! dirty bits (read back through qemu-nbd and nbdinfo), and both images
//! must pass `qemu-img check`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use diskit_core::{BlockDevice, WriteFlags, ZeroFlags};
use diskit_open::OpenOptions;

use common::{open_qcow2, run, s, writable};

/// The dirty map of bitmap `name` as QEMU sees it: qemu-nbd exports it as
/// the `qemu:dirty-bitmap:NAME` context and nbdinfo prints it.
fn qemu_dirty_map(img: &Path, name: &str) -> String {
    let sock = img.with_extension("sock");
    let _ = std::fs::remove_file(&sock);
    let mut server = Command::new("qemu-nbd")
        .args(["-r", "-f", "qcow2", "-B", name, "-k", s(&sock), s(img)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-nbd is installed");
    let start = Instant::now();
    while !sock.exists() {
        if start.elapsed() > Duration::from_secs(20) || server.try_wait().unwrap().is_some() {
            let _ = server.kill();
            let out = server.wait_with_output().unwrap();
            panic!(
                "qemu-nbd did not start: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let ctx = format!("--map=qemu:dirty-bitmap:{name}");
    let o = Command::new("nbdinfo").args([&ctx, &uri]).output();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_file(&sock);
    let o = o.expect("nbdinfo is installed");
    assert!(
        o.status.success(),
        "nbdinfo: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn check_clean(img: &Path) {
    // -U: the tests look at images they hold open, as at a running VM.
    let out = run("qemu-img", &["check", "-U", "--output=json", s(img)]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for k in ["corruptions", "leaks", "check-errors"] {
        assert_eq!(
            v.get(k).and_then(|x| x.as_u64()).unwrap_or(0),
            0,
            "{k}: {out}"
        );
    }
}

fn bitmap_flags(img: &Path) -> Vec<(String, Vec<String>)> {
    let out = run("qemu-img", &["info", "-U", "--output=json", s(img)]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["format-specific"]["data"]["bitmaps"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|b| {
                    let flags = b["flags"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|f| f.as_str().unwrap().to_string())
                        .collect();
                    (b["name"].as_str().unwrap().to_string(), flags)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// An 8 MiB image with three bitmaps (two enabled at 64 KiB and 4 KiB,
/// one disabled), all holding some dirty bits.
fn image_with_bitmaps(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let img = dir.join(name);
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-o", extra, s(&img), "8M"],
    );
    run("qemu-img", &["bitmap", "--add", s(&img), "b0"]);
    run(
        "qemu-img",
        &["bitmap", "--add", "-g", "4k", s(&img), "small"],
    );
    run("qemu-img", &["bitmap", "--add", s(&img), "off"]);
    run(
        "qemu-io",
        &["-c", "write -P 7 1M 64k", "-c", "write 6M 5k", s(&img)],
    );
    run("qemu-img", &["bitmap", "--disable", s(&img), "off"]);
    img
}

enum Op {
    Write(u64, usize),
    Zero(u64, u64),
    Discard(u64, u64),
}

fn qemu_io_cmds(ops: &[Op]) -> Vec<String> {
    ops.iter()
        .map(|op| match *op {
            Op::Write(o, l) => format!("write -P 9 {o} {l}"),
            Op::Zero(o, l) => format!("write -z {o} {l}"),
            Op::Discard(o, l) => format!("discard {o} {l}"),
        })
        .collect()
}

fn diskit_apply(img: &Path, ops: &[Op]) -> diskit_formats::Image {
    let image = open_qcow2(s(img), writable());
    for op in ops {
        match *op {
            Op::Write(o, l) => image
                .device
                .write_at(&vec![9u8; l], o, WriteFlags::NONE)
                .unwrap(),
            Op::Zero(o, l) => image
                .device
                .write_zeroes(o, l, ZeroFlags::default())
                .unwrap(),
            Op::Discard(o, l) => image.device.trim(o, l, WriteFlags::NONE).unwrap(),
        }
    }
    image
}

const OPS: &[Op] = &[
    Op::Write(0, 512),
    Op::Write(65536 * 3 - 100, 300),
    Op::Write(2 << 20, 200 << 10),
    Op::Zero(5 << 20, 128 << 10),
    Op::Zero((5 << 20) + 300_000, 1000),
    Op::Discard(7 << 20, 64 << 10),
    Op::Write((8 << 20) - 4096, 4096),
];

#[test]
fn writes_set_the_same_dirty_bits_as_qemu() {
    let dir = tempfile::tempdir().unwrap();
    for (i, extra) in ["cluster_size=65536", "cluster_size=16384,extended_l2=on"]
        .iter()
        .enumerate()
    {
        let ours = image_with_bitmaps(dir.path(), &format!("ours{i}.qcow2"), extra);
        let theirs = dir.path().join(format!("theirs{i}.qcow2"));
        std::fs::copy(&ours, &theirs).unwrap();
        let cmds = qemu_io_cmds(OPS);
        let mut args: Vec<&str> = Vec::new();
        for c in &cmds {
            args.extend(["-c", c]);
        }
        args.push(s(&theirs));
        run("qemu-io", &args);
        diskit_apply(&ours, OPS).close().unwrap();

        check_clean(&ours);
        run("qemu-img", &["compare", s(&ours), s(&theirs)]);
        assert_eq!(bitmap_flags(&ours), bitmap_flags(&theirs));
        for name in ["b0", "small", "off"] {
            let (a, b) = (qemu_dirty_map(&ours, name), qemu_dirty_map(&theirs, name));
            assert_eq!(a, b, "bitmap {name} ({extra})");
            assert!(a.contains("dirty"), "{name}: {a}");
        }
    }
}

#[test]
fn a_crash_leaves_the_enabled_bitmaps_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let img = image_with_bitmaps(dir.path(), "crash.qcow2", "cluster_size=65536");
    let image = diskit_apply(&img, &OPS[..2]);
    image.device.flush().unwrap();
    // No close: as if the process died here.
    std::mem::forget(image);
    let flags = bitmap_flags(&img);
    assert_eq!(
        flags,
        vec![
            (
                "b0".to_string(),
                vec!["in-use".to_string(), "auto".to_string()]
            ),
            (
                "small".to_string(),
                vec!["in-use".to_string(), "auto".to_string()]
            ),
            ("off".to_string(), vec![]),
        ]
    );
    // QEMU counts the clusters of in-use bitmaps too: nothing is lost.
    check_clean(&img);
}

#[test]
fn opening_for_writing_alone_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = image_with_bitmaps(dir.path(), "idle.qcow2", "cluster_size=65536");
    let before = std::fs::read(&img).unwrap();
    diskit_apply(&img, &[]).close().unwrap();
    assert!(std::fs::read(&img).unwrap() == before);
}

#[test]
fn resize_fits_the_bitmaps_as_qemu_does() {
    let dir = tempfile::tempdir().unwrap();
    for (name, delta, shrink) in [("grow", "+3M", false), ("shrink", "-3M", true)] {
        let ours = image_with_bitmaps(dir.path(), &format!("{name}.qcow2"), "cluster_size=65536");
        let theirs = dir.path().join(format!("{name}-qemu.qcow2"));
        std::fs::copy(&ours, &theirs).unwrap();
        let mut args = vec!["resize"];
        if shrink {
            args.push("--shrink");
        }
        args.extend([s(&theirs), delta]);
        run("qemu-img", &args);
        let image = diskit_apply(&ours, &OPS[..3]);
        let new_size = if shrink { 5 << 20 } else { 11 << 20 };
        image
            .ops
            .resize(new_size, shrink, diskit_open::Prealloc::Off)
            .unwrap();
        image.close().unwrap();
        // Closed and gone: its image locks with it (qemu-nbd reads next).
        drop(image);
        run(
            "qemu-io",
            &[
                "-c",
                "write -P 9 0 512",
                "-c",
                "write -P 9 196508 300",
                "-c",
                "write -P 9 2M 200k",
                s(&theirs),
            ],
        );
        check_clean(&ours);
        assert_eq!(bitmap_flags(&ours), bitmap_flags(&theirs));
        for b in ["b0", "small", "off"] {
            assert_eq!(
                qemu_dirty_map(&ours, b),
                qemu_dirty_map(&theirs, b),
                "{name} {b}"
            );
        }
    }
}

fn autoclear_bits(img: &Path) -> u64 {
    let b = std::fs::read(img).unwrap();
    u64::from_be_bytes(b[88..96].try_into().unwrap())
}

#[test]
fn unknown_autoclear_bits_go_at_a_writable_open() {
    let dir = tempfile::tempdir().unwrap();
    let img = image_with_bitmaps(dir.path(), "autoclear.qcow2", "cluster_size=65536");
    let mut bytes = std::fs::read(&img).unwrap();
    bytes[95] |= 1 << 5;
    std::fs::write(&img, bytes).unwrap();
    assert_eq!(autoclear_bits(&img), 1 | 1 << 5);
    let open = |writable| {
        open_qcow2(
            s(&img),
            OpenOptions {
                writable,
                ..Default::default()
            },
        )
    };
    open(false).close().unwrap();
    assert_eq!(
        autoclear_bits(&img),
        1 | 1 << 5,
        "a read-only open changes nothing"
    );
    open(true).close().unwrap();
    // The bitmaps bit stays: diskit keeps the bitmaps up to date.
    assert_eq!(autoclear_bits(&img), 1);
    check_clean(&img);
    assert_eq!(bitmap_flags(&img).len(), 3);
}
