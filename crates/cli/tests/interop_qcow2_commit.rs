//! `commit`, `rebase` and `convert -B` against qemu-img: chains made by
//! qemu-img with data written by qemu-io, the same command run by qemu-img
//! and by diskit on identical copies, then the results compared: content
//! (qemu-img compare), consistency (qemu-img check), allocation (qemu-img
//! map) and, where qemu-img's result is deterministic, the bytes.
//!
//! Each case works in two sibling directories (`q` for qemu-img, `d` for
//! diskit) with the same relative names, so that names stored in headers
//! and printed in messages are the same.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

/// Runs qemu-img in `dir`.
fn qimg(dir: &Path, args: &[&str]) -> Output {
    run_in(Path::new("qemu-img"), dir, args)
}

/// Runs qemu-io in `dir`, which must succeed.
fn qio(dir: &Path, args: &[&str]) {
    ok(run_in(Path::new("qemu-io"), dir, args));
}

/// Two sibling directories holding the same images.
struct Pair {
    _tmp: tempfile::TempDir,
    q: PathBuf,
    d: PathBuf,
}

impl Pair {
    /// Runs `setup` (qemu-img and qemu-io commands, which write the same
    /// bytes and leave the same holes every time) in both directories.
    fn new(setup: impl Fn(&Path)) -> Pair {
        let tmp = workdir();
        let q = tmp.path().join("q");
        let d = tmp.path().join("d");
        for dir in [&q, &d] {
            std::fs::create_dir_all(dir).unwrap();
            setup(dir);
        }
        Pair { _tmp: tmp, q, d }
    }

    /// Runs `args` with qemu-img in `q` and diskit in `d`: the same exit
    /// code, standard output and (with diskit's prefix) standard error.
    fn both(&self, args: &[&str]) -> Output {
        let theirs = qimg(&self.q, args);
        let ours = run_in(&diskit_bin(), &self.d, args);
        assert_eq!(
            (code(&ours), stdout(&ours), stderr(&ours)),
            (code(&theirs), stdout(&theirs), as_diskit(&stderr(&theirs))),
            "{args:?}"
        );
        ours
    }

    /// Asserts that `name` has the same bytes in both directories.
    fn same_file(&self, name: &str) {
        assert!(
            same_bytes(&self.q.join(name), &self.d.join(name)),
            "{name} differs from qemu-img's:\n{}\n{}",
            map(&self.d, name),
            map(&self.q, name)
        );
    }

    /// Asserts that qemu-img map prints the same for `name` in both.
    fn same_map(&self, name: &str) {
        assert_eq!(map(&self.d, name), map(&self.q, name), "map of {name}");
    }
}

/// The map of `name` without host offsets, as (start, length, flags) runs
/// with equal neighbours merged: which ranges are allocated where and how,
/// whatever order the clusters were allocated in.
fn layout(dir: &Path, name: &str) -> Vec<(u64, u64, String)> {
    let num = |l: &str, key: &str| -> u64 {
        let at = l.find(key).unwrap() + key.len();
        let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap()
    };
    let mut runs: Vec<(u64, u64, String)> = Vec::new();
    for l in map(dir, name).lines() {
        let (start, length) = (num(l, "\"start\": "), num(l, "\"length\": "));
        let from = l.find("\"depth\"").unwrap();
        let to = l.find(", \"offset\"").unwrap_or(l.rfind('}').unwrap());
        let flags = l[from..to].to_string();
        match runs.last_mut() {
            Some(r) if r.2 == flags && r.0 + r.1 == start => r.1 += length,
            _ => runs.push((start, length, flags)),
        }
    }
    runs
}

fn map(dir: &Path, name: &str) -> String {
    stdout(&ok(qimg(dir, &["map", "--output=json", name])))
}

/// qemu-img check finds nothing wrong with `name`.
fn check_clean(dir: &Path, name: &str) {
    let o = qimg(dir, &["check", name]);
    assert_eq!(code(&o), 0, "check {name}: {}{}", stdout(&o), stderr(&o));
    assert_contains(&stdout(&o), "No errors were found");
}

/// qemu-img compare says `a` and `b` show the same content.
fn identical(dir: &Path, a: &str, b: &str) {
    let o = qimg(dir, &["compare", a, b]);
    assert_eq!(code(&o), 0, "compare {a} {b}: {}{}", stdout(&o), stderr(&o));
}

/// What `name` shows, saved as a raw file `to`.
fn snapshot_raw(dir: &Path, name: &str, to: &str) {
    ok(qimg(dir, &["convert", "-O", "raw", name, to]));
}

/// base (4 MiB) <- mid <- top, with data, zero clusters and partial
/// clusters at every level; `opts` are extra create options for mid and top.
fn chain(dir: &Path, opts: &str) {
    let create = |name: &str, backing: Option<&str>| {
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if let Some(b) = backing {
            args.extend(["-b", b, "-F", "qcow2"]);
        }
        if !opts.is_empty() && backing.is_some() {
            args.extend(["-o", opts]);
        }
        args.push(name);
        if backing.is_none() {
            args.push("4M");
        }
        ok(qimg(dir, &args));
    };
    create("base.qcow2", None);
    qio(dir, &["-c", "write -P 1 0 1M", "base.qcow2"]);
    create("mid.qcow2", Some("base.qcow2"));
    qio(
        dir,
        &[
            "-c",
            "write -P 2 512k 1M",
            "-c",
            "write -z 3M 64k",
            "mid.qcow2",
        ],
    );
    create("top.qcow2", Some("mid.qcow2"));
    qio(
        dir,
        &[
            "-c",
            "write -P 3 2M 64k",
            "-c",
            "write -z 0 64k",
            "-c",
            "write -P 4 3M 4k",
            "-c",
            "write -P 5 1000k 8k",
            "top.qcow2",
        ],
    );
}

#[test]
fn commit_into_the_backing_file_then_empty_the_image() {
    let p = Pair::new(|dir| {
        chain(dir, "");
        snapshot_raw(dir, "top.qcow2", "before.raw");
    });
    let o = p.both(&["commit", "top.qcow2"]);
    assert_eq!(stdout(&o), "Image committed.\n");
    for dir in [&p.q, &p.d] {
        for img in ["base.qcow2", "mid.qcow2", "top.qcow2"] {
            check_clean(dir, img);
        }
        // The backing file now holds what the image showed, and the
        // emptied image reads through to it.
        identical(dir, "before.raw", "mid.qcow2");
        identical(dir, "before.raw", "top.qcow2");
    }
    // Emptied as qemu-img empties it: reset to its smallest form.
    p.same_file("top.qcow2");
    p.same_file("base.qcow2");
    assert_eq!(layout(&p.d, "mid.qcow2"), layout(&p.q, "mid.qcow2"));
    assert!(!map(&p.d, "top.qcow2").contains("\"depth\": 0"));
}

#[test]
fn commit_of_v2_and_extended_l2_images() {
    for opts in ["compat=0.10", "extended_l2=on"] {
        let p = Pair::new(|dir| {
            chain(dir, opts);
            snapshot_raw(dir, "top.qcow2", "before.raw");
        });
        p.both(&["commit", "-q", "top.qcow2"]);
        for img in ["mid.qcow2", "top.qcow2"] {
            check_clean(&p.d, img);
        }
        identical(&p.d, "before.raw", "mid.qcow2");
        identical(&p.d, "before.raw", "top.qcow2");
        // The same blocks written, in whole clusters as QEMU's job writes
        // them (the order, hence the host offsets, may differ).
        assert_eq!(
            layout(&p.d, "mid.qcow2"),
            layout(&p.q, "mid.qcow2"),
            "{opts}"
        );
        assert!(!map(&p.d, "top.qcow2").contains("\"depth\": 0"), "{opts}");
    }
}

#[test]
fn commit_down_a_three_deep_chain_keeps_the_images_above() {
    let p = Pair::new(|dir| {
        chain(dir, "");
        snapshot_raw(dir, "top.qcow2", "before.raw");
        std::fs::copy(dir.join("top.qcow2"), dir.join("top.orig")).unwrap();
        std::fs::copy(dir.join("mid.qcow2"), dir.join("mid.orig")).unwrap();
    });
    // -b implies -d: nothing above the base changes.
    let o = p.both(&["commit", "-b", "base.qcow2", "top.qcow2"]);
    assert_eq!(stdout(&o), "Image committed.\n");
    check_clean(&p.d, "base.qcow2");
    identical(&p.d, "before.raw", "base.qcow2");
    assert_eq!(layout(&p.d, "base.qcow2"), layout(&p.q, "base.qcow2"));
    assert!(same_bytes(&p.d.join("top.qcow2"), &p.d.join("top.orig")));
    assert!(same_bytes(&p.d.join("mid.qcow2"), &p.d.join("mid.orig")));
    p.same_file("top.qcow2");

    // -d alone: the image keeps its data.
    let p = Pair::new(|dir| {
        chain(dir, "");
        snapshot_raw(dir, "top.qcow2", "before.raw");
        std::fs::copy(dir.join("top.qcow2"), dir.join("top.orig")).unwrap();
    });
    p.both(&["commit", "-d", "-q", "top.qcow2"]);
    identical(&p.d, "before.raw", "mid.qcow2");
    assert!(same_bytes(&p.d.join("top.qcow2"), &p.d.join("top.orig")));
    check_clean(&p.d, "mid.qcow2");
}

#[test]
fn commit_grows_a_smaller_raw_base() {
    let p = Pair::new(|dir| {
        sparse_file(&dir.join("base.raw"), 1 << 20, &[(4096, 8192, 0xff)]);
        ok(qimg(
            dir,
            &words("create -q -f qcow2 -b base.raw -F raw top.qcow2 3M"),
        ));
        qio(
            dir,
            &[
                "-c",
                "write -P 7 2M 64k",
                "-c",
                "write -P 8 0 4k",
                "top.qcow2",
            ],
        );
        snapshot_raw(dir, "top.qcow2", "before.raw");
    });
    p.both(&["commit", "top.qcow2"]);
    assert_eq!(
        std::fs::metadata(p.d.join("base.raw")).unwrap().len(),
        3 << 20
    );
    identical(&p.d, "before.raw", "base.raw");
    identical(&p.d, "before.raw", "top.qcow2");
    check_clean(&p.d, "top.qcow2");
    p.same_file("top.qcow2");
}

#[test]
fn commit_errors_match_qemu_img() {
    let p = Pair::new(|dir| {
        chain(dir, "");
    });
    for args in [
        &["commit", "base.qcow2"][..],
        &["commit", "-b", "nonexistent.qcow2", "top.qcow2"],
        &["commit", "-b", "top.qcow2", "top.qcow2"],
        &["commit", "missing.qcow2"],
        &["commit", "-r", "fast", "top.qcow2"],
        &["commit", "-t", "bogus", "top.qcow2"],
    ] {
        let o = p.both(args);
        assert_eq!(code(&o), 1, "{args:?}");
    }
}

#[test]
fn unsafe_rebase_rewrites_only_the_header() {
    let p = Pair::new(|dir| {
        chain(dir, "");
        ok(qimg(
            dir,
            &words("create -q -f qcow2 -o data_file=ext.raw ext.qcow2 1M"),
        ));
        ok(qimg(
            dir,
            &words("create -q -f qcow2 -o compat=0.10 v2.qcow2 1M"),
        ));
    });
    // A missing backing file is fine with -u: only the name changes.
    p.both(&words("rebase -u -b gone.qcow2 -F qcow2 top.qcow2"));
    p.same_file("top.qcow2");
    let info = stdout(&ok(run_in(&diskit_bin(), &p.d, &["info", "top.qcow2"])));
    assert_contains(&info, "backing file: gone.qcow2");
    let info = stdout(&ok(qimg(&p.d, &["info", "top.qcow2"])));
    assert_contains(&info, "backing file: gone.qcow2");
    assert_contains(&info, "backing file format: qcow2");
    // Without -b, the backing file goes.
    p.both(&["rebase", "-u", "top.qcow2"]);
    p.same_file("top.qcow2");
    let info = stdout(&ok(qimg(&p.d, &["info", "top.qcow2"])));
    assert!(!info.contains("backing file"), "{info}");
    check_clean(&p.d, "top.qcow2");
    // Other extensions (data file) keep their place; v2 headers get one too.
    p.both(&words("rebase -u -b base.qcow2 -F qcow2 ext.qcow2"));
    p.same_file("ext.qcow2");
    p.both(&["rebase", "-u", "-b", "base.qcow2", "-F", "raw", "v2.qcow2"]);
    p.same_file("v2.qcow2");
    check_clean(&p.d, "v2.qcow2");
}

#[test]
fn safe_rebase_keeps_the_content_and_matches_qemu_img() {
    for opts in ["", "extended_l2=on"] {
        let p = Pair::new(|dir| {
            chain(dir, opts);
            ok(qimg(
                dir,
                &["create", "-q", "-f", "qcow2", "other.qcow2", "4M"],
            ));
            qio(
                dir,
                &[
                    "-c",
                    "write -P 1 0 768k",
                    "-c",
                    "write -P 6 1536k 1M",
                    "other.qcow2",
                ],
            );
            snapshot_raw(dir, "top.qcow2", "before.raw");
            std::fs::copy(dir.join("top.qcow2"), dir.join("t1.qcow2")).unwrap();
            std::fs::copy(dir.join("top.qcow2"), dir.join("t2.qcow2")).unwrap();
        });
        // Onto another image, onto nothing, and onto the base (mid dropped).
        p.both(&["rebase", "-b", "other.qcow2", "-F", "qcow2", "top.qcow2"]);
        p.both(&["rebase", "-b", "", "t1.qcow2"]);
        p.both(&["rebase", "-b", "base.qcow2", "-F", "qcow2", "t2.qcow2"]);
        for img in ["top.qcow2", "t1.qcow2", "t2.qcow2"] {
            p.same_file(img);
            check_clean(&p.d, img);
            identical(&p.d, "before.raw", img);
        }
    }
}

#[test]
fn rebase_errors_match_qemu_img() {
    let p = Pair::new(|dir| {
        chain(dir, "");
        sparse_file(&dir.join("plain.raw"), 1 << 20, &[]);
    });
    for args in [
        &["rebase", "top.qcow2"][..],
        &["rebase", "-b", "nowhere.qcow2", "-F", "qcow2", "top.qcow2"],
        &[
            "rebase",
            "-u",
            "-b",
            "x.qcow2",
            "-F",
            "nosuchfmt",
            "top.qcow2",
        ],
        &["rebase", "-b", "base.qcow2", "-F", "qcow2", "missing.qcow2"],
        &["rebase", "-u", "-b", "base.qcow2", "-f", "raw", "plain.raw"],
    ] {
        let o = p.both(args);
        assert_eq!(code(&o), 1, "{args:?}");
    }
    // A name without a format: the differences are written, the header is
    // refused, as qemu-img does.
    let o = p.both(&["rebase", "-b", "base.qcow2", "top.qcow2"]);
    assert_eq!(code(&o), 1);
    p.same_file("top.qcow2");
}

#[test]
fn convert_with_a_backing_file_writes_only_the_top_layer() {
    let p = Pair::new(|dir| {
        chain(dir, "");
        snapshot_raw(dir, "top.qcow2", "flat.raw");
        ok(qimg(
            dir,
            &["create", "-q", "-f", "qcow2", "lone.qcow2", "4M"],
        ));
        qio(dir, &["-c", "write -P 7 1M 64k", "lone.qcow2"]);
    });
    let cases = [
        ("top.qcow2", "o1.qcow2", "mid.qcow2"),
        ("flat.raw", "o2.qcow2", "mid.qcow2"),
        ("lone.qcow2", "o3.qcow2", "base.qcow2"),
    ];
    for (src, out, backing) in cases {
        p.both(&argv(
            "convert -O qcow2 -B",
            &[backing, "-F", "qcow2", src, out],
        ));
        p.same_file(out);
        p.same_map(out);
        check_clean(&p.d, out);
        let info = stdout(&ok(qimg(&p.d, &["info", out])));
        assert_contains(&info, &format!("backing file: {backing}"));
    }
    // An overlay converted onto its own backing file: only what the
    // overlay holds is allocated, and it shows the same content.
    identical(&p.d, "top.qcow2", "o1.qcow2");
    let m = map(&p.d, "o1.qcow2");
    let ours: Vec<&str> = m.lines().filter(|l| l.contains("\"depth\": 0")).collect();
    let top = map(&p.d, "top.qcow2");
    let theirs: Vec<&str> = top.lines().filter(|l| l.contains("\"depth\": 0")).collect();
    assert_eq!(ours.len(), theirs.len(), "{m}\n{top}");
    for args in [
        &[
            "convert",
            "-O",
            "qcow2",
            "-B",
            "mid.qcow2",
            "top.qcow2",
            "e1.qcow2",
        ][..],
        &[
            "convert",
            "-O",
            "qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
            "e2.qcow2",
        ],
        &[
            "convert",
            "-O",
            "qcow2",
            "-B",
            "mid.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
            "top.qcow2",
            "e3.qcow2",
        ],
        &[
            "convert",
            "-O",
            "raw",
            "-B",
            "mid.qcow2",
            "top.qcow2",
            "e4.raw",
        ],
    ] {
        let o = p.both(args);
        assert_eq!(code(&o), 1, "{args:?}");
    }
}

/// `rebase -c` writes what safe mode copies as compressed clusters, as
/// qemu-img does: the same layout (compressed flags included), the same
/// content, a clean check.
#[test]
fn rebase_c_compresses_what_it_copies_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    for who in ["ours", "theirs"] {
        let (base, top, new) = (
            format!("{who}-base.qcow2"),
            format!("{who}-top.qcow2"),
            format!("{who}-new.qcow2"),
        );
        ok(qimg(d, &["create", "-q", "-f", "qcow2", &base, "4M"]));
        qio(
            d,
            &["-c", "write -P 1 0 1M", "-c", "write -P 2 3M 100k", &base],
        );
        ok(qimg(
            d,
            &argv("create -q -f qcow2 -b", &[&base, "-F", "qcow2", &top]),
        ));
        qio(d, &["-c", "write -P 9 512k 4k", &top]);
        ok(qimg(d, &["create", "-q", "-f", "qcow2", &new, "4M"]));
        let args = [
            "rebase",
            "-c",
            "-b",
            new.as_str(),
            "-F",
            "qcow2",
            top.as_str(),
        ];
        if who == "ours" {
            ok(run_in(&diskit_bin(), d, &args));
        } else {
            ok(qimg(d, &args));
        }
    }
    assert_eq!(layout(d, "ours-top.qcow2"), layout(d, "theirs-top.qcow2"));
    assert!(map(d, "ours-top.qcow2").contains("\"compressed\": true"));
    identical(d, "ours-top.qcow2", "theirs-top.qcow2");
    check_clean(d, "ours-top.qcow2");
}
