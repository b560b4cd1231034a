//! Splitting the source into work items, guided by its extents.

use std::collections::VecDeque;

use diskit_core::{BlockDevice, Extent, Result, extent};

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
    /// A layer below the source's top answers the range: the destination
    /// has the same layer below it, so nothing is written.
    pub skip: bool,
}

/// Zero ranges are handed out in pieces no larger than this, so that a
/// destination that must really write zeros spreads the work over workers.
const MAX_ZERO_ITEM: u64 = 1 << 30;

/// Hands out the items of a range of the source in order. Extents are
/// fetched as needed and queued, so each extents query serves many items.
pub struct Planner {
    /// The source's size.
    size: u64,
    /// Where the range ends.
    end: u64,
    request: u64,
    pos: u64,
    seq: u64,
    queue: VecDeque<Extent>,
    /// Zero extents are only trusted in whole aligned blocks of this size.
    zero_align: u64,
    /// Ranges answered below the source's top layer are skipped.
    skip_below: bool,
}

impl Planner {
    /// A planner over a source of `size` bytes with data requests of `request` bytes.
    pub fn new(size: u64, request: u64) -> Planner {
        Planner::range(size, 0, size, request)
    }

    /// A planner over `start..end` of a source of `size` bytes.
    pub fn range(size: u64, start: u64, end: u64, request: u64) -> Planner {
        Planner {
            size,
            end: end.min(size),
            request: request.max(512),
            pos: start,
            seq: 0,
            queue: VecDeque::new(),
            zero_align: 1,
            skip_below: false,
        }
    }

    /// Skips the ranges that a layer below the source's top answers (the
    /// destination has the same backing file: `convert -B`).
    pub fn skipping_backing(mut self, skip: bool) -> Planner {
        self.skip_below = skip;
        self
    }

    /// Normalizes an extent to what the copy needs: skipped (depth 1, not
    /// zero), zero, or data (both at depth 0).
    fn classify(&self, e: Extent) -> Extent {
        let mut e = e;
        if self.skip_below && e.depth > 0 {
            e.depth = 1;
            e.flags.zero = false;
        } else {
            e.depth = 0;
        }
        e
    }

    /// Asks the source about the whole range at once, before `next` needs
    /// it: on another thread, for a source where each question is a round
    /// trip (NBD), so that the worker does not wait for the answers.
    pub fn prefilled(mut self, src: &dyn BlockDevice) -> Result<Planner> {
        loop {
            let covered = self.pos + self.queue.iter().map(|e| e.length).sum::<u64>();
            if covered >= self.end {
                return Ok(self);
            }
            self.fill(src, covered)?;
        }
    }

    /// Queues the extents from `from` on (the queue holds what precedes it).
    fn fill(&mut self, src: &dyn BlockDevice, from: u64) -> Result<()> {
        // One answer (a prefix), never trusted to stay inside the range asked.
        let rest = self.end - from;
        let mut start = from;
        for e in extent::clip(src.extents(from, rest)?, rest) {
            let e = self.classify(e);
            self.push(start, e);
            start += e.length;
        }
        if start == from {
            // A device that answers nothing: treat the rest as data.
            self.push_merged(Extent::data(self.end - from));
        }
        Ok(())
    }

    /// Treats the unaligned edges of zero extents as data, so that every
    /// zero item covers whole aligned blocks of `align` bytes (compressed
    /// targets store whole clusters only).
    pub fn with_zero_alignment(mut self, align: u64) -> Planner {
        self.zero_align = align.max(1);
        self
    }

    fn push(&mut self, start: u64, e: Extent) {
        let end = start + e.length;
        let al = self.zero_align;
        if !e.flags.zero || al == 1 {
            self.push_merged(e);
            return;
        }
        let a = start.div_ceil(al) * al;
        let b = if end == self.size { end } else { end / al * al };
        if a >= b {
            self.push_merged(Extent::data(e.length));
            return;
        }
        if a > start {
            self.push_merged(Extent::data(a - start));
        }
        self.queue.push_back(Extent { length: b - a, ..e });
        if end > b {
            self.queue.push_back(Extent::data(end - b));
        }
    }

    /// Queues an extent, joining it to the previous one when both are to be
    /// read: only zero or not matters to the copy.
    fn push_merged(&mut self, e: Extent) {
        match self.queue.back_mut() {
            Some(back) if !back.flags.zero && !e.flags.zero && back.depth == e.depth => {
                back.length += e.length
            }
            _ => self.queue.push_back(e),
        }
    }

    /// The next item, or None at the end.
    pub fn next(&mut self, src: &dyn BlockDevice) -> Result<Option<Item>> {
        if self.pos >= self.end {
            return Ok(None);
        }
        if self.queue.is_empty() {
            self.fill(src, self.pos)?;
        }
        // A data run that stops short of the request boundary may continue
        // in the next extents (unaligned zero edges become data): look, so
        // that one request reads it whole.
        loop {
            let front = self.queue.front().expect("queue filled above");
            let boundary = self.request - self.pos % self.request;
            let end = self.pos + front.length;
            if front.flags.zero
                || self.queue.len() > 1
                || front.length >= boundary
                || end >= self.end
            {
                break;
            }
            self.fill(src, end)?;
            if self.queue.len() > 1 {
                break;
            }
        }
        let front = self.queue.front_mut().expect("queue filled above");
        if front.depth > 0 {
            let item = Item {
                seq: self.seq,
                offset: self.pos,
                len: front.length,
                zero: false,
                skip: true,
            };
            self.pos += front.length;
            self.queue.pop_front();
            return Ok(Some(item));
        }
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
            skip: false,
        };
        self.seq += 1;
        self.pos += len;
        Ok(Some(item))
    }
}
