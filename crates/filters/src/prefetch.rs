//! Prefetching: what a client is likely to read next, guessed from what
//! it reads, fetched by a few background threads while it waits for
//! something else. The readahead filter fetches by asking the layer below
//! to cache; the cache and cow filters fill their own overlay (see
//! [`crate::overlay::Overlay::fill`]).
//!
//! Two patterns are predicted:
//! - **sequential**: a read that starts where an earlier one ended
//!   continues a stream; the window ahead of it doubles with each such
//!   read, from 128 KiB up to 32 MiB;
//! - **clustered**: any other read is taken as a visit to a region that
//!   will be read around; the 2 MiB on either side of it are asked for
//!   (a guest inspector reading metadata and the files next to it).
//!
//! Everything is bounded: ranges asked for recently are not asked again,
//! they are fetched in pieces of at most 8 MiB, at most 64 pieces wait
//! (when the threads fall behind, the oldest are dropped rather than
//! delaying anything) and 4 threads fetch them. A fetch that fails costs
//! nothing but the guess: the client's own read of those bytes finds them
//! missing and reads them itself.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use diskit_core::sync::lock;
use diskit_core::{BlockDevice, DeviceRef, Error, Filter, Filtered, Result};

/// The first window ahead of a sequential stream.
const MIN_WINDOW: u64 = 128 << 10;
/// The largest window ahead of a sequential stream.
pub(crate) const MAX_WINDOW: u64 = 32 << 20;
/// How far around a read elsewhere is asked for, on each side.
pub(crate) const CLUSTER: u64 = 2 << 20;
/// Streams followed at once.
const STREAMS: usize = 16;
/// Ranges remembered as asked for.
const REMEMBERED: usize = 256;
/// Pieces waiting at most; older ones are dropped.
const QUEUE: usize = 64;
/// The largest piece fetched at once.
pub(crate) const PIECE: u64 = 8 << 20;
/// Background threads.
pub(crate) const THREADS: usize = 4;
/// Clusters start at a multiple of this.
const ALIGN: u64 = 64 << 10;

/// A sequential stream: where it will continue, and its window.
#[derive(Debug, Clone, Copy)]
struct Stream {
    next: u64,
    window: u64,
    /// How far ahead has been asked for already.
    asked_to: u64,
}

/// Guesses what is read next from the reads so far.
#[derive(Debug, Default)]
pub(crate) struct Predictor {
    streams: VecDeque<Stream>,
    /// Recently asked ranges, newest last.
    asked: VecDeque<(u64, u64)>,
}

impl Predictor {
    /// The ranges worth fetching after a read of `len` bytes at `offset`
    /// of a device of `size` bytes, less what was asked for recently, in
    /// pieces of at most [`PIECE`].
    pub(crate) fn after_read(&mut self, offset: u64, len: u64, size: u64) -> Vec<(u64, u64)> {
        let mut pieces = Vec::new();
        for (off, len) in self.predict(offset, len, size) {
            if let Some((off, len)) = self.unasked(off, len) {
                let end = off + len;
                let mut at = off;
                while at < end {
                    let n = (end - at).min(PIECE);
                    pieces.push((at, n));
                    at += n;
                }
            }
        }
        pieces
    }

    /// The ranges a read of `len` bytes at `offset` makes likely.
    fn predict(&mut self, offset: u64, len: u64, size: u64) -> Vec<(u64, u64)> {
        let end = offset + len;
        let mut want = Vec::new();
        if let Some(i) = self.streams.iter().position(|s| s.next == offset) {
            let mut s = self.streams.remove(i).expect("found");
            s.window = (s.window * 2).min(MAX_WINDOW);
            s.next = end;
            let to = (end + s.window).min(size);
            let from = s.asked_to.max(end);
            if from < to {
                want.push((from, to - from));
                s.asked_to = to;
            }
            self.streams.push_back(s);
        } else {
            if self.streams.len() >= STREAMS {
                self.streams.pop_front();
            }
            self.streams.push_back(Stream {
                next: end,
                window: MIN_WINDOW,
                asked_to: end,
            });
            let from = offset.saturating_sub(CLUSTER) / ALIGN * ALIGN;
            let to = (end + CLUSTER).min(size);
            want.push((from, to - from));
        }
        want
    }

    /// `off..off+len` less what a recent range covered at either end, and
    /// remembered; `None` when nothing is left.
    fn unasked(&mut self, mut off: u64, len: u64) -> Option<(u64, u64)> {
        let mut end = off + len;
        for &(a, l) in self.asked.iter().rev() {
            if a <= off && off < a + l {
                off = a + l;
            }
            if a < end && end <= a + l {
                end = a;
            }
        }
        if off >= end {
            return None;
        }
        self.asked.push_back((off, end - off));
        if self.asked.len() > REMEMBERED {
            self.asked.pop_front();
        }
        Some((off, end - off))
    }
}

#[derive(Debug, Default)]
struct State {
    predictor: Predictor,
    queue: VecDeque<(u64, u64)>,
    /// Threads started (none: guesses are not even made).
    threads: usize,
    /// Fetches running now.
    running: usize,
    stopped: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// Work was queued, or the prefetcher stopped.
    work: Condvar,
    /// A fetch finished.
    done: Condvar,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

/// A filter that fills itself with what its [`Prefetcher`] guesses (the
/// cache and cow filters).
pub(crate) trait Prefetching: Filter + Sized + 'static {
    /// The filter's prefetcher.
    fn prefetcher(&self) -> &Prefetcher;

    /// Fills `offset..offset+len` from `next`, in a background thread; a
    /// failure is only a wrong guess.
    fn fetch(&self, next: &dyn BlockDevice, offset: u64, len: u64);
}

/// `filter` stacked on `next`, its prefetcher started if `prefetching`.
pub(crate) fn stacked<F: Prefetching>(
    filter: F,
    next: DeviceRef,
    prefetching: bool,
) -> Result<Arc<Filtered<F>>> {
    let dev = Arc::new(Filtered::new(filter, next));
    if prefetching {
        let name = dev.filter().name().to_string();
        dev.filter().prefetcher().start(
            &name,
            Arc::downgrade(&dev),
            |d: &Filtered<F>, offset, len| d.filter().fetch(&**d.next(), offset, len),
        )?;
    }
    Ok(dev)
}

/// A predictor and its background threads.
#[derive(Debug, Default)]
pub(crate) struct Prefetcher {
    shared: Arc<Shared>,
}

impl Prefetcher {
    /// A prefetcher that does nothing until [`started`](Self::start).
    pub(crate) fn new() -> Prefetcher {
        Prefetcher::default()
    }

    /// Starts the threads, which fetch a piece by calling `fetch` on
    /// `target` while it lives (`name` names them: the filter's).
    pub(crate) fn start<T: ?Sized + Send + Sync + 'static>(
        &self,
        name: &str,
        target: Weak<T>,
        fetch: fn(&T, u64, u64),
    ) -> Result<()> {
        for i in 0..THREADS {
            let shared = self.shared.clone();
            let target = target.clone();
            std::thread::Builder::new()
                .name(format!("{name}-prefetch-{i}"))
                .spawn(move || worker(&shared, &target, fetch))
                .map_err(|e| Error::from(e).context(format!("{name}: cannot start a thread")))?;
            self.shared.state().threads += 1;
        }
        Ok(())
    }

    /// Guesses what follows a read of `len` bytes at `offset` (of a device
    /// of `size` bytes) and queues it for the threads, if they run.
    pub(crate) fn after_read(&self, offset: u64, len: u64, size: u64) {
        let mut st = self.shared.state();
        if st.threads == 0 || st.stopped || len == 0 {
            return;
        }
        let pieces = st.predictor.after_read(offset, len, size);
        if pieces.is_empty() {
            return;
        }
        let n = pieces.len();
        for p in pieces {
            if st.queue.len() >= QUEUE {
                st.queue.pop_front();
            }
            st.queue.push_back(p);
        }
        drop(st);
        for _ in 0..n.min(THREADS) {
            self.shared.work.notify_one();
        }
    }

    /// Stops for good: what waits is dropped, and the call returns once no
    /// fetch runs any more (so that the device can close under it). A
    /// fetch must not call it.
    pub(crate) fn stop(&self) {
        let mut st = self.shared.state();
        st.stopped = true;
        st.queue.clear();
        self.shared.work.notify_all();
        while st.running > 0 {
            st = self.shared.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether nothing waits and nothing runs (for tests).
    #[cfg(test)]
    pub(crate) fn idle(&self) -> bool {
        let st = self.shared.state();
        st.queue.is_empty() && st.running == 0
    }
}

impl Drop for Prefetcher {
    /// Stops the threads without waiting for them: the last fetch may be
    /// what drops the prefetcher.
    fn drop(&mut self) {
        let mut st = self.shared.state();
        st.stopped = true;
        st.queue.clear();
        drop(st);
        self.shared.work.notify_all();
    }
}

/// A background thread: fetches queued pieces until the prefetcher stops
/// or its target goes. One lock of the state per piece.
fn worker<T: ?Sized>(shared: &Shared, target: &Weak<T>, fetch: fn(&T, u64, u64)) {
    let mut st = shared.state();
    loop {
        if st.stopped {
            return;
        }
        let Some((off, len)) = st.queue.pop_front() else {
            st = shared.work.wait(st).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        st.running += 1;
        drop(st);
        let alive = match target.upgrade() {
            Some(t) => {
                fetch(&t, off, len);
                true
            }
            None => false,
        };
        st = shared.state();
        st.running -= 1;
        if st.stopped {
            // Someone may wait in stop() for the last fetch.
            shared.done.notify_all();
        }
        if !alive {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_gets_a_growing_window_and_a_scattered_read_its_neighbourhood() {
        let mut p = Predictor::default();
        let size = 1 << 30;
        // A read elsewhere: CLUSTER on either side, aligned.
        let at = 10 << 20;
        let got = p.after_read(at, 4096, size);
        assert_eq!(got, vec![(at - CLUSTER, 2 * CLUSTER + 4096)]);
        // Near it again: only what its neighbourhood adds.
        let got = p.after_read(at + 8192, 4096, size);
        assert_eq!(got, vec![(at + CLUSTER + 4096, 8192)]);
        assert!(p.after_read(10 << 20, 4096, size).is_empty());
        // A stream: the window doubles, only what is new is asked.
        let mut asked = 0;
        let mut at = 100 << 20;
        p.after_read(at, 64 << 10, size);
        for _ in 0..12 {
            at += 64 << 10;
            for (_, n) in p.after_read(at, 64 << 10, size) {
                assert!(n <= PIECE);
                asked += n;
            }
        }
        assert!(asked >= 16 << 20, "{asked}");
        assert!(asked <= (13 << 16) + MAX_WINDOW, "{asked}");
    }

    #[test]
    fn a_prediction_stops_at_the_end_of_the_device() {
        let mut p = Predictor::default();
        let got = p.after_read((4 << 20) - 4096, 4096, 4 << 20);
        let from = (4 << 20) - CLUSTER - ALIGN;
        assert_eq!(got, vec![(from, (4 << 20) - from)]);
        assert!(p.after_read((4 << 20) - 4096, 4096, 4 << 20).is_empty());
    }

    /// Counts the bytes fetched; each fetch waits until the gate opens.
    #[derive(Default)]
    struct Gated {
        open: Mutex<bool>,
        opened: Condvar,
        fetched: std::sync::atomic::AtomicU64,
    }

    #[test]
    fn stopping_waits_for_the_fetches_in_flight_and_drops_the_rest() {
        use std::sync::atomic::Ordering;
        let target = Arc::new(Gated::default());
        let p = Arc::new(Prefetcher::new());
        p.start("test", Arc::downgrade(&target), |g, _, len| {
            let mut open = lock(&g.open);
            while !*open {
                open = g.opened.wait(open).unwrap();
            }
            g.fetched.fetch_add(len, Ordering::SeqCst);
        })
        .unwrap();
        for i in 0..20u64 {
            p.after_read((i + 1) * (16 << 20), 4096, 1 << 30);
        }
        // Every thread holds a piece; the rest wait.
        while p.shared.state().running < THREADS {
            std::thread::yield_now();
        }
        let stopping = {
            let p = p.clone();
            std::thread::spawn(move || p.stop())
        };
        while !p.shared.state().stopped {
            std::thread::yield_now();
        }
        assert!(!stopping.is_finished(), "four fetches still run");
        *lock(&target.open) = true;
        target.opened.notify_all();
        stopping.join().unwrap();
        assert!(p.idle());
        let piece = 2 * CLUSTER + 4096;
        assert_eq!(
            target.fetched.load(Ordering::SeqCst),
            THREADS as u64 * piece,
            "the pieces in flight, no more"
        );
        // Guesses after stopping are not made.
        p.after_read(0, 4096, 1 << 30);
        assert!(p.idle());
    }
}
