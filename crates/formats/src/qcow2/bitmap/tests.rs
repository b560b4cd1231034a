use super::*;
use crate::qcow2::HeaderExtension;
use crate::qcow2::test_tools::{damaged, open, qemu_img};

#[test]
fn lists_what_qemu_img_adds() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("b.qcow2");
    let ps = p.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", ps, "100M"]);
    let (f, h) = open(&p);
    assert_eq!(read(&f, &h).unwrap(), (BitmapsState::None, vec![]));
    qemu_img(&["bitmap", "--add", ps, "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "512k", ps, "second one"]);
    qemu_img(&["bitmap", "--add", ps, "off"]);
    qemu_img(&["bitmap", "--disable", ps, "off"]);
    let (f, h) = open(&p);
    let (state, list) = read(&f, &h).unwrap();
    let BitmapsState::Present(x) = state else {
        panic!("{state:?}")
    };
    assert_eq!(x.nb_bitmaps, 3);
    let got: Vec<(String, u64, bool, bool)> = list
        .iter()
        .map(|b| (b.display_name(), b.granularity(), b.auto(), b.in_use()))
        .collect();
    assert_eq!(
        got,
        [
            ("b0".to_string(), 65536, true, false),
            ("second one".to_string(), 512 << 10, true, false),
            ("off".to_string(), 65536, false, false),
        ]
    );

    // A writer that does not know bitmaps clears autoclear bit 0: the
    // extension no longer counts.
    let mut h2 = h.clone();
    h2.autoclear_features &= !autoclear::BITMAPS;
    assert_eq!(read(&f, &h2).unwrap(), (BitmapsState::Stale, vec![]));
}

/// A header with a bitmaps extension of `nb` bitmaps, directory at `off`
/// of `size` bytes.
fn header_with(nb: u32, size: u64, off: u64) -> Header {
    let mut data = Vec::new();
    data.extend_from_slice(&nb.to_be_bytes());
    data.extend_from_slice(&0u32.to_be_bytes());
    data.extend_from_slice(&size.to_be_bytes());
    data.extend_from_slice(&off.to_be_bytes());
    let mut cluster0 = vec![0u8; 4096];
    cluster0[..4].copy_from_slice(b"QFI\xfb");
    cluster0[4..8].copy_from_slice(&3u32.to_be_bytes());
    cluster0[20..24].copy_from_slice(&16u32.to_be_bytes());
    cluster0[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
    cluster0[36..40].copy_from_slice(&2u32.to_be_bytes());
    cluster0[40..48].copy_from_slice(&0x30000u64.to_be_bytes());
    cluster0[48..56].copy_from_slice(&0x10000u64.to_be_bytes());
    cluster0[56..60].copy_from_slice(&1u32.to_be_bytes());
    cluster0[88..96].copy_from_slice(&1u64.to_be_bytes());
    cluster0[96..100].copy_from_slice(&4u32.to_be_bytes());
    cluster0[100..104].copy_from_slice(&104u32.to_be_bytes());
    let mut h = Header::parse(&cluster0).unwrap();
    h.extensions.push(HeaderExtension {
        kind: ext::BITMAPS,
        data,
    });
    h
}

fn ext_err(h: &Header, what: &str) {
    let e = BitmapsExt::of(h).unwrap_err().to_string();
    assert!(e.contains(what), "'{e}' lacks '{what}'");
}

#[test]
fn hostile_extensions_are_refused() {
    let h = header_with(1, 32, 0x40000);
    assert!(matches!(BitmapsExt::of(&h), Ok(BitmapsState::Present(_))));
    ext_err(&header_with(0, 32, 0x40000), "zero bitmaps");
    ext_err(&header_with(MAX_BITMAPS + 1, 32, 0x40000), "exceeding");
    ext_err(
        &header_with(1, 32, 0x40200),
        "invalid bitmap directory offset",
    );
    ext_err(&header_with(1, MAX_DIRECTORY_BYTES + 1, 0x40000), "exceeds");
    let mut h = header_with(1, 32, 0x40000);
    h.extensions[0].data[5] = 1;
    ext_err(&h, "Reserved field is not zero");
    h.extensions[0].data.push(0);
    ext_err(&h, "Invalid extension length");
}

/// A directory entry.
fn entry(name: &[u8], flags: u32, gran: u8, table_size: u32, extra: &[u8]) -> Vec<u8> {
    let mut e = Vec::new();
    e.extend_from_slice(&0x50000u64.to_be_bytes());
    e.extend_from_slice(&table_size.to_be_bytes());
    e.extend_from_slice(&flags.to_be_bytes());
    e.push(TYPE_DIRTY_TRACKING);
    e.push(gran);
    e.extend_from_slice(&(name.len() as u16).to_be_bytes());
    e.extend_from_slice(&(extra.len() as u32).to_be_bytes());
    e.extend_from_slice(extra);
    e.extend_from_slice(name);
    e.resize(e.len().next_multiple_of(8), 0);
    e
}

const CX: DirectoryContext = DirectoryContext {
    cluster_size: 65536,
    virtual_size: 1 << 30,
};

fn ext(nb: u32, dir: &[u8]) -> BitmapsExt {
    BitmapsExt {
        nb_bitmaps: nb,
        directory_size: dir.len() as u64,
        directory_offset: 0x40000,
    }
}

fn dir_err(dir: &[u8], nb: u32, what: &str) {
    match parse_directory(dir, &ext(nb, dir), &CX) {
        Ok(v) => panic!("accepted {v:?}, expected '{what}'"),
        Err(e) => assert!(e.to_string().contains(what), "'{e}' lacks '{what}'"),
    }
}

#[test]
fn hostile_directories_are_refused() {
    let a = entry(b"a", flags::AUTO, 16, 1, &[]);
    let b = entry(b"bee", flags::IN_USE, 9, 1, &[]);
    let both = [a.clone(), b.clone()].concat();
    let list = parse_directory(&both, &ext(2, &both), &CX).unwrap();
    assert_eq!(list.len(), 2);
    assert!(list[1].in_use() && !list[1].auto());

    dir_err(&both, 1, "More bitmaps found than specified");
    dir_err(&both, 3, "Less bitmaps found than specified");
    dir_err(&[], 1, "directory size is zero");
    dir_err(&both[..both.len() - 8], 2, "Broken bitmap directory");
    dir_err(&both[..20], 1, "Broken bitmap directory");
    dir_err(
        &[both.clone(), vec![0; 8]].concat(),
        2,
        "Broken bitmap directory",
    );
    dir_err(
        &entry(b"x", 0, 16, 1, &[1; 8]),
        1,
        "extra data is not supported",
    );
    for (bad, why) in [
        (entry(b"x", 4, 16, 1, &[]), "reserved flag"),
        (entry(b"x", 0, 8, 1, &[]), "granularity too small"),
        (entry(b"x", 0, 32, 1, &[]), "granularity too large"),
        (entry(b"x", 0, 16, 0, &[]), "empty table"),
        (entry(b"x", 0, 9, 1, &[]), "table too small for the disk"),
        (
            entry(b"x", 0, 16, MAX_TABLE_ENTRIES + 1, &[]),
            "table too large",
        ),
        (entry(&[b'n'; 1024], 0, 16, 1, &[]), "name too long"),
    ] {
        let list = parse_directory(&bad, &ext(1, &bad), &CX);
        let e = list.expect_err(why).to_string();
        assert!(
            e.ends_with("' doesn't satisfy the constraints"),
            "{why}: {e}"
        );
    }
    // An inconsistent bitmap may be too small (not saved after a resize).
    let stale = entry(b"x", flags::IN_USE, 9, 1, &[]);
    assert!(parse_directory(&stale, &ext(1, &stale), &CX).is_ok());
    let mut bad = entry(b"x", 0, 16, 1, &[]);
    bad[16] = 2;
    dir_err(&bad, 1, "doesn't satisfy the constraints");
    bad[16] = TYPE_DIRTY_TRACKING;
    bad[..8].copy_from_slice(&0x50200u64.to_be_bytes());
    dir_err(&bad, 1, "doesn't satisfy the constraints");
}

#[test]
fn garbage_never_panics() {
    let base = [
        entry(b"a", flags::AUTO, 16, 1, &[]),
        entry(b"bb", 0, 20, 1, &[]),
    ]
    .concat();
    damaged(0x9e37_79b9_7f4a_7c15, &base, 20_000, 5, |d, n| {
        let nb = (n % 4) as u32;
        if let Ok(v) = parse_directory(d, &ext(nb, d), &CX) {
            assert_eq!(v.len(), nb as usize);
            assert!(
                v.iter()
                    .all(|b| GRANULARITY_BITS.contains(&b.granularity_bits))
            );
        }
    });
}
