//! The decompression and archive filters (`xz`, `gzip`, `bzip2`, `tar`)
//! against nbdkit 1.32's on the same command lines, over files made by
//! the real tools (`xz`, `gzip`, `bzip2`, GNU `tar`): the bytes nbdcopy
//! copies out, reads across block edges (nbdsh), the export's size and
//! read-only flag; and what each refuses (a corrupt or truncated stream,
//! a missing entry, a block over `xz-max-block`): one line, a non-zero
//! exit, never a panic. nbdkit has no bzip2 filter: that one is compared
//! with `bzip2 -d`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Nbdkit,
    Diskit,
}

/// Runs `SERVER -U - ARGS --run CMD` under a timeout.
fn run(server: Server, args: &[&str], cmd: &str) -> Output {
    let mut c = match server {
        Server::Nbdkit => timed("nbdkit", 120),
        Server::Diskit => {
            let mut c = timed(diskit_bin(), 120);
            c.arg("serve");
            c
        }
    };
    c.args(["-U", "-"]).args(args).args(["--run", cmd]);
    c.output().expect("run a server")
}

/// The bytes `server` serves with `args`, copied out by nbdcopy.
fn served(dir: &Path, server: Server, args: &[&str]) -> Vec<u8> {
    let out = dir.join(format!("{server:?}.out"));
    let _ = std::fs::remove_file(&out);
    ok(run(server, args, &format!("nbdcopy $uri {}", s(&out))));
    std::fs::read(&out).unwrap()
}

/// A disk of `mib` MiB: runs of random bytes, zeros and text.
fn disk(dir: &Path, name: &str, mib: usize) -> PathBuf {
    let mut x = 0x2545f4914f6cdd1du64;
    let mut data = Vec::with_capacity(mib << 20);
    let mut i = 0u64;
    while data.len() < mib << 20 {
        match i % 3 {
            0 => data.extend((0..200_000).map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })),
            1 => data.resize(data.len() + 300_000, 0),
            _ => {
                for n in 0..5000u64 {
                    data.extend_from_slice(format!("line {n} of part {i}\n").as_bytes());
                }
            }
        }
        i += 1;
    }
    data.truncate(mib << 20);
    let p = dir.join(name);
    std::fs::write(&p, &data).unwrap();
    p
}

/// Runs `tool ARGS` in `dir`, which must succeed.
fn made(dir: &Path, tool: &str, args: &[&str]) {
    let o = std::process::Command::new(tool)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {tool} ({e})"));
    ok(o);
}

/// `nbdinfo --json`'s view of the export: (size, read-only).
fn shape(server: Server, args: &[&str]) -> (u64, bool) {
    let o = ok(run(server, args, "nbdinfo --json $uri"));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let e = &v["exports"][0];
    (
        e["export-size"].as_u64().unwrap(),
        e["is_read_only"].as_bool().unwrap(),
    )
}

/// Asserts that diskit refused `args` in one line naming `what`, with a
/// non-zero exit and no panic.
#[track_caller]
fn refused(args: &[&str], what: &str) {
    let o = run(Server::Diskit, args, "nbdinfo $uri");
    let err = stderr(&o);
    assert_ne!(code(&o), 0, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert_contains(&err, what);
}

/// Reads at block edges and odd places, printed as digests.
const READS: &str = r#"import hashlib
for off, n in [(0, 512), (1048575, 2), (1048000, 300000), (3145727, 1), (7, 2097152)]:
    print(off, n, hashlib.sha256(h.pread(n, off)).hexdigest())
"#;

#[test]
fn xz_files_of_one_and_many_blocks_and_streams_read_as_nbdkit_reads_them() {
    let dir = workdir();
    let d = dir.path();
    let raw = disk(d, "disk.img", 4);
    let want = std::fs::read(&raw).unwrap();
    made(d, "xz", &["-k", "-T1", "--block-size=1MiB", "disk.img"]);
    std::fs::rename(d.join("disk.img.xz"), d.join("multi.xz")).unwrap();
    made(d, "xz", &["-k", "-T1", "-1", "disk.img"]);
    std::fs::rename(d.join("disk.img.xz"), d.join("single.xz")).unwrap();
    // Two streams with stream padding between them: the halves.
    made(
        d,
        "sh",
        &[
            "-c",
            "head -c 2097152 disk.img | xz -T1 --block-size=300KiB > a.xz; \
                          tail -c 2097152 disk.img | xz -T1 -C crc32 > b.xz; \
                          { cat a.xz; head -c 8 /dev/zero; cat b.xz; } > streams.xz",
        ],
    );
    for file in ["multi.xz", "single.xz", "streams.xz"] {
        let path = d.join(file);
        for extra in [&[][..], &["xz-max-depth=1"][..]] {
            let mut args = vec!["--filter=xz", "file", s(&path)];
            args.extend(extra);
            for server in [Server::Nbdkit, Server::Diskit] {
                assert!(
                    served(d, server, &args) == want,
                    "{file} {extra:?} {server:?}"
                );
            }
            let script = d.join("reads.py");
            std::fs::write(&script, READS).unwrap();
            let reads = |server| {
                stdout(&ok(run(
                    server,
                    &args,
                    &format!("nbdsh -u $uri -c \"$(cat {})\"", s(&script)),
                )))
            };
            let theirs = reads(Server::Nbdkit);
            assert_eq!(reads(Server::Diskit), theirs, "{file}");
            assert_eq!(theirs.lines().count(), 5, "{theirs}");
        }
        let args = ["--filter=xz", "file", s(&path)];
        assert_eq!(shape(Server::Diskit, &args), shape(Server::Nbdkit, &args));
        assert_eq!(shape(Server::Diskit, &args), (4 << 20, true));
    }
}

#[test]
fn broken_xz_files_and_big_blocks_are_refused_in_one_line() {
    let dir = workdir();
    let d = dir.path();
    disk(d, "disk.img", 3);
    made(d, "xz", &["-k", "-T1", "--block-size=1MiB", "disk.img"]);
    let xz = d.join("disk.img.xz");
    let bytes = std::fs::read(&xz).unwrap();
    let refuse = |p: &Path, extra: &[&str], what: &str| {
        let mut args = vec!["--filter=xz", "file", s(p)];
        args.extend(extra);
        refused(&args, what);
    };
    refuse(&xz, &["xz-max-block=512K"], "is bigger than xz-max-block");
    refuse(&xz, &["xz-max-depth=0"], "xz-max-depth");
    let cut = d.join("cut.xz");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    refuse(&cut, &[], "xz: ");
    let plain = d.join("plain.xz");
    std::fs::write(&plain, &bytes[12..]).unwrap();
    refuse(&plain, &[], "not an xz file");
    // A block's data changed: served, but reading it fails (nbdkit 1.32
    // aborts on an assertion here) and the server stays up.
    let bad = d.join("bad.xz");
    let mut b = bytes.clone();
    for x in &mut b[5000..5016] {
        *x ^= 0x5a;
    }
    std::fs::write(&bad, &b).unwrap();
    let o = run(
        Server::Diskit,
        &["--filter=xz", "file", s(&bad)],
        "nbdcopy $uri null: ; nbdinfo --size $uri",
    );
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert_contains(&stderr(&o), "nbdcopy: read at offset ");
    assert_eq!(stdout(&o).trim(), (3 << 20).to_string());
}

#[test]
fn gzip_and_bzip2_files_are_served_whole_and_read_only() {
    let dir = workdir();
    let d = dir.path();
    let raw = disk(d, "disk.img", 3);
    let want = std::fs::read(&raw).unwrap();
    made(d, "gzip", &["-k", "disk.img"]);
    made(d, "bzip2", &["-k", "disk.img"]);
    let gz = d.join("disk.img.gz");
    let bz = d.join("disk.img.bz2");
    let gargs = ["--filter=gzip", "file", s(&gz)];
    for server in [Server::Nbdkit, Server::Diskit] {
        assert!(served(d, server, &gargs) == want, "{server:?}");
    }
    assert_eq!(shape(Server::Diskit, &gargs), shape(Server::Nbdkit, &gargs));
    let bargs = ["--filter=bzip2", "file", s(&bz)];
    assert!(served(d, Server::Diskit, &bargs) == want);
    assert_eq!(shape(Server::Diskit, &bargs), (3 << 20, true));
    // Writes are refused.
    let o = run(
        Server::Diskit,
        &gargs,
        "nbdsh -u $uri -c 'h.pwrite(b\"x\", 0)'",
    );
    assert_ne!(code(&o), 0);
    for (file, filter) in [(&gz, "gzip"), (&bz, "bzip2")] {
        let bytes = std::fs::read(file).unwrap();
        let cut = d.join(format!("cut.{filter}"));
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        refused(
            &[&format!("--filter={filter}"), "file", s(&cut)],
            &format!("{filter}: "),
        );
        let bad = d.join(format!("bad.{filter}"));
        let mut b = bytes.clone();
        for x in &mut b[2000..2100] {
            *x ^= 0xa5;
        }
        std::fs::write(&bad, &b).unwrap();
        refused(
            &[&format!("--filter={filter}"), "file", s(&bad)],
            &format!("{filter}: "),
        );
    }
}

#[test]
fn tar_entries_are_found_as_nbdkit_finds_them() {
    let dir = workdir();
    let d = dir.path();
    let long =
        "a-directory-with-a-rather-long-name/and-another-one-below-it-also-quite-long/and-a-third";
    std::fs::create_dir_all(d.join("t").join(long)).unwrap();
    let t = d.join("t");
    disk(&t, "disk.img", 2);
    disk(&t.join(long), "disk-with-a-long-name-too.img", 1);
    std::fs::write(t.join("vm.ovf"), "<Envelope/>\n").unwrap();
    let deep = format!("{long}/disk-with-a-long-name-too.img");
    for (format, name) in [
        ("gnu", "gnu.tar"),
        ("pax", "pax.tar"),
        ("ustar", "ustar.tar"),
    ] {
        made(
            &t,
            "tar",
            &[
                &format!("--format={format}"),
                "-cf",
                &format!("../{name}"),
                "vm.ovf",
                "disk.img",
                &deep,
            ],
        );
    }
    made(
        d,
        "sh",
        &[
            "-c",
            "xz -T1 --block-size=512KiB -k gnu.tar && gzip -k pax.tar",
        ],
    );
    // nbdkit 1.32 takes the block number `tar -tvR` gives, which for a
    // GNU long name is the long name's own header: it serves the entry
    // from the name on. Those cases are checked against the file only.
    let cases = [
        ("gnu.tar", vec![], "disk.img", true),
        ("gnu.tar", vec![], deep.as_str(), false),
        ("pax.tar", vec![], deep.as_str(), true),
        ("ustar.tar", vec![], deep.as_str(), true),
        ("ustar.tar", vec![], "vm.ovf", true),
        ("gnu.tar.xz", vec!["--filter=xz"], deep.as_str(), false),
        ("gnu.tar.xz", vec!["--filter=xz"], "disk.img", true),
        ("pax.tar.gz", vec!["--filter=gzip"], deep.as_str(), true),
    ];
    for (tarball, below, entry, nbdkit_right) in cases {
        let want = std::fs::read(t.join(entry)).unwrap();
        let entry_arg = format!("tar-entry={entry}");
        let mut args = vec!["-r", "--filter=tar"];
        args.extend(below);
        let path = d.join(tarball);
        args.extend(["file", s(&path), &entry_arg]);
        assert!(
            served(d, Server::Diskit, &args) == want,
            "{tarball} {entry}"
        );
        let theirs = served(d, Server::Nbdkit, &args);
        assert_eq!(theirs == want, nbdkit_right, "nbdkit: {tarball} {entry}");
    }
    // Missing entries, a limit that stops before the entry, no entry at all.
    let gnu = d.join("gnu.tar");
    refused(
        &["--filter=tar", "file", s(&gnu), "tar-entry=nope.img"],
        "'nope.img' not found",
    );
    let o = run(
        Server::Nbdkit,
        &["--filter=tar", "file", s(&gnu), "tar-entry=nope.img"],
        "nbdinfo $uri",
    );
    assert_ne!(code(&o), 0);
    refused(
        &[
            "--filter=tar",
            "file",
            s(&gnu),
            "tar-entry=disk.img",
            "tar-limit=1K",
        ],
        "tar-limit",
    );
    refused(&["--filter=tar", "file", s(&gnu)], "tar-entry");
    refused(
        &[
            "--filter=tar",
            "file",
            s(&d.join("t/disk.img")),
            "tar-entry=x",
        ],
        "tar: ",
    );
}
