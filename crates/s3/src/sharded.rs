//! A disk laid out over many objects, as nbdkit's S3 plugin lays it out
//! (`nbdkit S3 size=SIZE object-size=N key=KEY`): block `i` of
//! `object-size` bytes is the object `KEY/` followed by `i` in 16
//! lowercase hex digits; an object that is not there reads as zeros. A
//! write of a whole object is one PUT; a write of part of one reads the
//! object, changes it and puts it back (read-modify-write), one at a time
//! for each object; zeroing or trimming deletes the objects the range
//! covers whole (and zeroing writes zeros into the parts at its ends), so
//! a bucket written by either server is read by the other.
//!
//! Requests come from many server threads at once, and a request over
//! several objects sends its object requests in parallel.

use std::sync::Mutex;

use diskit_core::device::check_range;
use diskit_core::range_lock::RangeLock;
use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, Result, WriteFlags, ZeroFlags,
};

use crate::client::Client;
use crate::config::S3Options;
use crate::name::S3Name;
use crate::upload::MAX_PART;

/// The most object requests of one request in flight at once.
const PARALLEL: usize = 8;

/// Ranges this long or shorter are deleted object by object, without
/// listing which of their objects are there.
const DELETE_UNLISTED: u64 = 8;

/// A disk over objects `KEY/%016x` of `object_size` bytes each.
pub struct S3Sharded {
    /// The prefix `KEY`, as a client (its key is the prefix).
    prefix: Client,
    size: u64,
    object_size: u64,
    writable: bool,
    /// Blocks being changed: a change of an object holds its block
    /// exclusively, so that a read-modify-write never undoes another
    /// change of the same object.
    changing: RangeLock,
}

/// One object's share of a request: `len` bytes at `within` of block
/// `block`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    block: u64,
    within: u64,
    len: u64,
}

impl S3Sharded {
    /// The disk of `size` bytes over objects of `object_size` bytes named
    /// after `name`'s key, in `name`'s bucket; writable or not. The
    /// bucket is listed once, so that a missing bucket or wrong keys are
    /// an error now, not at the first request.
    pub fn open(
        name: &S3Name,
        opts: &S3Options,
        size: u64,
        object_size: u64,
        writable: bool,
    ) -> Result<S3Sharded> {
        if object_size == 0 || object_size > MAX_PART {
            return Err(Error::invalid(format!(
                "`object-size` must be between 1 and {MAX_PART} (S3's largest PUT)"
            )));
        }
        if !size.is_multiple_of(object_size) {
            return Err(Error::invalid("`size` must be a multiple of `object-size`"));
        }
        let prefix = Client::new(name, opts)?;
        prefix.list_page(&format!("{}/", prefix.key), None, None, 1)?;
        Ok(S3Sharded {
            prefix,
            size,
            object_size,
            writable,
            changing: RangeLock::new(),
        })
    }

    /// The key of block `block`.
    fn key(&self, block: u64) -> String {
        key_of(&self.prefix.key, block)
    }

    /// The object of block `block`.
    fn object(&self, block: u64) -> Client {
        self.prefix.object(self.key(block))
    }

    /// The objects' shares of `len` bytes at `offset`, in order.
    fn pieces(&self, offset: u64, len: u64) -> Vec<Piece> {
        pieces(self.object_size, offset, len)
    }

    /// Whether `p` covers its object whole.
    fn whole(&self, p: &Piece) -> bool {
        p.len == self.object_size
    }

    /// Writes `data` as piece `p` of its object: a PUT when it covers
    /// the object, else a read-modify-write.
    fn write_piece(&self, p: Piece, data: &[u8]) -> Result<()> {
        let _held = self.changing.lock(p.block, p.block + 1, true);
        let object = self.object(p.block);
        if self.whole(&p) {
            return object.put(data);
        }
        let mut all = vec![0u8; self.object_size as usize];
        object.read_or_zeros(&mut all, 0, self.object_size)?;
        let at = p.within as usize;
        all[at..at + data.len()].copy_from_slice(data);
        object.put(&all)
    }

    /// Deletes the objects of blocks `first..end` that are there.
    fn delete_blocks(&self, first: u64, end: u64) -> Result<()> {
        let blocks: Vec<u64> = if end - first <= DELETE_UNLISTED {
            (first..end).collect()
        } else {
            self.blocks_there(first, end)?
        };
        in_parallel(blocks, |block| {
            let _held = self.changing.lock(block, block + 1, true);
            self.object(block).delete()
        })
    }

    /// The blocks in `first..end` whose objects are there, listed.
    fn blocks_there(&self, first: u64, end: u64) -> Result<Vec<u64>> {
        let prefix = format!("{}/", self.prefix.key);
        let after = first.checked_sub(1).map(|b| self.key(b));
        let mut token: Option<String> = None;
        let mut blocks = Vec::new();
        loop {
            let (keys, next) =
                self.prefix
                    .list_page(&prefix, after.as_deref(), token.as_deref(), 1000)?;
            for key in &keys {
                match key.strip_prefix(&prefix).and_then(block_of) {
                    Some(b) if b >= end => return Ok(blocks),
                    Some(b) if b >= first => blocks.push(b),
                    _ => {}
                }
            }
            match next {
                Some(t) => token = Some(t),
                None => return Ok(blocks),
            }
        }
    }
}

/// The key of block `block` under `prefix`, as nbdkit names it:
/// `PREFIX/` and the block number in 16 lowercase hex digits.
fn key_of(prefix: &str, block: u64) -> String {
    format!("{prefix}/{block:016x}")
}

/// The shares of objects of `object_size` bytes in `len` bytes at
/// `offset`, in order.
fn pieces(object_size: u64, offset: u64, len: u64) -> Vec<Piece> {
    let mut out = Vec::new();
    let (mut at, end) = (offset, offset + len);
    while at < end {
        let (block, within) = (at / object_size, at % object_size);
        let len = (object_size - within).min(end - at);
        out.push(Piece { block, within, len });
        at += len;
    }
    out
}

/// A buffer cut (by `split`) into the shares of `pieces`, in order.
fn shares<B>(pieces: Vec<Piece>, buf: B, split: impl Fn(B, usize) -> (B, B)) -> Vec<(Piece, B)> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut rest = buf;
    for p in pieces {
        let (share, after) = split(rest, p.len as usize);
        out.push((p, share));
        rest = after;
    }
    out
}

/// The block a key's last part names: exactly 16 lowercase hex digits.
fn block_of(tail: &str) -> Option<u64> {
    let hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
    (tail.len() == 16 && tail.bytes().all(hex))
        .then(|| u64::from_str_radix(tail, 16).ok())
        .flatten()
}

/// Runs `f` on every item, up to [`PARALLEL`] at once; the first error.
fn in_parallel<T: Send>(items: Vec<T>, f: impl Fn(T) -> Result<()> + Sync) -> Result<()> {
    if items.len() <= 1 {
        return items.into_iter().try_for_each(f);
    }
    let threads = items.len().min(PARALLEL);
    let work = Mutex::new(items.into_iter());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while lock(&failed).is_none() {
                    let Some(item) = lock(&work).next() else {
                        return;
                    };
                    if let Err(e) = f(item) {
                        lock(&failed).get_or_insert(e);
                    }
                }
            });
        }
    });
    failed.into_inner().map_or(Ok(()), |e| match e {
        Some(e) => Err(e),
        None => Ok(()),
    })
}

impl std::fmt::Debug for S3Sharded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Sharded")
            .field("prefix", &self.prefix.what)
            .field("size", &self.size)
            .field("object_size", &self.object_size)
            .finish_non_exhaustive()
    }
}

impl BlockDevice for S3Sharded {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        // As a device in memory: every write is on the store when it
        // returns (nothing to flush, FUA native), zeroes delete; but no
        // extents (as nbdkit's plugin) and no cache.
        let caps = Capabilities {
            can_extents: false,
            can_cache: false,
            ..Capabilities::IN_MEMORY
        };
        if self.writable {
            caps
        } else {
            caps.read_only()
        }
    }

    /// nbdkit's plugin asks for whole objects (its minimum, preferred and
    /// maximum are the object size, which limits it to objects of 64 KiB
    /// at most); here the object size is preferred, and any request is
    /// taken, split over objects (and read-modify-written at its ends).
    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            preferred: self.object_size.min(32 << 20) as u32,
            ..BlockSizeLimits::default()
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        let pieces = self.pieces(offset, buf.len() as u64);
        let jobs = shares(pieces, buf, |b, n| b.split_at_mut(n));
        in_parallel(jobs, |(p, piece)| {
            self.object(p.block)
                .read_or_zeros(piece, p.within, self.object_size)
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        let pieces = self.pieces(offset, buf.len() as u64);
        let jobs = shares(pieces, buf, |b, n| b.split_at(n));
        in_parallel(jobs, |(p, piece)| self.write_piece(p, piece))
    }

    /// The objects the range covers whole are deleted (they read as
    /// zeros); the parts of objects at its ends are written with zeros.
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size, offset, len)?;
        let pieces = self.pieces(offset, len);
        let (whole, parts): (Vec<Piece>, Vec<Piece>) =
            pieces.into_iter().partition(|p| self.whole(p));
        in_parallel(parts, |p| self.write_piece(p, &vec![0; p.len as usize]))?;
        match (whole.first(), whole.last()) {
            (Some(a), Some(b)) => self.delete_blocks(a.block, b.block + 1),
            _ => Ok(()),
        }
    }

    /// The objects the range covers whole are deleted; the parts of
    /// objects at its ends are left as they are.
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, len)?;
        let whole: Vec<Piece> = self
            .pieces(offset, len)
            .into_iter()
            .filter(|p| self.whole(p))
            .collect();
        match (whole.first(), whole.last()) {
            (Some(a), Some(b)) => self.delete_blocks(a.block, b.block + 1),
            _ => Ok(()),
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} (objects of {} bytes)",
            self.prefix.what, self.object_size
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_named_as_nbdkit_names_them() {
        assert_eq!(block_of("00000000000000ff"), Some(255));
        assert_eq!(block_of("00000000000000FF"), None);
        assert_eq!(block_of("0000000000000001x"), None);
        assert_eq!(block_of("ff"), None);
        assert_eq!(key_of("vm/disk", 255), "vm/disk/00000000000000ff");
        assert_eq!(key_of("d", 1 << 40), "d/0000010000000000");
    }

    #[test]
    fn requests_are_split_at_object_boundaries() {
        let p = |block, within, len| Piece { block, within, len };
        assert_eq!(pieces(16, 0, 16), [p(0, 0, 16)]);
        assert_eq!(
            pieces(16, 10, 40),
            [p(0, 10, 6), p(1, 0, 16), p(2, 0, 16), p(3, 0, 2)]
        );
        assert_eq!(pieces(16, 33, 2), [p(2, 1, 2)]);
        assert!(pieces(16, 5, 0).is_empty());
    }

    #[test]
    fn in_parallel_runs_every_item_and_gives_an_error() {
        let seen = Mutex::new(Vec::new());
        in_parallel((0..50).collect(), |i| {
            lock(&seen).push(i);
            Ok(())
        })
        .unwrap();
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
        let r = in_parallel((0..50).collect(), |i: i32| {
            if i == 7 {
                Err(Error::invalid("seven"))
            } else {
                Ok(())
            }
        });
        assert!(r.unwrap_err().to_string().contains("seven"));
    }
}
