use std::process::Command;

use super::*;

/// Cluster 0 of an image made by the real qemu-img with `opts`.
fn qemu_image(opts: &str, size: &str, backing: Option<&str>) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.qcow2");
    let mut cmd = Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2"]);
    if !opts.is_empty() {
        cmd.args(["-o", opts]);
    }
    if let Some(b) = backing {
        let base = dir.path().join(b);
        assert!(
            Command::new("qemu-img")
                .args(["create", "-q", "-f", "raw"])
                .arg(&base)
                .arg(size)
                .status()
                .unwrap()
                .success()
        );
        cmd.args(["-b", b, "-F", "raw"]);
    }
    let st = cmd
        .arg(&p)
        .arg(size)
        .status()
        .expect("qemu-img is needed (scripts/test installs it)");
    assert!(st.success());
    let mut data = std::fs::read(&p).unwrap();
    data.truncate(2 << 20);
    data
}

#[test]
fn parses_what_qemu_img_writes() {
    let h = Header::parse(&qemu_image("", "1G", None)).unwrap();
    assert_eq!(
        (h.version, h.cluster_bits, h.size, h.refcount_bits()),
        (3, 16, 1 << 30, 16)
    );
    assert_eq!(
        (h.header_length, h.l1_size, h.l1_table_offset),
        (112, 2, 3 << 16)
    );
    assert_eq!(h.compression_type, CompressionType::Zlib);
    assert_eq!(h.feature_name(0, 4).as_deref(), Some("extended L2 entries"));

    let h = Header::parse(&qemu_image(
        "extended_l2=on,compression_type=zstd,cluster_size=128k",
        "1G",
        None,
    ))
    .unwrap();
    assert!(h.extended_l2());
    assert_eq!(h.l2_entries(), 8192);
    assert_eq!(h.compression_type, CompressionType::Zstd);

    let h = Header::parse(&qemu_image("compat=0.10,cluster_size=512", "100M", None)).unwrap();
    assert_eq!((h.version, h.header_length, h.cluster_size()), (2, 72, 512));

    for bits in [1, 2, 4, 8, 32, 64] {
        let h = Header::parse(&qemu_image(&format!("refcount_bits={bits}"), "1M", None)).unwrap();
        assert_eq!(h.refcount_bits(), bits);
    }

    let h = Header::parse(&qemu_image("lazy_refcounts=on", "1M", Some("base.raw"))).unwrap();
    assert_eq!(h.backing_file.as_deref(), Some("base.raw"));
    assert_eq!(h.backing_format().as_deref(), Some("raw"));
    assert_eq!(h.compatible_features, compat::LAZY_REFCOUNTS);
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn unknown_incompatible_bits_are_refused_by_name() {
    let good = qemu_image("", "1G", None);
    let mut b = good.clone();
    put64(&mut b, 72, 1 << 5);
    let e = Header::parse(&b).unwrap_err().to_string();
    assert_eq!(
        e,
        "Unsupported qcow2 feature(s): Unknown incompatible feature: 20"
    );
    // A name from the image's own feature table is used when there is one.
    let mut b = good.clone();
    put64(&mut b, 72, 1 << 7);
    let table = b[112..]
        .windows(4)
        .position(|w| w == [0x68, 0x03, 0xf8, 0x57])
        .unwrap()
        + 112;
    b[table + 8] = 0; // incompatible
    b[table + 9] = 7; // bit 7
    b[table + 10..table + 14].copy_from_slice(b"new\0");
    let e = Header::parse(&b).unwrap_err().to_string();
    assert!(e.ends_with(": new"), "{e}");
}

/// A change to an image's bytes.
type Mutation = Box<dyn Fn(&mut Vec<u8>)>;

#[test]
fn hostile_headers_get_clear_errors() {
    let good = qemu_image("", "1G", None);
    let cases: Vec<(&str, Mutation)> = vec![
        ("is not in qcow2 format", Box::new(|b| b[0] = b'X')),
        ("Unsupported qcow2 version", Box::new(|b| put32(b, 4, 4))),
        ("cluster size", Box::new(|b| put32(b, 20, 40))),
        ("cluster size", Box::new(|b| put32(b, 20, 8))),
        ("header length", Box::new(|b| put32(b, 100, 99))),
        ("exceeds cluster", Box::new(|b| put32(b, 100, 1 << 20))),
        ("refcount order", Box::new(|b| put32(b, 96, 7))),
        ("L1 table is too small", Box::new(|b| put32(b, 36, 1))),
        ("Image is too big", Box::new(|b| put64(b, 24, 1 << 62))),
        ("L1 table too large", Box::new(|b| put32(b, 36, u32::MAX))),
        ("L1 table offset", Box::new(|b| put64(b, 40, 12345))),
        ("refcount table offset", Box::new(|b| put64(b, 48, 0))),
        ("reference count table", Box::new(|b| put32(b, 56, 0))),
        (
            "Reference count table too large",
            Box::new(|b| put32(b, 56, 1 << 20)),
        ),
        ("Image size too large", Box::new(|b| put64(b, 24, u64::MAX))),
        (
            "Backing file name",
            Box::new(|b| {
                put64(b, 8, 65000);
                put32(b, 16, 1000)
            }),
        ),
        ("encryption method", Box::new(|b| put32(b, 32, 3))),
        (
            "compression type",
            Box::new(|b| put64(b, 72, incompat::COMPRESSION_TYPE)),
        ),
        ("Unknown compression type", Box::new(|b| b[104] = 9)),
        ("overflows", Box::new(|b| put32(b, 116, 0xffff_fff0))),
        ("truncated", Box::new(|b| b.truncate(80))),
        ("is not in qcow2 format", Box::new(|b| b.truncate(10))),
    ];
    for (want, mutate) in cases {
        let mut b = good.clone();
        mutate(&mut b);
        let e = Header::parse(&b).expect_err(want).to_string();
        assert!(e.contains(want), "expected '{want}', got '{e}'");
    }
}

#[test]
fn random_corruption_never_panics() {
    let good = qemu_image("", "1G", None);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..20_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut b = good[..4096].to_vec();
        for k in 0..(state % 8) {
            let at = ((state >> (8 * k)) % 512) as usize;
            b[at] = (state >> (k * 3)) as u8;
        }
        let _ = Header::parse(&b);
    }
}
