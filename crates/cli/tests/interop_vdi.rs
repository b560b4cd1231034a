//! VDI against qemu-img, both ways: images qemu-img makes and qemu-io
//! writes read back byte-equal (info and map as qemu-img's), images diskit
//! makes are qemu-img's byte for byte but for their random UUIDs, images
//! diskit writes pass qemu-img check and compare, and check finds what
//! qemu-img's finds, with its messages and exit codes.

mod common;

use std::path::Path;

use common::*;

/// VDI as qemu-img sees it: every command, the format probed.
const VDI: Format = Format {
    name: "vdi",
    convert: &[],
    reads: READS_ALL,
    writes: &["write -P 0x77 1536k 4k"],
};

#[test]
fn images_qemu_img_makes_read_back_byte_equal() {
    let dir = workdir();
    let d = dir.path();
    VDI.qemu_images_read_alike(
        d,
        &[
            ("dyn.vdi", "-o static=off", "16M"),
            ("stat.vdi", "-o static=on", "8M"),
        ],
    );
    // An odd size, too small for the scribble: one write inside it.
    qemu_img_in(d, "create -q -f vdi -o static=off odd.vdi 3000000");
    VDI.reads_like_qemu(d, "odd.vdi");
    qemu_io_in(d, "vdi", "odd.vdi", &["write -P 1 2M 900000"]);
    VDI.reads_like_qemu(d, "odd.vdi");
}

#[test]
fn create_is_qemu_img_but_for_the_uuids() {
    let dir = workdir();
    let d = dir.path();
    for (opts, size) in [
        ("static=off", "16M"),
        ("static=off", "1000000"),
        ("static=off", "1G"),
        ("static=on", "16M"),
        ("static=off", "0"),
    ] {
        let args = ["create", "-f", "vdi", "-o", opts, "x.vdi", size];
        let (a, b) = create_alike(d, &args, "x.vdi");
        let mask = |v: &[u8]| {
            let mut v = v.to_vec();
            v[0x188..0x1A8].fill(0);
            v
        };
        assert!(mask(&a) == mask(&b), "{opts} {size}: other bytes");
        assert_ne!(b[0x188..0x198], [0u8; 16], "no image UUID");
    }
    alike_lines(
        d,
        &[
            "create -f vdi -o help",
            "create -f vdi -o help x.vdi 1M",
            "create -f vdi -o preallocation=metadata x.vdi 1M",
            "create -f vdi x.vdi 600T",
        ],
    );
}

#[test]
fn images_diskit_writes_pass_qemu_img_check() {
    let dir = workdir();
    let d = dir.path();
    three_run_source(d, (20 << 20) + 4096, [0x11, 0x22, 0x33]);
    // convert -O vdi, dynamic and static.
    for opts in ["static=off", "static=on"] {
        VDI.converts_into(d, &["-o", opts], "src.raw", "c.vdi");
        std::fs::remove_file(d.join("c.vdi")).unwrap();
    }
    // Into a qemu-made image: a convert, then writes at odd offsets sent
    // over NBD through `diskit serve` (allocating blocks mid-block and
    // writing into allocated ones), then qemu-io's writes on top.
    qemu_img_in(d, "create -q -f vdi w.vdi 24M");
    good_in(
        d,
        "diskit",
        &words("convert -n -f raw -O vdi src.raw w.vdi"),
    );
    VDI.written_over_nbd(
        d,
        "w.vdi",
        &[
            "write -P 0x44 7340033 1000",
            "write -P 0x45 1000 3",
            "write -P 0x46 23068671 1048577",
        ],
        &["read -P 0x44 7340033 1000", "read -P 0x46 23068671 1048577"],
    );
    VDI.scribble(d, "w.vdi");
    qemu_img_in(d, "check w.vdi");
    VDI.reads_like_qemu(d, "w.vdi");
}

#[test]
fn check_finds_what_qemu_img_finds() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vdi g.vdi 8M");
    VDI.scribble(d, "g.vdi");
    let bmap = |p: &Path, block: u64, value: u32| patch(p, 0x200 + block * 4, &value.to_le_bytes());
    let header_count = |p: &Path, value: u32| patch(p, 0x184, &value.to_le_bytes());
    let cases: Vec<(&str, Mutation)> = vec![
        ("duplicate", Box::new(move |p| bmap(p, 7, 0))),
        ("too large", Box::new(move |p| bmap(p, 6, 100))),
        ("count", Box::new(move |p| header_count(p, 9))),
    ];
    for (what, mutate) in cases {
        mutated(d, "g.vdi", "bad.vdi", &mutate);
        alike_in(d, &["check", "bad.vdi"]);
        alike_in(d, &["check", "--output=json", "bad.vdi"]);
        let o = tool_in(d, "diskit", &["check", "bad.vdi"]);
        assert_eq!(code(&o), 2, "{what}");
    }
    // Repairs are not offered, as in qemu-img.
    alike_in(d, &["check", "-r", "all", "g.vdi"]);
}

#[test]
fn hostile_images_get_clear_errors() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vdi g.vdi 8M");
    let cases: Vec<(&str, Mutation)> = vec![
        ("version", Box::new(move |p| patch(p, 0x44, &[0, 0, 2, 0]))),
        (
            "block size",
            Box::new(move |p| patch(p, 0x178, &[0, 0, 0x20, 0])),
        ),
        (
            "sector size",
            Box::new(move |p| patch(p, 0x168, &[0, 0x10, 0, 0])),
        ),
        (
            "image bitmap has room",
            Box::new(move |p| patch(p, 0x180, &[1, 0, 0, 0])),
        ),
        (
            "max supported",
            Box::new(move |p| patch(p, 0x170, &[0xff; 8])),
        ),
        ("parent UUID", Box::new(move |p| patch(p, 0x1B8, &[1]))),
        (
            "too many blocks",
            Box::new(move |p| patch(p, 0x180, &0x2000_0000u32.to_le_bytes())),
        ),
    ];
    for (msg, mutate) in cases {
        mutated(d, "g.vdi", "bad.vdi", &mutate);
        let (ours, theirs) = info_refused(d, "bad.vdi", msg);
        assert_eq!(
            stderr(&ours).replace("diskit: ", ""),
            stderr(&theirs).replace("qemu-img: ", ""),
            "{msg}"
        );
    }
    // A block map the file does not hold: refused, not read as zeros.
    std::fs::copy(d.join("g.vdi"), d.join("short.vdi")).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("short.vdi"))
        .unwrap()
        .set_len(600)
        .unwrap();
    let o = tool_in(d, "diskit", &["convert", "-O", "raw", "short.vdi", "o.raw"]);
    assert_fails_with(&o, 1, "block map");
}
