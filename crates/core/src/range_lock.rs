//! A lock over byte ranges, shared or exclusive: requests on ranges that
//! do not overlap never wait for each other.
//!
//! Layers that must keep some requests apart without serialising the whole
//! device use it: the blocksize filter holds a block exclusively for a
//! read-modify-write and every other change shared, so a read-modify-write
//! never undoes a concurrent write to the same block.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::sync;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    id: u64,
    start: u64,
    end: u64,
    exclusive: bool,
}

impl Held {
    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        self.start < end && start < self.end && (self.exclusive || exclusive)
    }
}

/// The bookkeeping of a range lock, without a mutex of its own: for a
/// caller that keeps its ranges inside state it already locks (a format's
/// metadata), so that looking a mapping up and taking its range are one
/// critical section. [`RangeLock`] is this behind a mutex and a condvar.
#[derive(Debug, Default)]
pub struct RangeSet {
    held: Vec<Held>,
    next_id: u64,
}

/// A range taken from a [`RangeSet`]; give it back with
/// [`RangeSet::give_back`].
#[must_use = "a range taken must be given back"]
#[derive(Debug, PartialEq, Eq)]
pub struct RangeTicket(u64);

impl RangeSet {
    /// Whether `start..end` would conflict with a range held.
    pub fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        self.held.iter().any(|h| h.conflicts(start, end, exclusive))
    }

    /// Takes `start..end` (shared or exclusive) unless a conflicting range
    /// is held.
    pub fn try_take(&mut self, start: u64, end: u64, exclusive: bool) -> Option<RangeTicket> {
        if self.conflicts(start, end, exclusive) {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.held.push(Held {
            id,
            start,
            end,
            exclusive,
        });
        Some(RangeTicket(id))
    }

    /// Gives a range back.
    pub fn give_back(&mut self, t: RangeTicket) {
        if let Some(i) = self.held.iter().position(|h| h.id == t.0) {
            self.held.swap_remove(i);
        }
    }

    /// How many ranges are held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no range is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// Byte ranges held shared (any number at once) or exclusive (alone).
///
/// A range is held from [`lock`](RangeLock::lock) until its [`RangeGuard`]
/// is dropped. Shared ranges may overlap each other; an exclusive range
/// overlaps nothing else held. Waiters are woken whenever a range is
/// released (no fairness is promised). Empty ranges (`start >= end`)
/// conflict with nothing.
#[derive(Debug, Default)]
pub struct RangeLock {
    state: Mutex<RangeSet>,
    released: Condvar,
}

/// A range held by a [`RangeLock`], released when dropped.
#[must_use = "the range is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct RangeGuard<'a> {
    lock: &'a RangeLock,
    ticket: Option<RangeTicket>,
    range: (u64, u64),
}

impl RangeGuard<'_> {
    /// The range held: `(start, end)`.
    pub fn range(&self) -> (u64, u64) {
        self.range
    }
}

impl RangeLock {
    /// A lock with no range held.
    pub fn new() -> RangeLock {
        RangeLock::default()
    }

    fn state(&self) -> MutexGuard<'_, RangeSet> {
        sync::lock(&self.state)
    }

    /// Holds `start..end`, waiting while a conflicting range is held: any
    /// overlapping one if `exclusive`, else an overlapping exclusive one.
    /// The range stays held until the returned guard is dropped.
    pub fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_> {
        let mut st = self.state();
        loop {
            if let Some(t) = st.try_take(start, end, exclusive) {
                return RangeGuard {
                    lock: self,
                    ticket: Some(t),
                    range: (start, end),
                };
            }
            st = self.released.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Holds, without waiting, every part of `start..end` that conflicts
    /// with no range held (all of it, some pieces, or none), in order: for
    /// work that is worth doing where nobody else is busy (a prefetch),
    /// and needless where someone is. Each part stays held until its
    /// guard is dropped.
    pub fn try_lock_free(&self, start: u64, end: u64, exclusive: bool) -> Vec<RangeGuard<'_>> {
        let mut st = self.state();
        let mut busy: Vec<(u64, u64)> = st
            .held
            .iter()
            .filter(|h| h.conflicts(start, end, exclusive))
            .map(|h| (h.start.max(start), h.end.min(end)))
            .collect();
        busy.sort_unstable();
        let mut free = Vec::new();
        let mut at = start;
        for (s, e) in busy.into_iter().chain(std::iter::once((end, end))) {
            if at < s {
                free.push((at, s));
            }
            at = at.max(e);
        }
        free.into_iter()
            .filter_map(|(s, e)| {
                st.try_take(s, e, exclusive).map(|t| RangeGuard {
                    lock: self,
                    ticket: Some(t),
                    range: (s, e),
                })
            })
            .collect()
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.state().len()
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.lock.state().give_back(t);
        }
        self.lock.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn shared_ranges_coexist_and_exclusive_ones_wait() {
        let l = Arc::new(RangeLock::default());
        let a = l.lock(0, 10, false);
        let b = l.lock(5, 15, false);
        let c = l.lock(15, 20, true);
        assert_eq!(l.held(), 3);
        let got = Arc::new(AtomicBool::new(false));
        let t = {
            let (l, got) = (l.clone(), got.clone());
            std::thread::spawn(move || {
                let _g = l.lock(9, 10, true);
                got.store(true, Ordering::SeqCst);
            })
        };
        drop(a);
        // Still blocked by `b`, which overlaps 9..10: the waiter cannot
        // have taken the range while `b` is held.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!got.load(Ordering::SeqCst));
        drop(b);
        t.join().unwrap();
        assert!(got.load(Ordering::SeqCst));
        drop(c);
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn the_free_parts_of_a_range_are_taken_around_the_busy_ones() {
        let l = RangeLock::default();
        let a = l.lock(10, 20, true);
        let b = l.lock(25, 30, false);
        let c = l.lock(50, 60, false);
        let parts = l.try_lock_free(0, 55, true);
        let ranges: Vec<_> = parts.iter().map(RangeGuard::range).collect();
        assert_eq!(ranges, [(0, 10), (20, 25), (30, 50)]);
        assert_eq!(l.held(), 6);
        // Taken: nothing in them can be had now.
        assert!(l.try_lock_free(0, 10, false).is_empty());
        assert!(l.try_lock_free(30, 50, false).is_empty());
        drop(parts);
        // Shared: only exclusive ranges are in the way.
        let shared = l.try_lock_free(0, 70, false);
        let ranges: Vec<_> = shared.iter().map(RangeGuard::range).collect();
        assert_eq!(ranges, [(0, 10), (20, 70)]);
        drop(shared);
        drop((a, b, c));
        assert_eq!(l.try_lock_free(0, 70, true).len(), 1);
        assert!(l.try_lock_free(5, 5, true).is_empty(), "an empty range");
        assert_eq!(l.held(), 0);
    }
}
