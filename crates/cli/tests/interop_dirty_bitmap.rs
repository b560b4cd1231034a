//! Changed-block tracking over NBD, the backup cycle that libvirt and
//! virtnbdbackup run: a qcow2 image with an enabled persistent bitmap, a
//! full copy, writes by qemu-io, the bitmap served as
//! `qemu:dirty-bitmap:NAME` by the real qemu-nbd (`-B NAME`) and by
//! `diskit serve image ... bitmap=NAME` (the same extents, read by
//! nbdinfo), and `diskit copy --dirty-bitmap=NAME` from each into the
//! copy, which then equals the image (qemu-img compare). Inconsistent,
//! unknown, disabled and backing-file bitmaps as qemu-nbd treats them,
//! and the writes of a writable export marking its enabled bitmap.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

const KIB: u64 = 1024;

/// A server on a Unix socket in `dir`: qemu-nbd or diskit serve.
struct Server {
    uri: String,
    _guard: Box<dyn std::any::Any>,
}

/// qemu-nbd serving `img` with `args` (such as `-r -B b0`).
fn qemu_nbd(dir: &Path, tag: &str, img: &Path, args: &[&str]) -> Server {
    let mut all = vec!["-f", "qcow2"];
    all.extend_from_slice(args);
    all.push(s(img));
    let q = QemuNbd::start(&dir.join(format!("{tag}.sock")), &all);
    Server {
        uri: q.uri.clone(),
        _guard: Box::new(q),
    }
}

/// diskit under qemu-nbd's command line (`diskit qemu-nbd -t -k SOCK
/// -f qcow2 ARGS IMG`).
fn diskit_qemu_nbd(dir: &Path, tag: &str, img: &Path, args: &[&str]) -> Server {
    let sock = dir.join(format!("{tag}.sock"));
    let _ = std::fs::remove_file(&sock);
    let mut all = vec!["qemu-nbd", "-t", "-k", s(&sock), "-f", "qcow2"];
    all.extend_from_slice(args);
    all.push(s(img));
    let bin = diskit_bin();
    let guard = start_server(s(&bin), &all, || sock.exists());
    Server {
        uri: format!("nbd+unix:///?socket={}", s(&sock)),
        _guard: Box::new(guard),
    }
}

/// `diskit serve` of `img` with the image plugin's `keys` (such as
/// `bitmap=b0`) and serve's `opts` (such as `-r`).
fn diskit_serve(dir: &Path, tag: &str, img: &Path, opts: &[&str], keys: &[&str]) -> Server {
    let sock = dir.join(format!("{tag}.sock"));
    let _ = std::fs::remove_file(&sock);
    let mut args = vec!["serve", "-f", "-U", s(&sock)];
    args.extend_from_slice(opts);
    args.extend(["image", s(img)]);
    args.extend_from_slice(keys);
    let bin = diskit_bin();
    let guard = start_server(s(&bin), &args, || sock.exists());
    Server {
        uri: format!("nbd+unix:///?socket={}", s(&sock)),
        _guard: Box::new(guard),
    }
}

/// `nbdinfo ARGS URI`, which must succeed.
fn nbdinfo(args: &[&str], uri: &str) -> String {
    let o = timed("nbdinfo", 60).args(args).arg(uri).output().unwrap();
    stdout(&ok(o))
}

/// The extents of `context` as nbdinfo --map --json gives them.
fn map(uri: &str, context: &str) -> serde_json::Value {
    let out = nbdinfo(&[&format!("--map={context}"), "--json"], uri);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The dirty ranges `(offset, length)` of a --map --json answer.
fn dirty(map: &serde_json::Value) -> Vec<(u64, u64)> {
    map.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == 1)
        .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect()
}

fn qemu_io(fmt: &str, img: &Path, cmds: &[&str]) {
    ok(peer("qemu-io", &qemu_io_args(Some(fmt), cmds, s(img))));
}

/// Runs diskit under a timeout.
fn diskit_timed(args: &[&str]) -> Output {
    timed(diskit_bin(), 120).args(args).output().unwrap()
}

/// A 4 MiB qcow2 with data at 0..1M and 2M..2.5M, and bitmap "b0"
/// (64 KiB granularity) added and enabled after that data was written.
fn source(dir: &Path) -> PathBuf {
    let img = dir.join("src.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "4M"]));
    qemu_io(
        "qcow2",
        &img,
        &["write -P 0x11 0 1M", "write -P 0x22 2M 512k"],
    );
    ok(qemu_img(&[
        "bitmap",
        "--add",
        "--enable",
        "-g",
        "64k",
        s(&img),
        "b0",
    ]));
    img
}

/// The full backup: `src` converted to raw at `dst`.
fn full_copy(src: &Path, dst: &Path) {
    ok(qemu_img(&argv(
        "convert -f qcow2 -O raw",
        &[s(src), s(dst)],
    )));
}

/// The writes made after the full copy, and the 64 KiB blocks they dirty.
const WRITES: &[&str] = &[
    "write -z 0 4k",
    "write -P 0x33 100k 8k",
    "discard 2M 64k",
    "write -P 0x44 3M 64k",
    "write -P 0x55 4000k 1k",
];
const DIRTY: &[(u64, u64)] = &[
    (0, 128 * KIB),
    (2048 * KIB, 64 * KIB),
    (3072 * KIB, 64 * KIB),
    (3968 * KIB, 64 * KIB),
];

/// A clean range of the source that reads as zeros: what a copy of the
/// dirty ranges only must leave alone in the destination.
const CLEAN_AT: &str = "1536k";
const CLEAN_OFFSET: u64 = 1536 * KIB;

#[test]
fn backup_cycle_through_qemu_nbd_and_diskit() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    // The full backup, then the changes since.
    let full = d.join("full.raw");
    full_copy(&src, &full);
    qemu_io("qcow2", &src, WRITES);

    let theirs = qemu_nbd(d, "q", &src, &["-r", "-B", "b0"]);
    let ours = diskit_serve(d, "d", &src, &["-r"], &["bitmap=b0"]);
    let ours_as_qemu_nbd = diskit_qemu_nbd(d, "dq", &src, &["-r", "-B", "b0"]);
    let ctx = "qemu:dirty-bitmap:b0";
    let want = map(&theirs.uri, ctx);
    assert_eq!(map(&ours.uri, ctx), want, "the same extents as qemu-nbd");
    assert_eq!(
        map(&ours_as_qemu_nbd.uri, ctx),
        want,
        "diskit as qemu-nbd: the same extents"
    );
    assert_eq!(dirty(&want), DIRTY, "qemu-nbd marks what qemu-io wrote");

    for (tag, server) in [
        ("qemu-nbd", &theirs),
        ("diskit", &ours),
        ("diskit-qemu-nbd", &ours_as_qemu_nbd),
    ] {
        let dst = d.join(format!("backup-{tag}.raw"));
        std::fs::copy(&full, &dst).unwrap();
        // Bytes in a clean range that the incremental copy must not touch.
        qemu_io("raw", &dst, &[&format!("write -P 0xee {CLEAN_AT} 4k")]);
        let o = diskit_timed(&["copy", "--dirty-bitmap=b0", &server.uri, s(&dst)]);
        ok(o);
        assert_eq!(
            read_bytes(&dst, CLEAN_OFFSET, 4096),
            vec![0xee; 4096],
            "{tag}: a clean range was written"
        );
        qemu_io("raw", &dst, &[&format!("write -z {CLEAN_AT} 4k")]);
        let cmp = qemu_img(&["compare", "-f", "qcow2", "-F", "raw", s(&src), s(&dst)]);
        assert!(
            cmp.status.success(),
            "{tag}: {}{}",
            stdout(&cmp),
            stderr(&cmp)
        );
    }

    // The server run by the copy, as nbdcopy runs `[ CMD ]` (socket
    // activation).
    let dst = d.join("backup-cmd.raw");
    std::fs::copy(&full, &dst).unwrap();
    let o = diskit_timed(&[
        "copy",
        "--dirty-bitmap=b0",
        "[",
        "qemu-nbd",
        "-r",
        "-f",
        "qcow2",
        "-B",
        "b0",
        s(&src),
        "]",
        s(&dst),
    ]);
    ok(o);
    let cmp = qemu_img(&["compare", "-f", "qcow2", "-F", "raw", s(&src), s(&dst)]);
    assert!(cmp.status.success(), "[ CMD ]: {}", stdout(&cmp));
    let o = diskit_timed(&[
        "copy",
        "--dirty-bitmap=nope",
        "[",
        "qemu-nbd",
        "-r",
        "-f",
        "qcow2",
        s(&src),
        "]",
        s(&dst),
    ]);
    assert_ne!(code(&o), 0);
    assert!(stderr(&o).contains("does not offer"), "{}", stderr(&o));
}

/// A copy of `src` whose bitmap "b0" is marked in use (inconsistent), as
/// a QEMU that died with the image open for writing leaves it.
fn inconsistent(dir: &Path, src: &Path) -> PathBuf {
    let img = dir.join("crashed.qcow2");
    std::fs::copy(src, &img).unwrap();
    // qemu-io marks the enabled bitmaps in use when it opens the image
    // for writing, and abort ends it before it can clear the mark.
    let o = peer("qemu-io", &["-c", "write 0 4k", "-c", "abort", s(&img)]);
    assert!(!o.status.success());
    let info = stdout(&ok(qemu_img(&["info", s(&img)])));
    assert_contains(&info, "in-use");
    img
}

/// Runs qemu-nbd, diskit serve and diskit as qemu-nbd over `img` with
/// the bitmap `name`, all expected to refuse before serving: qemu-nbd's
/// and diskit serve's exit codes and messages (diskit as qemu-nbd must
/// say what qemu-nbd says).
fn both_refuse(dir: &Path, img: &Path, name: &str) -> [(i32, String); 2] {
    // qemu-nbd leaves its socket behind: each its own.
    let sock = dir.join("refused-qemu.sock");
    let theirs = timed("qemu-nbd", 30)
        .args(["-r", "-k", s(&sock), "-f", "qcow2", "-B", name, s(img)])
        .output()
        .unwrap();
    let key = format!("bitmap={name}");
    let sock = dir.join("refused-diskit.sock");
    let ours = diskit_timed(&["serve", "-f", "-r", "-U", s(&sock), "image", s(img), &key]);
    assert!(!sock.exists(), "diskit serve removes its socket");
    let sock = dir.join("refused-diskit-qemu-nbd.sock");
    let as_qemu_nbd = diskit_timed(&[
        "qemu-nbd",
        "-r",
        "-k",
        s(&sock),
        "-f",
        "qcow2",
        "-B",
        name,
        s(img),
    ]);
    let [theirs, ours, as_qemu_nbd] = [theirs, ours, as_qemu_nbd].map(|o| {
        let text = stderr(&o)
            .replacen("qemu-nbd: ", "", 1)
            .replacen("diskit: ", "", 1);
        (code(&o), text)
    });
    assert_eq!(
        as_qemu_nbd, theirs,
        "diskit as qemu-nbd refuses as qemu-nbd"
    );
    [theirs, ours]
}

#[test]
fn an_inconsistent_bitmap_is_refused_as_qemu_nbd_refuses_it() {
    let dir = workdir();
    let src = source(dir.path());
    let img = inconsistent(dir.path(), &src);
    let [theirs, ours] = both_refuse(dir.path(), &img, "b0");
    assert_ne!(theirs.0, 0, "qemu-nbd serves it: {}", theirs.1);
    assert_contains(&theirs.1, "Bitmap 'b0' is inconsistent and cannot be used");
    assert_eq!(ours, theirs);
}

#[test]
fn an_unknown_bitmap_is_refused_and_not_selected() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    let [theirs, ours] = both_refuse(d, &src, "nope");
    assert_ne!(theirs.0, 0);
    assert_contains(&theirs.1, "Bitmap 'nope' is not found");
    assert_eq!(ours, theirs);

    // Served with b0 only: asking for another bitmap selects nothing, and
    // an incremental copy from it says why it cannot run.
    let theirs = qemu_nbd(d, "q", &src, &["-r", "-B", "b0"]);
    let ours = diskit_serve(
        d,
        "d",
        &src,
        &["-r"],
        &["bitmap=b0", "allocation-depth=off"],
    );
    let contexts = |uri: &str| {
        let v: serde_json::Value = serde_json::from_str(&nbdinfo(&["--json"], uri)).unwrap();
        v["exports"][0]["contexts"].clone()
    };
    let listed = contexts(&theirs.uri);
    assert_eq!(contexts(&ours.uri), listed, "the same contexts listed");
    assert_eq!(
        listed,
        serde_json::json!(["base:allocation", "qemu:dirty-bitmap:b0"])
    );
    for server in [&theirs, &ours] {
        let o = timed("nbdinfo", 30)
            .args(["--map=qemu:dirty-bitmap:nope", &server.uri])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{}", stdout(&o));
    }
    let dst = d.join("backup.raw");
    full_copy(&src, &dst);
    let o = diskit_timed(&["copy", "--dirty-bitmap=nope", &ours.uri, s(&dst)]);
    assert_fails_with(
        &o,
        1,
        "does not offer the metadata context 'qemu:dirty-bitmap:nope'",
    );
    // Nothing made or emptied.
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), 4 << 20);
    let o = diskit_timed(&[
        "copy",
        "--dirty-bitmap=b0",
        &ours.uri,
        s(&d.join("missing.raw")),
    ]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(!d.join("missing.raw").exists());
}

#[test]
fn a_disabled_bitmap_is_served_as_it_stands() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    qemu_io("qcow2", &src, &["write -P 0x66 1M 4k"]);
    ok(qemu_img(&["bitmap", "--disable", s(&src), "b0"]));
    // Written after: not in the bitmap.
    qemu_io("qcow2", &src, &["write -P 0x77 3M 4k"]);
    let theirs = qemu_nbd(d, "q", &src, &["-r", "-B", "b0"]);
    let ours = diskit_serve(d, "d", &src, &["-r"], &["bitmap=b0"]);
    let ctx = "qemu:dirty-bitmap:b0";
    let want = map(&theirs.uri, ctx);
    assert_eq!(dirty(&want), vec![(1 << 20, 64 * KIB)]);
    assert_eq!(map(&ours.uri, ctx), want);
}

#[test]
fn writes_through_a_writable_export_mark_its_enabled_bitmap() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    ok(qemu_img(&["bitmap", "--add", s(&src), "frozen"]));
    ok(qemu_img(&["bitmap", "--disable", s(&src), "frozen"]));
    let mut maps = Vec::new();
    for tag in ["qemu-nbd", "diskit"] {
        let img = d.join(format!("{tag}.qcow2"));
        std::fs::copy(&src, &img).unwrap();
        let server = match tag {
            "qemu-nbd" => qemu_nbd(d, tag, &img, &["-B", "b0", "-B", "frozen"]),
            _ => diskit_serve(d, tag, &img, &[], &["bitmap=b0", "bitmap=frozen"]),
        };
        ok(timed("qemu-io", 60)
            .args([
                "-f",
                "raw",
                "-c",
                "write -P 9 1100k 8k",
                "-c",
                "write -z 3M 64k",
            ])
            .arg(&server.uri)
            .output()
            .unwrap());
        let b0 = map(&server.uri, "qemu:dirty-bitmap:b0");
        let frozen = map(&server.uri, "qemu:dirty-bitmap:frozen");
        assert_eq!(
            dirty(&b0),
            vec![(1088 * KIB, 64 * KIB), (3072 * KIB, 64 * KIB)],
            "{tag}"
        );
        assert!(dirty(&frozen).is_empty(), "{tag}");
        maps.push((b0, frozen));
    }
    assert_eq!(maps[0], maps[1]);
}

#[test]
fn a_bitmap_of_the_backing_file_is_found_as_qemu_nbd_finds_it() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    qemu_io("qcow2", &src, &["write -P 0x66 1M 4k"]);
    let top = d.join("top.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -F qcow2 -b",
        &[s(&src), s(&top)],
    )));
    let theirs = qemu_nbd(d, "q", &top, &["-r", "-B", "b0"]);
    let ours = diskit_serve(d, "d", &top, &["-r"], &["bitmap=b0"]);
    let ctx = "qemu:dirty-bitmap:b0";
    let want = map(&theirs.uri, ctx);
    assert_eq!(dirty(&want), vec![(1 << 20, 64 * KIB)]);
    assert_eq!(map(&ours.uri, ctx), want);
}

/// libvirt's pull-mode backup reads a bitmap through the nbd driver's
/// `x-dirty-bitmap` key (the bitmap's context as the allocation): `map`
/// and `convert` through it answer as qemu-img's, from qemu-nbd and from
/// diskit as qemu-nbd.
#[test]
fn x_dirty_bitmap_reads_the_bitmap_as_qemu_img_does() {
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    qemu_io("qcow2", &src, WRITES);
    let theirs = qemu_nbd(d, "q", &src, &["-r", "-B", "b0"]);
    let ours = diskit_qemu_nbd(d, "dq", &src, &["-r", "-B", "b0"]);
    for server in [&theirs, &ours] {
        let sock = server.uri.split("socket=").nth(1).unwrap();
        let opts = format!(
            "driver=nbd,server.type=unix,server.path={sock},x-dirty-bitmap=qemu:dirty-bitmap:b0"
        );
        let args = ["map", "--output=json", "--image-opts", opts.as_str()];
        let want = stdout(&ok(qemu_img(&args)));
        let got = stdout(&ok(diskit_timed(&args)));
        assert_eq!(got, want, "map through x-dirty-bitmap ({})", server.uri);
        let (q, ours_out) = (d.join("q.qcow2"), d.join("d.qcow2"));
        for (out, o) in [
            (
                &q,
                qemu_img(&["convert", "--image-opts", &opts, "-O", "qcow2", s(&q)]),
            ),
            (
                &ours_out,
                diskit_timed(&[
                    "convert",
                    "--image-opts",
                    &opts,
                    "-O",
                    "qcow2",
                    s(&ours_out),
                ]),
            ),
        ] {
            ok(o);
            assert!(out.exists());
        }
        let cmp = qemu_img(&["compare", s(&q), s(&ours_out)]);
        assert!(cmp.status.success(), "{}{}", stdout(&cmp), stderr(&cmp));
        let (ours, theirs) = (data_extents(&ours_out), data_extents(&q));
        assert_eq!(ours, theirs, "what convert allocated");
        std::fs::remove_file(&q).unwrap();
        std::fs::remove_file(&ours_out).unwrap();
    }
}
