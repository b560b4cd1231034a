//! `info` and `snapshot -l` on qcow2 images, compared byte for byte with
//! qemu-img's output (human, JSON, `--backing-chain`, both): every feature
//! qemu-img can write, backing chains with relative names, external data
//! files, internal snapshots (including entries QEMU never writes itself),
//! bitmaps, dirty and corrupt images.
//!
//! Commands run inside the test directory with relative names, so that
//! names print as qemu-img prints them, and under a fixed non-UTC time zone,
//! so that snapshot dates go through local time.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use diskit_backends::FileDevice;
use diskit_formats::qcow2::Header;
use diskit_formats::qcow2::bitmap::{BitmapsExt, BitmapsState};
use diskit_formats::qcow2::open::read_header;
use diskit_formats::qcow2::snapshot::{self, known_extra};

const TZ: &str = "Asia/Kolkata";

fn run_in(dir: &Path, tool: &Path, args: &[&str]) -> Output {
    Command::new(tool)
        .args(args)
        .current_dir(dir)
        .env("TZ", TZ)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e})", tool.display()))
}

/// The image file and its header.
fn open_header(img: &Path) -> (FileDevice, Header) {
    let file = FileDevice::open(img, Default::default()).unwrap();
    let h = read_header(&file).unwrap();
    (file, h)
}

/// Runs qemu-img (or qemu-io) in `dir`; it must succeed.
fn qemu_in(dir: &Path, tool: &str, args: &[&str]) {
    ok(run_in(dir, Path::new(tool), args));
}

/// diskit and qemu-img agree on `args` run in `dir`: both succeed with the
/// same standard output.
fn same_in(dir: &Path, args: &[&str], what: &str) {
    let ours = run_in(dir, &diskit_bin(), args);
    let theirs = run_in(dir, Path::new("qemu-img"), args);
    assert!(
        theirs.status.success(),
        "{what}: qemu-img {args:?} failed: {}",
        stderr(&theirs)
    );
    assert!(
        ours.status.success(),
        "{what}: diskit {args:?} failed: {}",
        stderr(&ours)
    );
    assert_eq!(stdout(&ours), stdout(&theirs), "{what}: {args:?}");
}

/// Every `info` variant and `snapshot -l` agree on `img`.
fn info_like_qemu(dir: &Path, img: &str, what: &str) {
    for extra in [
        &[][..],
        &["--output=json"],
        &["--backing-chain"],
        &["--backing-chain", "--output=json"],
    ] {
        let mut args = vec!["info"];
        args.extend_from_slice(extra);
        args.push(img);
        same_in(dir, &args, what);
    }
    same_in(dir, &["snapshot", "-l", img], what);
}

/// Runs qemu-img's command line `line` (see [`words`]) in `dir`; it must
/// succeed.
fn qemu_img_line(dir: &Path, line: &str) {
    qemu_in(dir, "qemu-img", &words(line));
}

fn create(dir: &Path, name: &str, opts: &str, size: &str) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([name, size]);
    qemu_in(dir, "qemu-img", &args);
}

/// For each of `opts`: qemu-img creates `img` of `size` with them,
/// qemu-io runs `write` on it, and every `info` variant agrees on it.
fn written_images_read_alike(dir: &Path, img: &str, size: &str, write: &str, opts: &[&str]) {
    for opts in opts {
        create(dir, img, opts, size);
        qemu_in(dir, "qemu-io", &["-c", write, img]);
        info_like_qemu(dir, img, opts);
    }
}

#[test]
fn every_creation_option() {
    let dir = workdir();
    let opts = [
        "compat=0.10",
        "compat=0.10,cluster_size=4096",
        "compat=1.1",
        "cluster_size=512",
        "cluster_size=2M",
        "extended_l2=on",
        "extended_l2=on,cluster_size=16k",
        "compression_type=zstd",
        "lazy_refcounts=on",
        "refcount_bits=1",
        "refcount_bits=8",
        "refcount_bits=64",
        "preallocation=metadata",
        "extended_l2=on,compression_type=zstd,lazy_refcounts=on,refcount_bits=32",
    ];
    let write = "write -P 1 1M 300k";
    written_images_read_alike(dir.path(), "img.qcow2", "100M", write, &opts);
}

#[test]
fn odd_virtual_and_file_sizes() {
    let dir = workdir();
    let d = dir.path();
    for size in ["1", "1000", "1536", "999k", "1023.5k", "3G", "1T"] {
        create(d, "s.qcow2", "", size);
        info_like_qemu(d, "s.qcow2", size);
    }
}

#[test]
fn backing_chains_with_relative_names() {
    let dir = workdir();
    let d = dir.path();
    std::fs::create_dir_all(d.join("sub/deeper")).unwrap();
    sparse_file(&d.join("base.raw"), 3 << 20, &[(0, 4096, 7)]);
    // sub/mid.qcow2 -> ../base.raw (raw), top -> sub/mid.qcow2 (qcow2).
    qemu_img_line(d, "create -q -f qcow2 -b ../base.raw -F raw sub/mid.qcow2");
    qemu_img_line(
        d,
        "create -q -f qcow2 -b sub/mid.qcow2 -F qcow2 top.qcow2 8M",
    );
    // Deeper: sub/deeper/leaf.qcow2 -> ../../top.qcow2 (a longer chain).
    qemu_img_line(
        d,
        "create -q -f qcow2 -b ../../top.qcow2 -F qcow2 sub/deeper/leaf.qcow2",
    );
    qemu_in(d, "qemu-io", &["-c", "write -P 2 0 64k", "top.qcow2"]);
    for img in [
        "top.qcow2",
        "sub/mid.qcow2",
        "sub/deeper/leaf.qcow2",
        "./sub/../top.qcow2",
    ] {
        info_like_qemu(d, img, img);
    }
    // Absolute names, and an absolute backing name.
    let abs_base = d.join("base.raw");
    let create_abs = argv(
        "create -q -f qcow2 -b",
        &[s(&abs_base), "-F", "raw", "abs.qcow2"],
    );
    qemu_in(d, "qemu-img", &create_abs);
    let abs_top = d.join("top.qcow2");
    info_like_qemu(d, "abs.qcow2", "absolute backing");
    info_like_qemu(d, s(&abs_top), "absolute image name");
    // Without a backing format (qemu-img no longer writes such images: the
    // extension is renamed to an unknown one): the chain is probed.
    let p = d.join("top.qcow2");
    let mut head = std::fs::read(&p).unwrap();
    let magic = 0xE279_2ACAu32.to_be_bytes();
    let at = head.windows(4).position(|w| w == magic).unwrap();
    head[at..at + 4].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    std::fs::write(&p, &head).unwrap();
    info_like_qemu(d, "top.qcow2", "no backing format");
}

#[test]
fn missing_backing_file_and_loops() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_line(d, "create -q -f qcow2 -u -b gone.qcow2 -F qcow2 m.qcow2 1M");
    // info does not open the backing file...
    same_in(d, &["info", "m.qcow2"], "missing backing");
    same_in(d, &["info", "--output=json", "m.qcow2"], "missing backing");
    // ...--backing-chain does, and fails like qemu-img.
    for args in [
        &["info", "--backing-chain", "m.qcow2"][..],
        &["snapshot", "-l", "m.qcow2"],
    ] {
        let ours = run_in(d, &diskit_bin(), args);
        let theirs = run_in(d, Path::new("qemu-img"), args);
        assert_eq!(
            (code(&ours), stdout(&ours)),
            (1, stdout(&theirs)),
            "{args:?}"
        );
        assert_eq!(code(&theirs), 1);
    }
    // a -> b -> a: fine without the chain, a loop error with it.
    for (img, backing) in [("a.qcow2", "b.qcow2"), ("b.qcow2", "a.qcow2")] {
        let create = argv(
            "create -q -f qcow2 -u -b",
            &[backing, "-F", "qcow2", img, "1M"],
        );
        qemu_in(d, "qemu-img", &create);
    }
    same_in(d, &["info", "a.qcow2"], "loop");
    let args = ["info", "--backing-chain", "a.qcow2"];
    let ours = run_in(d, &diskit_bin(), &args);
    let theirs = run_in(d, Path::new("qemu-img"), &args);
    assert_eq!(code(&ours), code(&theirs));
    assert_eq!(
        stderr(&ours).replacen("diskit: ", "", 1),
        stderr(&theirs).replacen("qemu-img: ", "", 1)
    );
}

/// A chain deeper than the limit is refused in one short line that names
/// the cause, not one "Could not open backing file" prefix per image.
#[test]
fn a_chain_too_deep_is_said_once() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_line(d, "create -q -f qcow2 c0.qcow2 1M");
    for i in 1..=300 {
        let (img, backing) = (format!("c{i}.qcow2"), format!("c{}.qcow2", i - 1));
        let create = argv(
            "create -q -f qcow2 -u -b",
            &[&backing, "-F", "qcow2", &img, "1M"],
        );
        qemu_in(d, "qemu-img", &create);
    }
    let o = run_in(d, &diskit_bin(), &["map", "--output=json", "c300.qcow2"]);
    assert_eq!(code(&o), 1);
    let err = stderr(&o);
    assert_contains(&err, "too deep");
    assert_eq!(
        err.matches("Could not open backing file").count(),
        0,
        "{err}"
    );
    assert!(err.len() < 300, "{} bytes: {err}", err.len());
}

#[test]
fn internal_snapshots() {
    let dir = workdir();
    let d = dir.path();
    for opts in ["compat=1.1", "compat=0.10", "cluster_size=512"] {
        create(d, "s.qcow2", opts, "20M");
        info_like_qemu(d, "s.qcow2", "no snapshots");
        let names = [
            "first",
            "second",
            "a much longer snapshot name than sixteen",
            "ünïcödé",
            "7",
        ];
        for (i, n) in names.iter().enumerate() {
            let cmd = format!("write -P {i} {i}M 64k");
            qemu_in(d, "qemu-io", &["-c", &cmd, "s.qcow2"]);
            qemu_in(d, "qemu-img", &["snapshot", "-c", n, "s.qcow2"]);
        }
        qemu_img_line(d, "snapshot -d second s.qcow2");
        info_like_qemu(d, "s.qcow2", opts);
    }
    // Snapshots in a chain: each image lists its own.
    create(d, "base.qcow2", "", "20M");
    qemu_img_line(d, "snapshot -c in-base base.qcow2");
    qemu_img_line(d, "create -q -f qcow2 -b base.qcow2 -F qcow2 over.qcow2");
    qemu_img_line(d, "snapshot -c in-over over.qcow2");
    info_like_qemu(d, "over.qcow2", "snapshots in a chain");
}

#[test]
fn external_data_files() {
    let dir = workdir();
    written_images_read_alike(
        dir.path(),
        "df.qcow2",
        "10M",
        "write -P 3 0 1M",
        &[
            "data_file=data.raw",
            "data_file=data.raw,data_file_raw=on",
            "data_file=data.raw,data_file_raw=on,extended_l2=on,lazy_refcounts=on",
        ],
    );
}

/// Rewrites the snapshot table of `img` with entries qemu-img never
/// writes itself: VM state, a VM clock, icount disabled, legacy entries
/// without extra data, unknown extra data.
fn doctor_snapshots(img: &Path) {
    use std::os::unix::fs::FileExt;
    let (file, h) = open_header(img);
    let mut snaps = snapshot::read(&file, &h).unwrap();
    let old_len = snapshot::table_len(&snaps);
    assert_eq!(snaps.len(), 4);
    snaps[0].extra = known_extra(5 << 30, h.size, None);
    snaps[0].vm_clock_nsec = 100 * 3600 * 1_000_000_000 + 3_723_456_789_000;
    snaps[0].date_sec = 0;
    snaps[1].extra.clear();
    snaps[1].vm_state_size_32 = 123_456;
    snaps[1].vm_clock_nsec = 999_999_999;
    snaps[2].extra = known_extra(1536, h.size, Some(42));
    snaps[2].extra.extend_from_slice(&[0xab; 16]);
    snaps[2].date_sec = u32::MAX;
    snaps[3].extra = known_extra(u64::MAX, h.size, Some(u64::MAX - 1));
    snaps[3].date_nsec = 999_999_999;
    let bytes = snapshot::serialize(&snaps).unwrap();
    // Still inside the table's cluster: qemu-img info does not mind.
    assert!(bytes.len() as u64 <= old_len.next_multiple_of(h.cluster_size()));
    drop(file);
    let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    f.write_all_at(&bytes, h.snapshots_offset).unwrap();
}

#[test]
fn snapshots_qemu_img_cannot_make() {
    let dir = workdir();
    let d = dir.path();
    create(d, "vm.qcow2", "", "1G");
    for n in ["one", "two", "three", "four"] {
        qemu_in(d, "qemu-img", &["snapshot", "-c", n, "vm.qcow2"]);
    }
    doctor_snapshots(&d.join("vm.qcow2"));
    info_like_qemu(d, "vm.qcow2", "doctored snapshots");
    // qemu-img check flags the legacy entry (v3 needs 16 bytes of extra
    // data), and only that.
    let o = qemu_img(&["check", s(&d.join("vm.qcow2"))]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("ERROR snapshot table entry 1 is incomplete"));
    let (file, h) = open_header(&d.join("vm.qcow2"));
    let snaps = snapshot::read(&file, &h).unwrap();
    let incomplete: Vec<bool> = snaps.iter().map(|s| s.incomplete(h.version)).collect();
    assert_eq!(incomplete, [false, true, false, false]);
}

#[test]
fn hostile_snapshot_tables_fail_cleanly() {
    use std::os::unix::fs::FileExt;
    let dir = workdir();
    let d = dir.path();
    create(d, "h.qcow2", "", "1M");
    qemu_img_line(d, "snapshot -c x h.qcow2");
    let p = d.join("h.qcow2");
    let head = std::fs::read(&p).unwrap();
    let off = u64::from_be_bytes(head[64..72].try_into().unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    // Extra data size 2000: both refuse the image.
    f.write_all_at(&2000u32.to_be_bytes(), off + 36).unwrap();
    for args in [&["info", "h.qcow2"][..], &["snapshot", "-l", "h.qcow2"]] {
        let ours = run_in(d, &diskit_bin(), args);
        let theirs = run_in(d, Path::new("qemu-img"), args);
        assert_eq!((code(&ours), code(&theirs)), (1, 1), "{args:?}");
        assert_stderr_has(&ours, "Too much extra metadata");
    }
    // A count far past the table: an error naming the entry, no panic.
    f.write_all_at(&24u32.to_be_bytes(), off + 36).unwrap();
    f.write_all_at(&60000u32.to_be_bytes(), 60).unwrap();
    let o = run_in(d, &diskit_bin(), &["info", "h.qcow2"]);
    assert_fails_with(&o, 1, "Snapshot table entry");
}

/// The offset of the bitmap directory of `img`.
fn bitmap_directory(img: &Path) -> u64 {
    let (_, h) = open_header(img);
    match BitmapsExt::of(&h).unwrap() {
        BitmapsState::Present(x) => x.directory_offset,
        other => panic!("{other:?}"),
    }
}

#[test]
fn bitmaps() {
    use std::os::unix::fs::FileExt;
    let dir = workdir();
    let d = dir.path();
    for opts in ["", "cluster_size=512", "cluster_size=2M", "extended_l2=on"] {
        create(d, "b.qcow2", opts, "100M");
        qemu_img_line(d, "bitmap --add b.qcow2 plain");
        qemu_in(
            d,
            "qemu-img",
            &[
                "bitmap",
                "--add",
                "-g",
                "512k",
                "b.qcow2",
                "with granularity",
            ],
        );
        qemu_img_line(d, "bitmap --add -g 2G b.qcow2 huge");
        qemu_img_line(d, "bitmap --add b.qcow2 off");
        qemu_img_line(d, "bitmap --disable b.qcow2 off");
        info_like_qemu(d, "b.qcow2", opts);
    }
    // One marked in use (saved uncleanly).
    let p = d.join("b.qcow2");
    let dir_off = bitmap_directory(&p);
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&3u32.to_be_bytes(), dir_off + 12).unwrap();
    info_like_qemu(d, "b.qcow2", "in use");
    // Autoclear bit 0 cleared by a program without bitmap support: the
    // bitmaps are ignored (and both warn on stderr).
    f.write_all_at(&0u64.to_be_bytes(), 88).unwrap();
    info_like_qemu(d, "b.qcow2", "stale bitmaps");
    let o = run_in(d, &diskit_bin(), &["info", "b.qcow2"]);
    assert!(stderr(&o).contains("bitmaps are now considered inconsistent"));
}

#[test]
fn dirty_and_corrupt_images() {
    use std::os::unix::fs::FileExt;
    let dir = workdir();
    let d = dir.path();
    create(d, "dirty.qcow2", "lazy_refcounts=on", "10M");
    // qemu-io aborts with the image dirty (lazy refcounts not written back).
    let o = run_in(
        d,
        Path::new("qemu-io"),
        &["-c", "write -P 9 0 128k", "-c", "abort", "dirty.qcow2"],
    );
    assert!(!o.status.success());
    let head = std::fs::read(d.join("dirty.qcow2")).unwrap();
    assert_eq!(head[79] & 1, 1, "the image should be dirty");
    info_like_qemu(d, "dirty.qcow2", "dirty");

    create(d, "corrupt.qcow2", "", "10M");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("corrupt.qcow2"))
        .unwrap();
    f.write_all_at(&2u64.to_be_bytes(), 72).unwrap();
    info_like_qemu(d, "corrupt.qcow2", "corrupt");
}

#[test]
fn raw_images_and_snapshot_usage() {
    let dir = workdir();
    let d = dir.path();
    sparse_file(&d.join("r.raw"), 1 << 20, &[(0, 512, 1)]);
    same_in(d, &["snapshot", "-l", "r.raw"], "raw");
    same_in(d, &["snapshot", "r.raw"], "raw, default -l");
    same_in(d, &["info", "--backing-chain", "r.raw"], "raw chain");
    same_in(
        d,
        &["info", "--backing-chain", "--output=json", "r.raw"],
        "raw chain",
    );
    create(d, "s.qcow2", "", "1M");
    for args in [
        &["snapshot", "-l", "-l", "s.qcow2"][..],
        &["snapshot", "-l", "-c", "x", "s.qcow2"],
        &["snapshot", "-a", "x", "-d", "y", "s.qcow2"],
    ] {
        let ours = run_in(d, &diskit_bin(), args);
        let theirs = run_in(d, Path::new("qemu-img"), args);
        assert_eq!(code(&ours), code(&theirs), "{args:?}");
        assert_eq!(
            stderr(&ours).replace("diskit", "qemu-img"),
            stderr(&theirs),
            "{args:?}"
        );
    }
    // A snapshot that is not there: qemu-img's error, the image untouched
    // (interop_qcow2_snapshot.rs tests the changes themselves).
    let before = std::fs::read(d.join("s.qcow2")).unwrap();
    for op in ["-a", "-d"] {
        let o = run_in(d, &diskit_bin(), &["snapshot", op, "x", "s.qcow2"]);
        assert_fails_with(&o, 1, "Could not");
    }
    assert_eq!(std::fs::read(d.join("s.qcow2")).unwrap(), before);
}
