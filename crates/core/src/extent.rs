//! Extents: what a range of a device is made of.
//!
//! One description feeds `map`, NBD block status and convert's hole
//! skipping: whether a range reads as zeros, whether it has data allocated,
//! at which layer of a backing chain it was found, and where it lives in
//! that layer's file.
//!
//! [`BlockDevice::extents`] may answer only a prefix of the range asked, and
//! a buggy layer may answer more than was asked, or nothing at all. The
//! walker ([`walk`], [`ExtentWalker`]) is the one loop that turns such
//! answers into extents covering exactly a range: it asks again after a
//! prefix, clips what is too long, and fails (instead of looping forever)
//! when the device stops making progress. [`collect`] gathers a walk into
//! merged extents; [`clip`] cuts one answer to a length.

use crate::device::BlockDevice;
use crate::error::{Error, ErrorKind, Result};

/// Flags of an extent, in qemu-img map's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExtentFlags {
    /// The range reads as zeros.
    pub zero: bool,
    /// The range has data allocated (false: a hole; NBD_STATE_HOLE).
    pub data: bool,
    /// The range is allocated in some layer of the chain (qemu's "present").
    pub present: bool,
    /// The data is stored compressed.
    pub compressed: bool,
}

/// A run of bytes with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (> 0).
    pub length: u64,
    /// Allocation state.
    pub flags: ExtentFlags,
    /// The layer of the backing chain that answered (0 = this device).
    pub depth: u32,
    /// Where the first byte lives in the answering layer's file, when it
    /// lives at a plain offset there.
    pub host_offset: Option<u64>,
}

impl Extent {
    /// Allocated data at this layer, location unknown.
    pub fn data(length: u64) -> Extent {
        Extent {
            length,
            flags: ExtentFlags {
                zero: false,
                data: true,
                present: true,
                compressed: false,
            },
            depth: 0,
            host_offset: None,
        }
    }

    /// A hole that reads as zeros, at this layer.
    pub fn hole(length: u64) -> Extent {
        Extent {
            length,
            flags: ExtentFlags {
                zero: true,
                data: false,
                present: true,
                compressed: false,
            },
            depth: 0,
            host_offset: None,
        }
    }

    /// Sets the host offset of the first byte.
    pub fn at_host(mut self, offset: u64) -> Extent {
        self.host_offset = Some(offset);
        self
    }

    /// Whether the range reads as zeros without looking at it.
    pub fn is_zero(&self) -> bool {
        self.flags.zero
    }

    /// Whether `next` continues `self` with the same state, so the two can merge.
    pub fn can_merge(&self, next: &Extent) -> bool {
        self.flags == next.flags
            && self.depth == next.depth
            && match (self.host_offset, next.host_offset) {
                (None, None) => true,
                (Some(a), Some(b)) => a.checked_add(self.length) == Some(b),
                _ => false,
            }
    }
}

/// Appends `e` to `list`, merging it into the last extent when possible.
pub fn push_merged(list: &mut Vec<Extent>, e: Extent) {
    if e.length == 0 {
        return;
    }
    if let Some(last) = list.last_mut()
        && last.can_merge(&e)
    {
        last.length += e.length;
        return;
    }
    list.push(e);
}

/// Cuts `extents` to `len` bytes in all, dropping empty ones: a layer below
/// that answers for more than was asked must not leak past the range.
pub fn clip(extents: Vec<Extent>, len: u64) -> Vec<Extent> {
    let mut left = len;
    let mut out = Vec::with_capacity(extents.len());
    for mut e in extents {
        if left == 0 {
            break;
        }
        e.length = e.length.min(left);
        if e.length > 0 {
            left -= e.length;
            out.push(e);
        }
    }
    out
}

/// Walks `offset..offset+len` of `dev`: see [`ExtentWalker`].
pub fn walk<D: BlockDevice + ?Sized>(dev: &D, offset: u64, len: u64) -> ExtentWalker<'_, D> {
    ExtentWalker::new(dev, offset, len)
}

/// The extents of `offset..offset+len` of `dev`, merged with
/// [`push_merged`]: at most `limit` of them, covering the whole range
/// unless the limit cuts it short (then the walk stops before the first
/// extent that would be one too many, so the prefix covered is as long as
/// `limit` extents allow). A device that stops answering is an error (see
/// [`ExtentWalker`]).
pub fn collect<D: BlockDevice + ?Sized>(
    dev: &D,
    offset: u64,
    len: u64,
    limit: usize,
) -> Result<Vec<Extent>> {
    let mut out: Vec<Extent> = Vec::new();
    for e in walk(dev, offset, len) {
        let e = e?;
        let merges = out.last().is_some_and(|last| last.can_merge(&e));
        if !merges && out.len() >= limit {
            break;
        }
        push_merged(&mut out, e);
    }
    Ok(out)
}

/// The extents of a range of a device, one at a time, in order: they are
/// contiguous from the range's start, never empty, and cover exactly the
/// range (the last one is clipped at its end).
///
/// The device is asked lazily: first for the whole range, then, whenever
/// its answer is used up, for what is left of the range, so a device that
/// answers a prefix is asked again and a walk stopped early asks no more.
/// Extents of an answer that reach past the range are clipped; zero-length
/// ones are skipped. An answer that covers nothing (empty, or only
/// zero-length extents) makes the walk fail with an [`ErrorKind::Io`]
/// error naming the device (its [`describe`](BlockDevice::describe)):
/// asking again would get the same answer forever. After an error, the
/// device's or that one, the walk ends; [`stalled`](Self::stalled) tells
/// the two apart, for callers that have a fallback for a device that
/// stops answering (see [`next_answered`](Self::next_answered)).
pub struct ExtentWalker<'a, D: BlockDevice + ?Sized> {
    dev: &'a D,
    pos: u64,
    end: u64,
    answer: std::vec::IntoIter<Extent>,
    /// Whether the current answer has covered any bytes yet.
    progressed: bool,
    stalled: bool,
    done: bool,
}

impl<'a, D: BlockDevice + ?Sized> ExtentWalker<'a, D> {
    /// A walk over `offset..offset+len` of `dev` (nothing when `len` is 0).
    /// Nothing is asked before the first extent is.
    pub fn new(dev: &'a D, offset: u64, len: u64) -> ExtentWalker<'a, D> {
        ExtentWalker {
            dev,
            pos: offset,
            end: offset.saturating_add(len),
            answer: Vec::new().into_iter(),
            // No answer yet: nothing to call stalled.
            progressed: true,
            stalled: false,
            done: false,
        }
    }

    /// Where the next extent starts: the end of the last one given.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// The end of the range walked.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Whether the walk ended because the device answered nothing for
    /// the rest of the range (rather than by reaching the end or by an
    /// error of the device).
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// The next extent, or `None` at the end of the range or when the
    /// device stops answering ([`stalled`](Self::stalled) says which):
    /// for callers that fall back to something else for the rest of the
    /// range. Errors of the device are still errors.
    pub fn next_answered(&mut self) -> Result<Option<Extent>> {
        match self.next() {
            Some(Err(_)) if self.stalled => Ok(None),
            other => other.transpose(),
        }
    }
}

impl<D: BlockDevice + ?Sized> Iterator for ExtentWalker<'_, D> {
    type Item = Result<Extent>;

    fn next(&mut self) -> Option<Result<Extent>> {
        if self.done {
            return None;
        }
        loop {
            if self.pos >= self.end {
                self.done = true;
                return None;
            }
            for e in self.answer.by_ref() {
                let length = e.length.min(self.end - self.pos);
                if length > 0 {
                    self.pos += length;
                    self.progressed = true;
                    return Some(Ok(Extent { length, ..e }));
                }
            }
            if !self.progressed {
                self.done = true;
                self.stalled = true;
                return Some(Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "{} returned no extents at offset {}",
                        self.dev.describe(),
                        self.pos
                    ),
                )));
            }
            match self.dev.extents(self.pos, self.end - self.pos) {
                Ok(v) => {
                    self.answer = v.into_iter();
                    self.progressed = false;
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

impl<D: BlockDevice + ?Sized> std::iter::FusedIterator for ExtentWalker<'_, D> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Capabilities;
    use std::sync::Mutex;

    /// Answers each extents call with the next of `answers` (then data up
    /// to the end), offsets ignored, and logs the calls.
    struct Scripted {
        answers: Mutex<Vec<Result<Vec<Extent>>>>,
        calls: Mutex<Vec<(u64, u64)>>,
    }

    impl Scripted {
        fn new(answers: Vec<Result<Vec<Extent>>>) -> Scripted {
            Scripted {
                answers: Mutex::new(answers.into_iter().rev().collect()),
                calls: Mutex::new(Vec::new()),
            }
        }
        fn calls(&self) -> Vec<(u64, u64)> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl BlockDevice for Scripted {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::READ_ONLY
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            buf.fill(0);
            Ok(())
        }
        fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
            self.calls.lock().unwrap().push((offset, len));
            self.answers
                .lock()
                .unwrap()
                .pop()
                .unwrap_or_else(|| Ok(vec![Extent::data(len)]))
        }
        fn describe(&self) -> String {
            "scripted".into()
        }
    }

    fn lens(v: &[Extent]) -> Vec<u64> {
        v.iter().map(|e| e.length).collect()
    }

    #[test]
    fn prefix_answers_are_followed_by_more_questions() {
        let d = Scripted::new(vec![
            Ok(vec![Extent::data(10), Extent::hole(5)]),
            Ok(vec![Extent::hole(20)]),
        ]);
        let got: Vec<Extent> = walk(&d, 100, 50).collect::<Result<_>>().unwrap();
        assert_eq!(lens(&got), [10, 5, 20, 15]);
        assert!(got[1].is_zero() && got[2].is_zero() && !got[3].is_zero());
        assert_eq!(d.calls(), [(100, 50), (115, 35), (135, 15)]);
    }

    #[test]
    fn too_long_answers_are_clipped_and_not_asked_again() {
        let d = Scripted::new(vec![Ok(vec![
            Extent::data(30).at_host(7),
            Extent::hole(1000),
            Extent::data(5),
        ])]);
        let mut w = walk(&d, 0, 40);
        let got: Vec<Extent> = w.by_ref().collect::<Result<_>>().unwrap();
        assert_eq!(lens(&got), [30, 10]);
        assert_eq!(got[0].host_offset, Some(7));
        assert_eq!(w.position(), 40);
        assert!(!w.stalled());
        assert_eq!(d.calls(), [(0, 40)]);

        // One extent far too long.
        let d = Scripted::new(vec![Ok(vec![Extent::hole(u64::MAX)])]);
        assert_eq!(lens(&collect(&d, 8, 16, usize::MAX).unwrap()), [16]);
    }

    #[test]
    fn zero_length_extents_are_skipped() {
        let d = Scripted::new(vec![Ok(vec![
            Extent::data(0),
            Extent::hole(3),
            Extent::hole(0),
            Extent::data(4),
        ])]);
        let got: Vec<Extent> = walk(&d, 0, 10).collect::<Result<_>>().unwrap();
        assert_eq!(lens(&got), [3, 4, 3]);
        assert_eq!(d.calls(), [(0, 10), (7, 3)]);
    }

    #[test]
    fn empty_answers_fail_naming_the_device_and_end_the_walk() {
        for stuck in [vec![], vec![Extent::data(0), Extent::hole(0)]] {
            let d = Scripted::new(vec![Ok(vec![Extent::data(4)]), Ok(stuck)]);
            let mut w = walk(&d, 0, 10);
            assert_eq!(w.next().unwrap().unwrap().length, 4);
            let e = w.next().unwrap().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io);
            assert!(e.to_string().contains("scripted"), "{e}");
            assert!(e.to_string().contains("offset 4"), "{e}");
            assert!(w.stalled());
            assert!(w.next().is_none());
            assert_eq!(d.calls(), [(0, 10), (4, 6)]);

            let d = Scripted::new(vec![Ok(vec![])]);
            assert!(collect(&d, 0, 10, usize::MAX).is_err());
        }
    }

    #[test]
    fn next_answered_stops_at_a_stall_but_not_at_an_error() {
        let d = Scripted::new(vec![Ok(vec![Extent::hole(4)]), Ok(vec![])]);
        let mut w = walk(&d, 0, 10);
        assert_eq!(w.next_answered().unwrap().unwrap().length, 4);
        assert!(w.next_answered().unwrap().is_none());
        assert!(w.stalled());
        assert_eq!(w.position(), 4);

        let d = Scripted::new(vec![Err(Error::from_kind(ErrorKind::NoSpace))]);
        let mut w = walk(&d, 0, 10);
        assert_eq!(w.next_answered().unwrap_err().kind(), ErrorKind::NoSpace);
        assert!(!w.stalled());
        assert!(w.next().is_none());
    }

    #[test]
    fn empty_ranges_ask_nothing() {
        let d = Scripted::new(vec![]);
        assert!(walk(&d, 5, 0).next().is_none());
        assert!(collect(&d, 5, 0, usize::MAX).unwrap().is_empty());
        assert!(d.calls().is_empty());
    }

    #[test]
    fn collecting_merges_up_to_a_limit() {
        let answers = || {
            vec![
                Ok(vec![Extent::data(10), Extent::data(10)]),
                Ok(vec![Extent::hole(5), Extent::hole(5)]),
                Ok(vec![Extent::data(10)]),
            ]
        };
        let d = Scripted::new(answers());
        assert_eq!(lens(&collect(&d, 0, 40, usize::MAX).unwrap()), [20, 10, 10]);
        let d = Scripted::new(answers());
        // The second hole still merges; the data after it would be a third.
        assert_eq!(lens(&collect(&d, 0, 40, 2).unwrap()), [20, 10]);
        assert_eq!(d.calls(), [(0, 40), (20, 20), (30, 10)]);
        let d = Scripted::new(answers());
        assert_eq!(lens(&collect(&d, 0, 40, 1).unwrap()), [20]);
        assert_eq!(d.calls(), [(0, 40), (20, 20)]);
    }

    #[test]
    fn clipping_extents() {
        let v = clip(
            vec![Extent::data(10), Extent::hole(10), Extent::data(5)],
            15,
        );
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].length, 5);
        assert!(
            clip(vec![Extent::data(0), Extent::hole(3)], 2)[0]
                .flags
                .zero
        );
    }

    #[test]
    fn merging_needs_same_flags_and_contiguous_host_offsets() {
        let mut v = Vec::new();
        push_merged(&mut v, Extent::data(10).at_host(0));
        push_merged(&mut v, Extent::data(5).at_host(10));
        push_merged(&mut v, Extent::data(5).at_host(100));
        push_merged(&mut v, Extent::hole(5));
        push_merged(&mut v, Extent::hole(0));
        push_merged(&mut v, Extent::hole(7));
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].length, 15);
        assert_eq!(v[2].length, 12);
    }
}
