//! VMDK against qemu-img, both ways: disks qemu-img makes (every
//! subformat) and qemu-io writes read back byte-equal with qemu-img's
//! info, map and check; disks diskit makes are qemu-img's byte for byte
//! but for their random content IDs; disks diskit writes (convert, and
//! qemu-io through `diskit serve`, over a parent) pass qemu-img check and
//! compare; VMware's own stream layout and ESX sparse extents read as
//! qemu-img reads them; hostile descriptors and headers get clear errors.

mod common;

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const SUBFORMATS: &[&str] = &[
    "monolithicSparse",
    "monolithicFlat",
    "twoGbMaxExtentSparse",
    "twoGbMaxExtentFlat",
    "streamOptimized",
];

fn reads_like_qemu(dir: &Path, img: &str) {
    good_in(
        dir,
        "qemu-img",
        &["convert", "-O", "raw", img, "theirs.raw"],
    );
    good_in(dir, "diskit", &["convert", "-O", "raw", img, "ours.raw"]);
    // (qemu-img compare skips the holes of these big sparse files.)
    qemu_img_in(dir, "compare -f raw -F raw theirs.raw ours.raw");
    alike_in(dir, &["info", img]);
    alike_in(dir, &["info", "--output=json", img]);
    alike_in(dir, &["map", "--output=json", img]);
    alike_in(dir, &["check", img]);
    alike_in(dir, &["check", "--output=json", img]);
    let _ = std::fs::remove_file(dir.join("theirs.raw"));
    let _ = std::fs::remove_file(dir.join("ours.raw"));
}

/// Writes at odd offsets (whole grains for a stream, which takes nothing
/// else), then zeros.
fn scribble(dir: &Path, img: &str, stream: bool) {
    let cmds: &[&str] = if stream {
        &[
            "write -P 0x5a 0 64k",
            "write -P 0x33 192k 128k",
            "write -P 7 2M 64k",
        ]
    } else {
        &[
            "write -P 0x5a 5M 100k",
            "write -P 0x33 1000 70000",
            "write -P 0x77 1536k 4k",
            "write -z 2M 128k",
            "write -P 0x11 2100M 1M",
        ]
    };
    qemu_io_in(dir, "vmdk", img, cmds);
}

#[test]
fn disks_qemu_img_makes_read_back_byte_equal() {
    let dir = workdir();
    let d = dir.path();
    for sub in SUBFORMATS {
        for extra in ["", ",zeroed_grain=on", ",adapter_type=lsilogic,compat6=on"] {
            let flat = sub.contains("Flat");
            if flat && extra.contains("zeroed") {
                continue;
            }
            let opts = format!("subformat={sub}{extra}");
            // twoGb disks split at 2 GiB.
            let size = if sub.starts_with("twoGb") {
                "2200M"
            } else {
                "2110M"
            };
            let img = "d.vmdk";
            good_in(
                d,
                "qemu-img",
                &["create", "-q", "-f", "vmdk", "-o", &opts, img, size],
            );
            reads_like_qemu(d, img);
            scribble(d, img, *sub == "streamOptimized");
            reads_like_qemu(d, img);
            for f in std::fs::read_dir(d).unwrap() {
                std::fs::remove_file(f.unwrap().path()).unwrap();
            }
        }
    }
}

/// A file's bytes with the content IDs masked: each ID's digits go, and
/// the NULs padding the text after them count as if they had stayed (an
/// ID is 1 to 8 hex digits, so the text's length varies with it).
fn masked(p: &Path) -> Vec<u8> {
    let b = std::fs::read(p).unwrap();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let mut removed = 0;
    while i < b.len() {
        if b[i..].starts_with(b"CID=") {
            out.extend_from_slice(b"CID=");
            i += 4;
            while i < b.len() && b[i].is_ascii_hexdigit() {
                i += 1;
                removed += 1;
            }
        } else if b[i] == 0 && removed > 0 {
            // The padding after the text: as long as it would be with
            // the digits kept.
            let pad = b[i..].iter().take_while(|&&c| c == 0).count();
            out.extend(std::iter::repeat_n(0u8, pad + removed));
            i += pad;
            removed = 0;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[test]
fn create_is_qemu_img_but_for_the_content_ids() {
    let dir = workdir();
    let d = dir.path();
    std::fs::write(d.join("base.vmdk"), b"").unwrap();
    qemu_img_in(d, "create -q -f vmdk base.vmdk 3M");
    let mut cases: Vec<(String, &str)> = Vec::new();
    for sub in SUBFORMATS {
        for size in ["1M", "100M", "1000000", "5G", "0"] {
            cases.push((format!("subformat={sub}"), size));
        }
    }
    for opts in [
        "zeroed_grain=on",
        "adapter_type=buslogic,hwversion=7,toolsversion=10240",
        "adapter_type=legacyESX,compat6=on",
        "subformat=streamOptimized,zeroed_grain=on",
        "subformat=twoGbMaxExtentSparse,zeroed_grain=on,adapter_type=lsilogic",
        "backing_file=base.vmdk,backing_fmt=vmdk",
    ] {
        cases.push((opts.to_string(), "3M"));
    }
    for (opts, size) in &cases {
        let (q, k) = (d.join("q"), d.join("k"));
        for x in [&q, &k] {
            std::fs::create_dir_all(x).unwrap();
            std::fs::copy(d.join("base.vmdk"), x.join("base.vmdk")).unwrap();
        }
        let args = ["create", "-f", "vmdk", "-o", opts, "x.vmdk", size];
        let o1 = good_in(&q, "qemu-img", &args);
        let o2 = good_in(&k, "diskit", &args);
        assert_eq!(stdout(&o1), stdout(&o2), "{opts} {size}");
        let mut names: Vec<String> = std::fs::read_dir(&q)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut ours: Vec<String> = std::fs::read_dir(&k)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        ours.sort();
        assert_eq!(names, ours, "{opts} {size}: files");
        for n in &names {
            if std::fs::metadata(q.join(n)).unwrap().len() > 64 << 20 {
                // A flat extent: raw data (holes), no content ID.
                good_in(
                    d,
                    "qemu-img",
                    &argv("compare -f raw -F raw", &[s(&q.join(n)), s(&k.join(n))]),
                );
            } else {
                assert!(
                    masked(&q.join(n)) == masked(&k.join(n)),
                    "{opts} {size}: {n} has other bytes"
                );
            }
            assert_eq!(
                allocated(&q.join(n)),
                allocated(&k.join(n)),
                "{opts} {size}: {n} allocation"
            );
        }
        std::fs::remove_dir_all(&q).unwrap();
        std::fs::remove_dir_all(&k).unwrap();
    }
    for line in [
        "create -f vmdk -o help",
        "create -f vmdk -o help x.vmdk 1M",
        "create -f vmdk -o subformat=bogus x.vmdk 1M",
        "create -f vmdk -o adapter_type=IDE x.vmdk 1M",
        "create -f vmdk -o compat6=on,hwversion=6 x.vmdk 1M",
        "create -f vmdk -o subformat=monolithicFlat,zeroed_grain=on x.vmdk 1M",
        "create -f vmdk -o subformat=twoGbMaxExtentFlat -b base.vmdk -F vmdk x.vmdk 1M",
        "create -f vmdk -b base.vmdk -F qcow2 x.vmdk 1M",
        "create -f vmdk x.vmdk",
        "measure -O vmdk --size 1G",
        "resize base.vmdk 20M",
        "amend -o compat6=on base.vmdk",
        "check -r all base.vmdk",
    ] {
        let args = &words(line)[..];
        alike_in(d, args);
        let _ = std::fs::remove_file(d.join("x.vmdk"));
    }
}

#[test]
fn disks_diskit_writes_pass_qemu_img_check() {
    let dir = workdir();
    let d = dir.path();
    sparse_file(
        &d.join("src.raw"),
        2300 << 20,
        &[
            (0, 3 << 20, 0x41),
            (5 << 20, 100_000, 0x42),
            (2100 << 20, 1 << 20, 0x43),
            ((2300 << 20) - 4096, 4096, 0x44),
        ],
    );
    for sub in SUBFORMATS {
        let opts = format!("subformat={sub}");
        good_in(
            d,
            "diskit",
            &["convert", "-O", "vmdk", "-o", &opts, "src.raw", "o.vmdk"],
        );
        qemu_img_in(d, "check o.vmdk");
        qemu_img_in(d, "compare src.raw o.vmdk");
        // And back, through diskit.
        good_in(d, "diskit", &["convert", "-O", "raw", "o.vmdk", "back.raw"]);
        assert!(same_bytes(&d.join("src.raw"), &d.join("back.raw")), "{sub}");
        for f in std::fs::read_dir(d).unwrap() {
            let p = f.unwrap().path();
            if p.file_name().unwrap() != "src.raw" {
                std::fs::remove_file(p).unwrap();
            }
        }
    }
}

#[test]
fn writes_through_serve_over_a_parent_match_qemu_io() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vmdk base.vmdk 10M");
    good_in(d, "qemu-io", &["-c", "write -P 1 0 10M", "base.vmdk"]);
    for (img, extra) in [("ov.vmdk", ""), ("zg.vmdk", "zeroed_grain=on,")] {
        let twin = format!("twin-{img}");
        for (tool, name) in [("diskit", img), ("qemu-img", twin.as_str())] {
            let opts = format!("{extra}backing_file=base.vmdk,backing_fmt=vmdk");
            good_in(d, tool, &["create", "-q", "-f", "vmdk", "-o", &opts, name]);
        }
        let cmds = [
            "write -P 5 4k 4k",
            "write -P 6 100k 200k",
            "write -z 1M 64k",
            "write -z 3M 100k",
            "write -P 7 9M 1M",
        ];
        qemu_io_over_nbd(d, img, &cmds);
        good_in(d, "qemu-io", &qemu_io_args(None, &cmds, &twin));
        good_in(d, "qemu-img", &["check", img]);
        good_in(d, "qemu-img", &["compare", img, &twin]);
        // The first write gave the disk a new content ID; its parent's
        // is unchanged, so qemu-img still reads through to it.
        let info = stdout(&good_in(d, "qemu-img", &["info", "--output=json", img]));
        let twin_info = stdout(&good_in(d, "qemu-img", &["info", "--output=json", &twin]));
        let parent = |t: &str| {
            t.lines()
                .find(|l| l.contains("parent-cid"))
                .map(str::to_string)
        };
        assert_eq!(parent(&info), parent(&twin_info));
    }
}

/// A VMware-style stream: header with the directory at the end, grains
/// with markers, a grain table and directory behind their markers, the
/// footer and the end-of-stream marker.
fn vmware_stream(path: &Path) {
    let cap: u64 = 4096;
    let header = |gd: u64| {
        let mut h = vec![0u8; 512];
        h[..4].copy_from_slice(b"KDMV");
        let mut put = |at: usize, v: &[u8]| h[at..at + v.len()].copy_from_slice(v);
        put(4, &3u32.to_le_bytes());
        put(8, &0x30001u32.to_le_bytes());
        put(12, &cap.to_le_bytes());
        put(20, &128u64.to_le_bytes());
        put(28, &1u64.to_le_bytes());
        put(36, &1u64.to_le_bytes());
        put(44, &512u32.to_le_bytes());
        put(56, &gd.to_le_bytes());
        put(64, &128u64.to_le_bytes());
        put(0x49, b"\n \r\n");
        put(0x4D, &1u16.to_le_bytes());
        h
    };
    let pad = |v: &mut Vec<u8>| v.resize(v.len().div_ceil(512) * 512, 0);
    let marker = |val: u64, kind: u32| {
        let mut m = vec![0u8; 512];
        m[..8].copy_from_slice(&val.to_le_bytes());
        m[12..16].copy_from_slice(&kind.to_le_bytes());
        m
    };
    let mut f = header(u64::MAX);
    f.extend_from_slice(
        b"# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\n\
          createType=\"streamOptimized\"\n\n# Extent description\nRW 4096 SPARSE \"x.vmdk\"\n",
    );
    f.resize(128 * 512, 0);
    let mut gt = vec![0u32; 512];
    for (grain, fill) in [(0usize, 0xaau8), (5, 0x01), (31, 0x77)] {
        let data: Vec<u8> = (0..65536u32).map(|i| fill ^ (i % 7) as u8).collect();
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&data).unwrap();
        let c = z.finish().unwrap();
        gt[grain] = (f.len() / 512) as u32;
        f.extend_from_slice(&(grain as u64 * 128).to_le_bytes());
        f.extend_from_slice(&(c.len() as u32).to_le_bytes());
        f.extend_from_slice(&c);
        pad(&mut f);
    }
    f.extend(marker(4, 1));
    let gt_at = f.len() / 512;
    for e in &gt {
        f.extend_from_slice(&e.to_le_bytes());
    }
    f.extend(marker(1, 2));
    let gd_at = f.len() / 512;
    f.extend_from_slice(&(gt_at as u32).to_le_bytes());
    pad(&mut f);
    f.extend(marker(1, 3));
    f.extend(header(gd_at as u64));
    f.extend(marker(0, 0));
    std::fs::write(path, f).unwrap();
}

/// An ESX sparse (COWD) extent and its vmfsSparse descriptor.
fn vmfs_sparse(dir: &Path) {
    let mut f = vec![0u8; 4 * 512];
    f[..4].copy_from_slice(b"COWD");
    for (i, v) in [1u32, 3, 2048, 16, 4, 1, 64].iter().enumerate() {
        f[4 + 4 * i..8 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    let mut gd = vec![0u8; 4 * 512];
    gd[..4].copy_from_slice(&8u32.to_le_bytes());
    f.extend(gd);
    let mut gt = vec![0u8; 4096 * 4];
    gt[4..8].copy_from_slice(&40u32.to_le_bytes());
    gt[12..16].copy_from_slice(&1u32.to_le_bytes());
    f.extend(gt);
    f.extend(vec![0x5au8; 16 * 512]);
    std::fs::write(dir.join("cowd-ext.vmdk"), f).unwrap();
    std::fs::write(
        dir.join("vmfssparse.vmdk"),
        "# Disk DescriptorFile\nversion=1\nCID=abcdef01\nparentCID=ffffffff\n\
         createType=\"vmfsSparse\"\n\n# Extent description\nRW 2048 VMFSSPARSE \"cowd-ext.vmdk\"\n",
    )
    .unwrap();
}

/// A seSparse extent (4 KiB grains: data, a zero grain, an unmapped one,
/// another data grain) and its descriptor.
fn se_sparse(dir: &Path) {
    let words = |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|w| w.to_le_bytes()).collect() };
    let cap = 4096u64;
    let mut f = words(&[
        0xcafebabe,
        0x2_0000_0001,
        cap,
        8,
        64,
        0,
        0,
        0,
        0,
        0,
        1,
        1,
        2,
        1,
        3,
        1,
        8,
        1,
        16,
        64,
        0,
        0,
        0,
        0,
        128,
        64,
    ]);
    f.resize(512, 0);
    let mut v = words(&[0xcafecafe, 1, 1, 0]);
    v.resize(512, 0);
    f.extend(v);
    f.resize(8 * 512, 0);
    let mut gd = vec![0u64; 64];
    gd[0] = 0x1000_0000_0000_0000;
    f.extend(words(&gd));
    f.resize(16 * 512, 0);
    let mut gt = vec![0u64; 4096];
    gt[0] = 0x3000_0000_0000_0000;
    gt[1] = 0x2000_0000_0000_0000;
    gt[2] = 0x1000_0000_0000_0000;
    gt[5] = 0x3000_0000_0000_0000 | (1 << 48);
    gt[6] = 0x3000_0000_0000_0000 | (2 << 48);
    f.extend(words(&gt));
    f.resize(128 * 512, 0);
    for fill in [0x11u8, 0x22, 0x33] {
        f.extend(vec![fill; 4096]);
    }
    std::fs::write(dir.join("se-ext.vmdk"), f).unwrap();
    std::fs::write(
        dir.join("sesparse.vmdk"),
        "# Disk DescriptorFile\nversion=1\nCID=1234\nparentCID=ffffffff\n\
         createType=\"seSparse\"\n\n# Extent description\nRW 4096 SESPARSE \"se-ext.vmdk\"\n",
    )
    .unwrap();
}

#[test]
fn vmware_streams_and_esx_sparse_extents_read_as_qemu_reads_them() {
    let dir = workdir();
    let d = dir.path();
    vmware_stream(&d.join("vw.vmdk"));
    reads_like_qemu(d, "vw.vmdk");
    // Grains written after its footer would lose it: read only.
    let o = tool_in(d, "diskit", &["serve", "-U", "x.sock", "image", "vw.vmdk"]);
    assert_stderr_has(&o, "read only");
    vmfs_sparse(d);
    reads_like_qemu(d, "vmfssparse.vmdk");
    se_sparse(d);
    reads_like_qemu(d, "sesparse.vmdk");
    // Read only, as in QEMU; a dirty journal or a bad magic is refused.
    let o = tool_in(
        d,
        "diskit",
        &["serve", "-U", "x.sock", "image", "sesparse.vmdk"],
    );
    assert_stderr_has(&o, "No write support for seSparse");
    let ext = std::fs::read(d.join("se-ext.vmdk")).unwrap();
    for (at, why) in [
        (0usize, "Bad const header magic"),
        (512 + 24, "Replaying journal not supported"),
    ] {
        let mut b = ext.clone();
        b[at] ^= 1;
        std::fs::write(d.join("se-ext.vmdk"), b).unwrap();
        let o = tool_in(d, "diskit", &["info", "sesparse.vmdk"]);
        assert_stderr_has(&o, why);
    }
    // A descriptor mixing flat and sparse extents, in a subdirectory.
    std::fs::create_dir(d.join("sub")).unwrap();
    qemu_img_in(d, "create -q -f raw sub/flat.raw 1M");
    good_in(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 9 4k 8k", "sub/flat.raw"],
    );
    qemu_img_in(d, "create -q -f vmdk sub/sp.vmdk 2M");
    good_in(d, "qemu-io", &["-c", "write -P 8 1M 70k", "sub/sp.vmdk"]);
    std::fs::write(
        d.join("sub/mixed.vmdk"),
        "# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\n\
         createType=\"twoGbMaxExtentSparse\"\n# Extents (QEMU reads an extent line\n\
         # after a blank line twice: not copied)\nRW 2048 FLAT \"flat.raw\" 0\n\
         RW 16 ZERO\nrw 16 FLAT \"x\" 0\nRW 4096 SPARSE \"sp.vmdk\"\nRW 1024 FLAT \"flat.raw\" 1024\n",
    )
    .unwrap();
    reads_like_qemu(d, "sub/mixed.vmdk");
}

#[test]
fn hostile_disks_get_clear_errors() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vmdk good.vmdk 4M");
    good_in(d, "qemu-io", &["-c", "write -P 3 0 256k", "good.vmdk"]);
    let good = std::fs::read(d.join("good.vmdk")).unwrap();
    let mutate = |name: &str, f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        std::fs::write(d.join(name), b).unwrap();
    };
    let put32 =
        |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put64 =
        |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    mutate("v4.vmdk", &|b| put32(b, 4, 4));
    mutate("gt.vmdk", &|b| put32(b, 0x2C, 4096));
    mutate("grain0.vmdk", &|b| put64(b, 0x14, 0));
    mutate("grainbig.vmdk", &|b| put64(b, 0x14, 1 << 30));
    mutate("short.vmdk", &|b| b.truncate(20000));
    mutate("l1.vmdk", &|b| put64(b, 0x0C, 1 << 62));
    mutate("nocid.vmdk", &|b| {
        b[0x200..0x200 + 10240].fill(b' ');
    });
    // The first grain table entry points past the end of the file.
    mutate("past.vmdk", &|b| {
        let gd = u64::from_le_bytes(b[0x38..0x40].try_into().unwrap()) as usize * 512;
        let gt = u32::from_le_bytes(b[gd..gd + 4].try_into().unwrap()) as usize * 512;
        b[gt..gt + 4].copy_from_slice(&0x0100_0000u32.to_le_bytes());
    });
    mutate("gdpast.vmdk", &|b| put64(b, 0x38, 1 << 40));
    for (img, why) in [
        ("v4.vmdk", "Unsupported VMDK version 4"),
        ("gt.vmdk", "L2 table size too big"),
        ("grain0.vmdk", "L1 entry size is invalid"),
        ("grainbig.vmdk", "Invalid granularity"),
        ("short.vmdk", "File truncated, expecting at least"),
        ("l1.vmdk", "L1 size too big"),
    ] {
        info_refused(d, img, why);
    }
    let o = tool_in(d, "diskit", &["info", "nocid.vmdk"]);
    assert_eq!(code(&o), 1);
    // qemu-img wraps its grain count from 256 TiB on and writes a broken
    // layout; diskit refuses.
    let o = tool_in(d, "diskit", &["create", "-f", "vmdk", "huge.vmdk", "1P"]);
    assert_fails_with(&o, 1, "too large");
    assert!(!d.join("huge.vmdk").exists());
    // A grain past the end reads as zeros, as in QEMU, and check finds it
    // with qemu-img's words.
    alike_in(d, &["check", "past.vmdk"]);
    good_in(d, "diskit", &["convert", "-O", "raw", "past.vmdk", "p.raw"]);
    good_in(
        d,
        "diskit",
        &["convert", "-O", "raw", "gdpast.vmdk", "g.raw"],
    );
    // Descriptor abuse: a missing extent, one outside the directory of an
    // untrusted disk, a bad line, 20,000 extents (qemu-img takes minutes).
    let desc = |name: &str, extents: &str| {
        std::fs::write(
            d.join(name),
            format!(
                "# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\n\
                 createType=\"monolithicFlat\"\n{extents}"
            ),
        )
        .unwrap();
    };
    desc("missing.vmdk", "RW 8 FLAT \"nope.raw\" 0\n");
    let o = tool_in(d, "diskit", &["info", "missing.vmdk"]);
    assert_fails_with(&o, 1, "nope.raw");
    desc("escape.vmdk", "RW 8 FLAT \"/etc/hostname\" 0\n");
    let o = tool_in(d, "diskit", &["--untrusted", "info", "escape.vmdk"]);
    assert_fails_with(&o, 1, "refusing extent file");
    desc("badline.vmdk", "RW 8 FLAT \"good.vmdk\"\n");
    let o = tool_in(d, "diskit", &["info", "badline.vmdk"]);
    assert_stderr_has(&o, "Invalid extent line");
    desc("none.vmdk", "RW 8 ZERO\n");
    let o = tool_in(d, "diskit", &["info", "none.vmdk"]);
    assert_eq!(code(&o), 1, "no extents: an error, not a crash");
    desc("many.vmdk", &"RW 1 FLAT \"good.vmdk\" 0\n".repeat(20_000));
    let t = Instant::now();
    let o = tool_in(d, "diskit", &["info", "many.vmdk"]);
    assert_fails_with(&o, 1, "extents");
    assert!(t.elapsed() < Duration::from_secs(30), "refused at once");
    // A parent that is the disk itself.
    let own = std::fs::read_to_string(d.join("missing.vmdk")).unwrap();
    std::fs::write(
        d.join("loop.vmdk"),
        own.replace("createType", "parentFileNameHint=\"loop.vmdk\"\ncreateType")
            .replace("nope.raw", "good.vmdk"),
    )
    .unwrap();
    let o = tool_in(d, "diskit", &["map", "loop.vmdk"]);
    assert_fails_with(&o, 1, "loop");
}

#[test]
fn descriptors_are_probed_as_qemu_img_probes_them() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vmdk -o subformat=monolithicFlat f.vmdk 1M");
    alike_in(d, &["info", "f.vmdk"]);
    // A descriptor whose version line is not first is raw to both.
    let text = std::fs::read_to_string(d.join("f.vmdk")).unwrap();
    std::fs::write(
        d.join("late.vmdk"),
        text.replace("# Disk DescriptorFile\n", "\n"),
    )
    .unwrap();
    alike_in(d, &["info", "late.vmdk"]);
    // A twoGb disk with its parts: one disk of the descriptor.
    let f = std::fs::File::options()
        .write(true)
        .open(d.join("f-flat.vmdk"))
        .unwrap();
    f.write_all_at(&[0xee; 512], 4096).unwrap();
    alike_in(d, &["map", "--output=json", "f.vmdk"]);
}

#[test]
fn a_writer_killed_mid_copy_leaves_a_disk_qemu_img_accepts() {
    let dir = workdir();
    let d = dir.path();
    // 96 MiB of data in runs, so that the copy is caught part way.
    let runs: Vec<(u64, usize, u8)> = (0..48u64)
        .map(|i| (i * (4 << 20), 2 << 20, i as u8 + 1))
        .collect();
    sparse_file(&d.join("src.raw"), 192 << 20, &runs);
    for (sub, delay_ms) in [
        ("monolithicSparse", 60),
        ("streamOptimized", 150),
        ("twoGbMaxExtentSparse", 60),
    ] {
        let opts = format!("subformat={sub}");
        let convert = argv("convert -O vmdk -o", &[&opts, "src.raw", "k.vmdk"]);
        diskit_killed_after(d, &convert, delay_ms);
        // A descriptor file is made empty first and gets its text once its
        // extents exist, as QEMU makes it: killed in between (a load
        // slowing the start), there is no image yet, only an empty file.
        let made = std::fs::metadata(d.join("k.vmdk")).is_ok_and(|m| m.len() > 0);
        if made {
            // What was written reads back; the rest is unallocated.
            let o = tool_in(d, "qemu-img", &["check", "k.vmdk"]);
            assert_eq!(code(&o), 0, "{sub}: {}{}", stdout(&o), stderr(&o));
            good_in(d, "diskit", &["check", "k.vmdk"]);
            good_in(d, "diskit", &["convert", "-O", "raw", "k.vmdk", "k.raw"]);
        }
        for f in std::fs::read_dir(d).unwrap() {
            let p = f.unwrap().path();
            if p.file_name().unwrap() != "src.raw" {
                std::fs::remove_file(p).unwrap();
            }
        }
    }
}
