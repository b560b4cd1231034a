//! The bits of a persistent dirty bitmap: in memory, read from a bitmap
//! table, and the guest ranges written since an image was opened.
//!
//! Bit `i` covers guest bytes `[i << g, (i + 1) << g)` for granularity
//! `2^g`; on disk and here the bits are packed least significant first
//! within each byte (QEMU serialises its bitmaps as little-endian words).

use std::collections::BTreeMap;

use diskit_core::Result;
use diskit_core::Storage;

pub use crate::bits::{Bits, bytes_for};

use super::bitmap::Bitmap;
use super::table::{corrupt, read_u64_table};

/// Bits 9–55 of a bitmap table entry: the data cluster's offset.
pub(super) const ENTRY_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bit 0 of an entry without an offset: the cluster reads as all ones.
const ENTRY_ALL_ONES: u64 = 1;

/// Reads the bits of a consistent bitmap `bm` of an image of `size` bytes
/// with `cluster_size` clusters, validating its table as it goes.
pub fn read_bits(file: &dyn Storage, cluster_size: u64, bm: &Bitmap, size: u64) -> Result<Bits> {
    let name = bm.display_name();
    let bad = |what: &str| corrupt(format!("bitmap '{name}': {what}"));
    let mut bits = Bits::new(size, bm.granularity_bits);
    let need = bits.bytes().len() as u64;
    let clusters = need.div_ceil(cluster_size);
    if clusters > bm.table_size as u64 {
        return Err(bad("the bitmap table is too small for the disk"));
    }
    let file_len = file.file_len()?;
    let table_bytes = bm.table_size as u64 * 8;
    if bm
        .table_offset
        .checked_add(table_bytes)
        .is_none_or(|end| end > file_len)
    {
        return Err(bad("the bitmap table is past the end of the file"));
    }
    let table = read_u64_table(file, bm.table_offset, clusters)?;
    let mut cluster = vec![0u8; cluster_size as usize];
    for (i, &e) in table.iter().enumerate() {
        let off = e & ENTRY_OFFSET_MASK;
        if e & !ENTRY_OFFSET_MASK & !ENTRY_ALL_ONES != 0 || (off != 0 && e & ENTRY_ALL_ONES != 0) {
            return Err(bad("reserved bits set in a bitmap table entry"));
        }
        let at = i * cluster_size as usize;
        let dst_len = (need as usize - at).min(cluster_size as usize);
        let dst = &mut bits.bytes_mut()[at..at + dst_len];
        if off == 0 {
            dst.fill(if e & ENTRY_ALL_ONES != 0 { 0xff } else { 0 });
            continue;
        }
        if !off.is_multiple_of(cluster_size) || off + cluster_size > file_len {
            return Err(bad(
                "a bitmap data cluster is unaligned or past the end of the file",
            ));
        }
        file.read_padded(&mut cluster, off)?;
        dst.copy_from_slice(&cluster[..dst_len]);
    }
    let nbits = size.div_ceil(1 << bm.granularity_bits);
    bits.clear_from(nbits);
    Ok(bits)
}

/// Guest byte ranges written since the image was opened, merged.
#[derive(Debug, Default, Clone)]
pub struct DirtyRanges {
    /// start → end, disjoint and not touching.
    ranges: BTreeMap<u64, u64>,
}

impl DirtyRanges {
    /// Records `[start, end)`.
    pub fn add(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let (mut s, mut e) = (start, end);
        // Absorb a range that starts before and reaches `start`.
        if let Some((&ps, &pe)) = self.ranges.range(..=s).next_back()
            && pe >= s
        {
            if pe >= e {
                return;
            }
            s = ps;
        }
        // Absorb every range that starts inside [s, e].
        let inside: Vec<u64> = self.ranges.range(s..=e).map(|(&k, _)| k).collect();
        for k in inside {
            let v = self.ranges.remove(&k).expect("present");
            e = e.max(v);
        }
        self.ranges.insert(s, e);
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The ranges, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&s, &e)| (s, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_cover_granules_lsb_first() {
        let mut b = Bits::new(1 << 20, 16);
        assert_eq!(b.bytes().len(), 2);
        b.set_range(0, 1);
        b.set_range(0x2_0000, 0x3_0001);
        assert_eq!(b.bytes(), &[0b0000_1101, 0]);
        assert!(b.get(0x3_ffff) && !b.get(0x4_0000));
        assert_eq!(b.dirty_ranges(), vec![(0, 0x1_0000), (0x2_0000, 0x4_0000)]);
        b.set_range(0xf_0000, 2 << 20);
        assert_eq!(b.bytes()[1], 0x80);
    }

    #[test]
    fn resize_drops_and_adds_clear_bits() {
        let mut b = Bits::new(1 << 20, 16);
        b.set_range(0, 1 << 20);
        b.resize(5 << 16);
        assert_eq!(b.bytes(), &[0b1_1111]);
        b.resize(12 << 16);
        assert_eq!(b.bytes(), &[0b1_1111, 0]);
        assert_eq!(b.dirty_ranges(), vec![(0, 5 << 16)]);
    }

    #[test]
    fn dirty_ranges_merge() {
        let mut d = DirtyRanges::default();
        d.add(10, 20);
        d.add(30, 40);
        d.add(20, 30);
        d.add(5, 6);
        d.add(12, 15);
        d.add(100, 200);
        d.add(50, 150);
        let v: Vec<_> = d.iter().collect();
        assert_eq!(v, vec![(5, 6), (10, 40), (50, 200)]);
        d.add(0, 1000);
        assert_eq!(d.iter().collect::<Vec<_>>(), vec![(0, 1000)]);
    }
}
