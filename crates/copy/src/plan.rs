//! Splitting the source into work items, guided by its extents.

use std::collections::VecDeque;

use diskit_core::{BlockDevice, Extent, Result};

/// One piece of work: a range that is either known zero or to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// Sequence number, in source order.
    pub seq: u64,
    /// Start in the source.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The source reports the range as reading zeros.
    pub zero: bool,
}

/// Zero ranges are handed out in pieces no larger than this, so that a
/// destination that must really write zeros spreads the work over workers.
const MAX_ZERO_ITEM: u64 = 1 << 30;

/// Hands out items in source order. Extents are fetched as needed and
/// queued, so each extents query serves many items.
pub struct Planner {
    size: u64,
    request: u64,
    pos: u64,
    seq: u64,
    queue: VecDeque<Extent>,
}

impl Planner {
    /// A planner over a source of `size` bytes with data requests of `request` bytes.
    pub fn new(size: u64, request: u64) -> Planner {
        Planner {
            size,
            request: request.max(512),
            pos: 0,
            seq: 0,
            queue: VecDeque::new(),
        }
    }

    /// The next item, or None at the end.
    pub fn next(&mut self, src: &dyn BlockDevice) -> Result<Option<Item>> {
        if self.pos >= self.size {
            return Ok(None);
        }
        if self.queue.is_empty() {
            let ex = src.extents(self.pos, self.size - self.pos)?;
            let mut covered = 0u64;
            for e in ex {
                // Never trust a device to stay inside the range asked.
                let len = e.length.min(self.size - self.pos - covered);
                if len == 0 {
                    break;
                }
                covered += len;
                self.queue.push_back(Extent { length: len, ..e });
            }
            if self.queue.is_empty() {
                // A device that answers nothing: treat the rest as data.
                self.queue.push_back(Extent::data(self.size - self.pos));
            }
        }
        let front = self.queue.front_mut().expect("queue filled above");
        let zero = front.flags.zero;
        let cap = if zero { MAX_ZERO_ITEM } else { self.request };
        // Align data requests to the request size so that later ones stay aligned.
        let to_boundary = if zero {
            cap
        } else {
            self.request - self.pos % self.request
        };
        let len = front.length.min(to_boundary);
        front.length -= len;
        if front.length == 0 {
            self.queue.pop_front();
        }
        let item = Item {
            seq: self.seq,
            offset: self.pos,
            len,
            zero,
        };
        self.seq += 1;
        self.pos += len;
        Ok(Some(item))
    }
}
