//! QED against qemu-img, both ways: images qemu-img makes and qemu-io
//! writes (zero clusters and backing files included) read back byte-equal
//! with qemu-img's info, map and check; creation is qemu-img's byte for
//! byte; images diskit writes pass qemu-img check and read the same; check
//! and its repairs find what qemu-img's find.

mod common;

use std::path::Path;

use common::*;

/// QED as qemu-img sees it: every command, the format probed.
const QED: Format = Format {
    name: "qed",
    convert: &[],
    reads: READS_ALL,
    writes: &["write -z 2M 128k", "write -P 0x77 3M 4k"],
};

#[test]
fn images_qemu_img_makes_read_back_byte_equal() {
    let dir = workdir();
    let d = dir.path();
    // The backing files: raw, and the same in qcow2.
    let data = [(0, 3 << 20, 0x11), (6 << 20, 4096, 0x12)];
    sparse_file(&d.join("base.raw"), 8 << 20, &data);
    qemu_img_in(d, "convert -O qcow2 base.raw base.qcow2");
    QED.qemu_images_read_alike(
        d,
        &[
            ("plain.qed", "-o cluster_size=65536", "8M"),
            ("small.qed", "-o cluster_size=4096,table_size=2", "8M"),
            ("raw-backed.qed", "-b base.raw -F raw", "8M"),
            ("qcow2-backed.qed", "-b base.qcow2 -F qcow2", "8M"),
        ],
    );
}

#[test]
fn images_diskit_writes_pass_qemu_img_check() {
    let dir = workdir();
    let d = dir.path();
    three_run_source(d, 20 << 20, [0x21, 0x22, 0x23]);
    QED.converts_into(d, &[], "src.raw", "c.qed");
    // Odd writes over NBD through `diskit serve`, into an image with a
    // backing file (copy-on-write from it) and one without (zeros).
    sparse_file(&d.join("base.raw"), 24 << 20, &[(0, 24 << 20, 0x31)]);
    for backed in [true, false] {
        let mut create = vec!["create", "-q", "-f", "qed"];
        if backed {
            create.extend(["-b", "base.raw", "-F", "raw"]);
        }
        create.extend(["-o", "cluster_size=65536", "w.qed", "24M"]);
        good_in(d, "qemu-img", &create);
        QED.written_over_nbd(
            d,
            "w.qed",
            &[
                "write -P 0x44 7340033 1000",
                "write -P 0x45 1000 3",
                "write -P 0x46 4194303 2097154",
                "write -z 9M 1M",
                "write -z 12582913 70000",
            ],
            &[
                "read -P 0x44 7340033 1000",
                "read -P 0x46 4194303 2097154",
                "read -P 0 9M 1M",
            ],
        );
        QED.reads_like_qemu(d, "w.qed");
        std::fs::remove_file(d.join("w.qed")).unwrap();
    }
}

#[test]
fn check_and_repairs_find_what_qemu_img_finds() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f qed g.qed 8M");
    qemu_io_in(d, "qed", "g.qed", &["write -P 1 0 4k"]);
    let read_u64 = |p: &Path, at: u64| u64::from_le_bytes(read_bytes(p, at, 8).try_into().unwrap());
    let l2 = read_u64(&d.join("g.qed"), 65536);
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "leaks",
            Box::new(|p| {
                let len = std::fs::metadata(p).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(len + 2 * 65536)
                    .unwrap()
            }),
        ),
        (
            "entry past the end",
            Box::new(move |p| patch(p, l2 + 8, &(1u64 << 40).to_le_bytes())),
        ),
        (
            "duplicate",
            Box::new(move |p| {
                let e = read_u64(p, l2);
                patch(p, l2 + 16, &e.to_le_bytes())
            }),
        ),
    ];
    for (what, mutate) in cases {
        for repair in [None, Some("all"), Some("leaks")] {
            mutated(d, "g.qed", "bad.qed", &mutate);
            std::fs::copy(d.join("bad.qed"), d.join("bad2.qed")).unwrap();
            let mut ours = vec!["check"];
            let mut theirs = vec!["check"];
            if let Some(r) = repair {
                ours.extend(["-r", r]);
                theirs.extend(["-r", r]);
            }
            ours.push("bad.qed");
            theirs.push("bad2.qed");
            let o = tool_in(d, "diskit", &ours);
            let t = tool_in(d, "qemu-img", &theirs);
            assert_eq!(
                stdout(&o).replace("bad.qed", "X"),
                stdout(&t).replace("bad2.qed", "X"),
                "{what} {repair:?}"
            );
            assert_eq!(code(&o), code(&t), "{what} {repair:?}");
        }
    }
}

#[test]
fn hostile_headers_and_resize_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f qed g.qed 8M");
    let cases: Vec<Mutation> = vec![
        Box::new(move |p| patch(p, 16, &[8])),
        Box::new(move |p| patch(p, 4, &[0, 0x10, 0, 0])),
        Box::new(move |p| patch(p, 8, &[3])),
        Box::new(move |p| patch(p, 48, &[1, 2, 0, 0, 0, 0, 0, 0])),
        Box::new(move |p| patch(p, 40, &[0, 0x10, 0, 0, 0, 0, 0, 0])),
        Box::new(move |p| {
            patch(p, 16, &[1]);
            patch(p, 56, &[0xf0, 0xff, 0, 0, 0x20, 0, 0, 0])
        }),
    ];
    for mutate in cases {
        mutated(d, "g.qed", "bad.qed", &mutate);
        alike_in(d, &["info", "bad.qed"]);
    }
    std::fs::copy(d.join("g.qed"), d.join("r.qed")).unwrap();
    alike_in(d, &["resize", "-f", "qed", "r.qed", "1000"]);
    good_in(d, "diskit", &["resize", "-f", "qed", "r.qed", "64M"]);
    qemu_img_in(d, "resize -f qed g.qed 64M");
    assert!(same_bytes(&d.join("g.qed"), &d.join("r.qed")));
}

#[test]
fn create_is_qemu_img_byte_for_byte() {
    let dir = workdir();
    let d = dir.path();
    // Each tool's directory holds the same backing file.
    for dir in [d.join("q"), d.join("k")] {
        std::fs::create_dir_all(&dir).unwrap();
        sparse_file(&dir.join("base.raw"), 1 << 20, &[]);
    }
    for line in [
        "create -f qed x.qed 16M",
        "create -f qed -o cluster_size=4096,table_size=2 x.qed 16M",
        "create -f qed -o cluster_size=1M,table_size=16 x.qed 1G",
        "create -f qed -b base.raw -F raw x.qed 16M",
        "create -f qed -b base.raw -F raw x.qed",
        "create -f qed x.qed 1000",
        "create -f qed x.qed 0",
    ] {
        let (a, b) = create_alike(d, &words(line), "x.qed");
        assert!(a == b, "{line}: other bytes");
    }
    alike_lines(
        d,
        &[
            "create -f qed -o help",
            "create -f qed -o help x.qed 1M",
            "create -f qed -o cluster_size=1000 x.qed 1M",
            "create -f qed -o table_size=3 x.qed 1M",
            "create -f qed x.qed 65T",
            "measure -O qed --size 1G",
        ],
    );
}
