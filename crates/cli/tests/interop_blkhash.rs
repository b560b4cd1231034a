//! `diskit checksum` and `diskit copy --blkhash` against blkhash's own
//! `blksum` (built from third_party/blkhash by scripts/blksum.sh) and the
//! published test vectors: the same digest for the same guest data, for
//! every digest both have, whatever the format, the source (a file, an NBD
//! export, a pipe), the block size and the number of threads.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use common::*;

/// blksum, built once for all the tests (the script waits for a build
/// another test started).
fn blksum_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/blksum.sh");
        let o = Command::new(script)
            .stderr(Stdio::inherit())
            .output()
            .expect("run scripts/blksum.sh");
        assert!(o.status.success(), "scripts/blksum.sh failed");
        PathBuf::from(stdout(&o).trim())
    })
}

/// The digest a `HEX  NAME` line gives, checking the name.
fn digest_of(line: &str, name: &str) -> String {
    let (hex, named) = line
        .trim_end_matches('\n')
        .split_once("  ")
        .unwrap_or_else(|| panic!("not a blksum line: {line:?}"));
    assert_eq!(named, name, "the line names the image");
    assert!(
        !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "{line:?}"
    );
    hex.to_string()
}

/// blksum's digest of `image` with `opts`.
fn blksum(opts: &[&str], image: &str) -> String {
    let o = ok(timed(blksum_bin(), 120)
        .args(opts)
        .arg(image)
        .output()
        .unwrap());
    digest_of(&stdout(&o), image)
}

/// diskit checksum's digest of `image` with `opts`.
fn checksum(opts: &[&str], image: &str) -> String {
    let o = ok(diskit(&argv("checksum", &[opts, &[image]].concat())));
    digest_of(&stdout(&o), image)
}

/// Names listed one a line.
fn listed(o: &std::process::Output) -> Vec<String> {
    stdout(o).lines().map(str::to_string).collect()
}

/// A sparse raw image (data, a zero block written inside data, holes, a
/// size that is not a whole number of 64 KiB blocks) and a full one.
fn images(dir: &Path) -> Vec<PathBuf> {
    let sparse = dir.join("sparse.raw");
    sparse_file(
        &sparse,
        (5 << 20) + 3 * 512,
        &[
            (0, 70_000, 0xff),
            (1 << 20, 300_000, 0x22),
            ((1 << 20) + 65536, 65536, 0),
            (3 << 20, 4096, 0xff),
            ((5 << 20) + 1000, 500, 0x44),
        ],
    );
    let full = dir.join("full.raw");
    sparse_file(&full, 3 << 20, &[(0, 3 << 20, 0xff)]);
    let mut all = vec![sparse.clone(), full.clone()];
    for raw in [sparse, full] {
        let qcow2 = raw.with_extension("qcow2");
        ok(qemu_img(&[
            "convert",
            "-f",
            "raw",
            "-O",
            "qcow2",
            s(&raw),
            s(&qcow2),
        ]));
        all.push(qcow2);
    }
    all
}

#[test]
fn every_digest_equals_blksums_on_raw_and_qcow2_images() {
    let dir = workdir();
    let images = images(dir.path());
    let ours = listed(&ok(diskit(&["checksum", "--list-digests"])));
    let theirs = listed(&ok(Command::new(blksum_bin()).arg("-l").output().unwrap()));
    // Every digest diskit has, blksum has (OpenSSL's, by OpenSSL's names);
    // blksum's others are its "null" and OpenSSL's md5-sha1.
    for name in &ours {
        assert!(theirs.contains(name), "blksum lacks {name}: {theirs:?}");
    }
    assert!(ours.len() >= 18, "{ours:?}");
    for name in &ours {
        let d = format!("--digest={name}");
        for raw in [&images[0], &images[1]] {
            let want = blksum(&["-d", name], s(raw));
            let qcow2 = raw.with_extension("qcow2");
            assert_eq!(checksum(&[&d], s(raw)), want, "{name} of {raw:?}");
            assert_eq!(checksum(&[&d], s(&qcow2)), want, "{name} of {qcow2:?}");
        }
    }
    // blksum says the same of the same data in both formats.
    for raw in [&images[0], &images[1]] {
        let qcow2 = raw.with_extension("qcow2");
        assert_eq!(blksum(&[], s(raw)), blksum(&[], s(&qcow2)));
    }
    // OpenSSL's other names for a digest, in any case.
    assert_eq!(
        checksum(&["-d", "SHA2-512/256"], s(&images[0])),
        blksum(&["-d", "sha512-256"], s(&images[0]))
    );
}

#[test]
fn threads_do_not_change_the_digest_and_block_sizes_are_blksums() {
    let dir = workdir();
    let images = images(dir.path());
    for img in &images {
        let want = blksum(&[], s(img));
        for t in ["1", "2", "7"] {
            assert_eq!(checksum(&["-T", t], s(img)), want, "{img:?} on {t} threads");
        }
        // blksum's -t is taken too.
        assert_eq!(checksum(&["-t", "3"], s(img)), want);
        for (bs, read) in [("4096", "256k"), ("1m", "1m")] {
            let theirs = blksum(
                &[
                    &format!("--block-size={bs}"),
                    &format!("--read-size={read}"),
                ],
                s(img),
            );
            assert_ne!(theirs, want, "the block size is part of the digest");
            assert_eq!(
                checksum(&[&format!("--block-size={bs}")], s(img)),
                theirs,
                "{img:?} in blocks of {bs}"
            );
        }
    }
}

#[test]
fn nbd_exports_hash_as_their_files() {
    let dir = workdir();
    let images = images(dir.path());
    for (i, img) in images.iter().enumerate() {
        let fmt = if i < 2 { "raw" } else { "qcow2" };
        let sock = dir.path().join(format!("nbd{i}.sock"));
        let server = QemuNbd::start(&sock, &["-r", "-f", fmt, "-e", "4", s(img)]);
        let want = blksum(&[], s(img));
        assert_eq!(blksum(&[], &server.uri), want);
        assert_eq!(checksum(&[], &server.uri), want, "{img:?} over NBD");
        assert_eq!(
            checksum(&["-T", "1", "-d", "sha1"], &server.uri),
            blksum(&["-d", "sha1"], s(img))
        );
        // The qcow2 file itself, served raw: its format is probed (as
        // qemu-img probes an export), or its bytes hashed with -f raw, as
        // blksum hashes an export.
        if fmt == "qcow2" {
            let raw = dir.path().join(format!("nbd{i}-file.sock"));
            let file = QemuNbd::start(&raw, &["-r", "-f", "raw", s(img)]);
            assert_eq!(checksum(&[], &file.uri), want);
            let bytes = checksum(&["-f", "raw"], &file.uri);
            assert_ne!(bytes, want);
            assert_eq!(bytes, blksum(&[], &file.uri));
            assert_eq!(bytes, checksum(&["-f", "raw"], s(img)));
        }
    }
}

/// Runs `script` under `nbdkit -U - ARGS --run`, where `$uri` is the
/// export and `$diskit` diskit.
fn under_nbdkit(args: &[&str], script: &str) -> std::process::Output {
    ok(timed("nbdkit", 300)
        .env("diskit", diskit_bin())
        .args(["-U", "-"])
        .args(args)
        .args(["--run", script])
        .output()
        .expect("nbdkit is installed"))
}

/// libnbd's vectors for nbdcopy --blkhash (copy/copy-blkhash-known.sh and
/// copy-blkhash-pattern.sh, which nbdcopy's tests check), through the same
/// command lines: nbdkit's data and pattern plugins copied to null:.
#[test]
fn nbdcopys_published_vectors() {
    let dir = workdir();
    let file = dir.path().join("hash");
    let cases = [
        (
            "",
            "sha256",
            "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc",
        ),
        ("\"hello\"", "md5", "f741ac9ce55f5325906bb14e9c05d467"),
        (
            "\"hello\"",
            "sha256",
            "337355feb53a5309d5aba92796223c2c84ffab930e706c01fef573a2722545e6",
        ),
        (
            "\"hello\"",
            "sha512",
            "eca04a593cf12ec4132993da709048e25a2f1be3526e132fb521ec9d41f023ec4018b3fd07b014a33e36bb5fa145b36991f431e62f9e1a93bebea6c9565682c1",
        ),
        ("\"hello\"", "md5/4", "8262896de34125dec173722c920e8bd0"),
        (
            "\"hello\" @1048576 \"goodbye\"",
            "sha256",
            "61b8f3a8cea76e16eeff7ce27f1b7711c1f1e437f5038cec17773772a4bded28",
        ),
        (
            "\"12345678\"*512*256",
            "md5",
            "84fc21ac2f49ac283ff399378d834d1a",
        ),
        (
            "\"12345678\"*512*256",
            "sha256",
            "cbb388edd25e567b85f504c7b345497f9fb4f6bbf4e39768809184b9f9e678f8",
        ),
        (
            "\"12345678\"*512*256",
            "sha512/512k",
            "379f7eb1628058c7abbc4c96941ac972074815ea9ef4aca95eefb2b4f9c29f64023fff8d966e9fddf08d07bdba548e75298917f10268fdf9ba636c2321a2214e",
        ),
    ];
    for (data, hash, want) in cases {
        let _ = std::fs::remove_file(&file);
        under_nbdkit(
            &["data", data],
            &format!(
                "\"$diskit\" copy --blkhash={hash} --blkhash-file={} \"$uri\" null:",
                s(&file)
            ),
        );
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            format!("{want}\n"),
            "data {data}, {hash}"
        );
    }
    // 1 GiB of nbdkit's pattern: --blkhash alone is sha256/64k, printed on
    // standard output; checksum says the same.
    let o = under_nbdkit(
        &["pattern", "1G"],
        "set -e; \"$diskit\" copy --blkhash \"$uri\" null:; \
         \"$diskit\" copy --blkhash=sha512/512k \"$uri\" null:; \
         \"$diskit\" checksum -T 2 \"$uri\"",
    );
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..2],
        [
            "6750a1c3d78e46eaffb0d094624825dea88f0c7098b2424fce776c0748442649",
            "aef2905a223b2b9b565374ce9671bcb434fc944b0a108c8b5b98769d830b6c61b9567de177791a092514675c3a3e0740758c6a5a171ae71d844c60315f07e334",
        ],
        "{out}"
    );
    assert!(lines[2].starts_with(&format!("{}  nbd", lines[0])), "{out}");
}

#[test]
fn copy_blkhash_is_blksum_of_the_source() {
    let dir = workdir();
    let images = images(dir.path());
    let hash_file = dir.path().join("hash");
    let read_hash = || {
        std::fs::read_to_string(&hash_file)
            .unwrap()
            .trim_end()
            .to_string()
    };
    for img in &images[..2] {
        let want = blksum(&[], s(img));
        let want_md5 = blksum(&["-d", "md5"], s(img));
        // A file into a file (digest on standard output), into null:, on
        // one thread and several.
        let dst = dir.path().join("copy.raw");
        let o = ok(diskit(&["copy", "--blkhash", s(img), s(&dst)]));
        assert_eq!(stdout(&o), format!("{want}\n"));
        assert!(same_bytes(img, &dst));
        for t in ["1", "4"] {
            let o = ok(diskit(&["copy", "-T", t, "--blkhash=md5", s(img), "null:"]));
            assert_eq!(stdout(&o), format!("{want_md5}\n"), "{t} threads");
        }
        // From an NBD export (read on the connections' threads) into a
        // file, with the digest in a file.
        let qcow2 = img.with_extension("qcow2");
        let sock = dir.path().join("src.sock");
        let server = QemuNbd::start(&sock, &["-r", "-f", "qcow2", "-e", "4", s(&qcow2)]);
        let hf = format!("--blkhash-file={}", s(&hash_file));
        let o = ok(diskit(&["copy", "--blkhash", &hf, &server.uri, s(&dst)]));
        assert_eq!(stdout(&o), "");
        assert_eq!(read_hash(), want);
        assert!(same_bytes(img, &dst));
        drop(server);
        // From a pipe, and into one.
        let o = ok(Command::new(diskit_bin())
            .args(["copy", "--blkhash", &hf, "-", s(&dst)])
            .stdin(std::fs::File::open(img).unwrap())
            .output()
            .unwrap());
        assert!(o.status.success());
        assert_eq!(read_hash(), want);
        let o = ok(Command::new(diskit_bin())
            .args(["copy", "--blkhash=md5", &hf, s(img), "-"])
            .stdout(Stdio::piped())
            .output()
            .unwrap());
        assert_eq!(o.stdout.len() as u64, std::fs::metadata(img).unwrap().len());
        assert_eq!(read_hash(), want_md5);
        // The checksum file is never the copy's source or destination,
        // nor an image another process serves: refused before the copy,
        // and each keeps its bytes.
        let before = std::fs::read(img).unwrap();
        let dst_before = std::fs::read(&dst).unwrap();
        let other = dir.path().join("other.raw");
        for (hf, to) in [(img, &other), (&dst, &dst)] {
            let o = diskit(&[
                "copy",
                "--blkhash",
                &format!("--blkhash-file={}", s(hf)),
                s(img),
                s(to),
            ]);
            assert_eq!(code(&o), 1, "{}", stderr(&o));
        }
        assert_eq!(
            std::fs::read(img).unwrap(),
            before,
            "the source keeps its bytes"
        );
        assert_eq!(std::fs::read(&dst).unwrap(), dst_before);
        let served = dir.path().join("served.raw");
        std::fs::copy(img, &served).unwrap();
        let sock = dir.path().join("held.sock");
        let server = QemuNbd::start(&sock, &["-f", "raw", s(&served)]);
        let o = diskit(&[
            "copy",
            "--blkhash",
            &format!("--blkhash-file={}", s(&served)),
            s(img),
            "null:",
        ]);
        assert_eq!(code(&o), 1, "{}", stderr(&o));
        drop(server);
        assert_eq!(
            std::fs::read(&served).unwrap(),
            before,
            "the served image keeps its bytes"
        );
    }
}

#[test]
fn bad_digests_and_block_sizes_are_refused() {
    let dir = workdir();
    let img = &images(dir.path())[0];
    let missing = dir.path().join("missing.raw");
    for args in [
        &["checksum", "--digest=whirlpool", s(img)][..],
        &["checksum", "--block-size=3000", s(img)],
        &["checksum", "-T", "0", s(img)],
        &["checksum", s(&missing)],
        &["copy", "--blkhash=sha256/3", s(img), "null:"],
        &["copy", "--blkhash=whirlpool", s(img), "null:"],
    ] {
        let o = diskit(args);
        assert_eq!(code(&o), 1, "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?}");
    }
}

#[test]
fn every_format_hashes_as_its_guest_data() {
    let dir = workdir();
    let images = images(dir.path());
    for raw in &images[..2] {
        let want = blksum(&[], s(raw));
        for (fmt, opts) in [
            ("vmdk", ""),
            ("vhdx", ""),
            ("vdi", ""),
            ("qed", ""),
            ("vpc", "force_size=on"),
        ] {
            let img = raw.with_extension(fmt);
            let mut args = vec!["convert", "-f", "raw", "-O", fmt];
            if !opts.is_empty() {
                args.extend(["-o", opts]);
            }
            ok(qemu_img(&[&args[..], &[s(raw), s(&img)]].concat()));
            assert_eq!(checksum(&[], s(&img)), want, "{img:?}");
            assert_eq!(checksum(&["-f", fmt, "-T", "1"], s(&img)), want, "{img:?}");
        }
    }
}
