//! Interop tests for raw images, with qemu-img as the oracle.

mod common;

use common::*;

/// A test file: name, size, and data runs (offset, length, byte).
type Layout = (&'static str, u64, Vec<(u64, usize, u8)>);

/// The file layouts every test runs over.
fn layouts() -> Vec<Layout> {
    vec![
        ("empty-sparse", 8 << 20, vec![]),
        ("data-in-middle", 16 << 20, vec![(5 << 20, 65536, 0xff)]),
        (
            "data-at-ends",
            8 << 20,
            vec![(0, 4096, 0xff), ((8 << 20) - 8192, 8192, 0xff)],
        ),
        (
            "scattered",
            32 << 20,
            (0..16)
                .map(|i| (i * (2 << 20) + 12288, 20000, 0xff))
                .collect(),
        ),
        (
            "written-zeros",
            4 << 20,
            vec![(0, 1 << 20, 0), (2 << 20, 4096, 7)],
        ),
        ("full", 4 << 20, vec![(0, 4 << 20, 0xff)]),
        ("unaligned-size", 5000, vec![(1000, 100, 0xff)]),
        ("unaligned-full", 1000, vec![(0, 1000, 0xff)]),
        ("unaligned-tail-data", 5000, vec![(4500, 1, 0xff)]),
        (
            "unaligned-big",
            (3 << 20) + 777,
            vec![((3 << 20) - 100, 877, 0xff)],
        ),
        ("zero-size", 0, vec![]),
    ]
}

#[test]
fn map_json_equals_qemu_img() {
    let dir = workdir();
    for (name, size, runs) in layouts() {
        let p = dir.path().join(format!("{name}.raw"));
        sparse_file(&p, size, &runs);
        same_as_qemu_img(&["map", "--output=json", "-f", "raw", s(&p)], name);
        same_as_qemu_img(&["map", "-f", "raw", s(&p)], name);
    }
}

#[test]
fn info_json_equals_qemu_img() {
    let dir = workdir();
    for (name, size, runs) in layouts() {
        let p = dir.path().join(format!("{name}.raw"));
        sparse_file(&p, size, &runs);
        same_as_qemu_img(&["info", "--output=json", "-f", "raw", s(&p)], name);
        same_as_qemu_img(&["info", s(&p)], name);
    }
}

#[test]
fn convert_gives_qemu_img_bytes_and_holes() {
    let dir = workdir();
    for (name, size, runs) in layouts() {
        let src = dir.path().join(format!("{name}.raw"));
        sparse_file(&src, size, &runs);
        let ours = dir.path().join(format!("{name}.diskit"));
        let theirs = dir.path().join(format!("{name}.qemu"));
        ok(diskit(&argv("convert -f raw -O raw", &[s(&src), s(&ours)])));
        ok(qemu_img(&argv(
            "convert -f raw -O raw",
            &[s(&src), s(&theirs)],
        )));
        assert!(
            same_bytes(&ours, &theirs),
            "{name}: bytes differ from qemu-img's output"
        );
        assert_eq!(
            std::fs::metadata(&ours).unwrap().len(),
            std::fs::metadata(&theirs).unwrap().len()
        );
        // Allocation within one 4 KiB block per extent of qemu-img's output.
        let extents = extent_count(&theirs).max(1);
        let (a, b) = (allocated(&ours), allocated(&theirs));
        assert!(
            a.abs_diff(b) <= 4096 * extents,
            "{name}: du {a} vs qemu-img {b} ({extents} extents)"
        );
        // And the compare commands agree.
        assert_eq!(code(&diskit(&["compare", s(&src), s(&ours)])), 0, "{name}");
    }
}

fn extent_count(p: &std::path::Path) -> u64 {
    let out = stdout(&ok(qemu_img(&["map", "--output=json", "-f", "raw", s(p)])));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v.as_array().unwrap().len() as u64
}

#[test]
fn convert_options_keep_content() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(
        &src,
        16 << 20,
        &[
            (1 << 20, 100_000, 0xff),
            (8 << 20, 1 << 20, 0),
            (12 << 20, 8192, 3),
        ],
    );
    for extra in [
        vec!["-S", "0"],
        vec!["-S", "64k"],
        vec!["-S", "512"],
        vec!["-m", "1"],
        vec!["-m", "16", "-W"],
        vec!["-t", "writeback", "-T", "none"],
        vec!["-t", "none"],
        vec!["-p"],
        vec!["-q"],
    ] {
        let dst = dir.path().join("dst.raw");
        let mut args = vec!["convert", "-f", "raw", "-O", "raw"];
        args.extend(&extra);
        args.extend([s(&src), s(&dst)]);
        ok(diskit(&args));
        assert!(same_bytes(&src, &dst), "content differs with {extra:?}");
        if extra == ["-S", "0"] {
            assert!(allocated(&dst) >= 16 << 20, "-S 0 must allocate everything");
        }
        std::fs::remove_file(&dst).unwrap();
    }
}

#[test]
fn convert_into_existing_target_overwrites_everything() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 8 << 20, &[(4096, 4096, 0xff)]);
    let dst = dir.path().join("dst.raw");
    sparse_file(&dst, 10 << 20, &[(0, 10 << 20, 0x55)]);
    ok(diskit(&argv(
        "convert -n -f raw -O raw",
        &[s(&src), s(&dst)],
    )));
    // The first 8 MiB are the source; the rest of the larger target stays.
    let out = std::fs::read(&dst).unwrap();
    assert_eq!(out[..8 << 20], std::fs::read(&src).unwrap()[..]);
    assert!(out[8 << 20..].iter().all(|&b| b == 0x55));
    // Zeroing used holes, not written zeros.
    assert!(
        allocated(&dst) < (4 << 20),
        "zeroed ranges should be punched"
    );
    // A smaller target is refused.
    let small = dir.path().join("small.raw");
    sparse_file(&small, 1 << 20, &[]);
    let o = diskit(&["convert", "-n", "-O", "raw", s(&src), s(&small)]);
    assert_fails_with(&o, 1, "output file is smaller than input file");
}

#[test]
fn convert_concatenates_sources_like_qemu_img() {
    let dir = workdir();
    let a = dir.path().join("a.raw");
    let b = dir.path().join("b.raw");
    sparse_file(&a, 3 << 20, &[(100, 5000, 0xff)]);
    sparse_file(&b, (2 << 20) + 512, &[(1 << 20, 4096, 9)]);
    let ours = dir.path().join("ours.raw");
    let theirs = dir.path().join("theirs.raw");
    ok(diskit(&["convert", "-f", "raw", s(&a), s(&b), s(&ours)]));
    ok(qemu_img(&argv(
        "convert -f raw",
        &[s(&a), s(&b), s(&theirs)],
    )));
    assert!(same_bytes(&ours, &theirs));
}

#[test]
fn compare_matches_qemu_img_codes_and_messages() {
    let dir = workdir();
    let base = dir.path().join("base.raw");
    sparse_file(&base, 1 << 20, &[(65536, 8192, 0xff)]);
    let same = dir.path().join("same.raw");
    std::fs::copy(&base, &same).unwrap();
    let differ = dir.path().join("differ.raw");
    std::fs::copy(&base, &differ).unwrap();
    sparse_file(&differ, 1 << 20, &[(65536, 8192, 0xff), (70000, 1, 1)]);
    let longer_zero = dir.path().join("longer-zero.raw");
    sparse_file(&longer_zero, 2 << 20, &[(65536, 8192, 0xff)]);
    let longer_data = dir.path().join("longer-data.raw");
    sparse_file(
        &longer_data,
        2 << 20,
        &[(65536, 8192, 0xff), ((1 << 20) + 1000, 10, 4)],
    );
    let written_zeros = dir.path().join("written-zeros.raw");
    sparse_file(
        &written_zeros,
        1 << 20,
        &[(0, 65536, 0), (65536, 8192, 0xff)],
    );
    let missing = dir.path().join("missing.raw");
    let cases: Vec<(Vec<&str>, &std::path::Path)> = vec![
        (vec![], &same),
        (vec![], &differ),
        (vec![], &longer_zero),
        (vec![], &longer_data),
        (vec![], &written_zeros),
        (vec!["-s"], &longer_zero),
        (vec!["-q"], &differ),
        (vec!["-f", "raw", "-F", "raw"], &same),
    ];
    for (flags, other) in cases {
        let mut args = vec!["compare"];
        args.extend(&flags);
        args.extend([s(&base), s(other)]);
        let ours = diskit(&args);
        let theirs = qemu_img(&args);
        assert_eq!(code(&ours), code(&theirs), "exit code of {args:?}");
        assert_eq!(stdout(&ours), stdout(&theirs), "output of {args:?}");
    }
    // Errors: 2, as qemu-img.
    let o = diskit(&["compare", s(&base), s(&missing)]);
    assert_eq!(code(&o), 2);
    assert_eq!(code(&qemu_img(&["compare", s(&base), s(&missing)])), 2);
    assert_stderr_has(&o, "Could not open");
}

#[test]
fn bad_input_gets_one_clear_error_and_no_leftovers() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 1 << 20, &[(0, 4096, 1)]);
    let dst = dir.path().join("dst.raw");
    let missing = dir.path().join("nope.raw");
    let cases: Vec<Vec<&str>> = vec![
        vec!["convert", s(&missing), s(&dst)],
        vec!["convert", "-O", "nosuchformat", s(&src), s(&dst)],
        vec!["convert", "-S", "513", s(&src), s(&dst)],
        vec!["convert", "-m", "0", s(&src), s(&dst)],
        vec!["convert", "-c", s(&src), s(&dst)],
        vec!["convert", "--bogus", s(&src), s(&dst)],
        vec!["convert", "-o", "nosuchoption=1", s(&src), s(&dst)],
        vec!["create", "-f", "raw", s(&dst), "12Q"],
        vec!["create", "-f", "raw", s(&dst), "-5"],
        vec!["create", "-f", "raw", s(&dst)],
        vec!["info", s(&missing)],
        vec!["map", s(&missing)],
        vec!["info", "--output=xml", s(&src)],
        vec!["resize", "-f", "raw", s(&src), "512k"],
        vec!["nosuchcommand"],
    ];
    for args in cases {
        let o = diskit(&args);
        assert_ne!(code(&o), 0, "{args:?} should fail");
        assert!(o.status.code().is_some(), "{args:?} died of a signal");
        let err = stderr(&o);
        assert!(err.starts_with("diskit: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(!dst.exists(), "{args:?} left {dst:?} behind");
    }
    // A FIFO, a directory: refused at once, never waited on.
    let fifo = dir.path().join("fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    for args in [
        vec!["info", s(&fifo)],
        vec!["map", s(&fifo)],
        vec!["info", s(dir.path())],
    ] {
        let o = diskit(&args);
        assert_eq!(code(&o), 1, "{args:?}");
        assert!(
            stderr(&o).contains("to be a regular file"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    // A target in a directory that does not exist.
    let o = diskit(&["convert", s(&src), s(&dir.path().join("no/such/dir/x.raw"))]);
    assert_eq!(code(&o), 1);
}

#[test]
fn resize_grows_and_shrinks_like_qemu_img() {
    let dir = workdir();
    let p = dir.path().join("r.raw");
    sparse_file(&p, 1 << 20, &[(0, 100, 1)]);
    let o = ok(diskit(&["resize", "-f", "raw", s(&p), "+1M"]));
    assert_eq!(stdout(&o), "Image resized.\n");
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 << 20);
    ok(diskit(&["resize", "-f", "raw", "--shrink", s(&p), "-512k"]));
    assert_eq!(std::fs::metadata(&p).unwrap().len(), (3 << 20) / 2);
    ok(diskit(&argv(
        "resize -f raw --preallocation=falloc",
        &[s(&p), "4M"],
    )));
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 20);
    assert!(allocated(&p) >= (4 << 20) - (3 << 20) / 2);
}

#[test]
fn measure_raw_matches_qemu_img() {
    let dir = workdir();
    let p = dir.path().join("m.raw");
    sparse_file(&p, 3 << 20, &[(0, 100, 1)]);
    for args in [
        vec!["measure", "-O", "raw", "--size", "1G"],
        vec!["measure", "--output=json", "-O", "raw", "--size", "1G"],
        vec!["measure", "-f", "raw", "-O", "raw", s(&p)],
        vec!["measure", "--output=json", "-f", "raw", "-O", "raw", s(&p)],
    ] {
        same_as_qemu_img(&args, "measure");
    }
}

/// A loop device over a file of `size` bytes, detached on drop; None where
/// loop devices cannot be set up (no root, no loop module).
struct LoopDevice {
    path: String,
    _backing: tempfile::TempDir,
}

impl LoopDevice {
    fn new(size: u64) -> Option<LoopDevice> {
        let dir = workdir();
        let backing = dir.path().join("loop.img");
        sparse_file(&backing, size, &[(0, size as usize, 0x5a)]);
        let o = std::process::Command::new("losetup")
            .args(["-f", "--show", s(&backing)])
            .output()
            .ok()?;
        if !o.status.success() {
            return None;
        }
        Some(LoopDevice {
            path: stdout(&o).trim().to_string(),
            _backing: dir,
        })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.path])
            .status();
    }
}

#[test]
fn convert_onto_a_block_device_zeroes_its_holes() {
    let Some(dev) = LoopDevice::new(16 << 20) else {
        eprintln!("SKIP: cannot set up a loop device here");
        return;
    };
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 16 << 20, &[(3 << 20, 70000, 0xff)]);
    for extra in [vec!["-n"], vec![]] {
        // The device holds 0x5a everywhere: the source's holes must become zeros.
        std::fs::write(&dev.path, vec![0x5au8; 16 << 20]).unwrap();
        let mut args = vec!["convert", "-f", "raw", "-O", "raw"];
        args.extend(&extra);
        args.extend([s(&src), dev.path.as_str()]);
        ok(diskit(&args));
        let o = ok(diskit(&argv(
            "compare -f raw -F raw",
            &[s(&src), &dev.path],
        )));
        assert_eq!(stdout(&o), "Images are identical.\n");
        ok(qemu_img(&argv(
            "compare -f raw -F raw",
            &[s(&src), &dev.path],
        )));
    }
    assert!(
        std::path::Path::new(&dev.path).exists(),
        "the device node must survive"
    );
}

#[test]
fn error_messages_match_qemu_img() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 1 << 20, &[(0, 4096, 1)]);
    let small = dir.path().join("small.raw");
    sparse_file(&small, 4096, &[]);
    let missing = dir.path().join("missing.raw");
    let t = dir.path().join("t.raw");
    let (src, small, missing, t) = (s(&src), s(&small), s(&missing), s(&t));
    let cases: Vec<Vec<&str>> = vec![
        vec!["create", "-f", "raw", t, "1Gb"],
        vec!["create", "-f", "raw", t, "100E"],
        vec!["create", "-f", "raw", t, "1.5"],
        vec!["create", "-f", "raw", t],
        vec!["create", "-f", "foo", t, "1M"],
        vec!["create", "-f", "raw", "-o", "bogus=1", t, "1M"],
        vec!["create", "-f", "raw", "-o", "size=2M", t, "1M"],
        vec!["create", "-f", "raw", "-o", "size=abc", t],
        vec!["create", "-f", "raw", "-o", "preallocation=bogus", t, "1M"],
        vec![
            "create",
            "-f",
            "raw",
            "-o",
            "preallocation=metadata",
            t,
            "1M",
        ],
        vec!["info", missing],
        vec!["info", "--output=xml", src],
        vec!["map", missing],
        vec!["convert", missing, t],
        vec!["convert", "-O", "foo", src, t],
        vec!["convert", "-m", "0", src, t],
        vec!["convert", "-m", "abc", src, t],
        vec!["convert", "-S", "513", src, t],
        vec!["convert", "-S", "abc", src, t],
        vec!["convert", "-c", src, t],
        vec!["convert", "-n", "-o", "preallocation=full", src, small],
        vec!["convert", "-n", src, small],
        vec!["convert", "--target-is-zero", src, t],
        vec!["convert", "-o", "bogus=1", src, t],
        vec!["resize", "-f", "raw", src, "512k"],
        vec!["resize", "-f", "raw", src, "abc"],
        vec!["resize", "-f", "raw", "--shrink", src, "0"],
        vec!["resize", "-f", "raw", "--preallocation=bogus", src, "2M"],
        vec!["resize", "-f", "raw", "--preallocation=falloc", src, "1M"],
        vec!["measure", "-O", "raw"],
        vec!["measure", "-O", "raw", "--size", "abc"],
    ];
    for args in cases {
        let ours = diskit(&args);
        let theirs = qemu_img(&args);
        assert_eq!(
            code(&ours),
            code(&theirs),
            "exit code of {args:?}: {}",
            stderr(&ours)
        );
        // diskit adds its hint to usage errors qemu-img gives none for.
        let hint = format!("Try 'diskit {} --help' for more info\n", args[0]);
        let theirs_text = as_diskit(&stderr(&theirs));
        let ours_text = if theirs_text.contains(&hint) {
            stderr(&ours)
        } else {
            stderr(&ours).replace(&hint, "")
        };
        assert_eq!(ours_text, theirs_text, "stderr of {args:?}");
        assert_eq!(stdout(&ours), stdout(&theirs), "stdout of {args:?}");
        let _ = std::fs::remove_file(t);
    }
}

#[test]
fn create_output_and_layout_match_qemu_img() {
    let dir = workdir();
    for (size, opts) in [
        ("1M", ""),
        ("1000", ""),
        ("5000", "preallocation=falloc"),
        ("0", ""),
        ("1.1k", "preallocation=full"),
        ("64k", "preallocation=off"),
        ("10M", "preallocation=falloc"),
        ("3M", "preallocation=full"),
        ("1.5M", ""),
    ] {
        let ours = dir.path().join("ours.raw");
        let theirs = dir.path().join("theirs.raw");
        let run = |tool: fn(&[&str]) -> std::process::Output, p: &std::path::Path| {
            let mut a = vec!["create", "-f", "raw"];
            if !opts.is_empty() {
                a.extend(["-o", opts]);
            }
            a.extend([s(p), size]);
            ok(tool(&a))
        };
        let (o, t) = (run(diskit, &ours), run(qemu_img, &theirs));
        assert_eq!(
            stdout(&o).replace("ours", "theirs"),
            stdout(&t),
            "{size} {opts}"
        );
        let m = |tool: fn(&[&str]) -> std::process::Output, p: &std::path::Path| {
            stdout(&ok(tool(&["map", "--output=json", "-f", "raw", s(p)])))
        };
        assert_eq!(
            m(qemu_img, &ours),
            m(qemu_img, &theirs),
            "layout of {size} {opts}"
        );
        assert!(same_bytes(&ours, &theirs));
        // Preallocated space is really reserved, as qemu-img reserves it.
        let len = std::fs::metadata(&ours).unwrap().len();
        if opts.contains("falloc") || opts.contains("full") {
            assert!(allocated(&ours) >= len, "{opts} must allocate");
        }
        assert_eq!(
            allocated(&ours),
            allocated(&theirs),
            "allocation of {size} {opts}"
        );
        std::fs::remove_file(&ours).unwrap();
        std::fs::remove_file(&theirs).unwrap();
    }
}
