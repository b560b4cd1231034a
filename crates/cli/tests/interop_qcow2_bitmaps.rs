//! `convert --bitmaps` against qemu-img: the target carries every bitmap
//! of the source with the same bits (read back through qemu-nbd and
//! nbdinfo), flags and granularity, and the errors are qemu-img's.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn peer_ok(tool: &str, args: &[&str]) {
    ok(peer(tool, args));
}

/// A 4 MiB image with bitmaps "b0" (enabled), "fine" (4 KiB granularity)
/// and "frozen" (disabled), all holding dirty bits.
fn source(dir: &Path) -> PathBuf {
    let img = dir.join("src.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "4M"]));
    ok(qemu_img(&["bitmap", "--add", s(&img), "b0"]));
    ok(qemu_img(&["bitmap", "--add", "-g", "4k", s(&img), "fine"]));
    ok(qemu_img(&["bitmap", "--add", s(&img), "frozen"]));
    peer_ok(
        "qemu-io",
        &["-c", "write -P 3 64k 8k", "-c", "write 3M 100k", s(&img)],
    );
    ok(qemu_img(&["bitmap", "--disable", s(&img), "frozen"]));
    peer_ok("qemu-io", &["-c", "write -P 5 2M 4k", s(&img)]);
    img
}

fn dirty_map(img: &Path, name: &str) -> String {
    let server = QemuNbd::start(
        &img.with_extension("sock"),
        &["-r", "-f", "qcow2", "-B", name, s(img)],
    );
    let o = Command::new("nbdinfo")
        .args([&format!("--map=qemu:dirty-bitmap:{name}"), &server.uri])
        .output();
    drop(server);
    stdout(&ok(o.expect("nbdinfo is installed")))
}

fn bitmaps_json(img: &Path) -> serde_json::Value {
    let out = stdout(&ok(qemu_img(&["info", "--output=json", s(img)])));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["format-specific"]["data"]["bitmaps"].clone()
}

#[test]
fn convert_carries_every_bitmap_like_qemu_img() {
    let dir = workdir();
    let src = source(dir.path());
    for extra in [&[][..], &["-o", "cluster_size=4096"][..], &["-c"][..]] {
        let ours = dir.path().join("ours.qcow2");
        let theirs = dir.path().join("theirs.qcow2");
        let mut args = vec!["convert", "--bitmaps", "-O", "qcow2"];
        args.extend_from_slice(extra);
        args.extend([s(&src)]);
        ok(diskit(&[&args[..], &[s(&ours)]].concat()));
        ok(qemu_img(&[&args[..], &[s(&theirs)]].concat()));
        let check = stdout(&ok(qemu_img(&["check", s(&ours)])));
        assert_contains(&check, "No errors were found");
        ok(qemu_img(&["compare", s(&src), s(&ours)]));
        assert_eq!(bitmaps_json(&ours), bitmaps_json(&theirs), "{extra:?}");
        for name in ["b0", "fine", "frozen"] {
            let (a, b) = (dirty_map(&ours, name), dirty_map(&theirs, name));
            assert!(a.contains("dirty"), "{name}: {a}");
            assert_eq!(a, b, "{name} {extra:?}");
        }
        // The copied bitmaps go on tracking writes: qemu-img opens the
        // target and writes through them.
        peer_ok("qemu-io", &["-c", "write 1M 4k", s(&ours)]);
        assert!(dirty_map(&ours, "b0").contains("1048576"));
        std::fs::remove_file(&ours).unwrap();
        std::fs::remove_file(&theirs).unwrap();
    }
}

/// Sets the in-use flag of the first bitmap, as a crash of its writer
/// would leave it.
fn mark_first_in_use(img: &Path) {
    let mut bytes = std::fs::read(img).unwrap();
    let magic = 0x2385_2875u32.to_be_bytes();
    let at = bytes[..65536]
        .windows(4)
        .position(|w| w == magic)
        .expect("bitmaps extension");
    let dir = u64::from_be_bytes(bytes[at + 24..at + 32].try_into().unwrap()) as usize;
    bytes[dir + 15] |= 1;
    std::fs::write(img, bytes).unwrap();
}

#[test]
fn inconsistent_bitmaps_fail_or_are_skipped() {
    let dir = workdir();
    let src = source(dir.path());
    mark_first_in_use(&src);
    let out = dir.path().join("out.qcow2");
    let args = ["convert", "--bitmaps", "-O", "qcow2", s(&src), s(&out)];
    let d = diskit(&args);
    let q = qemu_img(&args);
    assert_eq!(code(&d), 1);
    assert_eq!(code(&q), 1);
    assert_stderr_has(&d, "Cannot copy inconsistent bitmap 'b0'");
    assert!(stderr(&q).contains("Cannot copy inconsistent bitmap 'b0'"));

    let args = [
        "convert",
        "--bitmaps",
        "--skip-broken-bitmaps",
        "-O",
        "qcow2",
        s(&src),
        s(&out),
    ];
    let d = ok(diskit(&args));
    assert!(stderr(&d).contains("Skipping inconsistent bitmap 'b0'"));
    let names: Vec<String> = bitmaps_json(&out)
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["fine", "frozen"]);
}

#[test]
fn bitmap_errors_match_qemu_img() {
    let dir = workdir();
    let src = source(dir.path());
    let raw = dir.path().join("plain.raw");
    ok(qemu_img(&["create", "-q", "-f", "raw", s(&raw), "4M"]));
    let out = dir.path().join("o");
    let cases: Vec<Vec<&str>> = vec![
        vec!["convert", "--bitmaps", "-O", "qcow2", s(&raw), s(&out)],
        vec!["convert", "--bitmaps", "-O", "raw", s(&src), s(&out)],
        vec![
            "convert",
            "--bitmaps",
            "-O",
            "qcow2",
            "-o",
            "compat=0.10",
            s(&src),
            s(&out),
        ],
    ];
    for args in cases {
        let d = diskit(&args);
        let q = qemu_img(&args);
        assert_eq!(code(&d), code(&q), "{args:?}");
        let want = stderr(&q).trim().replace("qemu-img: ", "");
        assert!(
            stderr(&d).contains(&want),
            "{args:?}: {} vs {want}",
            stderr(&d)
        );
        let _ = std::fs::remove_file(&out);
    }
}

/// `diskit bitmap` against `qemu-img bitmap`: the same operations on two
/// copies of an image leave the same bitmaps (names, flags, granularity,
/// dirty bits read back through qemu-nbd), a clean `qemu-img check`, and
/// the same messages and exit codes.
#[test]
fn bitmap_subcommand_edits_as_qemu_img_does() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    let other = d.join("other.qcow2");
    std::fs::copy(&src, &other).unwrap();
    peer_ok("qemu-io", &["-c", "write 1M 64k", s(&other)]);
    let copies = [d.join("ours.qcow2"), d.join("theirs.qcow2")];
    for c in &copies {
        std::fs::copy(&src, c).unwrap();
    }
    let steps: &[&[&str]] = &[
        &["--add", "IMG", "new"],
        &["--add", "-g", "128k", "--disable", "IMG", "coarse"],
        &["--merge", "b0", "IMG", "new"],
        &[
            "--merge", "b0", "-b", "OTHER", "-F", "qcow2", "IMG", "coarse",
        ],
        &["--clear", "--enable", "IMG", "fine"],
        &["--remove", "IMG", "frozen"],
        &["--enable", "IMG", "nope"],
        &["--add", "IMG", "new"],
        &["--add", "-g", "1000", "IMG", "x"],
        &["-g", "64k", "--remove", "IMG", "new"],
        &["IMG", "b0"],
        &["--add", "IMG"],
    ];
    for step in steps {
        let outs: Vec<(i32, String)> = copies
            .iter()
            .enumerate()
            .map(|(i, img)| {
                let args: Vec<&str> = step
                    .iter()
                    .map(|a| match *a {
                        "IMG" => s(img),
                        "OTHER" => s(&other),
                        a => a,
                    })
                    .collect();
                let o = if i == 0 {
                    diskit(&[&["bitmap"], &args[..]].concat())
                } else {
                    qemu_img(&[&["bitmap"], &args[..]].concat())
                };
                (
                    code(&o),
                    // diskit adds a hint to usage errors.
                    stderr(&o)
                        .replace("diskit: ", "")
                        .replace("qemu-img: ", "")
                        .replace("Try 'diskit bitmap --help' for more info\n", ""),
                )
            })
            .collect();
        assert_eq!(outs[0], outs[1], "{step:?}");
    }
    assert_eq!(bitmaps_json(&copies[0]), bitmaps_json(&copies[1]));
    let names: Vec<String> = bitmaps_json(&copies[1])
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    for name in &names {
        assert_eq!(
            dirty_map(&copies[0], name),
            dirty_map(&copies[1], name),
            "bitmap {name}"
        );
    }
    // The merges carried dirty bits.
    for name in ["new", "coarse"] {
        assert!(dirty_map(&copies[0], name).contains("dirty"), "{name}");
    }
    let check = qemu_img(&["check", s(&copies[0])]);
    assert_eq!(code(&check), 0, "{}", stdout(&check));
}
