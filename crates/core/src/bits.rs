//! The bits of a dirty bitmap in memory, whatever keeps it (a qcow2
//! image's persistent bitmaps, an NBD export serving one): bit `i` covers
//! guest bytes `[i << g, (i + 1) << g)` for granularity `2^g`, packed
//! least significant first within each byte, as QEMU serialises them.

/// The in-memory bits of one bitmap covering a disk of `size` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bits {
    granularity_bits: u8,
    size: u64,
    bytes: Vec<u8>,
}

/// Bytes of bits a bitmap of granularity `2^granularity_bits` needs for
/// `size` bytes of disk.
pub fn bytes_for(size: u64, granularity_bits: u8) -> u64 {
    size.div_ceil(1 << granularity_bits).div_ceil(8)
}

impl Bits {
    /// All clear.
    pub fn new(size: u64, granularity_bits: u8) -> Bits {
        Bits {
            granularity_bits,
            size,
            bytes: vec![0; bytes_for(size, granularity_bits) as usize],
        }
    }

    /// The packed bits (the last byte's unused high bits are clear).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The packed bits, to fill in (a format reading a stored bitmap);
    /// [`clear_from`](Self::clear_from) then clears the bits past the disk.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    /// log2 of the bytes one bit covers.
    pub fn granularity_bits(&self) -> u8 {
        self.granularity_bits
    }

    /// The disk size the bits cover.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the bit for guest offset `g` is set.
    pub fn get(&self, g: u64) -> bool {
        let i = g >> self.granularity_bits;
        self.bytes
            .get((i / 8) as usize)
            .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    /// Marks guest bytes `[start, end)` dirty (clamped to the disk).
    pub fn set_range(&mut self, start: u64, end: u64) {
        let end = end.min(self.size);
        if start >= end {
            return;
        }
        let first = start >> self.granularity_bits;
        let last = (end - 1) >> self.granularity_bits;
        for i in first..=last {
            self.bytes[(i / 8) as usize] |= 1 << (i % 8);
        }
    }

    /// Changes the disk size: bits past a smaller size go, a larger size
    /// adds clear bits (as QEMU truncates its bitmaps).
    pub fn resize(&mut self, size: u64) {
        let nbits = size.div_ceil(1 << self.granularity_bits);
        self.bytes
            .resize(bytes_for(size, self.granularity_bits) as usize, 0);
        self.clear_from(nbits);
        self.size = size;
    }

    /// Clears bit `nbits` and every bit after it.
    pub fn clear_from(&mut self, nbits: u64) {
        let whole = (nbits / 8) as usize;
        if let Some(b) = self.bytes.get_mut(whole)
            && !nbits.is_multiple_of(8)
        {
            *b &= (1u8 << (nbits % 8)) - 1;
        }
        let from = whole + usize::from(!nbits.is_multiple_of(8));
        for b in self.bytes.iter_mut().skip(from) {
            *b = 0;
        }
    }

    /// Guest ranges whose bits are set, merged, in order.
    pub fn dirty_ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut pos = 0;
        for (len, dirty) in self.runs(0, self.size) {
            if dirty {
                out.push((pos, pos + len));
            }
            pos += len;
        }
        out
    }

    /// The runs of guest bytes `[start, end)` (clipped to the disk), in
    /// order: `(length, dirty)`, each run as long as its bits agree. Runs
    /// are found as they are asked for, so a caller that needs only the
    /// first few does not scan the rest.
    pub fn runs(&self, start: u64, end: u64) -> Runs<'_> {
        Runs {
            bits: self,
            pos: start,
            end: end.min(self.size),
        }
    }

    /// The first bit index in `[from, to)` whose value is not `set`, or
    /// `to`: whole bytes of `set` bits are passed over at once.
    fn first_not(&self, from: u64, to: u64, set: bool) -> u64 {
        let same = if set { 0xff } else { 0 };
        let mut i = from;
        while i < to {
            if i.is_multiple_of(8) && to - i >= 8 && self.bytes[(i / 8) as usize] == same {
                i += 8;
                continue;
            }
            let b = self.bytes[(i / 8) as usize] & (1 << (i % 8)) != 0;
            if b != set {
                return i;
            }
            i += 1;
        }
        to
    }
}

/// The runs of a range of a bitmap (see [`Bits::runs`]).
pub struct Runs<'a> {
    bits: &'a Bits,
    pos: u64,
    end: u64,
}

impl Iterator for Runs<'_> {
    type Item = (u64, bool);

    fn next(&mut self) -> Option<(u64, bool)> {
        if self.pos >= self.end {
            return None;
        }
        let g = self.bits.granularity_bits;
        let bit = self.pos >> g;
        let dirty = self.bits.get(self.pos);
        let last = (self.end - 1) >> g;
        let next = self.bits.first_not(bit + 1, last + 1, dirty);
        let run_end = (next << g).min(self.end);
        let len = run_end - self.pos;
        self.pos = run_end;
        Some((len, dirty))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_follow_the_bits_within_the_range() {
        // 64 KiB granularity, 1 MiB + 4 KiB of disk: 17 bits.
        let mut b = Bits::new((1 << 20) + 4096, 16);
        b.set_range(0x1_0000, 0x3_0000);
        b.set_range(0x10_0000, 0x10_0001);
        let all: Vec<_> = b.runs(0, b.size()).collect();
        assert_eq!(
            all,
            vec![
                (0x1_0000, false),
                (0x2_0000, true),
                (0x10_0000 - 0x3_0000, false),
                (4096, true)
            ]
        );
        // Clipped to the range asked, and to the disk.
        let part: Vec<_> = b.runs(0x1_8000, 0x2_0000).collect();
        assert_eq!(part, vec![(0x8000, true)]);
        let tail: Vec<_> = b.runs(0x2_f000, u64::MAX).collect();
        assert_eq!(
            tail,
            vec![(0x1000, true), (0x10_0000 - 0x3_0000, false), (4096, true)]
        );
        assert_eq!(
            b.dirty_ranges(),
            vec![(0x1_0000, 0x3_0000), (0x10_0000, 0x10_1000)]
        );
    }

    #[test]
    fn long_runs_pass_whole_bytes() {
        let mut b = Bits::new(64 << 20, 16);
        b.set_range(0, 40 << 20);
        let all: Vec<_> = b.runs(0, 64 << 20).collect();
        assert_eq!(all, vec![(40 << 20, true), (24 << 20, false)]);
        b.clear_from(0);
        assert_eq!(
            b.runs(0, 64 << 20).collect::<Vec<_>>(),
            vec![(64 << 20, false)]
        );
    }
}
