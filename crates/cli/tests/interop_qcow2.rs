//! qcow2 interop with qemu-img and qemu-io as the oracle, both ways:
//! images QEMU writes (every feature) read back byte-equal through diskit
//! with the same map; images diskit writes pass `qemu-img check` and compare
//! equal; hostile images get clear errors. (The kill -9 test is in
//! crates/formats/tests/qcow2_rw.rs, where it can use a tiny L2 cache.)

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::*;

fn qemu_io(args: &[&str]) {
    ok(peer("qemu-io", args));
}

/// Writes a recognisable mix with qemu-io: data, partial clusters, zeroes
/// (whole and partial clusters), a discard and data near the end.
fn scribble(img: &Path, fmt: &str, size: u64) {
    let end = size - 4096;
    let cmds = [
        "write -P 0x11 0 64k".to_string(),
        "write -P 0x22 70k 3k".to_string(),
        "write -P 0x33 200k 200k".to_string(),
        "write -z 256k 64k".to_string(),
        "write -z 1000k 5k".to_string(),
        "discard 320k 64k".to_string(),
        "write -P 0x44 1M 4k".to_string(),
        "write -P 0x55 1028k 4k".to_string(),
        format!("write -P 0x66 {end} 4k"),
    ];
    let mut args = vec!["-f", fmt];
    for c in &cmds {
        args.extend(["-c", c.as_str()]);
    }
    args.push(s(img));
    qemu_io(&args);
}

/// diskit and qemu-img read the same bytes and map the same extents.
fn reads_like_qemu(img: &Path, dir: &Path, what: &str) {
    let ours = dir.join("ours.raw");
    let theirs = dir.join("theirs.raw");
    ok(diskit(&["convert", "-O", "raw", s(img), s(&ours)]));
    ok(qemu_img(&["convert", "-O", "raw", s(img), s(&theirs)]));
    assert!(same_bytes(&ours, &theirs), "{what}: converted bytes differ");
    // Both maps depend on how much of the file is allocated on disk.
    let (json, human) = on_settled_allocation(img, || {
        let json = ["map", "--output=json", s(img)];
        let human = ["map", s(img)];
        (
            (diskit(&json), qemu_img(&json)),
            (diskit(&human), qemu_img(&human)),
        )
    });
    let (o, t) = json;
    assert_eq!(stdout(&ok(o)), stdout(&ok(t)), "{what}: map --output=json");
    // Human map fails like qemu-img's on compressed data: compare outcomes.
    let (o, t) = human;
    assert_eq!(
        (code(&o), stdout(&o)),
        (code(&t), stdout(&t)),
        "{what}: map"
    );
    assert_eq!(
        stderr(&o).trim_start_matches("diskit: "),
        stderr(&t).trim_start_matches("qemu-img: "),
        "{what}: map"
    );
    ok(qemu_img(&["compare", s(img), s(&ours)]));
}

#[test]
fn reads_what_qemu_writes() {
    let dir = workdir();
    let d = dir.path();
    let cases = [
        "compat=0.10",
        "compat=1.1",
        "cluster_size=512",
        "cluster_size=4096,refcount_bits=1",
        "cluster_size=2M",
        "extended_l2=on",
        "extended_l2=on,cluster_size=16k",
        "extended_l2=on,cluster_size=2M",
        "refcount_bits=64,lazy_refcounts=on",
        "preallocation=metadata",
        "preallocation=falloc,extended_l2=on",
        "compression_type=zstd",
    ];
    for opts in cases {
        let img = d.join("img.qcow2");
        let size = 5 << 20;
        ok(qemu_img(&argv(
            "create -q -f qcow2 -o",
            &[opts, s(&img), &size.to_string()],
        )));
        scribble(&img, "qcow2", size);
        reads_like_qemu(&img, d, opts);
    }
}

#[test]
fn reads_compressed_clusters_of_both_types() {
    let dir = workdir();
    let d = dir.path();
    let src = d.join("src.raw");
    // Compressible, incompressible and zero clusters, and an unaligned end.
    sparse_file(
        &src,
        (3 << 20) + 1000,
        &[
            (0, 300_000, 0x61),
            (400_000, 500_000, 0xff),
            (2 << 20, 70_000, 0x62),
        ],
    );
    for ty in ["zlib", "zstd"] {
        for cs in ["512", "65536", "2M"] {
            let img = d.join(format!("c-{ty}-{cs}.qcow2"));
            let o = format!("compression_type={ty},cluster_size={cs}");
            ok(qemu_img(&argv(
                "convert -c -O qcow2 -o",
                &[&o, s(&src), s(&img)],
            )));
            reads_like_qemu(&img, d, &o);
        }
    }
}

#[test]
fn reads_three_deep_chains_with_short_backing() {
    let dir = workdir();
    let d = dir.path();
    let base = d.join("base.qcow2");
    let mid = d.join("sub/mid.qcow2");
    let top = d.join("sub/top.qcow2");
    std::fs::create_dir(d.join("sub")).unwrap();
    // The base is shorter than the overlays: reads past it are zeros.
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "2M"]));
    qemu_io(&["-c", "write -P 0xa1 0 2M", s(&base)]);
    // Relative backing names resolve against the overlay's directory.
    ok(qemu_img(&argv(
        "create -q -f qcow2 -b ../base.qcow2 -F qcow2 -o extended_l2=on",
        &[s(&mid), "6M"],
    )));
    qemu_io(&[
        "-c",
        "write -P 0xb2 8k 4k",
        "-c",
        "write -z 512k 64k",
        "-c",
        "write -P 0xb3 3M 64k",
        s(&mid),
    ]);
    ok(qemu_img(&argv(
        "create -q -f qcow2 -b mid.qcow2 -F qcow2",
        &[s(&top), "8M"],
    )));
    qemu_io(&[
        "-c",
        "write -P 0xc3 4k 4k",
        "-c",
        "write -P 0xc4 1M 64k",
        "-c",
        "write -z 1536k 64k",
        "-c",
        "write -P 0xc5 7M 64k",
        s(&top),
    ]);
    reads_like_qemu(&top, d, "3-deep chain");
    // The raw below a qcow2 overlay.
    let raw = d.join("base.raw");
    sparse_file(&raw, 1 << 20, &[(0, 4096, 0x71), (600_000, 10_000, 0xff)]);
    let over = d.join("over.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -b",
        &[s(&raw), "-F", "raw", s(&over), "3M"],
    )));
    qemu_io(&["-c", "write -P 0xd1 64k 64k", s(&over)]);
    reads_like_qemu(&over, d, "raw backing");
}

/// diskit writes into images qemu-img created: qemu-img check finds no
/// error and compare finds the source.
#[test]
fn images_diskit_writes_pass_qemu_check() {
    let dir = workdir();
    let d = dir.path();
    let src = d.join("src.raw");
    let size: u64 = 6 << 20;
    sparse_file(
        &src,
        size,
        &[
            (0, 100_000, 0x31),
            (500_000, 700_000, 0xff),
            (3 << 20, 65536, 0x32),
            (size - 5000, 5000, 0x33),
        ],
    );
    let data_file = d.join("data.raw");
    let data_file_opt = format!("data_file={}", s(&data_file));
    let data_file_raw_opt = format!("data_file={},data_file_raw=on", s(&data_file));
    for opts in [
        "compat=0.10",
        "cluster_size=512",
        "cluster_size=4096,refcount_bits=2",
        "extended_l2=on",
        "refcount_bits=32,cluster_size=2M",
        "preallocation=metadata",
        &data_file_opt,
        &data_file_raw_opt,
    ] {
        let img = d.join("w.qcow2");
        ok(qemu_img(&argv(
            "create -q -f qcow2 -o",
            &[opts, s(&img), &size.to_string()],
        )));
        ok(diskit(&["convert", "-n", "-O", "qcow2", s(&src), s(&img)]));
        let check = qemu_img(&["check", s(&img)]);
        assert_eq!(code(&check), 0, "{opts}: {}", stdout(&check));
        ok(qemu_img(&["compare", s(&src), s(&img)]));
        reads_like_qemu(&img, d, opts);
        if opts.contains("data_file_raw=on") {
            // The data file alone is the disk.
            ok(qemu_img(&argv(
                "compare -f raw -F raw",
                &[s(&src), s(&data_file)],
            )));
        }
    }
}

fn patch(path: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

fn read_u64(path: &Path, at: u64) -> u64 {
    let f = std::fs::File::open(path).unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, at).unwrap();
    u64::from_be_bytes(b)
}

/// Hostile images: a clear error and a non-zero exit, never a panic or a hang.
#[test]
fn hostile_images_get_clear_errors() {
    let dir = workdir();
    let d = dir.path();
    let good = d.join("good.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&good), "4M"]));
    qemu_io(&["-c", "write -P 0x5a 0 128k", s(&good)]);
    let l1 = read_u64(&good, 40);
    let l2 = read_u64(&good, l1) & 0x00ff_ffff_ffff_fe00;
    let comp = d.join("comp.qcow2");
    let src = d.join("c.raw");
    sparse_file(&src, 1 << 20, &[(0, 1 << 20, 0x41)]);
    ok(qemu_img(&argv("convert -c -O qcow2", &[s(&src), s(&comp)])));
    let cl1 = read_u64(&comp, 40);
    let cl2 = read_u64(&comp, cl1) & 0x00ff_ffff_ffff_fe00;
    let centry = read_u64(&comp, cl2);
    let coff = centry & ((1u64 << 54) - 1);
    type Mutate = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, PathBuf, Mutate, &str)> = vec![
        (
            "L1 past EOF",
            good.clone(),
            Box::new(|p: &Path| patch(p, 40, &(1u64 << 40).to_be_bytes())),
            "outside the file",
        ),
        (
            "L2 past EOF",
            good.clone(),
            Box::new(move |p: &Path| patch(p, l1, &((1u64 << 40) | (1 << 63)).to_be_bytes())),
            "past the end of the file",
        ),
        (
            "L2 on L1",
            good.clone(),
            Box::new(move |p: &Path| patch(p, l1, &(l1 | (1 << 63)).to_be_bytes())),
            "overlaps the L1 table",
        ),
        (
            "L2 reserved bits",
            good.clone(),
            Box::new(move |p: &Path| patch(p, l1, &(0x7u64 | (l2) | (1 << 63)).to_be_bytes())),
            "invalid",
        ),
        (
            "data unaligned",
            good.clone(),
            Box::new(move |p: &Path| patch(p, l2, &(0x50200u64 | (1 << 63)).to_be_bytes())),
            "unaligned",
        ),
        (
            "compressed and COPIED",
            good.clone(),
            Box::new(move |p: &Path| patch(p, l2, &(0xc000_0000_0005_0000u64).to_be_bytes())),
            "COPIED",
        ),
        (
            "absurd size",
            good.clone(),
            Box::new(|p: &Path| patch(p, 24, &(1u64 << 62).to_be_bytes())),
            "",
        ),
        (
            "truncated",
            good.clone(),
            Box::new(|p: &Path| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(100)
                    .unwrap()
            }),
            "",
        ),
        (
            "compressed past EOF",
            comp.clone(),
            Box::new(move |p: &Path| {
                patch(
                    p,
                    cl2,
                    &((centry & !((1u64 << 54) - 1)) | (1 << 50)).to_be_bytes(),
                )
            }),
            "past the end",
        ),
        (
            "bad deflate",
            comp.clone(),
            Box::new(move |p: &Path| patch(p, coff, &[0xff; 64])),
            "compressed cluster at host offset",
        ),
        (
            // The last cluster's stream said to run 128 KiB, past the end
            // of the file: said so, not as a deflate error alone.
            "compressed stream running past EOF",
            comp.clone(),
            Box::new(move |p: &Path| {
                let last = read_u64(p, cl2 + 15 * 8);
                patch(p, cl2 + 15 * 8, &(last | (0xff << 54)).to_be_bytes());
                let stream = (last & ((1u64 << 54) - 1)) + 512;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(stream.max(std::fs::metadata(p).unwrap().len()))
                    .unwrap();
                // Garbage after the real stream, as another cluster's bytes.
                patch(p, last & ((1u64 << 54) - 1), &[0xfe; 8]);
            }),
            "past the end of the file",
        ),
    ];
    for (what, orig, mutate, msg) in cases {
        let img = d.join("bad.qcow2");
        std::fs::copy(&orig, &img).unwrap();
        mutate(&img);
        let out = d.join("out.raw");
        let o = diskit(&["convert", "-O", "raw", s(&img), s(&out)]);
        let err = stderr(&o);
        assert_eq!(code(&o), 1, "{what}: exit code; stderr: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
        assert!(err.starts_with("diskit: "), "{what}: {err}");
        assert!(err.contains(msg), "{what}: expected '{msg}' in: {err}");
        // Writable opens refuse too (or work) without panicking.
        let o = diskit(&["convert", "-n", "-O", "qcow2", s(&src), s(&img)]);
        assert!(
            !stderr(&o).contains("panicked"),
            "{what} (rw): {}",
            stderr(&o)
        );
    }
    // Refcounts are only read for writing: a read-only open may succeed,
    // a writable one refuses.
    let img = d.join("bad.qcow2");
    std::fs::copy(&good, &img).unwrap();
    patch(&img, 48, &(1u64 << 40).to_be_bytes());
    let o = diskit(&["convert", "-n", "-O", "qcow2", s(&src), s(&img)]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_stderr_has(&o, "refcount table offset");
    // A backing file that is the image itself.
    let looped = d.join("loop.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&looped), "1M"]));
    ok(qemu_img(&argv(
        "rebase -u -b loop.qcow2 -F qcow2",
        &[s(&looped)],
    )));
    let o = diskit(&["map", s(&looped)]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_stderr_has(&o, "loop");
}

/// `check` reports what qemu-img check reports (exit code, human and JSON
/// output), and `-r` repairs so that qemu-img then finds the image clean.
#[test]
fn check_matches_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let same = |img: &Path, extra: &[&str], what: &str| {
        for output in ["human", "json"] {
            let mut args = vec!["check", "--output", output];
            args.extend_from_slice(extra);
            args.push(s(img));
            let (o, t) = (diskit(&args), qemu_img(&args));
            assert_eq!(
                (code(&o), stdout(&o)),
                (code(&t), stdout(&t)),
                "{what} ({output}): {}",
                stderr(&o)
            );
        }
    };
    // Clean images of several kinds, written by QEMU.
    for opts in [
        "compat=0.10",
        "cluster_size=4096,refcount_bits=1",
        "extended_l2=on",
        "preallocation=metadata",
    ] {
        let img = d.join("c.qcow2");
        let size = 5 << 20;
        ok(qemu_img(&argv(
            "create -q -f qcow2 -o",
            &[opts, s(&img), &size.to_string()],
        )));
        scribble(&img, "qcow2", size);
        same(&img, &[], opts);
    }
    // Snapshots and a dirtied persistent bitmap: their clusters count too.
    let snap = d.join("snap.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&snap), "8M"]));
    ok(qemu_img(&["bitmap", "--add", s(&snap), "b1"]));
    qemu_io(&["-c", "write 0 1M", "-c", "write 5M 64k", s(&snap)]);
    ok(qemu_img(&["snapshot", "-c", "s1", s(&snap)]));
    qemu_io(&["-c", "write -P 4 0 128k", s(&snap)]);
    ok(qemu_img(&["snapshot", "-c", "s2", s(&snap)]));
    same(&snap, &[], "snapshots and bitmaps");
    let src = d.join("src.raw");
    sparse_file(
        &src,
        2 << 20,
        &[(0, 1 << 20, 0x41), (1 << 20, 300_000, 0xff)],
    );
    let comp = d.join("comp.qcow2");
    ok(qemu_img(&argv("convert -c -O qcow2", &[s(&src), s(&comp)])));
    same(&comp, &[], "compressed");
    // A leak and a refcount too low (corruption), patched in.
    let good = d.join("good.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&good), "1M"]));
    qemu_io(&["-c", "write 0 64k", "-c", "write 256k 64k", s(&good)]);
    let reftable = read_u64(&good, 48);
    let block = read_u64(&good, reftable);
    let leaky = d.join("leaky.qcow2");
    std::fs::copy(&good, &leaky).unwrap();
    patch(&leaky, block + 2 * 4, &2u16.to_be_bytes());
    same(&leaky, &[], "leak");
    let broken = d.join("broken.qcow2");
    std::fs::copy(&good, &broken).unwrap();
    patch(&broken, block + 2 * 5, &0u16.to_be_bytes());
    same(&broken, &[], "refcount too low");
    // Repairs: diskit repairs one copy, qemu-img another; same report, and
    // qemu-img finds diskit's repaired image clean.
    for (img, mode) in [(&leaky, "leaks"), (&leaky, "all"), (&broken, "all")] {
        let ours = d.join("ours.qcow2");
        let theirs = d.join("theirs.qcow2");
        std::fs::copy(img, &ours).unwrap();
        std::fs::copy(img, &theirs).unwrap();
        let o = diskit(&["check", "-r", mode, s(&ours)]);
        let t = qemu_img(&["check", "-r", mode, s(&theirs)]);
        assert_eq!(code(&o), code(&t), "-r {mode}: {}", stderr(&o));
        if img == &leaky {
            assert_eq!(stdout(&o), stdout(&t), "-r {mode}");
        }
        let after = qemu_img(&["check", s(&ours)]);
        assert_eq!(code(&after), 0, "-r {mode}: {}", stdout(&after));
        ok(qemu_img(&["compare", s(&good), s(&ours)]));
    }
    // What reading refuses, check reports, as qemu-img: a subcluster
    // both allocated and zero (extended L2)...
    let ext = d.join("ext.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o extended_l2=on",
        &[s(&ext), "1M"],
    )));
    qemu_io(&["-c", "write -P 5 0 4k", s(&ext)]);
    let l2 = read_u64(&ext, read_u64(&ext, 40)) & 0x00ff_ffff_ffff_fe00;
    let bitmap = read_u64(&ext, l2 + 8);
    patch(&ext, l2 + 8, &(bitmap | 1 << 32).to_be_bytes());
    same(&ext, &[], "subcluster allocated and zero");
    // ... a compressed cluster whose size runs past the end of the file...
    let past = d.join("past.qcow2");
    std::fs::copy(&comp, &past).unwrap();
    let l2 = read_u64(&past, read_u64(&past, 40)) & 0x00ff_ffff_ffff_fe00;
    let entry = read_u64(&past, l2);
    // 64 KiB clusters: the sector count is bits 54..61.
    patch(&past, l2, &(entry | 0xff << 54).to_be_bytes());
    same(&past, &[], "compressed cluster past the end");
    // ... and a missing external data file (exit 1, as for any image that
    // cannot be opened).
    let with_data = d.join("with-data.qcow2");
    let data_opt = format!("data_file={}", s(&d.join("data.raw")));
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o",
        &[&data_opt, s(&with_data), "1M"],
    )));
    same(&with_data, &[], "data file present");
    std::fs::remove_file(d.join("data.raw")).unwrap();
    same(&with_data, &[], "data file missing");
    let o = diskit(&["check", s(&with_data)]);
    assert_stderr_has(&o, "data.raw");
    // Raw images cannot be checked.
    let o = diskit(&["check", "-f", "raw", s(&src)]);
    let t = qemu_img(&["check", "-f", "raw", s(&src)]);
    assert_eq!(code(&o), code(&t));
    assert_eq!(code(&o), 63);
}

/// A lazy-refcounts image left dirty by a killed QEMU is repaired when
/// diskit opens it for writing, as QEMU does.
#[test]
fn dirty_lazy_refcounts_image_is_repaired_on_writable_open() {
    let dir = workdir();
    let d = dir.path();
    let img = d.join("lazy.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o lazy_refcounts=on",
        &[s(&img), "4M"],
    )));
    // qemu-io kills itself after the write: refcounts stay stale, dirty bit set.
    let _ = peer(
        "qemu-io",
        &["-c", "write -P 7 0 1M", "-c", "sigraise 9", s(&img)],
    );
    assert_eq!(read_u64(&img, 72) & 1, 1, "the image is dirty");
    assert_eq!(code(&qemu_img(&["check", s(&img)])), 2);
    let expect = d.join("expect.raw");
    ok(qemu_img(&["convert", "-O", "raw", s(&img), s(&expect)]));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&expect)
        .unwrap();
    f.write_all_at(&[0x42; 4096], 2 << 20).unwrap();
    drop(f);
    ok(diskit(&argv(
        "convert -n -O qcow2 -f raw",
        &[s(&expect), s(&img)],
    )));
    assert_eq!(read_u64(&img, 72) & 1, 0, "the dirty bit is cleared");
    let check = qemu_img(&["check", s(&img)]);
    assert_eq!(code(&check), 0, "{}", stdout(&check));
    ok(qemu_img(&["compare", s(&expect), s(&img)]));
}

/// The "N/M = ... compressed clusters" line of qemu-img check.
fn check_stats(img: &Path) -> String {
    let o = qemu_img(&["check", s(img)]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    stdout(&o)
        .lines()
        .find(|l| l.contains("compressed clusters"))
        .unwrap_or_default()
        .to_string()
}

/// `convert -c` writes compressed clusters that QEMU reads, in both
/// compression types, compressing the same clusters qemu-img does.
#[test]
fn compressed_writes_qemu_reads() {
    let dir = workdir();
    let d = dir.path();
    let src = d.join("src.raw");
    let size: u64 = (6 << 20) + 1000;
    sparse_file(
        &src,
        size,
        &[
            (0, 1_200_000, 0x68),
            (2 << 20, 1 << 20, 0xff),
            (4_198_400, 70_000, 0x78),
            (size - 3000, 3000, 0x65),
        ],
    );
    for ty in ["zlib", "zstd"] {
        for cs in ["512", "65536", "2M"] {
            let o = format!("compression_type={ty},cluster_size={cs}");
            let ours = d.join("ours.qcow2");
            let theirs = d.join("theirs.qcow2");
            ok(qemu_img(&argv(
                "create -q -f qcow2 -o",
                &[&o, s(&ours), &size.to_string()],
            )));
            ok(diskit(&argv(
                "convert -n -c -O qcow2",
                &[s(&src), s(&ours)],
            )));
            ok(qemu_img(&argv(
                "convert -c -O qcow2 -o",
                &[&o, s(&src), s(&theirs)],
            )));
            ok(qemu_img(&["compare", s(&src), s(&ours)]));
            assert_eq!(check_stats(&ours), check_stats(&theirs), "{o}");
            // diskit reads its own compressed clusters back too.
            reads_like_qemu(&ours, d, &o);
        }
    }
}

/// resize grows (moving the L1 table when it must) and shrinks (with
/// --shrink) like qemu-img: same contents, and qemu-img check is clean.
#[test]
fn resize_matches_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    for cs in ["512", "65536"] {
        let ours = d.join("ours.qcow2");
        let theirs = d.join("theirs.qcow2");
        ok(qemu_img(&argv(
            "create -q -f qcow2 -o",
            &[&format!("cluster_size={cs}"), s(&ours), "1M"],
        )));
        qemu_io(&["-c", "write -P 9 0 1M", s(&ours)]);
        std::fs::copy(&ours, &theirs).unwrap();
        for (size, flag) in [("+100M", "-q"), ("300k", "--shrink"), ("+5M", "-q")] {
            ok(diskit(&["resize", flag, s(&ours), size]));
            ok(qemu_img(&["resize", "-q", flag, s(&theirs), size]));
            let check = qemu_img(&["check", s(&ours)]);
            assert_eq!(code(&check), 0, "{cs} {size}: {}", stdout(&check));
            ok(qemu_img(&["compare", s(&ours), s(&theirs)]));
            same_as_qemu_img(&["map", "--output=json", s(&ours)], "resized");
        }
        // Shrinking needs --shrink.
        let o = diskit(&["resize", s(&ours), "100k"]);
        assert_eq!(code(&o), 1);
        assert!(stderr(&o).contains("--shrink"));
    }
}

/// `resize --preallocation`: every mode maps the new clusters, passes
/// check and reads as zeros; metadata lays them out exactly as qemu-img
/// does; falloc and full reserve the space in the file; a shrink truncates
/// the file where qemu-img does.
#[test]
fn resize_preallocates_and_truncates_like_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    for mode in ["metadata", "falloc", "full"] {
        let ours = d.join("ours.qcow2");
        let theirs = d.join("theirs.qcow2");
        ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&ours), "1M"]));
        qemu_io(&["-c", "write -P 9 0 300k", s(&ours)]);
        std::fs::copy(&ours, &theirs).unwrap();
        let flag = format!("--preallocation={mode}");
        ok(diskit(&["resize", &flag, s(&ours), "+3M"]));
        ok(qemu_img(&["resize", "-q", &flag, s(&theirs), "+3M"]));
        let check = qemu_img(&["check", s(&ours)]);
        assert_eq!(code(&check), 0, "{mode}: {}", stdout(&check));
        ok(qemu_img(&["compare", s(&ours), s(&theirs)]));
        assert_eq!(data_extents(&ours), data_extents(&theirs), "{mode}");
        if mode == "metadata" {
            same_as_qemu_img(&["map", "--output=json", s(&ours)], "metadata preallocated");
        } else {
            // The new 3 MiB are allocated in the file.
            assert!(allocated(&ours) >= (3 << 20) + (300 << 10), "{mode}");
        }
        std::fs::remove_file(&theirs).unwrap();
        std::fs::remove_file(&ours).unwrap();
    }
    let ours = d.join("shrink.qcow2");
    let theirs = d.join("shrink-qemu.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&ours), "4M"]));
    qemu_io(&["-c", "write -P 9 0 3M", s(&ours)]);
    std::fs::copy(&ours, &theirs).unwrap();
    for args in [
        &[
            "resize",
            "--preallocation=falloc",
            "--shrink",
            "IMG",
            "--",
            "-1M",
        ][..],
        &["resize", "--preallocation=bogus", "IMG", "+1M"][..],
    ] {
        let (o, t) = (
            diskit(
                &args
                    .iter()
                    .map(|a| if *a == "IMG" { s(&ours) } else { a })
                    .collect::<Vec<_>>(),
            ),
            qemu_img(
                &args
                    .iter()
                    .map(|a| if *a == "IMG" { s(&theirs) } else { a })
                    .collect::<Vec<_>>(),
            ),
        );
        assert_eq!(code(&o), code(&t), "{args:?}");
        assert_eq!(
            stderr(&o).replace("diskit: ", ""),
            stderr(&t).replace("qemu-img: ", ""),
            "{args:?}"
        );
    }
    ok(diskit(&["resize", "-q", "--shrink", s(&ours), "--", "-3M"]));
    ok(qemu_img(&argv(
        "resize -q --shrink",
        &[s(&theirs), "--", "-3M"],
    )));
    assert_eq!(
        std::fs::metadata(&ours).unwrap().len(),
        std::fs::metadata(&theirs).unwrap().len()
    );
    let check = qemu_img(&["check", s(&ours)]);
    assert_eq!(code(&check), 0, "{}", stdout(&check));
}

/// `convert -l` reads an internal snapshot, by id or name, as qemu-img does.
#[test]
fn convert_reads_internal_snapshots() {
    let dir = workdir();
    let d = dir.path();
    let img = d.join("sn.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "4M"]));
    qemu_io(&["-c", "write -P 1 0 1M", s(&img)]);
    ok(qemu_img(&["snapshot", "-c", "first", s(&img)]));
    qemu_io(&["-c", "write -P 2 512k 1M", "-c", "write -z 3M 64k", s(&img)]);
    ok(qemu_img(&["resize", "-q", s(&img), "8M"]));
    ok(qemu_img(&["snapshot", "-c", "second", s(&img)]));
    qemu_io(&["-c", "write -P 3 0 64k", s(&img)]);
    let ours = d.join("ours.raw");
    let theirs = d.join("theirs.raw");
    for l in [
        "first",
        "second",
        "1",
        "snapshot.id=2",
        "snapshot.name=first",
    ] {
        ok(diskit(&argv(
            "convert -l",
            &[l, "-O", "raw", s(&img), s(&ours)],
        )));
        ok(qemu_img(&argv(
            "convert -l",
            &[l, "-O", "raw", s(&img), s(&theirs)],
        )));
        assert!(same_bytes(&ours, &theirs), "-l {l}");
    }
    for (args, what) in [
        (
            vec!["convert", "-l", "nope", "-O", "raw", s(&img), s(&ours)],
            "missing",
        ),
        (
            vec![
                "convert",
                "-l",
                "1",
                "-f",
                "raw",
                "-O",
                "raw",
                s(&theirs),
                s(&ours),
            ],
            "raw",
        ),
    ] {
        let (o, t) = (diskit(&args), qemu_img(&args));
        assert_eq!(code(&o), code(&t), "{what}");
        assert_eq!(
            stderr(&o).trim_start_matches("diskit: "),
            stderr(&t).trim_start_matches("qemu-img: "),
            "{what}"
        );
    }
}

/// Writing over clusters shared with internal snapshots copies them (and
/// their L2 tables): the snapshots keep their contents, check stays clean.
#[test]
fn writes_keep_internal_snapshots_intact() {
    let dir = workdir();
    let d = dir.path();
    let img = d.join("sn.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o cluster_size=16k",
        &[s(&img), "8M"],
    )));
    qemu_io(&["-c", "write -P 1 0 3M", "-c", "write -P 2 6M 64k", s(&img)]);
    ok(qemu_img(&["snapshot", "-c", "s1", s(&img)]));
    let before = d.join("before.raw");
    ok(qemu_img(&argv(
        "convert -l s1 -O raw",
        &[s(&img), s(&before)],
    )));
    let src = d.join("src.raw");
    sparse_file(
        &src,
        8 << 20,
        &[
            (4096, 100_000, 0xff),
            (1 << 20, 5000, 0x44),
            (6 << 20, 1 << 20, 0x45),
        ],
    );
    ok(diskit(&["convert", "-n", "-O", "qcow2", s(&src), s(&img)]));
    let check = qemu_img(&["check", s(&img)]);
    assert_eq!(code(&check), 0, "{}", stdout(&check));
    ok(qemu_img(&["compare", s(&src), s(&img)]));
    let after = d.join("after.raw");
    ok(qemu_img(&argv(
        "convert -l s1 -O raw",
        &[s(&img), s(&after)],
    )));
    assert!(same_bytes(&before, &after), "the snapshot is unchanged");
}

/// `convert -O qcow2` lays out what it writes as qemu-img does: runs of
/// whole clusters go into runs of new clusters in one write each, and the
/// image is byte for byte qemu-img's, whatever the cluster size and L2
/// entry format.
#[test]
fn convert_to_qcow2_is_byte_identical_to_qemu_img() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    // Data runs of every shape: many clusters, one, part of one, across an
    // L2 table boundary (4 KiB clusters: 2 MiB per table), and zeros
    // inside data.
    sparse_file(
        &src,
        12 << 20,
        &[
            (0, 3 << 20, 0x11),
            (3_300_000, 70_000, 0x22),
            (4 << 20, 4096, 0x33),
            ((6 << 20) - 8192, 40_000, 0x44),
            (8 << 20, 1 << 20, 0x00),
            ((12 << 20) - 5000, 5000, 0x55),
        ],
    );
    for opts in [
        "",
        "cluster_size=4096",
        "cluster_size=2M",
        "extended_l2=on,cluster_size=128k",
    ] {
        let (ours, theirs) = (dir.path().join("d.qcow2"), dir.path().join("q.qcow2"));
        let _ = std::fs::remove_file(&ours);
        let _ = std::fs::remove_file(&theirs);
        let mut args = vec!["convert", "-O", "qcow2"];
        if !opts.is_empty() {
            args.extend(["-o", opts]);
        }
        ok(diskit(&[&args[..], &[s(&src), s(&ours)]].concat()));
        ok(qemu_img(&[&args[..], &[s(&src), s(&theirs)]].concat()));
        assert!(
            same_bytes(&ours, &theirs),
            "-o {opts}: not qemu-img's bytes"
        );
    }
}

/// Damaged snapshot and bitmap tables: info, check, map and convert give
/// qemu-img's exit codes. A snapshot L1 table past the end of the file is
/// listed by info and reported by check (QEMU checks where it lies only
/// when the snapshot is used); a bitmap directory past the end makes the
/// image unopenable for every command, as in QEMU.
#[test]
fn damaged_snapshot_and_bitmap_tables_get_qemu_img_exit_codes() {
    let dir = workdir();
    let d = dir.path();
    let snap = d.join("snap.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&snap), "4M"]));
    qemu_io(&["-c", "write -P 3 0 1M", s(&snap)]);
    ok(qemu_img(&["snapshot", "-c", "s1", s(&snap)]));
    // The first entry's L1 table offset (at the start of the table).
    let table = read_u64(&snap, 64);
    patch(&snap, table, &(1u64 << 40).to_be_bytes());
    let bm = d.join("bm.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&bm), "4M"]));
    ok(qemu_img(&["bitmap", "--add", s(&bm), "b"]));
    qemu_io(&["-c", "write 0 64k", s(&bm)]);
    // The bitmaps extension: its directory offset, 16 bytes into its data.
    let data = std::fs::read(&bm).unwrap();
    let mut at = u32::from_be_bytes(data[100..104].try_into().unwrap()) as usize;
    loop {
        let kind = u32::from_be_bytes(data[at..at + 4].try_into().unwrap());
        let len = u32::from_be_bytes(data[at + 4..at + 8].try_into().unwrap()) as usize;
        assert_ne!(kind, 0, "no bitmaps extension");
        if kind == 0x2385_2875 {
            patch(&bm, (at + 8 + 16) as u64, &(1u64 << 40).to_be_bytes());
            break;
        }
        at += 8 + len.div_ceil(8) * 8;
    }
    let out = d.join("out.raw");
    for img in [&snap, &bm] {
        for args in [
            vec!["info", s(img)],
            vec!["check", s(img)],
            vec!["check", "--output=json", s(img)],
            vec!["map", "--output=json", s(img)],
            vec!["convert", "-O", "raw", s(img), s(&out)],
        ] {
            let (o, t) = (diskit(&args), qemu_img(&args));
            assert_eq!(code(&o), code(&t), "{args:?}: {}", stderr(&o));
            if args[0] != "convert" && code(&t) != 1 {
                assert_eq!(stdout(&o), stdout(&t), "{args:?}");
            }
        }
    }
}
