//! The blocksize filter (nbdkit-blocksize-filter): lets clients send any
//! request to a device below that needs aligned or bounded ones.
//!
//! - `minblock=SIZE`: the alignment the device below gets (a power of two
//!   up to 64 KiB; default the device's own minimum). Reads are widened to
//!   whole blocks; the unaligned head and tail of a write or write-zeroes
//!   are done by read-modify-write of their block; the unaligned head and
//!   tail of a trim are dropped (trim is only a hint). The size is rounded
//!   down to a whole block (add the truncate filter with `round-up=` over
//!   this one to reach the last bytes).
//! - `maxdata=SIZE`: the longest read or write passed down (default 64 MiB,
//!   or `maxlen` if smaller, and never more than the device's maximum); a
//!   multiple of `minblock`.
//! - `maxlen=SIZE`: the longest write-zeroes, trim, cache or extents request
//!   passed down (default 4 GiB - `minblock`); a multiple of `minblock`.
//!
//! As nbdkit does, the filter advertises what it accepts, not what the
//! device below needs: minimum 1, preferred the largest of 4 KiB,
//! `minblock` and the device's preference, maximum 4 GiB - 1.
//!
//! Concurrency: a read-modify-write holds its block exclusively, and every
//! other write, zero or trim holds the range it changes shared, so a
//! read-modify-write never interleaves with a change to the same block
//! (which it would undo), while requests on other blocks run in parallel.
//! Reads use their own buffers and need no lock. A fast zero that is not
//! aligned or longer than `maxlen` fails at once (it would not be one
//! request below). A FUA request split into several pieces is passed down
//! without FUA and followed by one flush.

use std::ops::Range;

use diskit_core::device::split_fua;
use diskit_core::extent::{clip, push_merged};
use diskit_core::range_lock::RangeLock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Error, ErrorKind, Extent, Filter, Result, WriteFlags, ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["minblock", "maxdata", "maxlen"];

/// The largest `minblock`.
pub const MAX_MINBLOCK: u32 = 64 * 1024;

/// The default `maxdata`.
const DEFAULT_MAXDATA: u64 = 64 << 20;

/// The parameters, checked against each other but not yet against a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlocksizeConfig {
    /// `minblock=`.
    pub minblock: Option<u32>,
    /// `maxdata=`.
    pub maxdata: Option<u32>,
    /// `maxlen=`.
    pub maxlen: Option<u32>,
}

impl Configure for BlocksizeConfig {
    /// Takes `minblock=`, `maxdata=` or `maxlen=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let n = Some(params::size_u32("blocksize", key, value)?);
        match key {
            "minblock" => self.minblock = n,
            "maxdata" => self.maxdata = n,
            "maxlen" => self.maxlen = n,
            _ => return Err(unknown("blocksize", key)),
        }
        Ok(())
    }

    /// Checks `minblock` and that the other limits are multiples of it.
    fn finish(&self) -> Result<()> {
        let Some(m) = self.minblock else {
            return Ok(());
        };
        if !m.is_power_of_two() {
            return Err(Error::invalid("blocksize: minblock must be a power of 2"));
        }
        if m > MAX_MINBLOCK {
            return Err(Error::invalid(format!(
                "blocksize: minblock must not exceed {MAX_MINBLOCK}"
            )));
        }
        for (key, v) in [("maxdata", self.maxdata), ("maxlen", self.maxlen)] {
            if v.is_some_and(|v| v % m != 0) {
                return Err(Error::invalid(format!(
                    "blocksize: {key} must be a multiple of {m}"
                )));
            }
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Blocksize::new(&*next, self)?, next))
    }
}

/// The filter, with its limits resolved against the device below.
#[derive(Debug)]
pub struct Blocksize {
    minblock: u64,
    maxdata: u64,
    maxlen: u64,
    size: u64,
    locks: RangeLock,
}

fn round_down(n: u64, align: u64) -> u64 {
    n - n % align
}

fn round_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

impl Blocksize {
    /// The filter `config` describes over `next`.
    pub fn new(next: &dyn BlockDevice, config: &BlocksizeConfig) -> Result<Blocksize> {
        let below = next.block_size();
        let minblock = u64::from(config.minblock.unwrap_or(1).max(below.minimum).max(1));
        if !minblock.is_power_of_two() || minblock > u64::from(MAX_MINBLOCK) {
            return Err(Error::invalid(format!(
                "blocksize: the device's minimum block size {minblock} is not usable"
            )));
        }
        let maxdata = match (config.maxdata, config.maxlen) {
            (Some(d), _) => u64::from(d),
            (None, Some(l)) => u64::from(l).min(DEFAULT_MAXDATA),
            (None, None) => DEFAULT_MAXDATA,
        };
        let maxdata = round_down(maxdata.min(u64::from(below.maximum)), minblock).max(minblock);
        let maxlen = match config.maxlen {
            Some(l) => round_down(u64::from(l), minblock).max(minblock),
            None => (1u64 << 32) - minblock,
        };
        Ok(Blocksize {
            minblock,
            maxdata,
            maxlen,
            size: round_down(next.size(), minblock),
            locks: RangeLock::default(),
        })
    }

    /// The limits in force: (minblock, maxdata, maxlen).
    pub fn limits(&self) -> (u64, u64, u64) {
        (self.minblock, self.maxdata, self.maxlen)
    }

    /// How many requests below `offset..offset+len` takes when its aligned
    /// body goes in pieces of at most `max`.
    fn pieces(&self, offset: u64, len: u64, max: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        let mb = self.minblock;
        let end = offset + len;
        let (body_start, body_end) = (round_up(offset, mb), round_down(end, mb));
        if body_start >= body_end {
            // No whole block: one partial block, or the ends of two.
            return if round_down(offset, mb) == round_down(end - 1, mb) {
                1
            } else {
                2
            };
        }
        u64::from(!offset.is_multiple_of(mb))
            + (body_end - body_start).div_ceil(max)
            + u64::from(!end.is_multiple_of(mb))
    }

    /// Read-modify-write of the block at `block`: `edit` changes the part
    /// of it the request covers; the block is held exclusively throughout.
    fn rmw(
        &self,
        next: &dyn BlockDevice,
        block: u64,
        flags: WriteFlags,
        edit: impl FnOnce(&mut [u8]),
    ) -> Result<()> {
        let _held = self.locks.lock(block, block + self.minblock, true);
        let mut buf = vec![0u8; self.minblock as usize];
        next.read_at(&mut buf, block)?;
        edit(&mut buf);
        next.write_at(&buf, block, flags)
    }

    /// Runs a write or a zeroing of `range`. A partial block
    /// at either end goes through read-modify-write, where `edit(part, at)`
    /// changes the `part` of the block the request covers (`at`: where the
    /// part starts in the request); the aligned body goes to `body(pos, n,
    /// at, fua)` in pieces of at most `max`. FUA follows [`split_fua`].
    fn write_pieces(
        &self,
        next: &dyn BlockDevice,
        range: Range<u64>,
        max: u64,
        fua: bool,
        mut edit: impl FnMut(&mut [u8], usize),
        mut body: impl FnMut(u64, u64, usize, bool) -> Result<()>,
    ) -> Result<()> {
        let mb = self.minblock;
        let (offset, end) = (range.start, range.end);
        let (fua, flush) = split_fua(next, fua, self.pieces(offset, end - offset, max));
        let mut pos = offset;
        while pos < end {
            let at = (pos - offset) as usize;
            let drop = pos % mb;
            let n = if drop != 0 || end - pos < mb {
                let keep = (mb - drop).min(end - pos);
                let part = drop as usize..(drop + keep) as usize;
                self.rmw(next, pos - drop, WriteFlags { fua }, |b| {
                    edit(&mut b[part], at)
                })?;
                keep
            } else {
                let n = round_down(end - pos, mb).min(max);
                let _held = self.locks.lock(pos, pos + n, false);
                body(pos, n, at, fua)?;
                n
            };
            pos += n;
        }
        if flush { next.flush() } else { Ok(()) }
    }

    /// Extents of `start..end` (block aligned) with every extent made whole
    /// blocks: a block whose bytes differ is data unless all of it is a
    /// hole, and reads as zeros only if all of it does. May stop early, at
    /// a block boundary.
    fn aligned_extents(&self, next: &dyn BlockDevice, start: u64, end: u64) -> Result<Vec<Extent>> {
        let mut al = Aligner {
            block: self.minblock,
            out: Vec::new(),
            partial: None,
        };
        let mut pos = start;
        while pos < end {
            let before = pos;
            for mut e in next.extents(pos, end - pos)? {
                e.length = e.length.min(end - pos);
                pos += e.length;
                al.feed(e);
            }
            if pos == before {
                // The device below made no progress: call the rest data.
                al.feed(Extent::data(end - pos));
                pos = end;
            }
            if al.partial.is_none() && !al.out.is_empty() {
                break;
            }
        }
        Ok(al.out)
    }
}

/// Turns a run of extents into whole blocks.
struct Aligner {
    block: u64,
    out: Vec<Extent>,
    /// A block being assembled from pieces: its state so far and the bytes covered.
    partial: Option<(Extent, u64)>,
}

impl Aligner {
    fn feed(&mut self, mut e: Extent) {
        if e.length == 0 {
            return;
        }
        let mb = self.block;
        if let Some((acc, covered)) = self.partial.as_mut() {
            let take = e.length.min(mb - *covered);
            combine(acc, &e);
            *covered += take;
            e.length -= take;
            if let Some(h) = e.host_offset.as_mut() {
                *h += take;
            }
            if *covered == mb {
                acc.length = mb;
                push_merged(&mut self.out, *acc);
                self.partial = None;
            }
        }
        if e.length >= mb {
            let whole = round_down(e.length, mb);
            push_merged(&mut self.out, Extent { length: whole, ..e });
            e.length -= whole;
            if let Some(h) = e.host_offset.as_mut() {
                *h += whole;
            }
        }
        if e.length > 0 {
            self.partial = Some((e, e.length));
        }
    }
}

/// Folds `e` into `acc`, the state of a block both cover parts of.
fn combine(acc: &mut Extent, e: &Extent) {
    let f = &mut acc.flags;
    f.zero &= e.flags.zero;
    f.data |= e.flags.data;
    f.compressed &= e.flags.compressed;
    if e.flags.present {
        acc.depth = if f.present {
            acc.depth.min(e.depth)
        } else {
            e.depth
        };
        f.present = true;
    }
    acc.host_offset = None;
}

impl Filter for Blocksize {
    fn name(&self) -> &str {
        "blocksize"
    }
    fn reads_unchanged(&self) -> bool {
        // The bytes are the same; only how they may be asked for differs.
        true
    }
    fn size(&self, _next: &dyn BlockDevice) -> u64 {
        self.size
    }
    fn block_size(&self, next: &dyn BlockDevice) -> BlockSizeLimits {
        let below = next.block_size();
        BlockSizeLimits {
            minimum: 1,
            preferred: below.preferred.max(4096).max(self.minblock as u32),
            maximum: u32::MAX,
        }
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let mb = self.minblock;
        let mut pos = offset;
        let mut rest = buf;
        let mut block = Vec::new();
        while !rest.is_empty() {
            let drop = pos % mb;
            let n = if drop != 0 || (rest.len() as u64) < mb {
                // Unaligned head or tail: read the whole block, keep a part.
                block.resize(mb as usize, 0);
                next.read_at(&mut block, pos - drop)?;
                let keep = (mb - drop).min(rest.len() as u64) as usize;
                rest[..keep].copy_from_slice(&block[drop as usize..drop as usize + keep]);
                keep
            } else {
                let n = round_down(rest.len() as u64, mb).min(self.maxdata) as usize;
                next.read_at(&mut rest[..n], pos)?;
                n
            };
            pos += n as u64;
            rest = &mut rest[n..];
        }
        Ok(())
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.write_pieces(
            next,
            offset..offset + buf.len() as u64,
            self.maxdata,
            flags.fua,
            |part, at| part.copy_from_slice(&buf[at..at + part.len()]),
            |pos, n, at, fua| next.write_at(&buf[at..at + n as usize], pos, WriteFlags { fua }),
        )
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        if flags.fast && (!(offset | len).is_multiple_of(self.minblock) || len > self.maxlen) {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        self.write_pieces(
            next,
            offset..offset + len,
            self.maxlen,
            flags.fua,
            |part, _| part.fill(0),
            |pos, n, _, fua| next.write_zeroes(pos, n, ZeroFlags { fua, ..flags }),
        )
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        let mb = self.minblock;
        // Only whole blocks are trimmed: the partial head and tail are dropped.
        let mut pos = round_up(offset, mb);
        let end = round_down(offset + len, mb);
        if pos >= end {
            return Ok(());
        }
        let (fua, flush) = split_fua(next, flags.fua, (end - pos).div_ceil(self.maxlen));
        while pos < end {
            let n = (end - pos).min(self.maxlen);
            let _held = self.locks.lock(pos, pos + n, false);
            next.trim(pos, n, WriteFlags { fua })?;
            pos += n;
        }
        if flush { next.flush() } else { Ok(()) }
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        let mut pos = round_down(offset, self.minblock);
        let end = round_up(offset + len, self.minblock);
        while pos < end {
            let n = (end - pos).min(self.maxdata);
            next.cache(pos, n)?;
            pos += n;
        }
        Ok(())
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let start = round_down(offset, self.minblock);
        let end = round_up(offset + len, self.minblock).min(start + self.maxlen);
        let aligned = self.aligned_extents(next, start, end)?;
        // Drop what lies before `offset`, and cut at the end of the request.
        let mut skip = offset - start;
        let mut out = Vec::with_capacity(aligned.len());
        for mut e in aligned {
            if skip >= e.length {
                skip -= e.length;
                continue;
            }
            e.length -= skip;
            if let Some(h) = e.host_offset.as_mut() {
                *h += skip;
            }
            skip = 0;
            out.push(e);
        }
        Ok(clip(out, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FAST, Probe, kv};
    use diskit_backends::MemoryDevice;
    use diskit_core::{Capabilities, Filtered};
    use std::sync::{Arc, Mutex};

    /// A memory device that insists on `align`-aligned requests of at most
    /// `max` bytes (`max_len` for requests without data), and logs them.
    struct Strict {
        mem: MemoryDevice,
        align: u64,
        max: u64,
        max_len: u64,
        log: Mutex<Vec<(&'static str, u64, u64)>>,
    }

    impl Strict {
        fn new(size: u64, align: u64, max: u64, max_len: u64) -> Arc<Strict> {
            Arc::new(Strict {
                mem: MemoryDevice::new(size),
                align,
                max,
                max_len,
                log: Mutex::new(Vec::new()),
            })
        }
        fn check(&self, op: &'static str, offset: u64, len: u64, max: u64) -> Result<()> {
            self.log.lock().unwrap().push((op, offset, len));
            if !offset.is_multiple_of(self.align) || !len.is_multiple_of(self.align) || len > max {
                return Err(Error::invalid(format!(
                    "{op} {offset}+{len} breaks the limits"
                )));
            }
            Ok(())
        }
    }

    impl BlockDevice for Strict {
        fn size(&self) -> u64 {
            self.mem.size()
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::IN_MEMORY
        }
        fn block_size(&self) -> BlockSizeLimits {
            BlockSizeLimits {
                minimum: self.align as u32,
                preferred: 8192,
                maximum: self.max as u32,
            }
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.check("read", offset, buf.len() as u64, self.max)?;
            self.mem.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
            self.check("write", offset, buf.len() as u64, self.max)?;
            self.mem.write_at(buf, offset, flags)
        }
        fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
            self.check("zero", offset, len, self.max_len)?;
            self.mem.write_zeroes(offset, len, flags)
        }
        fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
            self.check("trim", offset, len, self.max_len)?;
            self.mem.trim(offset, len, flags)
        }
        fn cache(&self, offset: u64, len: u64) -> Result<()> {
            self.check("cache", offset, len, self.max)
        }
        fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
            self.check("extents", offset, len, self.max_len)?;
            self.mem.extents(offset, len)
        }
    }

    fn cfg(v: &[(&str, &str)]) -> Result<BlocksizeConfig> {
        BlocksizeConfig::from_params(&kv(v))
    }

    /// A 1 MiB + 100 byte strict device (512-byte blocks, 4 KiB requests)
    /// under the filter, with a mirror of what it should hold.
    fn setup(params: &[(&str, &str)]) -> (Arc<Strict>, Filtered<Blocksize>, Vec<u8>) {
        let strict = Strict::new((1 << 20) + 100, 512, 4096, 65536);
        let b = Blocksize::new(&*strict, &cfg(params).unwrap()).unwrap();
        let d = Filtered::new(b, strict.clone() as Arc<dyn BlockDevice>);
        (strict, d, vec![0u8; 1 << 20])
    }

    #[test]
    fn limits_come_from_the_parameters_and_the_device() {
        let strict = Strict::new(1 << 20, 512, 4096, 65536);
        let b = Blocksize::new(&*strict, &BlocksizeConfig::default()).unwrap();
        assert_eq!(b.limits(), (512, 4096, (1 << 32) - 512));
        let b = Blocksize::new(
            &*strict,
            &cfg(&[("minblock", "4k"), ("maxlen", "64k")]).unwrap(),
        )
        .unwrap();
        assert_eq!(b.limits(), (4096, 4096, 65536));
        let mem = MemoryDevice::new(3_000_000);
        let b = Blocksize::new(&mem, &cfg(&[("minblock", "64k")]).unwrap()).unwrap();
        assert_eq!(b.size, 2_949_120);
        let d = Filtered::new(b, Arc::new(mem));
        assert_eq!(
            d.block_size(),
            BlockSizeLimits {
                minimum: 1,
                preferred: 65536,
                maximum: u32::MAX
            }
        );
        for (bad, msg) in [
            (vec![("minblock", "3k")], "power of 2"),
            (vec![("minblock", "128k")], "must not exceed 65536"),
            (
                vec![("minblock", "4k"), ("maxdata", "6k")],
                "maxdata must be a multiple of 4096",
            ),
            (
                vec![("minblock", "4k"), ("maxlen", "5000")],
                "maxlen must be a multiple of 4096",
            ),
            (vec![("maxdata", "0")], "must be non-zero"),
            (vec![("maxlen", "8G")], "too large"),
            (vec![("maxlen", "lots")], "could not parse"),
        ] {
            let e = cfg(&bad).unwrap_err();
            assert!(e.to_string().contains(msg), "{bad:?}: {e}");
        }
    }

    #[test]
    fn unaligned_io_reaches_the_device_aligned_and_bounded() {
        let (strict, d, mut mirror) = setup(&[("maxdata", "2k")]);
        assert_eq!(d.size(), 1 << 20, "rounded down to the device's 512");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
        for &(off, len) in &[
            (1, 10),
            (700, 3000),
            (4095, 2),
            (5000, 10_000),
            (1_048_000, 576),
        ] {
            d.write_at(&data[..len], off, WriteFlags::NONE).unwrap();
            mirror[off as usize..off as usize + len].copy_from_slice(&data[..len]);
        }
        d.write_zeroes(6001, 3000, ZeroFlags::default()).unwrap();
        mirror[6001..9001].fill(0);
        let mut got = vec![0u8; 1 << 20];
        d.read_at(&mut got[..12345], 0).unwrap();
        d.read_at(&mut got[12345..], 12345).unwrap();
        assert!(got == mirror, "contents differ from what was written");
        let log = strict.log.lock().unwrap();
        assert!(log.iter().all(|&(op, off, len)| off % 512 == 0
            && len % 512 == 0
            && len
                <= if matches!(op, "read" | "write" | "cache") {
                    2048
                } else {
                    65536
                }));
        drop(log);
        // Fast zeros are refused unless one aligned request below.
        assert_eq!(
            d.write_zeroes(512, 1000, FAST).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
        d.write_zeroes(512, 1024, FAST).unwrap();
        // Trim drops partial blocks.
        strict.log.lock().unwrap().clear();
        d.trim(100, 2000, WriteFlags::NONE).unwrap();
        assert_eq!(*strict.log.lock().unwrap(), [("trim", 512, 1536)]);
        strict.log.lock().unwrap().clear();
        d.trim(100, 200, WriteFlags::NONE).unwrap();
        assert!(strict.log.lock().unwrap().is_empty());
        d.cache(100, 5000).unwrap();
        assert!(d.read_at(&mut got[..2], (1 << 20) - 1).is_err());
    }

    #[test]
    fn extents_are_whole_blocks() {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        // Memory pages are 64 KiB: data in the page at 64 KiB only.
        mem.write_at(b"x", 70_000, WriteFlags::NONE).unwrap();
        let b = Blocksize::new(&*mem, &cfg(&[("minblock", "16k")]).unwrap()).unwrap();
        let d = Filtered::new(b, mem.clone() as Arc<dyn BlockDevice>);
        let lens = |v: &[Extent]| {
            v.iter()
                .map(|e| (e.length, e.flags.data))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            lens(&d.extents(1000, 200_000).unwrap())[..2],
            [(64_536, false), (65_536, true)]
        );

        // A device whose extents change inside a block: the block is data.
        struct Fine;
        impl BlockDevice for Fine {
            fn size(&self) -> u64 {
                8192
            }
            fn capabilities(&self) -> Capabilities {
                Capabilities::READ_ONLY
            }
            fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
                buf.fill(0);
                Ok(())
            }
            fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
                // 1000-byte runs, alternating hole and data, one at a time.
                let run = 1000 - offset % 1000;
                let e = if (offset / 1000).is_multiple_of(2) {
                    Extent::hole(run)
                } else {
                    Extent::data(run)
                };
                Ok(vec![Extent {
                    length: run.min(len),
                    ..e
                }])
            }
        }
        let b = Blocksize::new(&Fine, &cfg(&[("minblock", "4k")]).unwrap()).unwrap();
        let d = Filtered::new(b, Arc::new(Fine) as Arc<dyn BlockDevice>);
        let ex = d.extents(10, 8000).unwrap();
        assert_eq!(ex.len(), 1);
        assert_eq!(
            (ex[0].length, ex[0].flags.data, ex[0].flags.zero),
            (8000, true, false)
        );
    }

    #[test]
    fn concurrent_unaligned_writes_to_one_block_lose_nothing() {
        // Reads that take a while, so that a read-modify-write left
        // unprotected would be overtaken by another one on the same block.
        let slow = Arc::new(Probe::new(1 << 16).slow_reads(std::time::Duration::from_millis(1)));
        let b = Blocksize::new(&*slow, &cfg(&[("minblock", "4k")]).unwrap()).unwrap();
        let d = Arc::new(Filtered::new(b, slow as Arc<dyn BlockDevice>));
        // Eight threads write disjoint bytes of the same four blocks, each
        // 16-byte slot once (each write a read-modify-write), while a ninth
        // rewrites block 4 whole (aligned, no read).
        let slot = |t: u64, round: u64| (round % 4) * 4096 + ((round / 4) * 8 + t) * 16 + 1;
        std::thread::scope(|s| {
            for t in 0..9u8 {
                let d = d.clone();
                s.spawn(move || {
                    for round in 0..20u64 {
                        if t == 8 {
                            d.write_at(&[0xee; 4096], 4 * 4096, WriteFlags::NONE)
                                .unwrap();
                        } else {
                            d.write_at(&[t + 1; 16], slot(u64::from(t), round), WriteFlags::NONE)
                                .unwrap();
                        }
                    }
                });
            }
        });
        let mut buf = vec![0u8; 5 * 4096];
        d.read_at(&mut buf, 0).unwrap();
        for round in 0..20 {
            for t in 0..8u64 {
                let at = slot(t, round) as usize;
                assert!(
                    buf[at..at + 16].iter().all(|&b| b == t as u8 + 1),
                    "round {round}: the write of thread {t} was lost"
                );
            }
        }
        assert!(buf[4 * 4096..].iter().all(|&b| b == 0xee));
    }
}
