//! VHD (vpc) against qemu-img, both ways: dynamic and fixed images
//! qemu-img makes and qemu-io writes read back byte-equal (info and map as
//! qemu-img's, the virtual size read by QEMU 10's rule for each creator),
//! images diskit makes are qemu-img's byte for byte but for the timestamp,
//! UUID and checksum (the Azure case included: fixed, force_size, whole
//! MiB), and images diskit writes read the same in qemu-img.

mod common;

use std::path::Path;

use common::*;

/// VHD as qemu-img sees it: no `check`, and a `map` only as JSON.
const VPC: Format = Format {
    name: "vpc",
    convert: &["-f", "vpc"],
    reads: &[
        "info -f vpc",
        "info -f vpc --output=json",
        "map -f vpc --output=json",
        "info",
    ],
    writes: &["write -P 0x77 3M 4k"],
};

#[test]
fn images_qemu_img_makes_read_back_byte_equal() {
    let dir = workdir();
    VPC.qemu_images_read_alike(
        dir.path(),
        &[
            ("dyn.vhd", "-o subformat=dynamic", "16M"),
            ("odd.vhd", "-o subformat=dynamic", "7000000"),
            ("fix.vhd", "-o subformat=fixed", "8M"),
            ("azure.vhd", "-o subformat=fixed,force_size=on", "10M"),
            ("forced.vhd", "-o subformat=dynamic,force_size=on", "9M"),
        ],
    );
}

/// Sets a footer's creator application and its checksum again.
fn set_creator(path: &Path, footer_at: u64, app: &[u8; 4]) {
    let mut b = read_bytes(path, footer_at, 512);
    b[28..32].copy_from_slice(app);
    b[64..68].fill(0);
    let sum = !b.iter().fold(0u32, |s, &x| s.wrapping_add(x as u32));
    b[64..68].copy_from_slice(&sum.to_be_bytes());
    patch(path, footer_at, &b);
}

#[test]
fn the_virtual_size_follows_the_creator_as_in_qemu_10() {
    let dir = workdir();
    let d = dir.path();
    for app in [b"vpc ", b"win ", b"d2v ", b"xyz "] {
        qemu_img_in(d, "create -q -f vpc c.vhd 16M");
        // qemu-img made it with the geometry's size; a current size other
        // than that shows which one each tool reads.
        patch(&d.join("c.vhd"), 48, &(16u64 << 20).to_be_bytes());
        set_creator(&d.join("c.vhd"), 0, app);
        alike_in(d, &["info", "--output=json", "c.vhd"]);
        // QEMU's force_size_calc open option overrides the rule.
        // (The image's name in `info` differs for descriptions with
        // options: compare the size, and the refusal of a bad mode.)
        for calc in ["chs", "current_size", "bogus"] {
            let desc = format!("driver=vpc,force_size_calc={calc},file.filename=c.vhd");
            let args = ["info", "--image-opts", &desc];
            let (ours, theirs) = (tool_in(d, "diskit", &args), tool_in(d, "qemu-img", &args));
            assert_eq!(code(&ours), code(&theirs), "{calc}");
            let size = |o: &std::process::Output| {
                stdout(o)
                    .lines()
                    .find(|l| l.starts_with("virtual size"))
                    .map(str::to_string)
            };
            assert_eq!(size(&ours), size(&theirs), "{calc}");
            if calc == "bogus" {
                assert_stderr_has(&ours, "Invalid size calculation mode: 'bogus'");
            }
        }
    }
}

/// Masks what differs between two creations: the timestamp, checksum and
/// UUID of each footer copy.
fn masked(v: &[u8], dynamic: bool) -> Vec<u8> {
    let mut v = v.to_vec();
    let n = v.len();
    let mut copies = vec![n - 512];
    if dynamic {
        copies.push(0);
    }
    for at in copies {
        v[at + 24..at + 28].fill(0);
        v[at + 64..at + 84].fill(0);
    }
    v
}

#[test]
fn create_is_qemu_img_but_for_time_and_uuid() {
    let dir = workdir();
    let d = dir.path();
    for (opts, size) in [
        ("subformat=dynamic", "16M"),
        ("subformat=dynamic", "1000"),
        ("subformat=dynamic", "1G"),
        ("subformat=dynamic", "0"),
        ("subformat=fixed", "16M"),
        ("subformat=fixed,force_size=on", "100M"),
        ("subformat=dynamic,force_size=on", "5M"),
    ] {
        let args = ["create", "-f", "vpc", "-o", opts, "x.vhd", size];
        let (a, b) = create_alike(d, &args, "x.vhd");
        let dynamic = opts.contains("dynamic");
        assert!(
            masked(&a, dynamic) == masked(&b, dynamic),
            "{opts} {size}: other bytes"
        );
        VPC.reads_like_qemu(&d.join("k"), "x.vhd");
    }
    alike_lines(
        d,
        &[
            "create -f vpc -o help",
            "create -f vpc -o help x.vhd 1M",
            "create -f vpc -o subformat=bogus x.vhd 1M",
            "create -f vpc x.vhd 3T",
            "measure -O vpc --size 1G",
        ],
    );
}

#[test]
fn images_diskit_writes_read_the_same_in_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    three_run_source(d, 20 << 20, [0x11, 0x22, 0x33]);
    for opts in [
        "subformat=dynamic",
        "subformat=fixed",
        "subformat=fixed,force_size=on",
    ] {
        // The geometry may round the image up: compare allows a larger
        // image whose tail reads as zeros (exit 0) and says so.
        VPC.converts_into(d, &["-o", opts], "src.raw", "c.vhd");
        VPC.scribble(d, "c.vhd");
        VPC.reads_like_qemu(d, "c.vhd");
        std::fs::remove_file(d.join("c.vhd")).unwrap();
    }
    // Odd writes over NBD through `diskit serve` into a qemu-made image.
    qemu_img_in(d, "create -q -f vpc w.vhd 24M");
    VPC.written_over_nbd(
        d,
        "w.vhd",
        &[
            "write -P 0x44 7340033 1000",
            "write -P 0x45 1000 3",
            "write -P 0x46 4194303 2097154",
        ],
        &["read -P 0x44 7340033 1000", "read -P 0x46 4194303 2097154"],
    );
    VPC.scribble(d, "w.vhd");
    VPC.reads_like_qemu(d, "w.vhd");
}

#[test]
fn hostile_images_get_clear_errors() {
    let dir = workdir();
    let d = dir.path();
    qemu_img_in(d, "create -q -f vpc g.vhd 8M");
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "Incorrect header checksum",
            Box::new(move |p| patch(p, 100, &[1])),
        ),
        (
            "Invalid header magic",
            Box::new(move |p| patch(p, 512, b"xxsparse")),
        ),
        (
            "Invalid block size",
            Box::new(move |p| patch(p, 512 + 32, &[0, 0, 3, 0])),
        ),
        (
            "Page table too small",
            Box::new(move |p| patch(p, 512 + 28, &[0, 0, 0, 1])),
        ),
        (
            "Max Table Entries too large",
            Box::new(move |p| patch(p, 512 + 28, &[0x7f, 0, 0, 0])),
        ),
    ];
    for (msg, mutate) in cases {
        mutated(d, "g.vhd", "bad.vhd", &mutate);
        info_refused(d, "bad.vhd", msg);
    }
    // A BAT entry pointing past the end of the file: refused at open.
    std::fs::copy(d.join("g.vhd"), d.join("bad.vhd")).unwrap();
    patch(&d.join("bad.vhd"), 1536, &0x0010_0000u32.to_be_bytes());
    alike_in(d, &["info", "bad.vhd"]);
    // check is not offered, as in qemu-img.
    alike_in(d, &["check", "g.vhd"]);
}
