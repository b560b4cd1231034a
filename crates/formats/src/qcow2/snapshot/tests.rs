use super::*;
use crate::qcow2::test_tools::{damaged, open, run};

const CX: TableContext = TableContext {
    cluster_size: 65536,
    file_len: 1 << 30,
};

/// One entry as QEMU would write it.
fn entry(id: &str, name: &str) -> Snapshot {
    Snapshot {
        l1_table_offset: 0x50000,
        l1_size: 1,
        id: id.as_bytes().to_vec(),
        name: name.as_bytes().to_vec(),
        date_sec: 1_700_000_000,
        date_nsec: 5,
        vm_clock_nsec: 3_723_456_000_000,
        vm_state_size_32: 0,
        extra: known_extra(0, 1 << 20, None),
    }
}

#[test]
fn round_trips_tables_qemu_img_writes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.qcow2");
    let ps = p.to_str().unwrap();
    for opts in ["compat=1.1", "compat=0.10", "cluster_size=512"] {
        run(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "-o", opts, ps, "4M"],
        );
        run("qemu-io", &["-c", "write -P 7 0 1M", ps]);
        let names = ["first", "a name with spaces", "x", "ünïcode", "5"];
        for n in names {
            run("qemu-img", &["snapshot", "-c", n, ps]);
        }
        run("qemu-img", &["snapshot", "-d", "x", ps]);
        let (f, h) = open(&p);
        let snaps = read(&f, &h).unwrap();
        let got: Vec<(String, String)> = snaps
            .iter()
            .map(|s| (s.display_id(), s.display_name()))
            .collect();
        assert_eq!(
            got,
            [
                ("1", "first"),
                ("2", "a name with spaces"),
                ("4", "ünïcode"),
                ("5", "5")
            ]
            .map(|(a, b)| (a.to_string(), b.to_string())),
            "{opts}"
        );
        for s in &snaps {
            assert_eq!(s.extra.len(), KNOWN_EXTRA_BYTES, "{opts}");
            assert_eq!(s.vm_state_size(), 0);
            assert_eq!(s.disk_size(), Some(4 << 20));
            assert_eq!(s.icount(), Some(0));
            assert_eq!(s.l1_table_offset % h.cluster_size(), 0);
            assert_eq!(s.l1_size, h.l1_size);
        }
        let bytes = serialize(&snaps).unwrap();
        assert_eq!(bytes.len() as u64, table_len(&snaps));
        let file = std::fs::read(&p).unwrap();
        let off = h.snapshots_offset as usize;
        assert_eq!(bytes, file[off..off + bytes.len()], "{opts}");
        // And the pure parser agrees with the reader.
        let cx = TableContext {
            cluster_size: h.cluster_size(),
            file_len: file.len() as u64,
        };
        assert_eq!(parse(&file[off..], h.nb_snapshots, &cx).unwrap(), snaps);
    }
}

#[test]
fn known_extra_data_and_fallbacks() {
    let mut s = entry("1", "n");
    s.extra = known_extra(5 << 30, 7, Some(99));
    assert_eq!(
        (s.vm_state_size(), s.disk_size(), s.icount()),
        (5 << 30, Some(7), Some(99))
    );
    s.extra = known_extra(1, 2, None);
    assert_eq!(s.icount(), None);
    // Old entries: no extra data, the 32-bit size counts.
    s.extra.clear();
    s.vm_state_size_32 = 1234;
    assert_eq!(
        (s.vm_state_size(), s.disk_size(), s.icount()),
        (1234, None, None)
    );
    // Only the 64-bit size.
    s.extra = 77u64.to_be_bytes().to_vec();
    assert_eq!((s.vm_state_size(), s.disk_size()), (77, None));
}

#[test]
fn unknown_extra_data_survives() {
    let mut a = entry("1", "a");
    a.extra.extend_from_slice(b"future fields");
    let mut b = entry("2", "bb");
    b.extra = vec![1, 2, 3];
    let bytes = serialize(&[a.clone(), b.clone()]).unwrap();
    assert_eq!(parse(&bytes, 2, &CX).unwrap(), [a, b]);
}

#[test]
fn display_strings_are_c_strings() {
    let mut s = entry("1", "");
    s.name = b"abc\0def".to_vec();
    assert_eq!(s.display_name(), "abc");
    s.name = vec![b'n'; 300];
    assert_eq!(s.display_name().len(), 255);
    s.id = vec![b'9'; 200];
    assert_eq!(s.display_id().len(), 127);
}

#[test]
fn zero_snapshots_on_an_empty_image() {
    // qemu-img gives a snapshot of a 0-byte image an empty L1 at offset 0.
    let mut s = entry("1", "z");
    s.l1_table_offset = 0;
    s.l1_size = 0;
    let bytes = serialize(std::slice::from_ref(&s)).unwrap();
    assert_eq!(parse(&bytes, 1, &CX).unwrap(), [s]);
    assert_eq!(parse(&[], 0, &CX).unwrap(), []);
}

fn expect_err(bytes: &[u8], count: u32, cx: &TableContext, what: &str) {
    match parse(bytes, count, cx) {
        Ok(v) => panic!("accepted ({} entries), expected '{what}'", v.len()),
        Err(e) => assert!(e.to_string().contains(what), "'{e}' lacks '{what}'"),
    }
}

#[test]
fn hostile_tables_are_refused() {
    let good = serialize(&[entry("1", "a"), entry("2", "b")]).unwrap();
    expect_err(&good, 3, &CX, "entry 2 extends past the end of the file");
    expect_err(&good[..good.len() - 1], 2, &CX, "entry 1 extends past");
    expect_err(&good[..10], 1, &CX, "entry 0 extends past");
    expect_err(&good, MAX_SNAPSHOTS + 1, &CX, "Too many snapshots");

    let mut s = entry("1", "a");
    s.extra = vec![0; MAX_EXTRA_DATA as usize];
    assert!(parse(&serialize(std::slice::from_ref(&s)).unwrap(), 1, &CX).is_ok());
    let mut bytes = serialize(&[s]).unwrap();
    bytes[36..40].copy_from_slice(&(MAX_EXTRA_DATA + 1).to_be_bytes());
    expect_err(
        &bytes,
        1,
        &CX,
        "Too much extra metadata in snapshot table entry 0",
    );

    let mut s = entry("7", "bad l1");
    s.l1_table_offset = 0x50200;
    let bytes = serialize(&[s.clone()]).unwrap();
    expect_err(
        &bytes,
        1,
        &CX,
        "id '7', name 'bad l1'): L1 table offset 0x50200 is not cluster-aligned",
    );
    s.l1_table_offset = 0x50000;
    s.l1_size = (MAX_L1_BYTES / 8) as u32 + 1;
    expect_err(
        &serialize(&[s.clone()]).unwrap(),
        1,
        &CX,
        "L1 table is too large",
    );
    s.l1_size = 2;
    let small = TableContext {
        cluster_size: 65536,
        file_len: 0x50008,
    };
    expect_err(
        &serialize(&[s.clone()]).unwrap(),
        1,
        &small,
        "L1 table extends past the end",
    );
    s.l1_table_offset = 0;
    expect_err(
        &serialize(&[s.clone()]).unwrap(),
        1,
        &CX,
        "overlaps the header",
    );
    s.l1_table_offset = !0xffff;
    expect_err(&serialize(&[s]).unwrap(), 1, &CX, "extends past the end");
}

#[test]
fn table_size_is_limited() {
    // 514 entries with 128 KiB of id and name pass 64 MiB of entries.
    let mut s = entry("", "");
    s.id = vec![b'i'; 65535];
    s.name = vec![b'n'; 65535];
    let per = s.entry_bytes() as u64;
    let fits = (MAX_TABLE_BYTES / per) as usize;
    let many = vec![s; fits + 1];
    // serialize refuses to write it...
    assert!(serialize(&many).is_err());
    assert!(serialize(&many[..fits]).is_ok());
    // ...and parse refuses to read it, before reading the entry's body.
    let mut bytes = serialize(&many[..fits]).unwrap();
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    bytes.extend_from_slice(&serialize(&many[..1]).unwrap()[..ENTRY_HEADER_BYTES]);
    expect_err(&bytes, fits as u32 + 1, &CX, "Snapshot table is too big");
}

#[test]
fn writer_refuses_what_does_not_fit() {
    let mut s = entry("1", "a");
    s.name = vec![b'n'; 65536];
    assert!(serialize(std::slice::from_ref(&s)).is_err());
    s.name.clear();
    s.extra = vec![0; MAX_EXTRA_DATA as usize + 1];
    assert!(serialize(&[s]).is_err());
}

#[test]
fn garbage_never_panics() {
    // Every outcome is Ok or Err.
    let base = serialize(&[entry("1", "a"), entry("2", "bb"), entry("3", "")]).unwrap();
    damaged(0x1234_5678_9abc_def0, &base, 20_000, 6, |b, n| {
        let count = (n % 5) as u32;
        if let Ok(v) = parse(b, count, &CX) {
            assert_eq!(v.len(), count as usize);
            for s in &v {
                assert!(s.extra.len() <= MAX_EXTRA_DATA as usize);
                assert_eq!(s.l1_table_offset % CX.cluster_size, 0);
            }
        }
    });
}

#[test]
fn reader_refuses_tables_past_the_end_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.qcow2");
    let ps = p.to_str().unwrap();
    run("qemu-img", &["create", "-q", "-f", "qcow2", ps, "1M"]);
    run("qemu-img", &["snapshot", "-c", "one", ps]);
    let (f, mut h) = open(&p);
    assert_eq!(read(&f, &h).unwrap().len(), 1);
    h.nb_snapshots = 2;
    let e = read(&f, &h).unwrap_err().to_string();
    assert!(
        e.contains("entry 1 extends past the end of the file"),
        "{e}"
    );
    h.nb_snapshots = MAX_SNAPSHOTS + 1;
    assert!(read(&f, &h).unwrap_err().to_string().contains("Too many"));
    h.nb_snapshots = 1;
    h.snapshots_offset = f.file_len().unwrap().next_multiple_of(65536) + (1 << 40);
    let e = read(&f, &h).unwrap_err().to_string();
    assert!(
        e.contains("entry 0 extends past the end of the file"),
        "{e}"
    );
}
