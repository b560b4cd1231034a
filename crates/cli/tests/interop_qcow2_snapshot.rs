//! Internal snapshots and `amend`, both ways with qemu-img and qemu-io as
//! the oracle: snapshots diskit creates, applies and deletes leave images
//! that `qemu-img check` finds clean, that `qemu-img snapshot -l` lists and
//! whose snapshots `qemu-img convert -l` reads back as they were; snapshots
//! qemu-img made are applied and deleted by diskit; every amendable option
//! changes what `qemu-img info` shows and nothing else; errors read as
//! qemu-img's.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

fn qemu_io(img: &Path, cmds: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(s(img));
    ok(peer("qemu-io", &args));
}

/// A qcow2 image made by qemu-img with `opts`, holding data, a compressed
/// cluster, a zero cluster and a partial cluster written by qemu-io.
fn qemu_image(dir: &Path, name: &str, opts: &str, size: &str) -> PathBuf {
    let img = dir.join(name);
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([s(&img), size]);
    ok(qemu_img(&args));
    qemu_io(
        &img,
        &[
            "write -P 0x11 0 64k",
            "write -P 0x22 1M 128k",
            "write -c -P 0x33 2M 64k",
            "write -z 3M 64k",
            "write -P 0x44 3100k 3k",
        ],
    );
    img
}

/// `qemu-img check` finds no errors and no leaks.
fn clean(img: &Path, what: &str) {
    let o = qemu_img(&["check", s(img)]);
    assert_eq!(code(&o), 0, "{what}: {}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("No errors were found"),
        "{what}: {}",
        stdout(&o)
    );
}

/// The active disk (or snapshot `snap`) as raw bytes, read by qemu-img.
fn contents(img: &Path, snap: Option<&str>, out: &Path) -> Vec<u8> {
    let mut args = vec!["convert", "-O", "raw"];
    if let Some(sn) = snap {
        args.extend(["-l", sn]);
    }
    args.extend([s(img), s(out)]);
    ok(qemu_img(&args));
    std::fs::read(out).unwrap()
}

fn snap_ok(args: &[&str]) {
    let mut a = vec!["snapshot"];
    a.extend(args);
    ok(diskit(&a));
}

/// `qemu-img snapshot -l` lists exactly `names` (in order), and diskit's
/// listing is byte-identical to it.
fn lists(img: &Path, names: &[&str], what: &str) {
    let theirs = stdout(&ok(qemu_img(&["snapshot", "-l", s(img)])));
    let tags: Vec<String> = theirs
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
        .collect();
    assert_eq!(tags, names, "{what}: {theirs}");
    let ours = stdout(&ok(diskit(&["snapshot", "-l", s(img)])));
    assert_eq!(ours, theirs, "{what}");
}

#[test]
fn diskit_snapshots_are_qemus() {
    let dir = workdir();
    let d = dir.path();
    for opts in [
        "",
        "compat=0.10",
        "extended_l2=on",
        "cluster_size=512",
        "lazy_refcounts=on",
        "refcount_bits=8",
    ] {
        let img = qemu_image(d, "a.qcow2", opts, "4M");
        let before = contents(&img, None, &d.join("before.raw"));
        snap_ok(&["-c", "s1", s(&img)]);
        clean(&img, opts);
        lists(&img, &["s1"], opts);
        // Writes after the snapshot leave it as it was.
        qemu_io(
            &img,
            &[
                "write -P 0x55 0 192k",
                "write -P 0x66 2M 4k",
                "write -z 1M 64k",
            ],
        );
        clean(&img, opts);
        assert!(
            contents(&img, Some("s1"), &d.join("s1.raw")) == before,
            "{opts}: s1 changed"
        );
        let mid = contents(&img, None, &d.join("mid.raw"));
        assert!(mid != before);
        snap_ok(&["-c", "s2", s(&img)]);
        clean(&img, opts);
        lists(&img, &["s1", "s2"], opts);
        // Back to s1, then away with it: s2 stays as it was.
        snap_ok(&["-a", "s1", s(&img)]);
        clean(&img, opts);
        assert!(contents(&img, None, &d.join("now.raw")) == before, "{opts}");
        snap_ok(&["-d", "s1", s(&img)]);
        clean(&img, opts);
        lists(&img, &["s2"], opts);
        assert!(
            contents(&img, Some("s2"), &d.join("s2.raw")) == mid,
            "{opts}: s2 changed"
        );
        assert!(contents(&img, None, &d.join("now.raw")) == before, "{opts}");
        // Writes after the last snapshot is gone go in place again.
        snap_ok(&["-d", "s2", s(&img)]);
        clean(&img, opts);
        qemu_io(&img, &["write -P 0x77 0 64k"]);
        clean(&img, opts);
        std::fs::remove_file(&img).unwrap();
    }
}

#[test]
fn diskit_writes_after_a_snapshot_keep_it() {
    let dir = workdir();
    let d = dir.path();
    let img = qemu_image(d, "a.qcow2", "", "4M");
    let before = contents(&img, None, &d.join("before.raw"));
    snap_ok(&["-c", "keep", s(&img)]);
    let new = d.join("new.raw");
    sparse_file(&new, 4 << 20, &[(0, 96 << 10, 0xff), (2 << 20, 4096, 0x5a)]);
    ok(diskit(&argv(
        "convert -n -f raw -O qcow2",
        &[s(&new), s(&img)],
    )));
    clean(&img, "after diskit writes");
    assert!(contents(&img, Some("keep"), &d.join("keep.raw")) == before);
    ok(qemu_img(&["compare", "-f", "raw", s(&new), s(&img)]));
    // And the snapshot comes back through diskit too.
    snap_ok(&["-a", "keep", s(&img)]);
    clean(&img, "after apply");
    assert!(contents(&img, None, &d.join("now.raw")) == before);
}

#[test]
fn qemu_snapshots_applied_and_deleted_by_diskit() {
    let dir = workdir();
    let d = dir.path();
    let img = qemu_image(d, "a.qcow2", "", "4M");
    let first = contents(&img, None, &d.join("first.raw"));
    ok(qemu_img(&["snapshot", "-c", "one", s(&img)]));
    qemu_io(&img, &["write -P 0x99 64k 1M"]);
    let second = contents(&img, None, &d.join("second.raw"));
    ok(qemu_img(&["snapshot", "-c", "two", s(&img)]));
    qemu_io(&img, &["write -P 0xaa 0 2M"]);
    // Apply by id, then by name.
    snap_ok(&["-a", "1", s(&img)]);
    clean(&img, "apply 1");
    assert!(contents(&img, None, &d.join("now.raw")) == first);
    snap_ok(&["-a", "two", s(&img)]);
    clean(&img, "apply two");
    assert!(contents(&img, None, &d.join("now.raw")) == second);
    snap_ok(&["-d", "one", s(&img)]);
    clean(&img, "delete one");
    lists(&img, &["two"], "delete one");
    // qemu-img carries on from what diskit left.
    ok(qemu_img(&["snapshot", "-c", "three", s(&img)]));
    snap_ok(&["-c", "four", s(&img)]);
    clean(&img, "mixed");
    lists(&img, &["two", "three", "four"], "mixed");
    let ids = stdout(&ok(qemu_img(&["snapshot", "-l", s(&img)])));
    assert!(ids.lines().last().unwrap().starts_with("4 "), "{ids}");
    ok(qemu_img(&["snapshot", "-d", "two", s(&img)]));
    snap_ok(&["-d", "three", s(&img)]);
    snap_ok(&["-d", "four", s(&img)]);
    clean(&img, "all gone");
    assert!(stdout(&ok(qemu_img(&["snapshot", "-l", s(&img)]))).is_empty());
    assert!(contents(&img, None, &d.join("now.raw")) == second);
}

/// An image with two snapshots and active data over them, for the same
/// operation by both tools.
fn layered_image(d: &Path, opts: &str) -> PathBuf {
    let img = qemu_image(d, "layered.qcow2", opts, "4M");
    qemu_io(&img, &["write -P 0x01 0 4M"]);
    ok(qemu_img(&["snapshot", "-c", "s1", s(&img)]));
    qemu_io(&img, &["write -P 0x02 1M 1M", "write -P 0x03 3M 512k"]);
    ok(qemu_img(&["snapshot", "-c", "s2", s(&img)]));
    qemu_io(&img, &["write -P 0x04 2M 64k"]);
    img
}

/// Runs `ours` (diskit) and `theirs` (qemu-img) on copies of `img` and
/// requires byte-identical results: the same clusters freed, and their
/// space given back (a freed cluster reads as zeros, as QEMU punches it).
fn same_result_as_qemu_img(img: &Path, ours: &[&str], theirs: &[&str], what: &str) {
    let a = img.with_extension("qemu.qcow2");
    let b = img.with_extension("diskit.qcow2");
    std::fs::copy(img, &a).unwrap();
    std::fs::copy(img, &b).unwrap();
    let with = |args: &[&str], p: &Path| -> Vec<String> {
        args.iter()
            .map(|x| {
                if *x == "IMG" {
                    s(p).to_string()
                } else {
                    x.to_string()
                }
            })
            .collect()
    };
    let theirs = with(theirs, &a);
    ok(qemu_img(
        &theirs.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let ours = with(ours, &b);
    ok(diskit(&ours.iter().map(String::as_str).collect::<Vec<_>>()));
    clean(&b, what);
    assert!(same_bytes(&a, &b), "{what}: images differ");
}

#[test]
fn shrink_and_delete_with_snapshots_match_qemu_img_byte_for_byte() {
    let dir = workdir();
    let d = dir.path();
    for opts in [
        "",
        "cluster_size=4096",
        "extended_l2=on",
        "cluster_size=512",
    ] {
        let img = layered_image(d, opts);
        for size in ["1536k", "100k", "3M"] {
            let what = format!("shrink to {size} ({opts})");
            let args = ["resize", "-q", "--shrink", "IMG", size];
            same_result_as_qemu_img(&img, &args[..], &args[..], &what);
        }
        let grow = ["resize", "-q", "IMG", "6M"];
        same_result_as_qemu_img(&img, &grow, &grow, &format!("grow ({opts})"));
        for sn in ["s1", "s2"] {
            let args = ["snapshot", "-d", sn, "IMG"];
            same_result_as_qemu_img(&img, &args, &args, &format!("delete {sn} ({opts})"));
        }
    }
    // v2 images keep their size while they hold snapshots.
    let img = layered_image(d, "compat=0.10");
    let o = diskit(&["resize", s(&img), "8M"]);
    assert_fails_with(&o, 1, "Can't resize a v2 image which has snapshots");
}

#[test]
fn apply_takes_the_snapshots_size() {
    let dir = workdir();
    let d = dir.path();
    let img = qemu_image(d, "a.qcow2", "", "4M");
    let small = contents(&img, None, &d.join("small.raw"));
    snap_ok(&["-c", "small", s(&img)]);
    ok(qemu_img(&["resize", "-q", s(&img), "40M"]));
    qemu_io(&img, &["write -P 0x12 30M 64k"]);
    let big = contents(&img, None, &d.join("big.raw"));
    snap_ok(&["-c", "big", s(&img)]);
    snap_ok(&["-a", "small", s(&img)]);
    clean(&img, "apply small");
    assert!(contents(&img, None, &d.join("now.raw")) == small);
    snap_ok(&["-a", "big", s(&img)]);
    clean(&img, "apply big");
    assert!(contents(&img, None, &d.join("now.raw")) == big);
}

/// Runs `args` (with `{}` standing for the image) through diskit and
/// qemu-img on two copies of `img`; both must end the same way with the
/// same message (program prefix aside). Returns diskit's run.
fn fails_like_qemu_img(img: &Path, args: &[&str], as_nobody: bool) -> Output {
    let mine = img.with_extension("ours");
    let theirs = img.with_extension("theirs");
    for copy in [&mine, &theirs] {
        std::fs::copy(img, copy).unwrap();
        std::fs::set_permissions(copy, std::fs::metadata(img).unwrap().permissions()).unwrap();
    }
    let run = |tool: &Path, copy: &Path| {
        let args: Vec<&str> = args
            .iter()
            .map(|a| if *a == "{}" { s(copy) } else { a })
            .collect();
        // Root ignores file modes: drop to nobody to see them apply.
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        if as_nobody && root {
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(tool)
                .args(&args)
                .output()
                .unwrap()
        } else {
            Command::new(tool).args(&args).output().unwrap()
        }
    };
    let o = run(&diskit_bin(), &mine);
    let t = run(Path::new("qemu-img"), &theirs);
    let strip = |e: String| {
        e.replace("diskit", "qemu-img")
            .replace(".ours", "")
            .replace(".theirs", "")
    };
    assert_eq!(code(&o), code(&t), "{args:?}: {}", stderr(&o));
    assert_eq!(strip(stderr(&o)), strip(stderr(&t)), "{args:?}");
    assert_eq!(stdout(&o), stdout(&t), "{args:?}");
    o
}

#[test]
fn errors_like_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let img = qemu_image(d, "a.qcow2", "", "4M");
    snap_ok(&["-c", "s1", s(&img)]);
    for args in [
        ["snapshot", "-a", "nope", "{}"],
        ["snapshot", "-d", "nope", "{}"],
        // -d looks names up, not ids.
        ["snapshot", "-d", "1", "{}"],
        ["snapshot", "-c", "s1", "{}"],
    ] {
        let o = fails_like_qemu_img(&img, &args, false);
        assert_eq!(code(&o) == 0, args[2] == "s1", "{args:?}");
    }
    // A duplicate name is allowed, with the next id.
    snap_ok(&["-c", "s1", s(&img)]);
    clean(&img, "duplicate");
    lists(&img, &["s1", "s1"], "duplicate");
    // -d takes the first of them.
    snap_ok(&["-d", "s1", s(&img)]);
    let list = stdout(&ok(qemu_img(&["snapshot", "-l", s(&img)])));
    assert!(list.lines().nth(2).unwrap().starts_with("2 "), "{list}");
    clean(&img, "duplicate deleted");

    // A file that cannot be opened for writing.
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o444)).unwrap();
    for op in ["-c", "-a", "-d"] {
        let o = fails_like_qemu_img(&img, &["snapshot", op, "s1", "{}"], true);
        assert_fails_with(&o, 1, "Permission denied");
    }
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o644)).unwrap();

    // Formats and images without internal snapshots.
    let raw = d.join("r.raw");
    sparse_file(&raw, 1 << 20, &[]);
    for op in ["-c", "-a", "-d"] {
        fails_like_qemu_img(&raw, &["snapshot", "-f", "raw", op, "x", "{}"], false);
        fails_like_qemu_img(&raw, &["snapshot", op, "x", "{}"], false);
    }
    let ext = d.join("ext.qcow2");
    let data_opt = format!("data_file={}", s(&d.join("ext.data")));
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o",
        &[&data_opt, s(&ext), "1M"],
    )));
    for op in ["-c", "-a", "-d"] {
        fails_like_qemu_img(&ext, &["snapshot", op, "x", "{}"], false);
    }
    // A refcount too narrow for a second reference: nothing is changed.
    let narrow = qemu_image(d, "n.qcow2", "refcount_bits=1", "4M");
    let o = diskit(&["snapshot", "-c", "x", s(&narrow)]);
    assert_eq!(code(&o), 1);
    assert_eq!(
        stderr(&o),
        "diskit: Could not create snapshot 'x': Invalid argument\n"
    );
    clean(&narrow, "refcount_bits=1");
    assert!(stdout(&ok(qemu_img(&["snapshot", "-l", s(&narrow)]))).is_empty());
    // Mixed operations are a usage error.
    let o = diskit(&["snapshot", "-c", "a", "-d", "b", s(&img)]);
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).contains("Cannot mix '-l', '-a', '-c', '-d'"));
}

/// qemu-img's format-specific data for an image.
fn qcow2_info(img: &Path) -> serde_json::Value {
    let o = ok(qemu_img(&["info", "--output=json", s(img)]));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["format-specific"]["data"].clone()
}

#[test]
fn amend_every_option() {
    let dir = workdir();
    let d = dir.path();
    // (created with, amended with, field, value qemu-img info then shows)
    let cases: [(&str, &str, &str, serde_json::Value); 12] = [
        ("compat=0.10", "compat=1.1", "compat", "1.1".into()),
        ("compat=1.1", "compat=0.10", "compat", "0.10".into()),
        ("lazy_refcounts=on", "compat=v2", "compat", "0.10".into()),
        (
            "compression_type=zstd",
            "compat=0.10",
            "compat",
            "0.10".into(),
        ),
        (
            "compat=1.1",
            "lazy_refcounts=on",
            "lazy-refcounts",
            true.into(),
        ),
        (
            "lazy_refcounts=on",
            "lazy_refcounts=off",
            "lazy-refcounts",
            false.into(),
        ),
        ("compat=1.1", "refcount_bits=1", "refcount-bits", 1.into()),
        ("compat=1.1", "refcount_bits=4", "refcount-bits", 4.into()),
        (
            "refcount_bits=8",
            "refcount_bits=64",
            "refcount-bits",
            64.into(),
        ),
        (
            "cluster_size=4096",
            "refcount_bits=8",
            "refcount-bits",
            8.into(),
        ),
        (
            "compat=0.10",
            "compat=1.1,refcount_bits=32,lazy_refcounts=on",
            "refcount-bits",
            32.into(),
        ),
        (
            "compat=1.1",
            "compat=0.10,refcount_bits=16",
            "compat",
            "0.10".into(),
        ),
    ];
    for (create, amend, field, want) in cases {
        let what = format!("{create} -> {amend}");
        let img = d.join("a.qcow2");
        ok(qemu_img(&argv(
            "create -q -f qcow2 -o",
            &[create, s(&img), "4M"],
        )));
        // Data, zero clusters (plain and allocated) and, where a refcount
        // of 2 fits, a snapshot; compressed data only where it may stay.
        let mut cmds = vec![
            "write -P 0x11 0 64k",
            "write -z 1M 128k",
            "write -P 0x22 2M 64k",
            "write -z 2M 64k",
            "write -P 0x33 3M 4k",
        ];
        if !amend.contains("compat=0.10") && !create.contains("zstd") {
            cmds.push("write -c -P 0x44 3200k 64k");
        }
        qemu_io(&img, &cmds);
        if !amend.contains("refcount_bits=1") {
            ok(qemu_img(&["snapshot", "-c", "keep", s(&img)]));
            qemu_io(&img, &["write -P 0x55 0 32k"]);
        }
        let copy = d.join("copy.qcow2");
        std::fs::copy(&img, &copy).unwrap();
        let has_snap = !amend.contains("refcount_bits=1");
        let snap_before = has_snap.then(|| contents(&img, Some("keep"), &d.join("k0.raw")));
        ok(diskit(&["amend", "-o", amend, s(&img)]));
        clean(&img, &what);
        assert_eq!(qcow2_info(&img)[field], want, "{what}");
        ok(qemu_img(&["compare", s(&copy), s(&img)]));
        if let Some(before) = snap_before {
            assert!(
                contents(&img, Some("keep"), &d.join("k1.raw")) == before,
                "{what}"
            );
        }
        std::fs::remove_file(&img).unwrap();
    }
    // The size, and several -o merged.
    let img = qemu_image(d, "s.qcow2", "", "4M");
    ok(diskit(&argv(
        "amend -o size=8M -o lazy_refcounts=on",
        &[s(&img)],
    )));
    clean(&img, "size");
    let info = stdout(&ok(qemu_img(&["info", "--output=json", s(&img)])));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["virtual-size"], 8 << 20);
    assert_eq!(v["format-specific"]["data"]["lazy-refcounts"], true);
    // The external data file's name, and its raw bit cleared.
    let ext = d.join("e.qcow2");
    let data = d.join("e.data");
    let data_opt = format!("data_file={},data_file_raw=on", s(&data));
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o",
        &[&data_opt, s(&ext), "1M"],
    )));
    qemu_io(&ext, &["write -P 0x66 0 64k"]);
    let moved = d.join("moved.data");
    std::fs::copy(&data, &moved).unwrap();
    let amend_opt = format!("data_file={},data_file_raw=off", s(&moved));
    ok(diskit(&["amend", "-o", &amend_opt, s(&ext)]));
    clean(&ext, "data_file");
    let v = qcow2_info(&ext);
    assert_eq!(v["data-file"], s(&moved));
    assert_eq!(v["data-file-raw"], false);
    std::fs::remove_file(&data).unwrap();
    let raw = d.join("e.raw");
    sparse_file(&raw, 1 << 20, &[(0, 64 << 10, 0x66)]);
    ok(qemu_img(&["compare", "-f", "raw", s(&raw), s(&ext)]));
}

#[test]
fn amend_errors_like_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let img = qemu_image(d, "a.qcow2", "", "4M");
    ok(qemu_img(&["snapshot", "-c", "s", s(&img)]));
    for o in [
        "foo=bar",
        "cluster_size=4096",
        "extended_l2=on",
        "compat=2",
        "refcount_bits=3",
        "refcount_bits=128",
        "lazy_refcounts=maybe",
        "compat=0.10,lazy_refcounts=on",
        "refcount_bits=8,compat=0.10",
        "data_file=x.raw",
        "data_file_raw=on",
        "backing_file=b.qcow2",
        "backing_fmt=raw",
        "encrypt.keyslot=1",
        "refcount_bits=1",
        "help",
    ] {
        fails_like_qemu_img(&img, &["amend", "-o", o, "{}"], false);
    }
    fails_like_qemu_img(&img, &["amend", "{}"], false);
    fails_like_qemu_img(&img, &["amend", "-f", "raw", "-o", "size=1M", "{}"], false);
    for create in ["extended_l2=on", "refcount_bits=8", "compression_type=zstd"] {
        let i = qemu_image(d, "b.qcow2", create, "4M");
        fails_like_qemu_img(&i, &["amend", "-o", "compat=0.10", "{}"], false);
    }
}
