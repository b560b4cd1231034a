//! Dirty bitmaps an export serves as `qemu:dirty-bitmap:NAME` metadata
//! contexts, as qemu-nbd serves the bitmaps `-B` names: a block status
//! reply says which ranges are dirty (flag 1) and which are clean (0), at
//! the bitmap's granularity, clipped to the range asked. An enabled
//! bitmap of a writable export takes the export's writes, as QEMU's
//! bitmaps take the writes of their node.

use diskit_core::bits::Bits;
use diskit_core::sync;
use std::sync::RwLock;

/// The namespace and prefix of a dirty bitmap's context name.
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// The state flag of a dirty range (NBD_STATE_DIRTY).
pub const STATE_DIRTY: u32 = 1;

/// A dirty bitmap served by an export.
#[derive(Debug)]
pub struct ExportBitmap {
    name: String,
    enabled: bool,
    bits: RwLock<Bits>,
}

impl ExportBitmap {
    /// Serves `bits` as bitmap `name`; an `enabled` one marks the export's
    /// writes, zeroes and trims dirty.
    pub fn new(name: impl Into<String>, bits: Bits, enabled: bool) -> ExportBitmap {
        ExportBitmap {
            name: name.into(),
            enabled,
            bits: RwLock::new(bits),
        }
    }

    /// The bitmap's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its context's name: `qemu:dirty-bitmap:NAME`.
    pub fn context_name(&self) -> String {
        format!("{DIRTY_BITMAP_PREFIX}{}", self.name)
    }

    /// Whether it tracks writes.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Marks guest bytes `[offset, offset + len)` dirty, if the bitmap is
    /// enabled (QEMU marks a write's range whether or not it succeeded).
    pub fn note_write(&self, offset: u64, len: u64) {
        if self.enabled {
            sync::write(&self.bits).set_range(offset, offset.saturating_add(len));
        }
    }

    /// The block status descriptors `(length, flags)` of `[offset, offset
    /// + len)`, at most `max` of them, as qemu-nbd builds them: dirty and
    /// clean runs in turn, a descriptor at most as long as a reply's
    /// lengths hold (`u32::MAX` in compact replies, `i64::MAX` in
    /// extended ones), and the answer stopping, a prefix of the range,
    /// when `max` are taken. Bytes past the bitmap's end are clean.
    pub fn status(&self, offset: u64, len: u64, max: usize, extended: bool) -> Vec<(u64, u32)> {
        let bits = sync::read(&self.bits);
        let mut out = Descriptors {
            list: Vec::new(),
            max: max.max(1),
            limit: if extended {
                i64::MAX as u64
            } else {
                u64::from(u32::MAX)
            },
        };
        let end = offset.saturating_add(len);
        let mut pos = offset;
        for (run, dirty) in bits.runs(offset, end) {
            if !out.add(run, if dirty { STATE_DIRTY } else { 0 }) {
                return out.list;
            }
            pos += run;
        }
        out.add(end - pos, 0);
        out.list
    }
}

/// Descriptors being gathered for one reply (qemu's NBDExtentArray).
struct Descriptors {
    list: Vec<(u64, u32)>,
    max: usize,
    limit: u64,
}

impl Descriptors {
    /// Adds `len` bytes with `flags`, merged into the last descriptor
    /// while they agree and the sum stays within the limit; false when a
    /// new descriptor is needed and the list is full.
    fn add(&mut self, mut len: u64, flags: u32) -> bool {
        while len > 0 {
            if let Some(last) = self.list.last_mut()
                && last.1 == flags
                && last.0 < self.limit
            {
                let more = len.min(self.limit - last.0);
                last.0 += more;
                len -= more;
                continue;
            }
            if self.list.len() >= self.max {
                return false;
            }
            let first = len.min(self.limit);
            self.list.push((first, flags));
            len -= first;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bitmap(enabled: bool) -> ExportBitmap {
        // 64 KiB granularity over 1 MiB; 128 KiB..256 KiB dirty.
        let mut bits = Bits::new(1 << 20, 16);
        bits.set_range(0x2_0000, 0x4_0000);
        ExportBitmap::new("b0", bits, enabled)
    }

    #[test]
    fn status_is_clipped_to_the_range_and_capped() {
        let b = bitmap(false);
        assert_eq!(b.context_name(), "qemu:dirty-bitmap:b0");
        assert_eq!(
            b.status(0, 1 << 20, 100, false),
            vec![(0x2_0000, 0), (0x2_0000, STATE_DIRTY), (0xc_0000, 0)]
        );
        assert_eq!(
            b.status(0x3_0800, 0x1000, 100, false),
            vec![(0x1000, STATE_DIRTY)]
        );
        assert_eq!(b.status(0, 1 << 20, 1, false), vec![(0x2_0000, 0)]);
        assert_eq!(
            b.status(0x1_0000, 1 << 20, 2, true),
            vec![(0x1_0000, 0), (0x2_0000, STATE_DIRTY)]
        );
    }

    #[test]
    fn only_an_enabled_bitmap_takes_writes() {
        let off = bitmap(false);
        off.note_write(0, 1);
        assert_eq!(off.status(0, 0x1_0000, 10, false), vec![(0x1_0000, 0)]);
        let on = bitmap(true);
        on.note_write(0x8_1000, 10);
        assert_eq!(
            on.status(0x6_0000, 0x6_0000, 10, false),
            vec![(0x2_0000, 0), (0x1_0000, STATE_DIRTY), (0x3_0000, 0)]
        );
    }

    #[test]
    fn descriptors_hold_what_the_reply_s_lengths_hold() {
        // One bit covering 8 GiB.
        let mut bits = Bits::new(8 << 30, 33);
        bits.set_range(0, 1);
        let b = ExportBitmap::new("big", bits, false);
        let len = u64::from(u32::MAX);
        assert_eq!(b.status(0, len, 10, false), vec![(len, STATE_DIRTY)]);
        assert_eq!(
            b.status(0, 16 << 30, 10, true),
            vec![(8 << 30, STATE_DIRTY), (8 << 30, 0)],
            "past the bitmap: clean"
        );
        let mut d = Descriptors {
            list: Vec::new(),
            max: 3,
            limit: u64::from(u32::MAX),
        };
        assert!(d.add(u64::from(u32::MAX) + 5, 0));
        assert_eq!(d.list, vec![(u64::from(u32::MAX), 0), (5, 0)]);
        assert!(d.add(1, 1));
        assert!(!d.add(1, 0), "full");
    }
}
