//! The mount's own readahead: the kernel reads ahead through FUSE at
//! most its default window (128 KiB, the cap of the `max_readahead` a
//! filesystem may ask for), one request at a time, so a sequential
//! reader waits a round trip to the device for every 128 KiB. When reads
//! come in sequence, the next ones are read from the device before they
//! are asked for, a window ahead that grows as the sequence goes on, and
//! are answered from memory, or as soon as their bytes arrive.
//!
//! Writes make what was read ahead stale: while one is in flight nothing
//! is read ahead, and what was read before it is not used after it.
//! Reads that cannot be answered from what was read ahead go to the
//! device as they are. Only reads through the kernel's cache are read
//! ahead: what was read ahead is as fresh as the kernel's cached pages
//! (an opening drops both), while reads that bypass the cache see what
//! other clients of the device wrote before they were made.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use diskit_core::buffer::AlignedBuf;
use diskit_core::sync::lock;

use crate::pool::BufPool;

/// How far ahead of a sequential reader reads go, at most.
pub const MAX_AHEAD: u64 = 2 << 20;
/// How many reads ahead are kept at most (small reads: the window is
/// counted in them too).
const MAX_SLOTS: usize = 32;

/// A read ahead from the device to give its bytes back from.
pub struct Prefetch {
    /// The tag of its completion.
    pub tag: u64,
    /// Device offset.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
}

/// What a read finds among the reads ahead.
pub enum Found<W> {
    /// Its bytes are there: `buf[range]`, for the waiter given back.
    /// Give `buf` back with [`Readahead::recycle`] once done with it.
    Ready(W, Arc<AlignedBuf>, Range<usize>),
    /// Its bytes are on their way: the waiter gets them from
    /// [`Readahead::completed`].
    Waiting,
    /// Not read ahead: the caller reads them itself.
    Miss(W),
}

/// A reader that waited for a read ahead, once it came.
pub struct Answer<W> {
    /// Who waited.
    pub waiter: W,
    /// The device offset it asked for.
    pub offset: u64,
    /// Its part of the bytes.
    pub range: Range<usize>,
    /// The bytes (give them back with [`Readahead::recycle`]); `None`
    /// when the read ahead failed: the reader reads for itself.
    pub bytes: Option<Arc<AlignedBuf>>,
}

/// Where a read ahead is.
enum Data<W> {
    /// Sent; readers that came meanwhile wait for it (each with the part
    /// of it they asked for).
    InFlight {
        tag: u64,
        waiters: Vec<(W, Range<usize>)>,
    },
    /// Arrived.
    Ready(Arc<AlignedBuf>),
}

struct Slot<W> {
    offset: u64,
    len: usize,
    /// The generation of the bytes: only the current one's are used.
    generation: u64,
    data: Data<W>,
}

impl<W> Slot<W> {
    fn end(&self) -> u64 {
        self.offset + self.len as u64
    }

    /// `offset..offset+len` of the device as a range of the slot's bytes,
    /// if the slot holds all of it.
    fn holds(&self, offset: u64, len: usize) -> Option<Range<usize>> {
        let start = offset.checked_sub(self.offset)? as usize;
        (offset + len as u64 <= self.end()).then_some(start..start + len)
    }

    /// Readers wait for it: it must stay until it comes.
    fn awaited(&self) -> bool {
        matches!(&self.data, Data::InFlight { waiters, .. } if !waiters.is_empty())
    }
}

struct State<W> {
    /// Bumped at the start and end of every write.
    generation: u64,
    /// Writes in flight: nothing is read ahead meanwhile.
    writing: usize,
    /// Where the last read ended: a read from there is sequential.
    next: u64,
    /// How far ahead of `next` reads go now.
    window: u64,
    /// Where the reads ahead end.
    frontier: u64,
    slots: VecDeque<Slot<W>>,
    next_tag: u64,
}

/// The reads ahead of one file; `W` is how a reader waiting for bytes is
/// answered.
pub struct Readahead<W> {
    size: u64,
    pool: Arc<BufPool>,
    state: Mutex<State<W>>,
}

impl<W> Readahead<W> {
    /// Reads ahead of a file of `size` bytes, into buffers from `pool`.
    pub fn new(size: u64, pool: Arc<BufPool>) -> Readahead<W> {
        Readahead {
            size,
            pool,
            state: Mutex::new(State {
                generation: 0,
                writing: 0,
                next: u64::MAX,
                window: 0,
                frontier: 0,
                slots: VecDeque::new(),
                next_tag: 0,
            }),
        }
    }

    /// A read of `len` bytes at `offset` (`waiter` answers it if it must
    /// wait): what it finds, and the reads ahead to send now.
    pub fn read(&self, offset: u64, len: usize, waiter: W) -> (Found<W>, Vec<Prefetch>) {
        let mut st = lock(&self.state);
        let sequential = offset == st.next;
        st.next = offset + len as u64;
        if st.writing > 0 {
            return (Found::Miss(waiter), Vec::new());
        }
        // What lies behind the reader is not read again.
        let mut dropped = Vec::new();
        st.slots.retain_mut(|s| {
            let keep = s.end() > offset || s.awaited();
            if !keep && let Data::Ready(b) = &s.data {
                dropped.push(b.clone());
            }
            keep
        });
        let generation = st.generation;
        let hit = st
            .slots
            .iter()
            .position(|s| s.generation == generation && s.holds(offset, len).is_some());
        let found = match hit {
            Some(i) => {
                let range = st.slots[i].holds(offset, len).expect("found holding it");
                let last = range.end == st.slots[i].len;
                match &mut st.slots[i].data {
                    Data::Ready(buf) => {
                        let buf = buf.clone();
                        // Read to its end: nobody reads it again.
                        if last
                            && let Some(Slot {
                                data: Data::Ready(b),
                                ..
                            }) = st.slots.remove(i)
                        {
                            dropped.push(b);
                        }
                        Found::Ready(waiter, buf, range)
                    }
                    Data::InFlight { waiters, .. } => {
                        waiters.push((waiter, range));
                        Found::Waiting
                    }
                }
            }
            None => Found::Miss(waiter),
        };
        let prefetch = if hit.is_some() {
            st.window = (st.window * 2).max(2 * len as u64).min(MAX_AHEAD);
            self.ahead(&mut st, len)
        } else if sequential {
            // A sequence (re)starts: from the end of this read.
            st.window = 2 * len as u64;
            st.frontier = st.next;
            self.ahead(&mut st, len)
        } else {
            Vec::new()
        };
        drop(st);
        for b in dropped {
            self.recycle(b);
        }
        (found, prefetch)
    }

    /// New reads ahead of `unit` bytes each, up to the window.
    fn ahead(&self, st: &mut State<W>, unit: usize) -> Vec<Prefetch> {
        let mut out = Vec::new();
        let unit = unit as u64;
        st.frontier = st.frontier.max(st.next);
        let until = st.next.saturating_add(st.window).min(self.size);
        while st.frontier < until && st.slots.len() < MAX_SLOTS {
            let len = unit.min(self.size - st.frontier) as usize;
            let tag = st.next_tag;
            st.next_tag += 1;
            st.slots.push_back(Slot {
                offset: st.frontier,
                len,
                generation: st.generation,
                data: Data::InFlight {
                    tag,
                    waiters: Vec::new(),
                },
            });
            out.push(Prefetch {
                tag,
                offset: st.frontier,
                len,
            });
            st.frontier += len as u64;
        }
        out
    }

    /// A read ahead finished (`buf` filled, or `None` if it failed):
    /// the readers that wait for it, to be answered.
    pub fn completed(&self, tag: u64, buf: Option<AlignedBuf>) -> Vec<Answer<W>> {
        let mut st = lock(&self.state);
        let generation = st.generation;
        let i = st
            .slots
            .iter()
            .position(|s| matches!(s.data, Data::InFlight { tag: t, .. } if t == tag));
        let Some(i) = i else {
            drop(st);
            if let Some(b) = buf {
                self.pool.give(b);
            }
            return Vec::new();
        };
        let slot = &mut st.slots[i];
        let offset = slot.offset;
        let buf = buf.map(Arc::new);
        let keep = buf.is_some() && slot.generation == generation;
        let data = match (&buf, keep) {
            (Some(b), true) => Data::Ready(b.clone()),
            _ => Data::InFlight {
                tag,
                waiters: Vec::new(),
            },
        };
        let waiters = match std::mem::replace(&mut slot.data, data) {
            Data::InFlight { waiters, .. } => waiters,
            Data::Ready(_) => Vec::new(),
        };
        if !keep {
            st.slots.remove(i);
        }
        drop(st);
        let out = waiters
            .into_iter()
            .map(|(waiter, range)| Answer {
                waiter,
                offset: offset + range.start as u64,
                range,
                bytes: buf.clone(),
            })
            .collect();
        if let Some(b) = buf {
            self.recycle(b);
        }
        out
    }

    /// Gives a buffer back to the pool once nobody else holds it.
    pub fn recycle(&self, buf: Arc<AlignedBuf>) {
        if let Ok(b) = Arc::try_unwrap(buf) {
            self.pool.give(b);
        }
    }

    /// A write (or zeroing, or trim) starts: what was read ahead is stale.
    pub fn write_starts(&self) {
        let mut st = lock(&self.state);
        st.writing += 1;
        self.forget(st);
    }

    /// A write ended: what was read while it was in flight is stale too.
    pub fn write_ends(&self) {
        let mut st = lock(&self.state);
        st.writing = st.writing.saturating_sub(1);
        self.forget(st);
    }

    /// The file is opened: what was read ahead for an earlier opening
    /// is not used (as the kernel drops its cached pages at an opening),
    /// so that an opening sees changes made meanwhile by others.
    pub fn reset(&self) {
        self.forget(lock(&self.state));
    }

    fn forget(&self, mut st: std::sync::MutexGuard<'_, State<W>>) {
        st.generation += 1;
        st.next = u64::MAX;
        st.frontier = 0;
        let mut dropped = Vec::new();
        // Readers waiting for a read ahead still get it: they came before
        // the write.
        st.slots.retain_mut(|s| {
            if let Data::Ready(b) = &s.data {
                dropped.push(b.clone());
            }
            s.awaited()
        });
        drop(st);
        for b in dropped {
            self.recycle(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: usize = 4096;

    fn ra() -> Readahead<u32> {
        Readahead::new(64 * UNIT as u64, Arc::new(BufPool::new(UNIT)))
    }

    /// Two reads in sequence from the start: the reads ahead they send.
    fn sequence(r: &Readahead<u32>) -> Vec<Prefetch> {
        r.read(0, UNIT, 1);
        r.read(UNIT as u64, UNIT, 2).1
    }

    /// Completes `p` with a buffer of its offset's low byte.
    fn complete(r: &Readahead<u32>, p: &Prefetch) -> Vec<(u32, Range<usize>, u8)> {
        let mut b = AlignedBuf::new(UNIT, 4096).unwrap();
        b.fill(p.offset as u8 + 1);
        r.completed(p.tag, Some(b))
            .into_iter()
            .map(|a| (a.waiter, a.range, a.bytes.unwrap()[0]))
            .collect()
    }

    #[test]
    fn a_sequence_reads_ahead_and_is_answered_from_it() {
        let r = ra();
        let u = UNIT as u64;
        let (f, p) = r.read(0, UNIT, 1);
        assert!(matches!(f, Found::Miss(1)));
        assert!(p.is_empty(), "one read is no sequence");
        let (f, p) = r.read(u, UNIT, 2);
        assert!(matches!(f, Found::Miss(2)));
        let offsets: Vec<u64> = p.iter().map(|p| p.offset).collect();
        assert_eq!(offsets, [2 * u, 3 * u]);
        assert!(p.iter().all(|p| p.len == UNIT) && p[0].tag != p[1].tag);
        // The next read waits for the first read ahead...
        let (f, more) = r.read(2 * u, UNIT, 3);
        assert!(matches!(f, Found::Waiting));
        assert_eq!(more.len(), 3, "the window grew");
        assert_eq!(complete(&r, &p[0]), [(3, 0..UNIT, 2 * u as u8 + 1)]);
        // ...the one after finds it there.
        assert!(complete(&r, &p[1]).is_empty());
        let (f, _) = r.read(3 * u, UNIT, 4);
        let Found::Ready(4, buf, range) = f else {
            panic!("not read ahead")
        };
        assert_eq!((buf[0], range), (3 * u as u8 + 1, 0..UNIT));
    }

    #[test]
    fn a_write_makes_reads_ahead_stale() {
        let r = ra();
        let u = UNIT as u64;
        let p = sequence(&r);
        complete(&r, &p[0]);
        r.write_starts();
        let (f, p2) = r.read(2 * u, UNIT, 3);
        assert!(matches!(f, Found::Miss(3)), "read before the write");
        assert!(p2.is_empty(), "nothing read ahead during a write");
        // What was in flight across the write is not kept.
        r.write_ends();
        assert!(complete(&r, &p[1]).is_empty());
        let (f, _) = r.read(3 * u, UNIT, 4);
        assert!(matches!(f, Found::Miss(4)));
    }

    #[test]
    fn a_failed_read_ahead_sends_its_waiters_to_the_device() {
        let r = ra();
        let u = UNIT as u64;
        let p = sequence(&r);
        assert!(matches!(r.read(2 * u, UNIT, 3).0, Found::Waiting));
        let w = r.completed(p[0].tag, None);
        assert_eq!(w.len(), 1);
        assert!(w[0].waiter == 3 && w[0].offset == 2 * u && w[0].bytes.is_none());
    }

    #[test]
    fn random_reads_read_nothing_ahead() {
        let r = ra();
        for (i, at) in [5u64, 1, 9, 3].into_iter().enumerate() {
            let (f, p) = r.read(at * UNIT as u64, UNIT, i as u32);
            assert!(matches!(f, Found::Miss(_)) && p.is_empty());
        }
    }
}
