//! `create -f qcow2` and `measure -O qcow2` against qemu-img: the same
//! bytes, the same output, the same errors.
//!
//! Each case runs qemu-img and diskit in two sibling directories with the
//! same relative file names, so that names stored in the image (backing
//! file, data file) and printed in the "Formatting" line are identical.

mod common;

use std::path::Path;
use std::process::Output;

use common::*;

fn qemu_img_path() -> &'static Path {
    Path::new("qemu-img")
}

/// Two fresh directories (qemu-img's and diskit's), each with the same
/// 1 MiB raw file `base.raw` (some data in it) to use as a backing file.
struct Pair {
    _tmp: tempfile::TempDir,
    q: std::path::PathBuf,
    d: std::path::PathBuf,
}

impl Pair {
    fn new() -> Pair {
        let tmp = workdir();
        let q = tmp.path().join("q");
        let d = tmp.path().join("d");
        for dir in [&q, &d] {
            std::fs::create_dir_all(dir.join("sub")).unwrap();
            sparse_file(&dir.join("base.raw"), 1 << 20, &[(5000, 3000, 0xff)]);
            sparse_file(&dir.join("sub/base.raw"), 3 << 20, &[]);
        }
        Pair { _tmp: tmp, q, d }
    }

    /// Runs `args` with both tools, each in its directory.
    fn run(&self, args: &[&str]) -> (Output, Output) {
        (
            run_in(qemu_img_path(), &self.q, args),
            run_in(&diskit_bin(), &self.d, args),
        )
    }
}

/// Allocation may differ by a little (file system heuristics), never by much.
fn close_enough(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= (64 << 10).max(a / 100)
}

/// Creates `t.qcow2` with both tools and checks that everything matches:
/// exit code, output, errors, every byte of the image and of the data
/// file, file lengths, allocation; and that qemu-img accepts diskit's image.
fn check_create(pair: &Pair, args: &[&str]) {
    let mut full = vec!["create", "-f", "qcow2"];
    full.extend(args);
    let (theirs, ours) = pair.run(&full);
    let what = format!("{full:?}");
    assert_eq!(
        code(&ours),
        code(&theirs),
        "exit code of {what}: {}",
        stderr(&ours)
    );
    assert_eq!(stdout(&ours), stdout(&theirs), "stdout of {what}");
    assert_eq!(
        stderr(&ours),
        as_diskit(&stderr(&theirs)),
        "stderr of {what}"
    );
    for name in ["t.qcow2", "d.raw", "sub/t.qcow2"] {
        let (q, d) = (pair.q.join(name), pair.d.join(name));
        assert_eq!(q.exists(), d.exists(), "{name} exists after {what}");
        if !q.exists() {
            continue;
        }
        let (lq, ld) = (
            std::fs::metadata(&q).unwrap().len(),
            std::fs::metadata(&d).unwrap().len(),
        );
        assert_eq!(ld, lq, "length of {name} after {what}");
        assert!(same_bytes(&q, &d), "bytes of {name} differ after {what}");
        let (aq, ad) = (allocated(&q), allocated(&d));
        assert!(
            close_enough(aq, ad),
            "allocation of {name} after {what}: qemu-img {aq}, diskit {ad}"
        );
    }
    for name in ["t.qcow2", "sub/t.qcow2"] {
        if pair.d.join(name).exists() {
            // Without the backing file, which may not exist (-u).
            let spec = format!(
                r#"json:{{"driver":"qcow2","file":{{"driver":"file","filename":"{name}"}},"backing":null}}"#
            );
            let o = run_in(qemu_img_path(), &pair.d, &["check", &spec]);
            assert_eq!(
                code(&o),
                0,
                "qemu-img check of {what}: {}{}",
                stdout(&o),
                stderr(&o)
            );
        }
    }
    for dir in [&pair.q, &pair.d] {
        for name in ["t.qcow2", "d.raw", "sub/t.qcow2"] {
            let _ = std::fs::remove_file(dir.join(name));
        }
    }
}

fn check_all(cases: &[&str]) {
    let pair = Pair::new();
    for case in cases {
        let args: Vec<&str> = case.split_whitespace().collect();
        check_create(&pair, &args);
    }
}

#[test]
fn default_and_feature_options() {
    check_all(&[
        "t.qcow2 1G",
        "t.qcow2 0",
        "t.qcow2 1000",
        "t.qcow2 1.5k",
        "t.qcow2 5000000",
        "t.qcow2 1P",
        "t.qcow2 8E",
        "-q t.qcow2 1M",
        "-o size=7M t.qcow2",
        "-o compat=0.10 t.qcow2 1G",
        "-o compat=v2 t.qcow2 1G",
        "-o compat=1.1 t.qcow2 1G",
        "-o compat=v3 t.qcow2 1G",
        "-o lazy_refcounts=on t.qcow2 1G",
        "-o lazy_refcounts t.qcow2 1G",
        "-o nolazy_refcounts t.qcow2 1G",
        "-o lazy_refcounts=yes t.qcow2 1G",
        "-o compression_type=zstd t.qcow2 1G",
        "-o compression_type=zlib t.qcow2 1G",
        "-o extended_l2=on t.qcow2 5M",
        "-o extended_l2=on,cluster_size=16k t.qcow2 5M",
        "-o extended_l2=on,cluster_size=2M t.qcow2 1T",
        "-o lazy_refcounts,extended_l2,compression_type=zstd,refcount_bits=8 t.qcow2 1M",
        "-o encryption=off,nocow=off,extent_size_hint=1M t.qcow2 1M",
        "-o cluster_size=64k -o cluster_size=4k t.qcow2 1M",
        "-o refcount_bits=0x10 t.qcow2 1M",
        "-o refcount_bits=020 t.qcow2 1M",
    ]);
}

#[test]
fn cluster_sizes_and_refcount_widths() {
    let mut cases = Vec::new();
    for cs in ["512", "1k", "4k", "16k", "64k", "128k", "2M"] {
        for size in ["0", "1000", "3M", "1G"] {
            cases.push(format!("-o cluster_size={cs} t.qcow2 {size}"));
        }
    }
    for bits in [1, 2, 4, 8, 16, 32, 64] {
        for cs in ["512", "4k", "64k"] {
            cases.push(format!(
                "-o cluster_size={cs},refcount_bits={bits} t.qcow2 7M"
            ));
            cases.push(format!(
                "-o cluster_size={cs},refcount_bits={bits},preallocation=metadata t.qcow2 3M"
            ));
        }
    }
    let cases: Vec<&str> = cases.iter().map(String::as_str).collect();
    check_all(&cases);
}

#[test]
fn big_virtual_sizes_with_small_clusters() {
    // Several L1 clusters and refcount blocks; the first refcount table is
    // outgrown and replaced (its old bytes stay in a freed cluster).
    check_all(&[
        "-o cluster_size=4k t.qcow2 1T",
        "-o cluster_size=4k,refcount_bits=64 t.qcow2 1T",
        "-o cluster_size=512 t.qcow2 40G",
        "-o cluster_size=512,refcount_bits=64 t.qcow2 10G",
        "-o cluster_size=512,refcount_bits=1 t.qcow2 10G",
        "-o cluster_size=512,preallocation=metadata t.qcow2 12M",
        "-o cluster_size=512,refcount_bits=64,preallocation=metadata t.qcow2 4M",
        "-o cluster_size=512,preallocation=falloc t.qcow2 4M",
        "-o cluster_size=1k,refcount_bits=64,preallocation=full t.qcow2 20000000",
        "-o cluster_size=512 t.qcow2 200G",
        "-o cluster_size=1k t.qcow2 1T",
        "t.qcow2 9E",
    ]);
}

#[test]
fn preallocation_modes() {
    let mut cases = Vec::new();
    for mode in ["off", "metadata", "falloc", "full"] {
        for size in ["0", "1000", "1M", "5000000", "24M"] {
            cases.push(format!("-o preallocation={mode} t.qcow2 {size}"));
        }
        for opts in [
            "cluster_size=512",
            "cluster_size=4k",
            "cluster_size=2M",
            "extended_l2=on",
            "extended_l2=on,cluster_size=32k",
            "compat=0.10",
            "refcount_bits=1",
        ] {
            cases.push(format!("-o preallocation={mode},{opts} t.qcow2 5000000"));
        }
    }
    let cases: Vec<&str> = cases.iter().map(String::as_str).collect();
    check_all(&cases);
}

#[test]
fn backing_files() {
    check_all(&[
        "-b base.raw -F raw t.qcow2",
        "-b base.raw -F raw t.qcow2 5M",
        "-b base.raw -F raw t.qcow2 0",
        "-u -b base.raw -F raw t.qcow2 5M",
        "-u -b nope.raw -F raw t.qcow2 5M",
        "-u -b nope.raw -F vmdk t.qcow2 5M",
        "-o backing_file=base.raw,backing_fmt=raw t.qcow2",
        "-b base.raw -F raw -o backing_file=other.raw t.qcow2",
        "-b base.raw -F raw -o compat=0.10 t.qcow2",
        "-b base.raw -F raw -o cluster_size=512 t.qcow2",
        "-b base.raw -F raw -o extended_l2=on,preallocation=metadata t.qcow2",
        "-b base.raw -F raw -o extended_l2=on,preallocation=metadata t.qcow2 2000000",
        "-b base.raw -F raw -o extended_l2=on,preallocation=falloc t.qcow2 2000000",
        "-b base.raw -F raw -o extended_l2=on,preallocation=full t.qcow2 3M",
        // Relative to the new image's directory.
        "-b base.raw -F raw sub/t.qcow2",
        "-b ../base.raw -F raw sub/t.qcow2",
    ]);
    // A name too long for a 512-byte header cluster, or for qcow2 at all.
    let long = "b".repeat(400);
    let longer = "b".repeat(1024);
    let pair = Pair::new();
    for name in [long.as_str(), longer.as_str()] {
        check_create(
            &pair,
            &argv(
                "-u -b",
                &[name, "-F", "raw", "-o", "cluster_size=512", "t.qcow2", "1M"],
            ),
        );
    }
    check_create(&pair, &["-u", "-b", &long, "-F", "raw", "t.qcow2", "1M"]);
}

#[test]
fn external_data_files() {
    let mut cases = vec![
        "-o data_file=d.raw t.qcow2 3M".to_string(),
        "-o data_file=d.raw,data_file_raw=on t.qcow2 3M".to_string(),
        "-o data_file=d.raw,data_file_raw=on,cluster_size=512 t.qcow2 3000000".to_string(),
        "-o data_file=d.raw,extended_l2=on,preallocation=metadata t.qcow2 3M".to_string(),
        "-o data_file=d.raw,cluster_size=512 -b base.raw -F raw t.qcow2 3M".to_string(),
        "-o data_file=d.raw t.qcow2 0".to_string(),
    ];
    for mode in ["off", "metadata", "falloc", "full"] {
        for size in ["1M", "3000000"] {
            cases.push(format!(
                "-o data_file=d.raw,preallocation={mode} t.qcow2 {size}"
            ));
        }
    }
    let cases: Vec<&str> = cases.iter().map(String::as_str).collect();
    check_all(&cases);
}

#[test]
fn errors_match_qemu_img() {
    // Each fails with both tools, with the same message (and output: the
    // "Formatting" line comes before the qcow2 driver's own checks).
    check_all(&[
        "t.qcow2",
        "-o size=1M t.qcow2 1M",
        "-o bogus=1 t.qcow2 1M",
        "-o cluster_size=1000 t.qcow2 1M",
        "-o cluster_size=256 t.qcow2 1M",
        "-o cluster_size=4M t.qcow2 1M",
        "-o cluster_size=0 t.qcow2 1M",
        "-o cluster_size=64.5k t.qcow2 1M",
        "-o cluster_size=abc t.qcow2 1M",
        "-o refcount_bits=3 t.qcow2 1M",
        "-o refcount_bits=128 t.qcow2 1M",
        "-o refcount_bits=0 t.qcow2 1M",
        "-o refcount_bits=-1 t.qcow2 1M",
        "-o refcount_bits=abc t.qcow2 1M",
        "-o refcount_bits=16k t.qcow2 1M",
        "-o refcount_bits=99999999999999999999999 t.qcow2 1M",
        "-o compat=0.10,refcount_bits=8 t.qcow2 1M",
        "-o extended_l2=on,cluster_size=8k t.qcow2 1M",
        "-o extended_l2=on,compat=0.10 t.qcow2 1M",
        "-o extended_l2=maybe t.qcow2 1M",
        "-o lazy_refcounts=on,compat=0.10 t.qcow2 1M",
        "-o lazy_refcounts=maybe t.qcow2 1M",
        "-o data_file_raw=on t.qcow2 1M",
        "-o data_file=d.raw,compat=0.10 t.qcow2 1M",
        "-o data_file_raw=on,data_file=d.raw,backing_file=base.raw,backing_fmt=raw t.qcow2 1M",
        "-o data_file= t.qcow2 1M",
        "-o data_file=/nonexistent/d.raw t.qcow2 1M",
        "-o compat=1.2 t.qcow2 1M",
        "-o compat= t.qcow2 1M",
        "-o compat=V3 t.qcow2 1M",
        "-o preallocation=bogus t.qcow2 1M",
        "-o preallocation= t.qcow2 1M",
        "-o compression_type=lz4 t.qcow2 1M",
        "-o compression_type=zstd,compat=0.10 t.qcow2 1M",
        "-o backing_fmt=raw t.qcow2 1M",
        "-o backing_file= t.qcow2 1M",
        "-o preallocation=metadata,backing_file=base.raw,backing_fmt=raw t.qcow2 1M",
        "-o encrypt.cipher-alg=aes-256 t.qcow2 1M",
        "-o encrypt.format=bogus t.qcow2 1M",
        "-o encrypt.iter-time=abc t.qcow2 1M",
        "-o extent_size_hint=abc t.qcow2 1M",
        "-o nocow=maybe t.qcow2 1M",
        "-o cluster_size=512 t.qcow2 200G",
        "t.qcow2 12Q",
        "t.qcow2 100E",
        "/nonexistent/t.qcow2 1M",
        "-b base.raw t.qcow2",
        "-b base.raw t.qcow2 2M",
        "-u -b base.raw t.qcow2 2M",
        "-u -b base.raw -F raw t.qcow2",
        "-b nope.raw -F raw t.qcow2",
        "-b nope.raw -F raw sub/t.qcow2 1M",
        "-b base.raw -F bogus t.qcow2",
        "-u -b base.raw -F bogus t.qcow2 1M",
        "-F raw t.qcow2 1M",
        "-u -F raw t.qcow2 1M",
        "-b t.qcow2 -F raw t.qcow2 1M",
    ]);
}

#[test]
fn encryption_without_a_secret_or_with_aes_is_refused_clearly() {
    let dir = workdir();
    let t = dir.path().join("t.qcow2");
    for (opts, msg) in [
        (
            "encrypt.format=luks",
            "Parameter 'encrypt.key-secret' is required for cipher",
        ),
        ("encryption=on", "encrypt.format=luks"),
        ("encrypt.format=aes", "encrypt.format=luks"),
    ] {
        let o = diskit(&["create", "-f", "qcow2", "-o", opts, s(&t), "1M"]);
        assert_eq!(code(&o), 1, "{opts}");
        assert!(stderr(&o).contains(msg), "{opts}: {}", stderr(&o));
        assert!(!t.exists(), "{opts} left a file behind");
    }
}

#[test]
fn help_matches_qemu_img() {
    let pair = Pair::new();
    for args in [
        vec!["create", "-f", "qcow2", "-o", "help"],
        vec!["create", "-f", "qcow2", "-o", "help", "t.qcow2", "1M"],
    ] {
        let (theirs, ours) = pair.run(&args);
        assert_eq!(code(&ours), code(&theirs), "{args:?}");
        assert_eq!(stdout(&ours), stdout(&theirs), "{args:?}");
        assert!(!pair.d.join("t.qcow2").exists());
    }
}

#[test]
fn existing_images_are_replaced() {
    // Like qemu-img, create truncates an existing file (and data file).
    let pair = Pair::new();
    for dir in [&pair.q, &pair.d] {
        sparse_file(&dir.join("t.qcow2"), 10 << 20, &[(0, 1 << 20, 0x77)]);
        sparse_file(&dir.join("d.raw"), 10 << 20, &[(0, 1 << 20, 0x77)]);
    }
    check_create(&pair, &["-o", "data_file=d.raw", "t.qcow2", "1M"]);
}

/// Runs `measure` with both tools and compares everything.
fn check_measure(pair: &Pair, args: &[&str]) {
    let mut full = vec!["measure"];
    full.extend(args);
    let (theirs, ours) = pair.run(&full);
    assert_eq!(
        code(&ours),
        code(&theirs),
        "exit code of {full:?}: {}",
        stderr(&ours)
    );
    assert_eq!(stdout(&ours), stdout(&theirs), "stdout of {full:?}");
    // diskit adds its hint to usage errors.
    assert_eq!(
        stderr(&ours).replace("Try 'diskit measure --help' for more info\n", ""),
        as_diskit(&stderr(&theirs)),
        "stderr of {full:?}"
    );
}

#[test]
fn measure_matches_qemu_img() {
    let pair = Pair::new();
    for dir in [&pair.q, &pair.d] {
        sparse_file(
            &dir.join("src.raw"),
            100 << 20,
            &[
                (70000, 3, 1),
                (20 << 20, 3_000_000, 0xff),
                (50_000_000, 3, 2),
                ((100 << 20) - 1, 1, 3),
            ],
        );
        sparse_file(&dir.join("odd.raw"), 7_777_777, &[(7_777_000, 1, 9)]);
        sparse_file(&dir.join("empty.raw"), 0, &[]);
        sparse_file(&dir.join("full.raw"), 3 << 20, &[(0, 3 << 20, 0xff)]);
    }
    let sources = [
        "--size 0",
        "--size 1G",
        "--size 1T",
        "--size 123456789",
        "-f raw src.raw",
        "-f raw odd.raw",
        "-f raw empty.raw",
        "-f raw full.raw",
    ];
    let options = [
        "",
        "-o cluster_size=512",
        "-o cluster_size=2M",
        "-o preallocation=full",
        "-o preallocation=falloc",
        "-o preallocation=metadata",
        "-o preallocation=off",
        "-o extended_l2=on",
        "-o cluster_size=512,extended_l2=on",
        "-o refcount_bits=1",
        "-o refcount_bits=64,cluster_size=4k",
        "-o compat=0.10",
        "-o compat=1.1,lazy_refcounts=on",
        "-o backing_file=x",
        "-o size=5G",
        // Errors.
        "-o compat=v3",
        "-o compat=0.10,refcount_bits=8",
        "-o bogus=1",
        "-o preallocation=bogus",
        "-o cluster_size=3k",
        "-o cluster_size=abc",
        "-o refcount_bits=3",
        "-o extended_l2=on,cluster_size=4k",
    ];
    for src in sources {
        for opts in options {
            for json in [false, true] {
                let mut args = vec!["-O", "qcow2"];
                if json {
                    args.push("--output=json");
                }
                args.extend(opts.split_whitespace());
                args.extend(src.split_whitespace());
                check_measure(&pair, &args);
            }
        }
    }
    for args in [
        "-O qcow2 --size 200G -o cluster_size=512",
        "-O qcow2 --size 8E",
        "-O qcow2 --size 1E -o cluster_size=2M",
        "-O qcow2 -o size=1G",
        "-O qcow2 --size 1G -f raw src.raw",
    ] {
        let args: Vec<&str> = args.split_whitespace().collect();
        check_measure(&pair, &args);
    }
}

#[test]
fn measure_of_qcow2_sources() {
    // Sources with data clusters that are partly holes in the file (and
    // persistent bitmaps): block status must see the file as qemu-img does.
    let pair = Pair::new();
    for dir in [&pair.q, &pair.d] {
        for (name, opts) in [("v3.qcow2", "compat=1.1"), ("v2.qcow2", "compat=0.10")] {
            ok(run_in(
                qemu_img_path(),
                dir,
                &["create", "-q", "-f", "qcow2", "-o", opts, name, "10M"],
            ));
            ok(run_in(
                qemu_img_path(),
                dir,
                &argv("convert -f raw -O qcow2 -o", &[opts, "base.raw", name]),
            ));
        }
        ok(run_in(
            qemu_img_path(),
            dir,
            &["bitmap", "--add", "-g", "64k", "v3.qcow2", "bitmap0"],
        ));
        ok(run_in(
            qemu_img_path(),
            dir,
            &["bitmap", "--add", "v3.qcow2", "another-bitmap"],
        ));
    }
    for src in ["v3.qcow2", "v2.qcow2"] {
        for opts in [
            "",
            "-o cluster_size=512",
            "-o compat=0.10",
            "-o cluster_size=2M",
        ] {
            for json in [false, true] {
                let mut args = vec!["-O", "qcow2", "-f", "qcow2"];
                if json {
                    args.push("--output=json");
                }
                args.extend(opts.split_whitespace());
                args.push(src);
                check_measure(&pair, &args);
            }
        }
    }
}
