//! Decompressed blocks, kept and decompressed ahead.
//!
//! At most `depth` blocks (`xz-max-depth`) are held or being
//! decompressed at once, shared by every connection: a block several
//! reads need is decompressed once, the others wait for it. A read that
//! continues an earlier one (a stream: nbdcopy, a copy, `dd`) has the
//! blocks after its own decompressed ahead on the filter's threads, one
//! per processor, so that a sequential reader finds them ready and every
//! processor decompresses; nothing is decompressed ahead of reads that
//! jump about. When the cache is full the block used least recently
//! makes room (read ahead only gives up blocks that were read already,
//! never the reader's own); a failed decompression is forgotten, and each
//! read that needs the block tries again and gets its own error. The
//! buffers of blocks given up are reused.

use std::sync::{Arc, Condvar, Mutex};

use diskit_core::sync::{lock, wait};
use diskit_core::workers::Workers;
use diskit_core::{BlockDevice, DeviceRef, Result};

use super::block::decode;
use super::index::Index;

/// Reads remembered to recognise streams.
const RECENT: usize = 32;
/// Buffers of blocks given up kept for reuse.
const SPARE: usize = 2;

/// One block held, or being decompressed.
struct Slot {
    block: usize,
    /// The bytes; `None` while being decompressed.
    data: Option<Arc<Vec<u8>>>,
    /// When it was last used (a count of uses).
    used: u64,
    /// Whether a read has used it (blocks decompressed ahead have not).
    read: bool,
}

#[derive(Default)]
struct State {
    slots: Vec<Slot>,
    clock: u64,
    /// Where recent reads ended, oldest first.
    recent: Vec<u64>,
    /// Blocks being decompressed ahead.
    ahead: usize,
    spare: Vec<Vec<u8>>,
}

impl State {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn find(&mut self, block: usize) -> Option<&mut Slot> {
        self.slots.iter_mut().find(|s| s.block == block)
    }

    /// Adds a slot for `block`, to be decompressed (for a read when
    /// `read`); returns a buffer for it.
    fn claim(&mut self, block: usize, read: bool) -> Vec<u8> {
        let used = self.tick();
        self.slots.push(Slot {
            block,
            data: None,
            used,
            read,
        });
        self.spare.pop().unwrap_or_default()
    }

    /// Gives up the least recently used block held (only one that was
    /// read, when `read_only`; never `keep`); false when none may go.
    fn evict(&mut self, read_only: bool, keep: usize) -> bool {
        let victim = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.data.is_some() && s.block != keep && (s.read || !read_only))
            .min_by_key(|(_, s)| s.used)
            .map(|(i, _)| i);
        let Some(i) = victim else { return false };
        let slot = self.slots.swap_remove(i);
        if let Some(v) = slot.data.and_then(|d| Arc::try_unwrap(d).ok())
            && self.spare.len() < SPARE
        {
            self.spare.push(v);
        }
        true
    }
}

/// The decompressed blocks of one file.
pub struct Blocks {
    index: Index,
    below: DeviceRef,
    memlimit: u64,
    depth: usize,
    /// Blocks decompressed ahead of a stream, at most.
    reach: usize,
    state: Mutex<State>,
    changed: Condvar,
    workers: Workers,
}

impl Blocks {
    /// The blocks of `index`, read from `below`, at most `depth` held.
    pub fn new(index: Index, below: DeviceRef, memlimit: u64, depth: usize) -> Blocks {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let reach = cores.min(depth.saturating_sub(1));
        Blocks {
            index,
            below,
            memlimit,
            depth: depth.max(1),
            reach,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            workers: Workers::new("diskit-xz", reach),
        }
    }

    /// The map of the file.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Block `i`, decompressed (from `next` if it must be now).
    pub fn get(&self, i: usize, next: &dyn BlockDevice) -> Result<Arc<Vec<u8>>> {
        let mut st = lock(&self.state);
        loop {
            let now = st.tick();
            if let Some(slot) = st.find(i) {
                if let Some(d) = &slot.data {
                    slot.used = now;
                    slot.read = true;
                    return Ok(d.clone());
                }
            } else if st.slots.len() < self.depth || st.evict(false, i) {
                break;
            }
            // Being decompressed, or no room until something is.
            st = wait(&self.changed, st);
        }
        let spare = st.claim(i, true);
        drop(st);
        self.finish(i, decode(&self.index, i, next, self.memlimit, spare))
    }

    /// Records the end of block `i`'s decompression.
    fn finish(&self, i: usize, r: Result<Vec<u8>>) -> Result<Arc<Vec<u8>>> {
        let mut st = lock(&self.state);
        let at = st
            .slots
            .iter()
            .position(|s| s.block == i && s.data.is_none());
        let r = match r {
            Ok(v) => {
                let d = Arc::new(v);
                if let Some(at) = at {
                    st.slots[at].data = Some(d.clone());
                }
                Ok(d)
            }
            Err(e) => {
                if let Some(at) = at {
                    st.slots.swap_remove(at);
                }
                Err(e)
            }
        };
        drop(st);
        self.changed.notify_all();
        r
    }

    /// Notes a read of `offset..end`, which uses block `i`: when it
    /// continues an earlier read, the blocks after `i` are decompressed
    /// ahead.
    pub fn note_read(self: &Arc<Self>, i: usize, offset: u64, end: u64) {
        let mut st = lock(&self.state);
        let stream = st.recent.contains(&offset);
        if st.recent.len() == RECENT {
            st.recent.remove(0);
        }
        st.recent.push(end);
        if !stream || self.reach == 0 {
            return;
        }
        let mut start = Vec::new();
        for j in i + 1..(i + 1 + self.reach).min(self.index.blocks.len()) {
            if st.ahead >= self.reach {
                break;
            }
            if st.find(j).is_some() {
                continue;
            }
            if st.slots.len() >= self.depth && !st.evict(true, i) {
                break;
            }
            st.ahead += 1;
            let spare = st.claim(j, false);
            start.push((j, spare));
        }
        drop(st);
        for (j, spare) in start {
            let me = self.clone();
            self.workers.run(move || {
                let r = decode(&me.index, j, &*me.below, me.memlimit, spare);
                // A failure is the reader's to meet, with its own read.
                let _ = me.finish(j, r);
                lock(&me.state).ahead -= 1;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xz::index::Block;
    use diskit_backends::MemoryDevice;

    /// An index of `n` blocks of 1000 bytes whose data is nowhere: every
    /// decompression fails, which is enough to watch the slots.
    fn blocks(n: usize, depth: usize) -> Arc<Blocks> {
        let index = Index {
            blocks: (0..n)
                .map(|i| Block {
                    start: i as u64 * 1000,
                    size: 1000,
                    offset: 12 + i as u64 * 100,
                    unpadded: 100,
                    stream: 0,
                })
                .collect(),
            streams: vec![[0; 12]],
            size: n as u64 * 1000,
        };
        let mem: DeviceRef = Arc::new(MemoryDevice::new(1 << 20));
        Arc::new(Blocks::new(index, mem, 64 << 20, depth))
    }

    #[test]
    fn failures_are_forgotten_and_each_reader_gets_its_own() {
        let b = blocks(4, 2);
        let mem = MemoryDevice::new(1 << 20);
        for _ in 0..3 {
            let e = b.get(1, &mem).unwrap_err().to_string();
            assert!(e.starts_with("xz: block 1 at offset 112"), "{e}");
        }
        assert!(lock(&b.state).slots.is_empty());
    }

    #[test]
    fn room_is_made_from_the_least_recently_used_block_read() {
        let mut st = State::default();
        for (block, used, read) in [(0, 1, true), (1, 5, true), (2, 2, false)] {
            st.slots.push(Slot {
                block,
                data: Some(Arc::new(vec![0; 10])),
                used,
                read,
            });
        }
        // Read ahead gives up only blocks read, never the reader's own.
        assert!(st.evict(true, 1));
        assert_eq!(st.clone_blocks(), vec![2, 1]);
        assert!(!st.evict(true, 1));
        // A reader gives up any.
        assert!(st.evict(false, 1));
        assert_eq!(st.clone_blocks(), vec![1]);
        assert_eq!(st.spare.len(), 2);
    }

    impl State {
        fn clone_blocks(&self) -> Vec<usize> {
            self.slots.iter().map(|s| s.block).collect()
        }
    }
}
