//! The qcow2 snapshot table and bitmap directory parsers: any bytes give
//! entries or an error, never a panic; accepted entries satisfy the limits
//! promised, and a snapshot table written back parses to the same entries
//! with the same bytes.
#![no_main]

use diskit_formats::qcow2::bitmap::{self, BitmapsExt, DirectoryContext};
use diskit_formats::qcow2::snapshot::{self, TableContext};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    // Byte 0 picks the parser, bytes 1..3 a count and the cluster size.
    let count = u32::from(data[1]) % 16;
    let cluster_size = 512u64 << (data[2] % 13);
    let bytes = &data[4..];
    if data[0] & 1 == 0 {
        let cx = TableContext {
            cluster_size,
            file_len: 1 << 40,
        };
        let Ok(snaps) = snapshot::parse(bytes, count, &cx) else {
            return;
        };
        assert_eq!(snaps.len(), count as usize);
        for s in &snaps {
            assert!(s.extra.len() <= snapshot::MAX_EXTRA_DATA as usize);
            assert_eq!(s.l1_table_offset % cluster_size, 0);
            assert!(u64::from(s.l1_size) * 8 <= snapshot::MAX_L1_BYTES);
        }
        let again = snapshot::serialize(&snaps).expect("parsed tables can be written");
        assert_eq!(snapshot::table_len(&snaps), again.len() as u64);
        // Padding in the input may be anything; the entries are the same.
        assert_eq!(snapshot::parse(&again, count, &cx).unwrap(), snaps);
    } else {
        let ext = BitmapsExt {
            nb_bitmaps: count,
            directory_size: bytes.len() as u64,
            directory_offset: cluster_size,
        };
        let cx = DirectoryContext {
            cluster_size,
            virtual_size: u64::from(data[3]) << 20,
        };
        if let Ok(list) = bitmap::parse_directory(bytes, &ext, &cx) {
            assert_eq!(list.len(), count as usize);
            for b in &list {
                assert!(bitmap::GRANULARITY_BITS.contains(&b.granularity_bits));
                assert!(b.name.len() <= bitmap::MAX_NAME_BYTES);
                assert_eq!(b.table_offset % cluster_size, 0);
                assert_eq!(b.flags & !bitmap::flags::KNOWN, 0);
            }
        }
    }
});
