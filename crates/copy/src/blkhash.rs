//! The blkhash construction (github.com/nirs/blkhash, `blksum`, nbdcopy's
//! `--blkhash`): a checksum of a disk image's guest data that can be
//! computed in parallel and that skips holes.
//!
//! The data is cut into blocks of `block_size` bytes (the last one may be
//! shorter); the digest is
//!
//! ```text
//! H( H(block 0) || H(block 1) || ... || H(block N-1) || le64(length) )
//! ```
//!
//! A whole block of zeros hashes to `H(zeros(block_size))`, computed once:
//! ranges known to read as zeros (holes, zero extents) and zero blocks
//! found in data cost no hashing (blkhash's zero shortcut). A short last
//! block is always hashed as it is.
//!
//! [`BlockHash`] takes the data in any order, from any number of threads,
//! each byte once: blocks are hashed where the data arrives, and their
//! digests go into the outer hash in block order as soon as the blocks
//! before them are in. The result does not depend on the order or on the
//! number of threads.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use digest::{Digest, ExtendableOutput, Update, XofReader};
use diskit_core::zero::is_zero;
use diskit_core::{Error, Result, sync};

/// The largest digest of the algorithms here (sha512, blake2b512, sha3-512).
const MAX_MD: usize = 64;

/// The default block size of blksum and nbdcopy.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 << 10;

/// The largest block size taken.
pub const MAX_BLOCK_SIZE: u64 = 256 << 20;

/// One message digest.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Md {
    bytes: [u8; MAX_MD],
    len: u8,
}

impl Md {
    fn new(bytes: &[u8]) -> Md {
        let mut md = Md {
            bytes: [0; MAX_MD],
            len: bytes.len() as u8,
        };
        md.bytes[..bytes.len()].copy_from_slice(bytes);
        md
    }

    /// The digest's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The digest in lower-case hex, as blksum and nbdcopy print it.
    pub fn hex(&self) -> String {
        self.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Debug for Md {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// A digest being computed: the outer hash.
trait Outer: Send {
    fn update(&mut self, data: &[u8]);
    fn finish(self: Box<Self>) -> Md;
}

/// A fixed-size digest (RustCrypto's `Digest`).
struct Fixed<D>(D);

impl<D: Digest + Send> Outer for Fixed<D> {
    fn update(&mut self, data: &[u8]) {
        Digest::update(&mut self.0, data);
    }
    fn finish(self: Box<Self>) -> Md {
        Md::new(&self.0.finalize())
    }
}

/// An extendable-output function read for `N` bytes, as OpenSSL's
/// shake128 (16 bytes) and shake256 (32 bytes) are by default.
struct Xof<X, const N: usize>(X);

impl<X: Update + ExtendableOutput + Send, const N: usize> Outer for Xof<X, N> {
    fn update(&mut self, data: &[u8]) {
        Update::update(&mut self.0, data);
    }
    fn finish(self: Box<Self>) -> Md {
        let mut out = [0u8; N];
        self.0.finalize_xof().read(&mut out);
        Md::new(&out)
    }
}

fn one_fixed<D: Digest>(data: &[u8]) -> Md {
    Md::new(&D::digest(data))
}

fn new_fixed<D: Digest + Send + 'static>() -> Box<dyn Outer> {
    Box::new(Fixed(D::new()))
}

fn one_xof<X: Default + Update + ExtendableOutput, const N: usize>(data: &[u8]) -> Md {
    let mut x = X::default();
    x.update(data);
    let mut out = [0u8; N];
    x.finalize_xof().read(&mut out);
    Md::new(&out)
}

fn new_xof<X: Default + Update + ExtendableOutput + Send + 'static, const N: usize>()
-> Box<dyn Outer> {
    Box::new(Xof::<X, N>(X::default()))
}

/// A digest algorithm, under OpenSSL's names (which blksum takes).
pub struct Algorithm {
    /// The name blksum lists (`blksum -l`).
    pub name: &'static str,
    /// Other names OpenSSL takes for it (compared without case).
    aliases: &'static [&'static str],
    /// The digest of one piece of data.
    one: fn(&[u8]) -> Md,
    /// A digest to feed piece by piece.
    new: fn() -> Box<dyn Outer>,
}

impl std::fmt::Debug for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

const fn fixed<D: Digest + Send + 'static>(
    name: &'static str,
    aliases: &'static [&'static str],
) -> Algorithm {
    Algorithm::with(name, aliases, one_fixed::<D>, new_fixed::<D>)
}

const fn xof<X: Default + Update + ExtendableOutput + Send + 'static, const N: usize>(
    name: &'static str,
    aliases: &'static [&'static str],
) -> Algorithm {
    Algorithm::with(name, aliases, one_xof::<X, N>, new_xof::<X, N>)
}

/// Every algorithm, in `blksum -l`'s order.
pub const ALGORITHMS: &[Algorithm] = &[
    fixed::<blake2::Blake2b512>("blake2b512", &["BLAKE2B-512"]),
    fixed::<blake2::Blake2s256>("blake2s256", &["BLAKE2S-256"]),
    fixed::<md5::Md5>("md5", &["SSL3-MD5"]),
    fixed::<ripemd::Ripemd160>("ripemd160", &["RIPEMD-160", "RIPEMD", "RMD160"]),
    fixed::<sha1::Sha1>("sha1", &["SHA-1", "SSL3-SHA1"]),
    fixed::<sha2::Sha224>("sha224", &["SHA2-224", "SHA-224"]),
    fixed::<sha2::Sha256>("sha256", &["SHA2-256", "SHA-256"]),
    fixed::<sha3::Sha3_224>("sha3-224", &[]),
    fixed::<sha3::Sha3_256>("sha3-256", &[]),
    fixed::<sha3::Sha3_384>("sha3-384", &[]),
    fixed::<sha3::Sha3_512>("sha3-512", &[]),
    fixed::<sha2::Sha384>("sha384", &["SHA2-384", "SHA-384"]),
    fixed::<sha2::Sha512>("sha512", &["SHA2-512", "SHA-512"]),
    fixed::<sha2::Sha512_224>("sha512-224", &["SHA2-512/224", "SHA-512/224"]),
    fixed::<sha2::Sha512_256>("sha512-256", &["SHA2-512/256", "SHA-512/256"]),
    xof::<sha3::Shake128, 16>("shake128", &["SHAKE-128"]),
    xof::<sha3::Shake256, 32>("shake256", &["SHAKE-256"]),
    fixed::<sm3::Sm3>("sm3", &[]),
];

impl Algorithm {
    const fn with(
        name: &'static str,
        aliases: &'static [&'static str],
        one: fn(&[u8]) -> Md,
        new: fn() -> Box<dyn Outer>,
    ) -> Algorithm {
        Algorithm {
            name,
            aliases,
            one,
            new,
        }
    }

    /// The algorithm a name stands for, as OpenSSL reads names: blksum's
    /// (`sha256`) or another of OpenSSL's (`SHA2-256`), in any case.
    pub fn find(name: &str) -> Option<&'static Algorithm> {
        ALGORITHMS.iter().find(|a| {
            a.name.eq_ignore_ascii_case(name)
                || a.aliases.iter().any(|n| n.eq_ignore_ascii_case(name))
        })
    }

    /// The default: sha256.
    pub fn default_algorithm() -> &'static Algorithm {
        Algorithm::find("sha256").expect("sha256 is in the table")
    }

    /// The digest of `data`.
    pub fn digest(&self, data: &[u8]) -> Md {
        (self.one)(data)
    }
}

/// Parses nbdcopy's `--blkhash` value, `DIGEST[/SIZE]` (SIZE a power of 2,
/// with an optional k/M/G suffix); the empty value is sha256/64k.
pub fn parse_spec(spec: &str) -> Result<(&'static Algorithm, u64)> {
    let (name, size) = match spec.split_once('/') {
        Some((n, s)) => (n, Some(s)),
        None => (spec, None),
    };
    let alg = if name.is_empty() {
        Algorithm::default_algorithm()
    } else {
        Algorithm::find(name)
            .ok_or_else(|| Error::invalid(format!("unknown digest algorithm '{name}'")))?
    };
    let block_size = match size {
        None => DEFAULT_BLOCK_SIZE,
        Some(s) => diskit_core::size::parse_size(s)
            .map_err(|_| Error::invalid(format!("could not parse block size '{s}'")))?,
    };
    check_block_size(block_size)?;
    Ok((alg, block_size))
}

/// A block size must be a power of 2 (as nbdcopy asks), at most
/// [`MAX_BLOCK_SIZE`].
pub fn check_block_size(block_size: u64) -> Result<()> {
    if !block_size.is_power_of_two() || block_size > MAX_BLOCK_SIZE {
        return Err(Error::invalid(format!(
            "block size must be a power of 2 up to {MAX_BLOCK_SIZE}, not {block_size}"
        )));
    }
    Ok(())
}

/// Blocks whose digests are known, waiting for the blocks before them.
enum Ready {
    /// Consecutive blocks, with their digests.
    Blocks(Vec<Md>),
    /// This many consecutive blocks of zeros.
    Zeros(u64),
}

/// The outer hash and the digests waiting to go into it.
struct Waiting {
    /// The next block the outer hash takes.
    next: u64,
    /// Blocks ready, by their first block number.
    ready: BTreeMap<u64, Ready>,
    /// `None` once finished.
    outer: Option<Box<dyn Outer>>,
}

/// A block seen in part so far.
struct Partial {
    buf: Vec<u8>,
    /// Bytes of it seen.
    filled: u64,
}

/// How many zero-block digests are fed to the outer hash at once.
const ZERO_BATCH: usize = 1024;

/// The blkhash of data given in pieces, in any order, from any threads.
pub struct BlockHash {
    alg: &'static Algorithm,
    block_size: u64,
    /// The digest of a whole block of zeros, [`ZERO_BATCH`] times over.
    zero_mds: Vec<u8>,
    zero_md: Md,
    state: Mutex<Waiting>,
    partial: Mutex<HashMap<u64, Partial>>,
    /// Some bytes were given twice: the digest would be wrong.
    twice: AtomicBool,
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash({}/{})", self.alg.name, self.block_size)
    }
}

impl BlockHash {
    /// A hash of `alg` over blocks of `block_size` bytes (see
    /// [`check_block_size`]).
    pub fn new(alg: &'static Algorithm, block_size: u64) -> Result<BlockHash> {
        check_block_size(block_size)?;
        let zero_md = alg.digest(&vec![0u8; block_size as usize]);
        Ok(BlockHash {
            alg,
            block_size,
            zero_mds: zero_md.as_bytes().repeat(ZERO_BATCH),
            zero_md,
            state: Mutex::new(Waiting {
                next: 0,
                ready: BTreeMap::new(),
                outer: Some((alg.new)()),
            }),
            partial: Mutex::new(HashMap::new()),
            twice: AtomicBool::new(false),
        })
    }

    /// The algorithm.
    pub fn algorithm(&self) -> &'static Algorithm {
        self.alg
    }

    /// The block size.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Takes `data`, the bytes at `offset`.
    pub fn data(&self, offset: u64, data: &[u8]) {
        self.split(
            offset,
            data.len() as u64,
            |block, at, from, len| {
                let piece = &data[from as usize..(from + len) as usize];
                self.add_partial(block, at, piece);
            },
            |first, from, count| {
                let bs = self.block_size as usize;
                let whole = &data[from as usize..from as usize + count as usize * bs];
                let mds = whole
                    .chunks_exact(bs)
                    .map(|b| {
                        if is_zero(b) {
                            self.zero_md
                        } else {
                            self.alg.digest(b)
                        }
                    })
                    .collect();
                self.add_ready(first, Ready::Blocks(mds));
            },
        );
    }

    /// Takes `len` bytes of zeros at `offset`, without hashing whole
    /// blocks of them.
    pub fn zeros(&self, offset: u64, len: u64) {
        self.split(
            offset,
            len,
            |block, at, _, len| self.add_partial_zeros(block, at, len),
            |first, _, count| self.add_ready(first, Ready::Zeros(count)),
        );
    }

    /// Cuts `offset..offset+len` into a partial head, whole blocks and a
    /// partial tail: `part(block, offset in block, offset in range, len)`
    /// and `whole(first block, offset in range, count)`.
    fn split(
        &self,
        offset: u64,
        len: u64,
        mut part: impl FnMut(u64, u64, u64, u64),
        whole: impl FnOnce(u64, u64, u64),
    ) {
        let bs = self.block_size;
        let mut at = offset;
        let end = offset + len;
        if !at.is_multiple_of(bs) && at < end {
            let n = (bs - at % bs).min(end - at);
            part(at / bs, at % bs, at - offset, n);
            at += n;
        }
        let count = (end - at) / bs;
        if count > 0 {
            whole(at / bs, at - offset, count);
            at += count * bs;
        }
        if at < end {
            part(at / bs, 0, at - offset, end - at);
        }
    }

    fn add_partial_zeros(&self, block: u64, at: u64, len: u64) {
        self.add_partial_with(block, |p| {
            p.buf[at as usize..(at + len) as usize].fill(0);
            p.filled += len;
        });
    }

    fn add_partial(&self, block: u64, at: u64, data: &[u8]) {
        self.add_partial_with(block, |p| {
            p.buf[at as usize..at as usize + data.len()].copy_from_slice(data);
            p.filled += data.len() as u64;
        });
    }

    /// Adds to a block seen in part; hashes it when it is whole.
    fn add_partial_with(&self, block: u64, fill: impl FnOnce(&mut Partial)) {
        let whole = {
            let mut partial = sync::lock(&self.partial);
            let p = partial.entry(block).or_insert_with(|| Partial {
                buf: vec![0; self.block_size as usize],
                filled: 0,
            });
            fill(p);
            if p.filled < self.block_size {
                return;
            }
            if p.filled > self.block_size {
                self.twice.store(true, Ordering::Relaxed);
            }
            partial.remove(&block).expect("just seen")
        };
        let md = if is_zero(&whole.buf) {
            self.zero_md
        } else {
            self.alg.digest(&whole.buf)
        };
        self.add_ready(block, Ready::Blocks(vec![md]));
    }

    /// Puts digests ready at `first`, and feeds the outer hash all that
    /// follows on from what it has.
    fn add_ready(&self, first: u64, ready: Ready) {
        let mut s = sync::lock(&self.state);
        if first < s.next || s.ready.insert(first, ready).is_some() {
            self.twice.store(true, Ordering::Relaxed);
        }
        self.feed(&mut s);
    }

    fn feed(&self, s: &mut Waiting) {
        while let Some(entry) = s.ready.first_entry() {
            if *entry.key() != s.next {
                break;
            }
            let ready = entry.remove();
            let outer = s.outer.as_mut().expect("not finished");
            match ready {
                Ready::Blocks(mds) => {
                    for md in &mds {
                        outer.update(md.as_bytes());
                    }
                    s.next += mds.len() as u64;
                }
                Ready::Zeros(count) => {
                    let md_len = self.zero_md.as_bytes().len();
                    let mut left = count;
                    while left > 0 {
                        let n = left.min(ZERO_BATCH as u64);
                        outer.update(&self.zero_mds[..n as usize * md_len]);
                        left -= n;
                    }
                    s.next += count;
                }
            }
        }
    }

    /// The digest, once every byte of `size` has been given exactly once.
    pub fn finish(&self, size: u64) -> Result<Md> {
        let bs = self.block_size;
        let blocks = size.div_ceil(bs);
        let tail = size % bs;
        let incomplete = || Error::io("blkhash: not every byte of the data was hashed");
        let mut partial = std::mem::take(&mut *sync::lock(&self.partial));
        if tail > 0 {
            // The short last block is hashed as it is, zeros or not.
            let p = partial.remove(&(size / bs)).ok_or_else(incomplete)?;
            if p.filled != tail {
                return Err(incomplete());
            }
            let md = self.alg.digest(&p.buf[..tail as usize]);
            self.add_ready(size / bs, Ready::Blocks(vec![md]));
        }
        if !partial.is_empty() {
            return Err(incomplete());
        }
        let mut s = sync::lock(&self.state);
        if self.twice.load(Ordering::Relaxed) {
            return Err(Error::io(
                "blkhash: some bytes of the data were hashed twice",
            ));
        }
        if s.next != blocks || !s.ready.is_empty() {
            return Err(incomplete());
        }
        let mut outer = s
            .outer
            .take()
            .ok_or_else(|| Error::invalid("blkhash: finished twice"))?;
        outer.update(&size.to_le_bytes());
        Ok(outer.finish())
    }
}

#[cfg(test)]
mod tests;
