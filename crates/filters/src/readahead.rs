//! The readahead filter (nbdkit-readahead-filter): after each read, asks
//! the layer below to cache what the client is likely to read next, in the
//! background, so that a cache below (the cow filter with `cow-on-cache`,
//! or a device that prefetches) has it by the time it is asked for.
//!
//! Two patterns are predicted:
//! - **sequential**: a read that starts where an earlier one ended
//!   continues a stream; the window ahead of it doubles with each such
//!   read, from 128 KiB up to 32 MiB;
//! - **clustered**: any other read is taken as a visit to a region that
//!   will be read around; the 1 MiB on either side of it is asked for
//!   (a guest inspector reading metadata and the files next to it).
//!
//! Cache requests run on a few background threads, several in flight at
//! once; ranges asked for recently are not asked again, and when the
//! threads fall behind, the oldest predictions are dropped rather than
//! delaying anything. Reads themselves pass straight through: the filter
//! never holds a lock around I/O. Over a device that does not cache, the
//! filter does nothing but pass requests through.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, Weak};

use crate::registry::{Configure, over, unknown};
use diskit_core::sync::lock;
use diskit_core::{BlockDevice, DeviceRef, Error, Filter, Result};

/// The keys the filter takes (none, as nbdkit's).
pub const KEYS: &[&str] = &[];

/// The first window ahead of a sequential stream.
const MIN_WINDOW: u64 = 128 << 10;
/// The largest window ahead of a sequential stream.
const MAX_WINDOW: u64 = 32 << 20;
/// How far around a read elsewhere is asked for, on each side.
const CLUSTER: u64 = 1 << 20;
/// Streams followed at once.
const STREAMS: usize = 16;
/// Ranges remembered as asked for.
const REMEMBERED: usize = 256;
/// Cache requests waiting at most; older ones are dropped.
const QUEUE: usize = 64;
/// Background threads.
const THREADS: usize = 4;
/// Cache requests are aligned to this (and cut in pieces of at most
/// [`MAX_WINDOW`]).
const ALIGN: u64 = 64 << 10;

/// A sequential stream: where it will continue, and its window.
#[derive(Debug, Clone, Copy)]
struct Stream {
    next: u64,
    window: u64,
    /// How far ahead has been asked for already.
    asked_to: u64,
}

#[derive(Debug, Default)]
struct State {
    streams: VecDeque<Stream>,
    /// Recently asked ranges, newest last.
    asked: VecDeque<(u64, u64)>,
    queue: VecDeque<(u64, u64)>,
    stopped: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    work: Condvar,
}

/// The filter.
#[derive(Debug)]
pub struct Readahead {
    shared: Arc<Shared>,
    size: u64,
    enabled: bool,
}

impl Readahead {
    /// The filter over `next`, with its background threads (none when
    /// `next` cannot cache).
    pub fn new(next: &DeviceRef) -> Result<Readahead> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
        });
        let enabled = next.capabilities().can_cache;
        if enabled {
            for i in 0..THREADS {
                let shared = shared.clone();
                let below: Weak<dyn BlockDevice> = Arc::downgrade(next);
                std::thread::Builder::new()
                    .name(format!("readahead-{i}"))
                    .spawn(move || worker(&shared, &below))
                    .map_err(|e| Error::from(e).context("readahead: cannot start a thread"))?;
            }
        }
        Ok(Readahead {
            shared,
            size: next.size(),
            enabled,
        })
    }

    /// The ranges worth caching after a read of `len` bytes at `offset`.
    fn predict(st: &mut State, offset: u64, len: u64, size: u64) -> Vec<(u64, u64)> {
        let end = offset + len;
        let mut want = Vec::new();
        if let Some(i) = st.streams.iter().position(|s| s.next == offset) {
            let mut s = st.streams.remove(i).expect("found");
            s.window = (s.window * 2).min(MAX_WINDOW);
            s.next = end;
            let to = (end + s.window).min(size);
            let from = s.asked_to.max(end);
            if from < to {
                want.push((from, to - from));
                s.asked_to = to;
            }
            st.streams.push_back(s);
        } else {
            if st.streams.len() >= STREAMS {
                st.streams.pop_front();
            }
            st.streams.push_back(Stream {
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

    /// Queues `want`, less what was asked for recently.
    fn ask(&self, want: Vec<(u64, u64)>, st: &mut State) {
        for (mut off, len) in want {
            let end = off + len;
            // Trim what a recent request covered (from either end).
            for &(a, l) in st.asked.iter().rev() {
                if a <= off && off < a + l {
                    off = a + l;
                }
            }
            if off >= end {
                continue;
            }
            let len = end - off;
            if st
                .asked
                .iter()
                .any(|&(a, l)| a <= off && off + len <= a + l)
            {
                continue;
            }
            st.asked.push_back((off, len));
            if st.asked.len() > REMEMBERED {
                st.asked.pop_front();
            }
            let mut at = off;
            while at < end {
                let n = (end - at).min(MAX_WINDOW);
                if st.queue.len() >= QUEUE {
                    st.queue.pop_front();
                }
                st.queue.push_back((at, n));
                at += n;
            }
            self.shared.work.notify_all();
        }
    }
}

/// A background thread: runs queued cache requests until the filter goes.
fn worker(shared: &Shared, below: &Weak<dyn BlockDevice>) {
    loop {
        let (off, len) = {
            let mut st = lock(&shared.state);
            loop {
                if st.stopped {
                    return;
                }
                if let Some(r) = st.queue.pop_front() {
                    break r;
                }
                st = shared.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(dev) = below.upgrade() else {
            return;
        };
        // A prediction that fails costs nothing but the prediction.
        let _ = dev.cache(off, len);
    }
}

impl Drop for Readahead {
    fn drop(&mut self) {
        lock(&self.shared.state).stopped = true;
        self.shared.work.notify_all();
    }
}

impl Filter for Readahead {
    fn name(&self) -> &str {
        "readahead"
    }

    // No file view: reads spliced past the filter would go unpredicted.
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.enabled && !buf.is_empty() {
            let mut st = lock(&self.shared.state);
            let want = Self::predict(&mut st, offset, buf.len() as u64, self.size);
            self.ask(want, &mut st);
        }
        next.read_at(buf, offset)
    }

    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        {
            let mut st = lock(&self.shared.state);
            st.stopped = true;
            st.queue.clear();
        }
        self.shared.work.notify_all();
        next.close()
    }
}

/// The filter's configuration: it takes no parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadaheadConfig;

impl Configure for ReadaheadConfig {
    fn set(&mut self, key: &str, _value: &str) -> Result<()> {
        Err(unknown("readahead", key))
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Readahead::new(&next)?, next))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Probe;
    use diskit_core::{Capabilities, Filtered};
    use std::time::{Duration, Instant};

    /// The filter over `size` bytes that record what they are asked to
    /// cache.
    fn setup(size: u64) -> (Arc<Probe>, Filtered<Readahead>) {
        let below = Arc::new(Probe::new(size));
        let next: DeviceRef = below.clone();
        (below, Filtered::new(Readahead::new(&next).unwrap(), next))
    }

    fn covered(c: &[(u64, u64)], off: u64, len: u64) -> bool {
        let mut at = off;
        loop {
            match c.iter().find(|&&(a, l)| a <= at && at < a + l) {
                Some(&(a, l)) => {
                    at = a + l;
                    if at >= off + len {
                        return true;
                    }
                }
                None => return false,
            }
        }
    }

    fn wait_until(f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "timed out");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn sequential_reads_get_a_growing_window_ahead() {
        let (below, d) = setup(256 << 20);
        let mut buf = vec![0u8; 64 << 10];
        for i in 0..20u64 {
            d.read_at(&mut buf, i * (64 << 10)).unwrap();
        }
        let end = 20 * (64 << 10);
        // Far past the last read: the window grew.
        wait_until(|| covered(&below.cached.lock().unwrap(), end, 8 << 20));
        assert_eq!(below.reads(), 20);
    }

    #[test]
    fn a_read_elsewhere_gets_its_neighbourhood_once() {
        let (below, d) = setup(64 << 20);
        let mut buf = vec![0u8; 4096];
        d.read_at(&mut buf, 30 << 20).unwrap();
        wait_until(|| covered(&below.cached.lock().unwrap(), (29 << 20) + 4096, 2 << 20));
        let n = below.cached.lock().unwrap().len();
        // Reading nearby again asks for nothing new.
        d.read_at(&mut buf, (30 << 20) + 100_000).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let again: u64 = below.cached.lock().unwrap()[n..].iter().map(|c| c.1).sum();
        assert!(again <= 200_000, "asked for {again} bytes again");
    }

    #[test]
    fn without_cache_below_it_only_passes_reads() {
        let below: DeviceRef = Arc::new(Probe::new(1 << 20).caps(|c| Capabilities {
            can_cache: false,
            ..c
        }));
        let d = Filtered::new(Readahead::new(&below).unwrap(), below);
        assert!(!d.filter().enabled);
        let mut buf = vec![1u8; 4096];
        d.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }
}
