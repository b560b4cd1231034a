//! VHDX against qemu-img, both ways: dynamic and fixed images qemu-img
//! makes (several block sizes, block_state_zero on and off) and qemu-io
//! writes read back byte-equal, with info, map and check as qemu-img's;
//! images diskit makes are qemu-img's byte for byte but for the random
//! GUIDs, sequence numbers, checksums and the creator; images diskit
//! writes pass `qemu-img check` and `compare`, also after a kill -9 in
//! the middle of writing; a log left to replay (made here from a
//! qemu-written image) is refused read-only and replayed by `check -r
//! all` as qemu-img; hostile images get clear errors.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// VHDX as qemu-img sees it: no JSON check.
const VHDX: Format = Format {
    name: "vhdx",
    convert: &["-f", "vhdx"],
    reads: &[
        "info -f vhdx",
        "info --output=json",
        "map -f vhdx --output=json",
        "map",
        "check",
    ],
    writes: &["write -z 2M 64k", "write -P 0x77 3145727 4099"],
};

#[test]
fn images_qemu_img_makes_read_back_byte_equal() {
    let dir = workdir();
    VHDX.qemu_images_read_alike(
        dir.path(),
        &[
            ("dyn.vhdx", "-o subformat=dynamic", "16M"),
            ("small.vhdx", "-o block_size=1M", "7000000"),
            ("nozero.vhdx", "-o block_state_zero=off,block_size=2M", "9M"),
            ("fix.vhdx", "-o subformat=fixed", "10000000"),
            (
                "fixoff.vhdx",
                "-o subformat=fixed,block_state_zero=off,block_size=4M",
                "12M",
            ),
            ("big.vhdx", "-o block_size=32M", "40M"),
        ],
    );
}

/// What differs between two creations: the creator, the headers' random
/// fields and checksums, the page 83 GUID.
fn masked(v: &[u8]) -> Vec<u8> {
    let mut v = v.to_vec();
    v[8..0x208].fill(0);
    for h in [0x10000, 0x20000] {
        v[h + 4..h + 0x30].fill(0);
    }
    let md = u64::from_le_bytes(v[0x30040..0x30048].try_into().unwrap()) as usize;
    v[md + 0x10010..md + 0x10020].fill(0);
    v
}

#[test]
fn create_is_qemu_img_but_for_random_fields() {
    let dir = workdir();
    let d = dir.path();
    for (opts, size) in [
        ("subformat=dynamic", "100M"),
        ("block_state_zero=off", "1000"),
        ("subformat=fixed", "10000000"),
        ("subformat=fixed,block_state_zero=off,block_size=1M", "5M"),
        ("log_size=1536K,block_size=100K", "3G"),
        ("block_size=512M", "1G"),
        ("subformat=dynamic", "0"),
        ("subformat=dynamic", "64T"),
    ] {
        let args = ["create", "-f", "vhdx", "-o", opts, "x.vhdx", size];
        let (a, b) = create_alike(d, &args, "x.vhdx");
        let (q, k) = (d.join("q"), d.join("k"));
        assert!(masked(&a) == masked(&b), "{opts} {size}: other bytes");
        if size != "64T" {
            VHDX.reads_like_qemu(&k, "x.vhdx");
        }
        std::fs::remove_file(q.join("x.vhdx")).unwrap();
        std::fs::remove_file(k.join("x.vhdx")).unwrap();
    }
    qemu_img_in(d, "create -q -f vhdx e.vhdx 8M");
    alike_lines(
        d,
        &[
            "create -f vhdx -o help",
            "create -f vhdx -o help x.vhdx 1M",
            "create -f vhdx -o subformat=Fixed x.vhdx 1M",
            "create -f vhdx -o block_size=3M x.vhdx 1M",
            "create -f vhdx -o log_size=0 x.vhdx 1M",
            "create -f vhdx -o log_size=4G x.vhdx 1M",
            "create -f vhdx -o block_state_zero=maybe x.vhdx 1M",
            "create -f vhdx -o cluster_size=1M x.vhdx 1M",
            "create -f vhdx -b e.vhdx x.vhdx 1M",
            "create -f vhdx x.vhdx 65T",
            "measure -O vhdx --size 1G",
            "resize e.vhdx 16M",
            "resize e.vhdx 4M",
            "resize --shrink e.vhdx 4M",
            "amend -o block_size=1M e.vhdx",
            "snapshot -l e.vhdx",
            "snapshot -c s1 e.vhdx",
            "commit e.vhdx",
        ],
    );
}

#[test]
fn images_diskit_writes_pass_qemu_img_check() {
    let dir = workdir();
    let d = dir.path();
    three_run_source(d, 20 << 20, [0x11, 0xff, 0x33]);
    for opts in [
        "subformat=dynamic",
        "subformat=fixed",
        "subformat=fixed,block_state_zero=off",
        "block_size=1M,block_state_zero=off",
        "block_size=256M",
    ] {
        VHDX.converts_into(d, &["-o", opts], "src.raw", "c.vhdx");
        // And back: vhdx to vhdx, and qemu-io writes into diskit's image.
        good_in(d, "diskit", &["convert", "-O", "vhdx", "c.vhdx", "c2.vhdx"]);
        qemu_img_in(d, "compare -f vhdx -F raw c2.vhdx src.raw");
        VHDX.scribble(d, "c.vhdx");
        VHDX.reads_like_qemu(d, "c.vhdx");
        std::fs::remove_file(d.join("c.vhdx")).unwrap();
    }
    // Odd writes over NBD through `diskit serve` into a qemu-made image.
    qemu_img_in(d, "create -q -f vhdx -o block_size=1M w.vhdx 24M");
    VHDX.written_over_nbd(
        d,
        "w.vhdx",
        &[
            "write -P 0x44 7340033 1000",
            "write -P 0x45 1000 3",
            "flush",
            "write -P 0x46 4194303 2097154",
            "write -z 16M 1M",
        ],
        &[
            "read -P 0x44 7340033 1000",
            "read -P 0x45 1000 3",
            "read -P 0x46 4194303 2097154",
        ],
    );
    VHDX.scribble(d, "w.vhdx");
    VHDX.reads_like_qemu(d, "w.vhdx");
}

/// CRC-32C, as VHDX checksums.
fn crc32c(b: &[u8]) -> u32 {
    // Bit by bit, the reflected polynomial taken where the low bit is set.
    let bit = |c: u32| (c >> 1) ^ (0x82F6_3B78 & (c & 1).wrapping_neg());
    !b.iter()
        .fold(!0u32, |c, &x| (0..8).fold(c ^ u32::from(x), |c, _| bit(c)))
}

/// Checksums `len` bytes at `at` again (checksum field at `at + 4`).
fn fix_crc(p: &Path, at: u64, len: usize) {
    let mut b = read_bytes(p, at, len);
    b[4..8].fill(0);
    let c = crc32c(&b);
    patch(p, at + 4, &c.to_le_bytes());
}

/// Makes `dst` from `src`, an image qemu-io allocated block 0 of (its log
/// still holds that entry at offset 0): BAT[0] back to ZERO and the
/// current header pointing at the entry, so that it must be replayed.
fn make_dirty(src: &Path, dst: &Path) {
    std::fs::copy(src, dst).unwrap();
    let guid = read_bytes(dst, (1 << 20) + 32, 16);
    patch(dst, 2 << 20, &2u64.to_le_bytes());
    let seq = |h: u64| u64::from_le_bytes(read_bytes(dst, h + 8, 8).try_into().unwrap());
    let cur = if seq(0x10000) > seq(0x20000) {
        0x10000
    } else {
        0x20000
    };
    patch(dst, cur + 48, &guid);
    fix_crc(dst, cur, 4096);
}

#[test]
fn a_log_to_replay_is_refused_read_only_and_replayed_as_qemu() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vhdx w.vhdx 100M");
    qemu_io_in(d, "vhdx", "w.vhdx", &["write -P 0x77 4096 64k"]);
    make_dirty(&d.join("w.vhdx"), &d.join("dirty.vhdx"));
    // Read-only: QEMU's message, exit 1, for info, check and convert.
    alike_in(d, &["info", "dirty.vhdx"]);
    alike_in(d, &["check", "dirty.vhdx"]);
    alike_in(d, &["check", "--output=json", "dirty.vhdx"]);
    let o = tool_in(
        d,
        "diskit",
        &["convert", "-O", "raw", "dirty.vhdx", "x.raw"],
    );
    assert_fails_with(&o, 1, "contains a log that needs to be replayed");
    // check -r all replays it (one corruption fixed), as qemu-img.
    for (args, json) in [
        (&["check", "-r", "all"][..], false),
        (&["check", "-r", "all", "--output=json"], true),
    ] {
        std::fs::copy(d.join("dirty.vhdx"), d.join("a.vhdx")).unwrap();
        std::fs::copy(d.join("dirty.vhdx"), d.join("b.vhdx")).unwrap();
        let mut a = args.to_vec();
        a.push("a.vhdx");
        let ours = good_in(d, "diskit", &a);
        a.pop();
        a.push("b.vhdx");
        let theirs = good_in(d, "qemu-img", &a);
        assert_eq!(
            stdout(&ours).replace("a.vhdx", "F"),
            stdout(&theirs).replace("b.vhdx", "F"),
            "json {json}"
        );
        alike_in(d, &["check", "a.vhdx"]);
        qemu_io_in(d, "vhdx", "a.vhdx", &["read -P 0x77 4096 64k"]);
        qemu_img_in(d, "compare a.vhdx b.vhdx");
    }
    // A read-write open (a server) replays it too, and writes after it.
    std::fs::copy(d.join("dirty.vhdx"), d.join("s.vhdx")).unwrap();
    qemu_io_over_nbd(
        d,
        "s.vhdx",
        &["read -P 0x77 4096 64k", "write -P 0x12 50M 8k"],
    );
    qemu_img_in(d, "check s.vhdx");
    qemu_io_in(
        d,
        "vhdx",
        "s.vhdx",
        &["read -P 0x77 4096 64k", "read -P 0x12 50M 8k"],
    );
}

#[test]
fn hostile_images_get_clear_errors() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vhdx g.vhdx 16M");
    qemu_io_in(d, "vhdx", "g.vhdx", &["write -P 0x77 0 4k"]);
    make_dirty(&d.join("g.vhdx"), &d.join("dirty.vhdx"));
    const MD: u64 = 3 << 20;
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "No valid VHDX header found",
            Box::new(|p| {
                patch(p, 0x10000 + 100, &[1]);
                patch(p, 0x20000 + 100, &[1]);
            }),
        ),
        (
            "region table checksum",
            Box::new(|p| patch(p, 0x30000 + 100, &[1])),
        ),
        (
            "at most 2047",
            Box::new(|p| {
                patch(p, 0x30008, &5000u32.to_le_bytes());
                fix_crc(p, 0x30000, 65536);
            }),
        ),
        (
            "is required but unknown",
            Box::new(|p| {
                patch(p, 0x30008, &3u32.to_le_bytes());
                let mut e = vec![0x42u8; 16];
                e.extend((5u64 << 20).to_le_bytes());
                e.extend((1u32 << 20).to_le_bytes());
                e.extend(1u32.to_le_bytes());
                patch(p, 0x30000 + 16 + 64, &e);
                fix_crc(p, 0x30000, 65536);
            }),
        ),
        (
            "overlaps with region",
            Box::new(|p| {
                patch(p, 0x30000 + 16 + 16, &(1u64 << 20).to_le_bytes());
                fix_crc(p, 0x30000, 65536);
            }),
        ),
        ("metadata table signature", Box::new(|p| patch(p, MD, b"x"))),
        (
            "logical sector size 4096",
            Box::new(|p| patch(p, MD + 0x10020, &4096u32.to_le_bytes())),
        ),
        (
            "block size 3145728",
            Box::new(|p| patch(p, MD + 0x10000, &(3u32 << 20).to_le_bytes())),
        ),
        (
            "has a parent",
            Box::new(|p| patch(p, MD + 0x10004, &2u32.to_le_bytes())),
        ),
        (
            "too small for",
            Box::new(|p| patch(p, MD + 0x10008, &(1u64 << 50).to_le_bytes())),
        ),
        (
            "points after end of file",
            Box::new(|p| patch(p, 2 << 20, &((1u64 << 30) | 6).to_le_bytes())),
        ),
        (
            "region table signature not found",
            Box::new(|p| {
                let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
                f.set_len(66000).unwrap();
            }),
        ),
    ];
    for (msg, mutate) in cases {
        mutated(d, "g.vhdx", "bad.vhdx", &mutate);
        info_refused(d, "bad.vhdx", msg);
    }
    // A differencing image: refused as unsupported.
    std::fs::copy(d.join("g.vhdx"), d.join("bad.vhdx")).unwrap();
    let p = d.join("bad.vhdx");
    patch(&p, MD + 0x10004, &2u32.to_le_bytes());
    patch(&p, MD + 10, &6u16.to_le_bytes());
    let mut e = vec![
        0x2d, 0x5f, 0xd3, 0xa8, 0x0b, 0xb3, 0x4d, 0x45, 0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab,
        0x0c,
    ];
    e.extend((0x10100u32).to_le_bytes());
    e.extend(16u32.to_le_bytes());
    e.extend(4u32.to_le_bytes());
    patch(&p, MD + 32 + 5 * 32, &e);
    let o = tool_in(d, "diskit", &["info", "bad.vhdx"]);
    assert_stderr_has(&o, "differencing images (with a parent) are not supported");
    assert_eq!(code(&tool_in(d, "qemu-img", &["info", "bad.vhdx"])), 1);
    // A BAT entry past the end of the file: check says so, as qemu-img.
    std::fs::copy(d.join("g.vhdx"), d.join("bad.vhdx")).unwrap();
    patch(
        &d.join("bad.vhdx"),
        (2 << 20) + 8,
        &((1u64 << 30) | 6).to_le_bytes(),
    );
    alike_in(d, &["check", "bad.vhdx"]);
    alike_in(d, &["check", "-r", "all", "bad.vhdx"]);
    alike_in(d, &["check", "--output=json", "bad.vhdx"]);
    // Several at once: blocks over the metadata, past the end.
    std::fs::copy(d.join("g.vhdx"), d.join("bad.vhdx")).unwrap();
    let mut entries = Vec::new();
    for e in [6u64, (1 << 20) | 6, (127 << 20) | 6] {
        entries.extend(e.to_le_bytes());
    }
    patch(&d.join("bad.vhdx"), 2 << 20, &entries);
    alike_in(d, &["check", "bad.vhdx"]);
    // Log entries: a corrupt descriptor fails every open; an entry that
    // needs a longer file fails the replay.
    std::fs::copy(d.join("dirty.vhdx"), d.join("bad.vhdx")).unwrap();
    patch(&d.join("bad.vhdx"), (1 << 20) + 64, b"xxxx");
    let o = tool_in(d, "diskit", &["info", "bad.vhdx"]);
    assert_stderr_has(&o, "descriptor 0 is corrupt");
    assert_eq!(code(&tool_in(d, "qemu-img", &["info", "bad.vhdx"])), 1);
    std::fs::copy(d.join("dirty.vhdx"), d.join("bad.vhdx")).unwrap();
    patch(
        &d.join("bad.vhdx"),
        (1 << 20) + 48,
        &(1u64 << 40).to_le_bytes(),
    );
    fix_crc(&d.join("bad.vhdx"), 1 << 20, 8192);
    let o = tool_in(d, "diskit", &["check", "-r", "all", "bad.vhdx"]);
    assert_fails_with(&o, 1, "needs a file of");
    let o = tool_in(d, "qemu-img", &["check", "-r", "all", "bad.vhdx"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
}

/// `qemu-img check` accepts the image, after replaying its log if a
/// crash left one.
fn qemu_img_accepts(dir: &Path, img: &str, what: &str) {
    let o = tool_in(dir, "qemu-img", &["check", img]);
    if code(&o) != 0 {
        assert!(
            stderr(&o).contains("needs to be replayed"),
            "{what}: {}{}",
            stdout(&o),
            stderr(&o)
        );
        let o = tool_in(dir, "qemu-img", &["check", "-r", "all", img]);
        assert_eq!(code(&o), 0, "{what}: {}{}", stdout(&o), stderr(&o));
    }
    good_in(dir, "qemu-img", &["check", img]);
    good_in(dir, "qemu-img", &["convert", "-O", "raw", img, "after.raw"]);
}

#[test]
fn a_writer_killed_at_any_point_leaves_an_image_qemu_img_accepts() {
    let dir = workdir();
    let d = dir.path();
    let sock = d.join("s");
    for delay in [30u64, 90, 200, 400] {
        qemu_img_in(d, "create -q -f vhdx -o block_size=1M k.vhdx 256M");
        let server = serve_image(&sock, &d.join("k.vhdx"));
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        let mut args = vec!["-f".to_string(), "raw".to_string()];
        for i in 0..200u64 {
            args.push("-c".into());
            args.push(format!("write -P {} {} 64k", i % 250 + 1, i * 1_200_000));
            if i % 7 == 0 {
                args.push("-c".into());
                args.push("flush".into());
            }
        }
        args.push(uri);
        let mut writer = Command::new("qemu-io")
            .args(&args)
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay));
        // ServeGuard sends SIGKILL.
        drop(server);
        let _ = writer.wait();
        qemu_img_accepts(d, "k.vhdx", &format!("server killed after {delay} ms"));
        std::fs::remove_file(d.join("k.vhdx")).unwrap();
    }
    // A convert killed half-way.
    sparse_file(&d.join("big.raw"), 256 << 20, &[(0, 256 << 20, 0xff)]);
    for delay in [100u64, 300] {
        diskit_killed_after(d, &words("convert -O vhdx big.raw c.vhdx"), delay);
        if d.join("c.vhdx").exists() && std::fs::metadata(d.join("c.vhdx")).unwrap().len() > 0 {
            qemu_img_accepts(d, "c.vhdx", &format!("convert killed after {delay} ms"));
            std::fs::remove_file(d.join("c.vhdx")).unwrap();
        }
    }
}

#[test]
fn concurrent_writers_allocate_each_block_once() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vhdx -o block_size=1M m.vhdx 32M");
    let sock = d.join("s");
    let server = serve_image(&sock, &d.join("m.vhdx"));
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let writers: Vec<_> = (1..=3u64)
        .map(|p| {
            let mut args = vec!["-f".to_string(), "raw".to_string()];
            for b in 0..32u64 {
                args.push("-c".into());
                args.push(format!("write -P {p} {} 50000", (b << 20) + p * 100_000));
            }
            args.push(uri.clone());
            Command::new("qemu-io")
                .args(&args)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut w in writers {
        assert!(w.wait().unwrap().success());
    }
    drop(server);
    qemu_img_in(d, "check m.vhdx");
    // 8 MiB of metadata, then each 1 MiB block once.
    assert_eq!(std::fs::metadata(d.join("m.vhdx")).unwrap().len(), 40 << 20);
    for b in [0u64, 17, 31] {
        let mut args = vec!["-f".to_string(), "vhdx".to_string()];
        for p in 1..=3u64 {
            args.push("-c".into());
            args.push(format!("read -P {p} {} 50000", (b << 20) + p * 100_000));
        }
        args.push("m.vhdx".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        good_in(d, "qemu-io", &args);
    }
}
