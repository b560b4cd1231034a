//! Small reads that continue one another, served from whole chunks.
//!
//! A read shorter than a chunk that starts where a recent read ended
//! takes the aligned chunk (or two) it falls in with one request to the
//! source, and the reads after it that fall in the same chunk wait for
//! that request instead of sending their own; the chunk after it is
//! loaded ahead, on another thread, so that the stream finds it there.
//! For a source whose cost is per request more than per byte (an object
//! store: radosgw's range requests, an RBD image's OSD reads), a client
//! reading a stream in small requests (nbdcopy through `serve`: 256 KiB
//! each, 64 at once on each of 4 connections) is served with few big
//! ones. The chunk is the store's own unit: radosgw's 4 MiB stripe, an
//! RBD image's object.
//!
//! Any other read (the first of a stream, a random one, one of a chunk or
//! more) is sent as asked, unless the chunks it falls in are held
//! already. Memory is bounded: at most [`MEMORY`] bytes of chunks (and
//! between [`MIN_SLOTS`] and [`MAX_SLOTS`] of them) are held, the least
//! recently used one given up for a new one (its buffer kept for another
//! once no reply holds it: a fresh buffer costs as much to clear as to
//! fill); when
//! every slot is still being filled, a read is sent as asked and nothing
//! is loaded ahead. A chunk whose request fails is forgotten, and each
//! read that waited for it sends its own (with its own retries and
//! error). The source must not change while it is read (an S3 object
//! read by its entity tag, a read-only RBD image).
//!
//! [`RangeReader`] puts this in front of a [`ReadRange`] source, with the
//! threads that load chunks ahead.

use std::sync::{Arc, Condvar, Mutex, Weak};

use crate::sync::{lock, wait};
use crate::workers::Workers;
use crate::{Lent, Result};

/// The bytes of chunks held at most, when that many chunks are not fewer
/// than [`MIN_SLOTS`]: for each of several streams, the chunk it reads,
/// the one loaded ahead, and one it may come back to (16 chunks of 4 MiB).
pub const MEMORY: u64 = 64 << 20;
/// Chunks held at most, however small.
pub const MAX_SLOTS: usize = 16;
/// Chunks held at least, however large (up to [`MAX_CHUNK`]).
pub const MIN_SLOTS: usize = 4;
/// The largest chunk: a source with larger units is read as asked.
pub const MAX_CHUNK: u64 = 64 << 20;
/// Ends of recent reads remembered: a read that starts at one continues
/// a stream. Enough for several streams of many requests in flight.
const ENDS: usize = 64;
/// Threads that load chunks ahead of the streams read: as many streams
/// as nbdcopy reads at once by default.
const AHEAD_THREADS: usize = 4;

/// A source read by byte ranges, from any thread.
pub trait ReadRange: Send + Sync + 'static {
    /// Reads `buf.len()` bytes at `offset` (in range).
    fn read_range(&self, buf: &mut [u8], offset: u64) -> Result<()>;
}

/// A source's reads, either sent as asked or, made
/// [`chunked`](RangeReader::chunked), small ones that continue one another
/// served from whole chunks. Shared (`Arc`) with the threads that load
/// chunks ahead.
pub struct RangeReader<R> {
    source: R,
    chunked: Option<Chunked>,
}

/// The chunks held, and the threads that load chunks ahead (threads of
/// their own: they wait for nothing but their request).
struct Chunked {
    chunks: Chunks,
    ahead: Workers,
}

impl<R: ReadRange> RangeReader<R> {
    /// Reads of `source` sent as asked.
    pub fn direct(source: R) -> RangeReader<R> {
        RangeReader {
            source,
            chunked: None,
        }
    }

    /// Reads of `source`, of `size` bytes, in chunks of `chunk` bytes
    /// (aligned to it), chunks ahead loaded by threads named
    /// `thread_name`. A chunk of 0 or over [`MAX_CHUNK`] reads as asked.
    pub fn chunked(source: R, size: u64, chunk: u64, thread_name: &'static str) -> RangeReader<R> {
        if chunk == 0 || chunk > MAX_CHUNK {
            return Self::direct(source);
        }
        RangeReader {
            source,
            chunked: Some(Chunked {
                chunks: Chunks::new(size, chunk),
                ahead: Workers::new(thread_name, AHEAD_THREADS),
            }),
        }
    }

    /// The source.
    pub fn source(&self) -> &R {
        &self.source
    }

    /// The size of a chunk, when reads are chunked.
    pub fn chunk_size(&self) -> Option<u64> {
        self.chunked.as_ref().map(|c| c.chunks.chunk)
    }

    /// Reads `buf.len()` bytes at `offset` (in range).
    pub fn read(self: &Arc<Self>, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read_or_lend(buf, offset, false).map(drop)
    }

    /// Reads, or with `lend` may lend the bytes out of a held chunk
    /// (`Some`, `buf` left as it is) instead.
    pub fn read_or_lend(
        self: &Arc<Self>,
        buf: &mut [u8],
        offset: u64,
        lend: bool,
    ) -> Result<Option<Lent>> {
        let Some(c) = &self.chunked else {
            return self.source.read_range(buf, offset).map(|()| None);
        };
        let fetch = |b: &mut [u8], at| self.source.read_range(b, at);
        c.chunks.read(buf, offset, lend, fetch, |p| {
            let me = self.clone();
            c.ahead.run(move || {
                if let Some(c) = &me.chunked {
                    c.chunks.fill(p, |b, at| me.source.read_range(b, at));
                }
            });
        })
    }
}

/// Buffers of chunks given up, for new ones.
type Spares = Mutex<Vec<Vec<u8>>>;

/// A loaded chunk's bytes: its buffer goes back to the spares when the
/// last holder (the chunk's slot, a reply lent its bytes) lets it go.
struct Bytes {
    data: Vec<u8>,
    spares: Weak<Spares>,
    /// Spares kept at most.
    keep: usize,
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Bytes {
    fn drop(&mut self) {
        if let Some(spares) = self.spares.upgrade() {
            let mut spares = lock(&spares);
            if spares.len() < self.keep {
                spares.push(std::mem::take(&mut self.data));
            }
        }
    }
}

/// Where a chunk's bytes are.
enum Fill {
    /// Its request is in flight.
    Loading,
    /// Its bytes.
    Ready(Arc<Bytes>),
    /// Its request failed.
    Failed,
}

/// One chunk, and the reads waiting for it.
struct Chunk {
    fill: Mutex<Fill>,
    done: Condvar,
}

impl Chunk {
    fn loading() -> Chunk {
        Chunk {
            fill: Mutex::new(Fill::Loading),
            done: Condvar::new(),
        }
    }

    /// Its bytes, once loaded; `None` if its request failed.
    fn bytes(&self) -> Option<Arc<Bytes>> {
        let mut f = lock(&self.fill);
        loop {
            match &*f {
                Fill::Loading => f = wait(&self.done, f),
                Fill::Ready(d) => return Some(d.clone()),
                Fill::Failed => return None,
            }
        }
    }

    fn finish(&self, fill: Fill) {
        *lock(&self.fill) = fill;
        self.done.notify_all();
    }

    fn is_loading(&self) -> bool {
        matches!(*lock(&self.fill), Fill::Loading)
    }
}

/// A held chunk.
struct Slot {
    /// Which chunk (its offset over the chunk size).
    index: u64,
    chunk: Arc<Chunk>,
    /// When a read last used it (the table's clock).
    used: u64,
}

/// The chunks held and the reads seen.
struct Table {
    slots: Vec<Slot>,
    /// Slots at most.
    max: usize,
    /// Ends of recent reads, a ring.
    ends: [u64; ENDS],
    next_end: usize,
    clock: u64,
}

impl Table {
    fn find(&self, index: u64) -> Option<&Slot> {
        self.slots.iter().find(|s| s.index == index)
    }

    /// Whether a read at `offset` continues a recent one.
    fn follows(&self, offset: u64) -> bool {
        self.ends.contains(&offset)
    }

    fn note_end(&mut self, end: u64) {
        self.ends[self.next_end] = end;
        self.next_end = (self.next_end + 1) % ENDS;
    }

    /// Makes room for `need` chunks more, keeping those of `keep`: the
    /// least recently used loaded chunks go (their buffers come back to
    /// the spares when nothing holds them any more). `None` (and nothing
    /// given up) when there is not room enough.
    fn make_room(&mut self, need: usize, keep: &std::ops::RangeInclusive<u64>) -> Option<()> {
        let over = (self.slots.len() + need).saturating_sub(self.max);
        let mut victims: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !keep.contains(&s.index) && !s.chunk.is_loading())
            .map(|(i, s)| (s.used, i))
            .collect();
        if victims.len() < over {
            return None;
        }
        victims.sort_unstable();
        let mut gone: Vec<usize> = victims[..over].iter().map(|&(_, i)| i).collect();
        // From the last index down, so that each removal leaves the
        // indices still to remove in place.
        gone.sort_unstable_by(|a, b| b.cmp(a));
        for i in gone {
            self.slots.swap_remove(i);
        }
        Some(())
    }
}

/// A chunk whose slot is taken and whose request is still to send
/// ([`Chunks::fill`] sends it). Dropped unsent, the chunk fails: its
/// readers send their own requests.
pub struct Pending {
    index: u64,
    chunk: Arc<Chunk>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.chunk.is_loading() {
            self.chunk.finish(Fill::Failed);
        }
    }
}

/// What a read does: the chunks it copies from, in order; those it loads
/// first; the one after them to load in the background, if any.
struct Plan {
    chunks: Vec<(u64, Arc<Chunk>)>,
    mine: Vec<Pending>,
    ahead: Option<Pending>,
}

/// The chunks of one source of `size` bytes.
pub struct Chunks {
    size: u64,
    /// The size of a chunk, and the alignment of its start.
    chunk: u64,
    table: Mutex<Table>,
    /// Buffers of chunks given up, at most as many as the slots.
    spares: Arc<Spares>,
    /// Slots at most (the table's).
    slots: usize,
}

impl Chunks {
    /// No chunk held yet, for a source of `size` bytes read in chunks of
    /// `chunk` bytes (more than 0): as many slots as [`MEMORY`] holds,
    /// within [`MIN_SLOTS`] and [`MAX_SLOTS`].
    pub fn new(size: u64, chunk: u64) -> Chunks {
        let chunk = chunk.max(1);
        let max = usize::try_from(MEMORY / chunk)
            .unwrap_or(MAX_SLOTS)
            .clamp(MIN_SLOTS, MAX_SLOTS);
        Chunks {
            size,
            chunk,
            spares: Arc::new(Mutex::new(Vec::with_capacity(max))),
            slots: max,
            table: Mutex::new(Table {
                slots: Vec::with_capacity(max),
                max,
                ends: [u64::MAX; ENDS],
                next_end: 0,
                clock: 0,
            }),
        }
    }

    /// Reads `buf.len()` bytes at `offset` (in range): from held chunks,
    /// from chunks this read loads with `fetch`, or by `fetch` as asked.
    /// With `lend`, bytes that lie in one chunk are lent out of it
    /// (`Some`, `buf` left as it is) rather than copied. A read that
    /// continues a stream may also take the slot of the chunk after its
    /// own and hand it to `ahead`, which must see it filled
    /// ([`Chunks::fill`]) on another thread, one that waits for nothing
    /// else.
    pub fn read(
        &self,
        buf: &mut [u8],
        offset: u64,
        lend: bool,
        fetch: impl Fn(&mut [u8], u64) -> Result<()>,
        ahead: impl FnOnce(Pending),
    ) -> Result<Option<Lent>> {
        let len = buf.len() as u64;
        // A source that grew since (a read past the size it had) is read
        // as asked.
        if len == 0 || len >= self.chunk || offset.saturating_add(len) > self.size {
            return fetch(buf, offset).map(|()| None);
        }
        let Some(plan) = self.plan(offset, len) else {
            return fetch(buf, offset).map(|()| None);
        };
        if let Some(p) = plan.ahead {
            ahead(p);
        }
        for p in plan.mine {
            self.fill(p, &fetch);
        }
        let whole = plan.chunks.len() == 1;
        for (index, chunk) in plan.chunks {
            let at = index * self.chunk;
            let (from, to) = (offset.max(at), (offset + len).min(at + self.chunk));
            let piece = &mut buf[(from - offset) as usize..(to - offset) as usize];
            let range = (from - at) as usize..(to - at) as usize;
            match chunk.bytes() {
                Some(d) => {
                    if lend
                        && whole
                        && let Some(lent) = Lent::new(d.clone(), range.clone())
                    {
                        return Ok(Some(lent));
                    }
                    piece.copy_from_slice(&d.data[range]);
                }
                None => fetch(piece, from)?,
            }
        }
        Ok(None)
    }

    /// Loads the chunk `p` with `fetch`; if that fails, the chunk is
    /// forgotten and the reads waiting for it send their own requests.
    pub fn fill(&self, p: Pending, fetch: impl Fn(&mut [u8], u64) -> Result<()>) {
        let at = p.index * self.chunk;
        let mut data = lock(&self.spares).pop().unwrap_or_default();
        data.resize(self.chunk.min(self.size - at) as usize, 0);
        match fetch(&mut data, at) {
            Ok(()) => p.chunk.finish(Fill::Ready(Arc::new(Bytes {
                data,
                spares: Arc::downgrade(&self.spares),
                keep: self.slots,
            }))),
            Err(_) => {
                self.forget(p.index, &p.chunk);
                p.chunk.finish(Fill::Failed);
            }
        }
    }

    /// The chunks a read of `len` (less than a chunk) at `offset` uses,
    /// those it must load among them taking their slots, and, when it
    /// continues a stream, the chunk after them if there is room for it;
    /// `None` when the read is to be sent as asked (it does not continue a
    /// read and its chunks are not all held, or there is no room for
    /// them).
    fn plan(&self, offset: u64, len: u64) -> Option<Plan> {
        let span = offset / self.chunk..=(offset + len - 1) / self.chunk;
        let mut t = lock(&self.table);
        let follows = t.follows(offset);
        t.note_end(offset + len);
        t.clock += 1;
        let now = t.clock;
        let missing: Vec<u64> = span.clone().filter(|&k| t.find(k).is_none()).collect();
        if !missing.is_empty() {
            if !follows {
                return None;
            }
            t.make_room(missing.len(), &span)?;
        }
        let take = |t: &mut Table, index: u64| {
            let chunk = Arc::new(Chunk::loading());
            t.slots.push(Slot {
                index,
                chunk: chunk.clone(),
                used: now,
            });
            Pending { index, chunk }
        };
        let mine = missing
            .into_iter()
            .map(|index| take(&mut t, index))
            .collect();
        let mut chunks = Vec::with_capacity(2);
        for s in t.slots.iter_mut().filter(|s| span.contains(&s.index)) {
            s.used = now;
            chunks.push((s.index, s.chunk.clone()));
        }
        chunks.sort_by_key(|(k, _)| *k);
        let next = span.end() + 1;
        let ahead = if follows && next * self.chunk < self.size && t.find(next).is_none() {
            t.make_room(1, &(*span.start()..=next))
                .map(|()| take(&mut t, next))
        } else {
            None
        };
        Some(Plan {
            chunks,
            mine,
            ahead,
        })
    }

    /// Gives up chunk `index`, if `chunk` still holds its slot.
    fn forget(&self, index: u64, chunk: &Arc<Chunk>) {
        let mut t = lock(&self.table);
        t.slots
            .retain(|s| !(s.index == index && Arc::ptr_eq(&s.chunk, chunk)));
    }

    /// Chunks held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        lock(&self.table).slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// radosgw's stripe: the chunk of the tests.
    const CHUNK: u64 = 4 << 20;
    /// The slots of chunks of [`CHUNK`] bytes.
    const SLOTS: usize = MAX_SLOTS;

    /// A resource whose byte at `i` is `i % 251`, counting requests.
    struct Fake {
        size: u64,
        requests: Mutex<Vec<(u64, usize)>>,
        fail: AtomicUsize,
    }

    impl Fake {
        fn new(size: u64) -> Fake {
            Fake {
                size,
                requests: Mutex::new(Vec::new()),
                fail: AtomicUsize::new(0),
            }
        }

        fn fetch(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            assert!(offset + buf.len() as u64 <= self.size, "past the end");
            lock(&self.requests).push((offset, buf.len()));
            if self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(crate::Error::invalid("refused"));
            }
            pattern(buf.len(), offset, |at, bytes| {
                buf[at..at + bytes.len()].copy_from_slice(bytes)
            });
            Ok(())
        }

        fn taken(&self) -> Vec<(u64, usize)> {
            std::mem::take(&mut *lock(&self.requests))
        }
    }

    /// The resource's bytes from `offset`, `len` of them, given to `f`
    /// piece by piece with their place in the range.
    fn pattern(len: usize, offset: u64, mut f: impl FnMut(usize, &[u8])) {
        const PERIOD: usize = 251;
        static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let table = TABLE.get_or_init(|| {
            (0..(1 << 20) + PERIOD)
                .map(|i| (i % PERIOD) as u8)
                .collect()
        });
        let mut done = 0;
        while done < len {
            let start = ((offset + done as u64) % PERIOD as u64) as usize;
            let n = (len - done).min(1 << 20);
            f(done, &table[start..start + n]);
            done += n;
        }
    }

    /// Reads and checks the bytes; the chunk to load ahead, if any, is
    /// loaded after the read (by the same thread: the order of requests
    /// is then known).
    fn read(c: &Chunks, f: &Fake, offset: u64, len: usize) {
        let mut ahead = None;
        read_with(c, f, offset, len, |p| ahead = Some(p));
        if let Some(p) = ahead {
            c.fill(p, |b, o| f.fetch(b, o));
        }
    }

    /// Reads and checks the bytes, the chunk to load ahead handed to
    /// `ahead`.
    fn read_with(c: &Chunks, f: &Fake, offset: u64, len: usize, ahead: impl FnOnce(Pending)) {
        let mut buf = vec![0u8; len];
        c.read(&mut buf, offset, false, |b, o| f.fetch(b, o), ahead)
            .unwrap();
        pattern(len, offset, |at, want| {
            assert!(buf[at..at + want.len()] == *want, "{len} bytes at {offset}");
        });
    }

    #[test]
    fn a_stream_of_small_reads_is_served_from_whole_chunks() {
        stream_served_whole(CHUNK, 5 * CHUNK + 12345, 256 << 10);
    }

    /// A stream of reads of `step` bytes over a source of `size` bytes
    /// in chunks of `chunk`: the first read as asked, then each chunk
    /// whole (the one after the read's loaded ahead), the last one cut
    /// at the end.
    fn stream_served_whole(chunk: u64, size: u64, step: u64) {
        let (c, f) = (Chunks::new(size, chunk), Fake::new(size));
        let mut at = 0;
        while at < size {
            read(&c, &f, at, step.min(size - at) as usize);
            at += step;
        }
        let mut want = vec![(0, step as usize)];
        want.extend(
            (0..size.div_ceil(chunk)).map(|k| (k * chunk, chunk.min(size - k * chunk) as usize)),
        );
        assert_eq!(f.taken(), want);
    }

    #[test]
    fn reads_that_do_not_follow_are_sent_as_asked() {
        let size = 64 * CHUNK;
        let (c, f) = (Chunks::new(size, CHUNK), Fake::new(size));
        let mut asked = Vec::new();
        // Scattered, overlapping, across chunk ends, backwards.
        let mut x: u64 = 12345;
        for _ in 0..200 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (x >> 40) % (CHUNK - 1);
            let off = (x >> 8) % (size - len);
            read(&c, &f, off, len as usize);
            asked.push((off, len as usize));
        }
        assert_eq!(f.taken(), asked);
        assert_eq!(c.held(), 0);
        // Reads of a chunk or more are sent as asked even in a stream.
        for k in 0..4 {
            read(&c, &f, k * CHUNK, CHUNK as usize);
        }
        assert_eq!(f.taken().len(), 4);
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn held_chunks_serve_any_read_in_them_and_memory_is_bounded() {
        let size = 3 * SLOTS as u64 * CHUNK;
        let (c, f) = (Chunks::new(size, CHUNK), Fake::new(size));
        // A stream across unaligned reads that cross chunk ends.
        let step = 700_001;
        let mut at = 5;
        while at + step < size {
            read(&c, &f, at, step as usize);
            at += step;
            assert!(c.held() <= SLOTS);
        }
        let taken = f.taken();
        assert!(taken.len() <= 3 * SLOTS + 1, "{}", taken.len());
        assert_eq!(c.held(), SLOTS);
        // The last chunks are held: reads anywhere in them, in any
        // order, send nothing.
        let last = (at - 1) / CHUNK;
        for off in [last * CHUNK + 17, (last - 3) * CHUNK, last * CHUNK - 5] {
            read(&c, &f, off, 4096);
        }
        assert_eq!(f.taken(), vec![]);
    }

    #[test]
    fn a_chunk_that_fails_leaves_each_read_its_own_request() {
        let size = 4 * CHUNK;
        let (c, f) = (Chunks::new(size, CHUNK), Fake::new(size));
        read(&c, &f, 0, 4096);
        f.fail.store(1, Ordering::SeqCst);
        read(&c, &f, 4096, 4096);
        // The chunk's request failed; the read sent its own (and the
        // chunk after was loaded ahead).
        let chunk = CHUNK as usize;
        assert_eq!(
            f.taken(),
            vec![(0, 4096), (0, chunk), (4096, 4096), (CHUNK, chunk)]
        );
        assert_eq!(c.held(), 1);
        // A read that fails for good fails, and holds nothing more.
        f.fail.store(2, Ordering::SeqCst);
        let mut buf = vec![0u8; 4096];
        let r = c.read(
            &mut buf,
            8192,
            false,
            |b, o| f.fetch(b, o),
            |_| panic!("held"),
        );
        assert!(r.is_err());
        assert_eq!(c.held(), 1);
    }

    #[test]
    fn bytes_in_one_held_chunk_are_lent() {
        let size = 3 * CHUNK;
        let (c, f) = (Chunks::new(size, CHUNK), Fake::new(size));
        read(&c, &f, 0, 4096);
        let lend = |offset: u64, len: usize| {
            let mut buf = vec![0u8; len];
            let lent = c.read(
                &mut buf,
                offset,
                true,
                |b, o| f.fetch(b, o),
                |p| c.fill(p, |b, o| f.fetch(b, o)),
            );
            (buf, lent.unwrap())
        };
        // Sent as asked: nothing held to lend from.
        let (buf, lent) = lend(CHUNK + 5, 100);
        assert!(lent.is_none());
        pattern(100, CHUNK + 5, |at, want| {
            assert!(buf[at..at + want.len()] == *want)
        });
        // In chunk 0, loaded by this read: lent, the buffer untouched.
        let (buf, lent) = lend(4096, 8192);
        let lent = lent.expect("lent");
        assert!(buf.iter().all(|&b| b == 0));
        pattern(8192, 4096, |at, want| {
            assert!(lent.bytes()[at..at + want.len()] == *want)
        });
        // Across chunks 0 and 1 (loaded ahead): copied.
        let (buf, lent) = lend(CHUNK - 10, 20);
        assert!(lent.is_none());
        pattern(20, CHUNK - 10, |at, want| {
            assert!(buf[at..at + want.len()] == *want)
        });
        assert_eq!(
            f.taken(),
            vec![
                (0, 4096),
                (CHUNK + 5, 100),
                // Here the chunk ahead is loaded first, in the read's
                // own thread.
                (CHUNK, CHUNK as usize),
                (0, CHUNK as usize),
            ]
        );
    }

    #[test]
    fn reads_from_many_threads_get_their_bytes() {
        let size = 40 * CHUNK + 999;
        let (c, f) = (Chunks::new(size, CHUNK), Fake::new(size));
        let step = 256 << 10;
        // Four streams, each read by four threads taking requests in turn
        // (as a server's workers do), beside random reads; chunks ahead
        // are loaded on threads of their own.
        let next: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for t in 0..20 {
                let (c, f, next) = (&c, &f, &next);
                let read = move |at, len| {
                    read_with(c, f, at, len, |p| {
                        s.spawn(move || c.fill(p, |b, o| f.fetch(b, o)));
                    })
                };
                s.spawn(move || {
                    if t >= 16 {
                        let mut x = t as u64;
                        for _ in 0..100 {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                            let len = 1 + (x >> 45) % 300_000;
                            read((x >> 7) % (size - len), len as usize);
                        }
                        return;
                    }
                    let stream = t % 4;
                    let base = stream as u64 * 10 * CHUNK;
                    loop {
                        let i = next[stream].fetch_add(1, Ordering::SeqCst) as u64;
                        let at = base + i * step;
                        if at >= (base + 10 * CHUNK).min(size) {
                            return;
                        }
                        read(at, step.min(size - at) as usize);
                    }
                });
            }
        });
        assert!(c.held() <= SLOTS);
    }

    #[test]
    fn chunks_of_another_size_serve_a_stream_and_hold_what_memory_allows() {
        // RBD objects of 64 KiB, read in unaligned pieces of 10000 bytes.
        let chunk = 64 << 10;
        stream_served_whole(chunk, 10 * chunk + 100, 10_000);
        // Slots: as many as the memory holds, within the bounds.
        let slots = |chunk| Chunks::new(1 << 40, chunk).slots;
        assert_eq!(slots(64 << 10), MAX_SLOTS);
        assert_eq!(slots(4 << 20), 16);
        assert_eq!(slots(8 << 20), 8);
        assert_eq!(slots(32 << 20), MIN_SLOTS);
    }

    #[test]
    fn reads_past_the_size_known_are_sent_as_asked() {
        let (c, f) = (Chunks::new(2 * CHUNK, CHUNK), Fake::new(4 * CHUNK));
        read(&c, &f, 0, 4096);
        read(&c, &f, 4096, 4096);
        f.taken();
        // The source grew: a stream past the size the chunks know.
        read(&c, &f, 2 * CHUNK - 4096, 8192);
        read(&c, &f, 2 * CHUNK + 4096, 8192);
        assert_eq!(
            f.taken(),
            vec![(2 * CHUNK - 4096, 8192), (2 * CHUNK + 4096, 8192)]
        );
    }

    #[test]
    fn a_range_reader_loads_chunks_ahead_on_its_threads() {
        struct Shared(Arc<Fake>);
        impl ReadRange for Shared {
            fn read_range(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                self.0.fetch(buf, offset)
            }
        }
        let size = 3 * CHUNK;
        let f = Arc::new(Fake::new(size));
        let r = Arc::new(RangeReader::chunked(
            Shared(f.clone()),
            size,
            CHUNK,
            "test-ahead",
        ));
        assert_eq!(r.chunk_size(), Some(CHUNK));
        let mut buf = vec![0u8; 4096];
        r.read(&mut buf, 0).unwrap();
        r.read(&mut buf, 4096).unwrap();
        pattern(4096, 4096, |at, want| {
            assert!(buf[at..at + want.len()] == *want)
        });
        // The chunk after the stream's is loaded ahead: a read in it
        // waits for that load and sends nothing of its own.
        let lent = r.read_or_lend(&mut buf, CHUNK + 8, true).unwrap();
        let lent = lent.expect("lent from the chunk loaded ahead");
        pattern(4096, CHUNK + 8, |at, want| {
            assert!(lent.bytes()[at..at + want.len()] == *want)
        });
        let mut taken = f.taken();
        taken.sort_unstable();
        let chunk = CHUNK as usize;
        assert_eq!(taken, vec![(0, 4096), (0, chunk), (CHUNK, chunk)]);
        // Made direct, every read is sent as asked.
        let d = Arc::new(RangeReader::direct(Shared(f.clone())));
        assert_eq!(d.chunk_size(), None);
        d.read(&mut buf, 0).unwrap();
        d.read(&mut buf, 4096).unwrap();
        assert_eq!(f.taken(), vec![(0, 4096), (4096, 4096)]);
    }

    #[test]
    fn buffers_of_chunks_given_up_are_reused_once_no_reply_holds_them() {
        let size = (SLOTS as u64 + 4) * CHUNK;
        let (c, f) = (Chunks::new(size, CHUNK), Fake::new(size));
        read(&c, &f, 0, 4096);
        read(&c, &f, 4096, 4096);
        let mut buf = vec![0u8; 4096];
        let lent = c
            .read(
                &mut buf,
                8192,
                true,
                |b, o| f.fetch(b, o),
                |_| panic!("held"),
            )
            .unwrap()
            .expect("lent");
        // The stream goes on until chunk 0 is given up: its buffer is
        // still lent.
        let mut at = 12288;
        while lock(&c.table).find(0).is_some() {
            read(&c, &f, at, 1 << 20);
            at += 1 << 20;
        }
        let spares = lock(&c.spares).len();
        pattern(4096, 8192, |at, want| {
            assert!(lent.bytes()[at..at + want.len()] == *want)
        });
        drop(lent);
        assert_eq!(lock(&c.spares).len(), spares + 1);
        // The next chunk loaded takes it (and reads its own bytes).
        read(&c, &f, at, 1 << 20);
        assert!(lock(&c.spares).len() <= spares + 1);
        assert!(lock(&c.spares).len() <= SLOTS);
    }
}
