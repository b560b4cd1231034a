//! The bits of a dirty bitmap in memory, whatever keeps it (a qcow2
//! image's persistent bitmaps today): bit `i` covers guest bytes
//! `[i << g, (i + 1) << g)` for granularity `2^g`, packed least
//! significant first within each byte, as QEMU serialises them.

/// The in-memory bits of one bitmap covering a disk of `size` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bits {
    granularity_bits: u8,
    size: u64,
    pub(crate) bytes: Vec<u8>,
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

    pub(crate) fn clear_from(&mut self, nbits: u64) {
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
        let g = 1u64 << self.granularity_bits;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (byte_index, &b) in self.bytes.iter().enumerate() {
            if b == 0 {
                continue;
            }
            for bit in 0..8 {
                if b & (1 << bit) == 0 {
                    continue;
                }
                let start = (byte_index as u64 * 8 + bit) * g;
                let end = (start + g).min(self.size);
                match out.last_mut() {
                    Some(last) if last.1 == start => last.1 = end,
                    _ => out.push((start, end)),
                }
            }
        }
        out
    }
}
