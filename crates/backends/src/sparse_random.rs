//! nbdkit's sparse-random plugin: a disk shaped like a virtual machine's,
//! runs of data between long holes, for copy benchmarks. The layout is
//! nbdkit's to the block: 4 KiB blocks walked in order by a two-state
//! chain (hole and data) whose flips are drawn from nbdkit's generator
//! seeded with `seed`, with the probabilities that give `percent` data in
//! runs of `runlength` bytes on average. A data block is one byte repeated
//! (drawn from `seed` plus the block's offset, never 0) or, with
//! `random_content`, random bytes drawn the same way. Holes read as zeros
//! and are reported as holes.
//!
//! Writes are checked against what the disk holds; zeroes and trims are
//! taken where the disk is a hole (a copy back into it verifies it).
//!
//! One difference: nbdkit draws the bytes of a read's first, partial
//! block from the read's own offset, so a read not aligned to 4 KiB gets
//! other bytes there than an aligned one; here a block's bytes never
//! depend on the read, and equal nbdkit's for aligned reads.

use diskit_core::device::check_range;
use diskit_core::extent::push_merged;
use diskit_core::{BlockDevice, Capabilities, Error, Extent, Result, WriteFlags, ZeroFlags};

use crate::nbdkit_random::Xoshiro256;

/// The block size of the layout.
pub const BLOCK: u64 = 4096;

/// What a sparse-random disk is made of (nbdkit's parameters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseRandomLayout {
    /// Size in bytes.
    pub size: u64,
    /// The generator's seed.
    pub seed: u32,
    /// The share of data blocks, in percent (0 to 100).
    pub percent: f64,
    /// The mean length of a data run, in bytes (> 0).
    pub runlength: u64,
    /// Random bytes in each data block instead of one repeated byte.
    pub random_content: bool,
}

impl SparseRandomLayout {
    /// nbdkit's defaults for a disk of `size` bytes: 10% data in runs of
    /// 16 MiB, one byte repeated per block.
    pub fn new(size: u64, seed: u32) -> SparseRandomLayout {
        SparseRandomLayout {
            size,
            seed,
            percent: 10.0,
            runlength: 16 << 20,
            random_content: false,
        }
    }
}

/// A sparse-random disk: its layout and the map of data blocks.
pub struct SparseRandomDevice {
    layout: SparseRandomLayout,
    /// One bit per block, set for data.
    data: Vec<u64>,
    blocks: u64,
}

impl SparseRandomDevice {
    /// Draws the map of `layout` as nbdkit draws it.
    pub fn new(layout: SparseRandomLayout) -> SparseRandomDevice {
        let blocks = layout.size.div_ceil(BLOCK);
        let mut data = vec![0u64; blocks.div_ceil(64) as usize];
        if layout.percent >= 100.0 {
            data.fill(u64::MAX);
        } else if layout.percent > 0.0 {
            let p_dh = 1.0 / (layout.runlength as f64 / BLOCK as f64);
            let share = layout.percent / 100.0;
            let p_hd = share * p_dh / (1.0 - share);
            let mut rng = Xoshiro256::seeded(u64::from(layout.seed));
            let mut state = false;
            for i in 0..blocks {
                if state {
                    data[(i / 64) as usize] |= 1 << (i % 64);
                }
                let p = if state { p_dh } else { p_hd };
                if rng.next_u64() as f64 <= p * u64::MAX as f64 {
                    state = !state;
                }
            }
        }
        SparseRandomDevice {
            layout,
            data,
            blocks,
        }
    }

    fn is_data(&self, block: u64) -> bool {
        self.data[(block / 64) as usize] >> (block % 64) & 1 == 1
    }

    /// The first block at or after `block` (up to `end`) whose state is
    /// not `data`.
    fn run_end(&self, mut block: u64, end: u64, data: bool) -> u64 {
        let same = if data { u64::MAX } else { 0 };
        while block < end {
            if block.is_multiple_of(64) && self.data[(block / 64) as usize] == same {
                block += 64;
                continue;
            }
            if self.is_data(block) != data {
                return block;
            }
            block += 1;
        }
        end
    }

    /// The bytes of block `block` into `out` (a whole block).
    fn block_bytes(&self, block: u64, out: &mut [u8]) {
        if !self.is_data(block) {
            out.fill(0);
            return;
        }
        let seed = u64::from(self.layout.seed).wrapping_add(block * BLOCK);
        let mut rng = Xoshiro256::seeded(seed);
        if self.layout.random_content {
            for b in out.iter_mut() {
                *b = rng.next_u64() as u8;
            }
        } else {
            out.fill((rng.next_u64() as u8).max(1));
        }
    }

    /// Calls `f(block, offset in block, piece)` over the blocks of a
    /// request; the pieces tile the request.
    fn for_blocks(offset: u64, len: u64, mut f: impl FnMut(u64, usize, std::ops::Range<usize>)) {
        let mut at = 0u64;
        while at < len {
            let pos = offset + at;
            let within = (pos % BLOCK) as usize;
            let n = (BLOCK - within as u64).min(len - at);
            f(pos / BLOCK, within, at as usize..(at + n) as usize);
            at += n;
        }
    }

    fn touches_data(&self, offset: u64, len: u64) -> bool {
        if len == 0 {
            return false;
        }
        let first = offset / BLOCK;
        let last = (offset + len - 1) / BLOCK;
        self.run_end(first, last + 1, false) <= last
    }
}

impl BlockDevice for SparseRandomDevice {
    fn size(&self) -> u64 {
        self.layout.size
    }
    fn capabilities(&self) -> Capabilities {
        // nbdkit's plugin: flush (a no-op) and so FUA, zero and trim
        // (of holes), no fast zero.
        Capabilities {
            can_flush: true,
            can_fast_zero: false,
            ..Capabilities::IN_MEMORY
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.layout.size, offset, buf.len() as u64)?;
        let mut block = [0u8; BLOCK as usize];
        Self::for_blocks(offset, buf.len() as u64, |b, within, piece| {
            if piece.len() == BLOCK as usize {
                self.block_bytes(b, &mut buf[piece]);
            } else {
                self.block_bytes(b, &mut block);
                buf[piece.clone()].copy_from_slice(&block[within..within + piece.len()]);
            }
        });
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.layout.size, offset, buf.len() as u64)?;
        let mut block = [0u8; BLOCK as usize];
        let mut same = true;
        Self::for_blocks(offset, buf.len() as u64, |b, within, piece| {
            if same {
                self.block_bytes(b, &mut block);
                same = buf[piece.clone()] == block[within..within + piece.len()];
            }
        });
        if !same {
            return Err(Error::io("data written does not match expected"));
        }
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        self.trim(offset, len, WriteFlags::NONE)
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.layout.size, offset, len)?;
        if self.touches_data(offset, len) {
            return Err(Error::io("trying to trim or zero non-hole in disk"));
        }
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.layout.size, offset, len)?;
        let end = offset + len;
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let block = pos / BLOCK;
            let data = self.is_data(block);
            let run = self.run_end(block, self.blocks, data);
            let stop = (run * BLOCK).min(end);
            let n = stop - pos;
            push_merged(
                &mut out,
                if data {
                    Extent::data(n)
                } else {
                    Extent::hole(n)
                },
            );
            pos = stop;
        }
        Ok(out)
    }
    fn describe(&self) -> String {
        format!(
            "sparse-random({}, seed={})",
            self.layout.size, self.layout.seed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(percent: f64, random_content: bool) -> SparseRandomDevice {
        SparseRandomDevice::new(SparseRandomLayout {
            percent,
            runlength: 64 << 10,
            random_content,
            ..SparseRandomLayout::new(64 << 20, 1)
        })
    }

    #[test]
    fn extents_match_the_bytes_and_the_share() {
        for random_content in [false, true] {
            let d = device(30.0, random_content);
            let ext = d.extents(0, d.size()).unwrap();
            assert_eq!(ext.iter().map(|e| e.length).sum::<u64>(), d.size());
            let data: u64 = ext.iter().filter(|e| e.flags.data).map(|e| e.length).sum();
            let share = data as f64 / d.size() as f64;
            assert!((0.15..0.45).contains(&share), "{share}");
            let mut pos = 0;
            for e in &ext {
                let mut b = vec![1u8; e.length as usize];
                d.read_at(&mut b, pos).unwrap();
                assert_eq!(b.iter().all(|&x| x == 0), e.flags.zero, "at {pos}");
                pos += e.length;
            }
        }
    }

    #[test]
    fn unaligned_reads_agree_with_aligned_ones() {
        let d = device(50.0, true);
        let mut whole = vec![0u8; 1 << 20];
        d.read_at(&mut whole, 0).unwrap();
        let mut part = vec![0u8; 10_000];
        d.read_at(&mut part, 4000).unwrap();
        assert_eq!(&whole[4000..14_000], &part[..]);
        d.write_at(&part, 4000, WriteFlags::NONE).unwrap();
        part[0] ^= 0xff;
        assert!(d.write_at(&part, 4000, WriteFlags::NONE).is_err());
    }

    #[test]
    fn only_holes_take_zeroes() {
        let d = device(50.0, false);
        let ext = d.extents(0, d.size()).unwrap();
        let hole = ext.iter().position(|e| !e.flags.data).unwrap();
        let at: u64 = ext[..hole].iter().map(|e| e.length).sum();
        d.trim(at, ext[hole].length, WriteFlags::NONE).unwrap();
        assert!(d.trim(at, ext[hole].length + 1, WriteFlags::NONE).is_err());
    }

    #[test]
    fn all_or_nothing() {
        let all = device(100.0, false);
        assert!(all.extents(0, all.size()).unwrap()[0].flags.data);
        let none = device(0.0, false);
        assert_eq!(none.extents(0, none.size()).unwrap().len(), 1);
    }
}
