use super::*;

fn geo(cluster_bits: u32, refcount_order: u32, extended_l2: bool) -> Geometry {
    Geometry {
        cluster_bits,
        refcount_order,
        extended_l2,
    }
}

/// A header spec of `version` naming the backing file `file` of format
/// `format`, with the defaults elsewhere.
fn backed(version: u32, file: &str, format: &str) -> HeaderSpec {
    HeaderSpec {
        version,
        compression: CompressionType::Zlib,
        lazy_refcounts: false,
        data_file: None,
        data_file_raw: false,
        backing_file: Some(file.into()),
        backing_format: Some(format.into()),
    }
}

#[test]
fn refcount_metadata_size_is_a_fixed_point() {
    // One 64 KiB refcount block covers 32768 clusters with 16-bit refcounts.
    assert_eq!(refcount_metadata_size(3, 65536, 4, false), (1, 2 * 65536));
    assert_eq!(
        refcount_metadata_size(32766, 65536, 4, false),
        (1, 2 * 65536)
    );
    assert_eq!(
        refcount_metadata_size(32767, 65536, 4, false),
        (2, 3 * 65536)
    );
    // Generous: the table gets room for half as many blocks again.
    let (blocks, _) = refcount_metadata_size(51456, 512, 4, true);
    assert_eq!(blocks, 202);
}

#[test]
fn cluster_set_merges_and_splits() {
    let mut s = ClusterSet::default();
    s.insert(0, 3).unwrap();
    s.insert(5, 7).unwrap();
    s.insert(3, 5).unwrap();
    assert_eq!(s.ranges.len(), 1);
    assert!(s.insert(6, 8).is_err());
    s.remove(2, 4).unwrap();
    assert!(s.contains(1) && !s.contains(2) && !s.contains(3) && s.contains(4));
    assert!(s.remove(2, 3).is_err());
    assert_eq!(s.first_overlap(2, 4), None);
    assert_eq!(s.first_overlap(2, 5), Some((4, 7)));
    assert_eq!(s.clipped(1, 6).collect::<Vec<_>>(), vec![(1, 2), (4, 6)]);
}

#[test]
fn default_image_layout() {
    // 1 GiB, 64 KiB clusters: header, refcount table, refcount block, L1.
    let p = Plan::create(geo(16, 4, false), 1 << 30, Prealloc::Off, false).unwrap();
    assert_eq!(p.file_len(), 3 * 65536 + 16);
    assert_eq!(p.l1(), (3 * 65536, 2));
    assert_eq!(p.reftable_offset(), 65536);
    let rb = p.refblock_bytes(0);
    assert_eq!(&rb[..10], &[0, 1, 0, 1, 0, 1, 0, 1, 0, 0]);
}

#[test]
fn outgrown_refcount_table_is_replaced() {
    // 100 GiB with 512-byte clusters: the L1 table needs 51200 clusters,
    // far more than the first refcount table can describe.
    let p = Plan::create(geo(9, 4, false), 100 << 30, Prealloc::Off, false).unwrap();
    assert_eq!(p.l1(), (3 * 512, 3_276_800));
    assert_eq!(p.reftable_offset(), 51457 * 512);
    assert_eq!(p.reftable_clusters(), 5);
    assert_eq!(p.file_len(), 26_348_544);
    assert_eq!(p.stale().len(), 1);
    let blocks: Vec<_> = p.refblocks().take(3).collect();
    assert_eq!(blocks, vec![(0, 1024), (1, 51203 * 512), (2, 51205 * 512)]);
}

#[test]
fn preallocation_layouts() {
    let g = geo(16, 4, false);
    let m = Plan::create(g, 1 << 20, Prealloc::Metadata, false).unwrap();
    assert_eq!(m.file_len(), 21 * 65536);
    assert_eq!(m.l2_tables().collect::<Vec<_>>(), vec![(0, 4 * 65536)]);
    let f = Plan::create(g, 1 << 20, Prealloc::Falloc, false).unwrap();
    assert_eq!(f.reftable_offset(), 4 * 65536);
    assert_eq!(f.reserved(), Some((5 * 65536, 21 * 65536)));
    assert_eq!(f.l2_tables().collect::<Vec<_>>(), vec![(0, 65536)]);
    let l2 = f.l2_bytes(0);
    assert_eq!(&l2[..8], &(0x8000_0000_0005_0000u64).to_be_bytes());
}

#[test]
fn too_big_is_reported() {
    assert_eq!(
        Plan::create(geo(9, 4, false), 200 << 30, Prealloc::Off, false).unwrap_err(),
        PlanError::TooBig
    );
}

#[test]
fn headers_round_trip_through_the_parser() {
    use crate::qcow2::header::Header;
    for (geo, size, spec) in [
        (
            geo(16, 4, false),
            1 << 30,
            HeaderSpec {
                version: 3,
                compression: CompressionType::Zstd,
                lazy_refcounts: true,
                data_file: Some("data.raw".into()),
                data_file_raw: true,
                backing_file: None,
                backing_format: None,
            },
        ),
        (geo(9, 0, false), 1 << 20, backed(3, "base.qcow2", "qcow2")),
        (geo(21, 6, true), 5 << 30, backed(3, "b", "raw")),
        (geo(16, 4, false), 12345 * 512, backed(2, "base.raw", "raw")),
    ] {
        let plan = Plan::create(geo, size, Prealloc::Off, spec.data_file.is_some()).unwrap();
        let header = plan.header(&spec);
        let bytes = header.to_bytes().unwrap();
        assert_eq!(bytes.len() as u64, geo.cluster_size());
        let parsed = Header::parse(&bytes).unwrap();
        assert_eq!(parsed.size, size);
        assert_eq!(parsed.l1_table_offset, plan.l1().0);
        assert_eq!(parsed.refcount_table_offset, plan.reftable_offset());
        assert_eq!(parsed.backing_file, spec.backing_file);
        assert_eq!(parsed.backing_format(), spec.backing_format);
        assert_eq!(parsed.extensions, header.extensions);
        assert_eq!(
            parsed.to_bytes().unwrap(),
            bytes,
            "serialise(parse(x)) == x"
        );
    }
}

#[test]
fn a_header_that_does_not_fit_is_refused() {
    let plan = Plan::create(geo(9, 4, false), 1 << 20, Prealloc::Off, false).unwrap();
    let spec = backed(3, &"x".repeat(400), "raw");
    let err = plan.header(&spec).to_bytes().unwrap_err();
    assert_eq!(err.kind(), diskit_core::ErrorKind::NoSpace);
}
