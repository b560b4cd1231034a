//! Incremental copies: a source seen through what changed in it since
//! the last copy (a dirty bitmap, read over NBD as
//! `qemu:dirty-bitmap:NAME`). [`OnlyChanged`] reports the unchanged
//! ranges as answered by a layer below the source's top, which a copy
//! with [`CopyOptions::skip_backing`](crate::CopyOptions::skip_backing)
//! leaves alone, as it leaves what a shared backing file holds: the
//! destination has them already. Changed ranges keep the source's own
//! extents and are written whole, zeros included.

use std::sync::Arc;

use diskit_core::extent::{self, ExtentWalker};
use diskit_core::{BlockDevice, Error, ErrorKind, Extent, Filter, Result};

/// What says which ranges of a source changed.
pub trait ChangedRanges: Send + Sync {
    /// Runs `(length, changed)` covering a prefix of `offset..offset+len`
    /// (at least one byte of it), in order.
    fn changed(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>>;
}

/// A source whose unchanged ranges read as left to the layer below (see
/// the module documentation).
pub struct OnlyChanged {
    changed: Arc<dyn ChangedRanges>,
}

impl OnlyChanged {
    /// The source as `changed` says it changed.
    pub fn new(changed: Arc<dyn ChangedRanges>) -> OnlyChanged {
        OnlyChanged { changed }
    }
}

/// An unchanged range: answered below the top, not known to be zero.
fn unchanged(length: u64) -> Extent {
    Extent {
        depth: 1,
        ..Extent::data(length)
    }
}

impl Filter for OnlyChanged {
    fn name(&self) -> &str {
        "changed"
    }

    fn reads_unchanged(&self) -> bool {
        true
    }

    fn submits_below(&self) -> bool {
        true
    }

    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut left = len;
        for (l, changed) in self.changed.changed(offset, len)? {
            let l = l.min(left);
            if l == 0 {
                break;
            }
            runs.push((l, changed));
            left -= l;
        }
        if runs.is_empty() {
            return Err(Error::new(
                ErrorKind::Io,
                format!(
                    "{}: no changed ranges given for {len} bytes at {offset}",
                    next.describe()
                ),
            ));
        }
        // The source's allocation is asked once, from the first changed
        // byte to the last.
        let first = runs
            .iter()
            .position(|r| r.1)
            .map_or(0, |i| runs[..i].iter().map(|r| r.0).sum::<u64>());
        let end = runs
            .iter()
            .rposition(|r| r.1)
            .map_or(0, |i| runs[..=i].iter().map(|r| r.0).sum::<u64>());
        let mut source = Cursor {
            walk: extent::walk(next, offset + first, end.saturating_sub(first)),
            pending: None,
        };
        let mut out = Vec::new();
        let mut pos = 0;
        for (l, changed) in runs {
            if changed {
                for e in source.take(l)? {
                    extent::push_merged(&mut out, e);
                }
            } else {
                if pos > first && pos < end {
                    // A gap between changed runs: passed over.
                    source.take(l)?;
                }
                extent::push_merged(&mut out, unchanged(l));
            }
            pos += l;
        }
        Ok(out)
    }
}

/// The source's extents, taken a length at a time.
struct Cursor<'a> {
    walk: ExtentWalker<'a, dyn BlockDevice + 'a>,
    pending: Option<Extent>,
}

impl Cursor<'_> {
    /// The extents of the next `len` bytes, at this layer (a source that
    /// stops answering reads as data there).
    fn take(&mut self, len: u64) -> Result<Vec<Extent>> {
        let mut out = Vec::new();
        let mut left = len;
        while left > 0 {
            let e = match self.pending.take() {
                Some(e) => e,
                None => match self.walk.next_answered()? {
                    Some(e) => e,
                    None => Extent::data(left),
                },
            };
            let mut head = Extent {
                depth: 0,
                host_offset: None,
                ..e
            };
            if e.length > left {
                head.length = left;
                self.pending = Some(Extent {
                    length: e.length - left,
                    ..e
                });
            }
            left -= head.length;
            out.push(head);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::{Filtered, WriteFlags};

    /// Changed ranges from a fixed list, answered at most `per_answer`
    /// runs at a time.
    struct Fixed {
        runs: Vec<(u64, u64)>,
        per_answer: usize,
    }

    impl ChangedRanges for Fixed {
        fn changed(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
            let end = offset + len;
            let mut out = Vec::new();
            let mut pos = offset;
            for &(s, e) in &self.runs {
                let (s, e) = (s.max(pos), e.min(end));
                if s >= e {
                    continue;
                }
                if s > pos {
                    out.push((s - pos, false));
                }
                out.push((e - s, true));
                pos = e;
            }
            if pos < end {
                out.push((end - pos, false));
            }
            out.truncate(self.per_answer);
            Ok(out)
        }
    }

    const K: u64 = 64 << 10;

    #[test]
    fn unchanged_ranges_read_as_below_and_changed_ones_as_the_source() {
        let mem = Arc::new(MemoryDevice::new(16 * K));
        mem.write_at(&[1u8; K as usize], 2 * K, WriteFlags::NONE)
            .unwrap();
        let changed = Arc::new(Fixed {
            runs: vec![(K, 3 * K), (8 * K, 9 * K)],
            per_answer: 100,
        });
        let dev = Filtered::new(OnlyChanged::new(changed), mem);
        let got: Vec<(u64, u32, bool)> = dev
            .extents(0, 16 * K)
            .unwrap()
            .iter()
            .map(|e| (e.length, e.depth, e.flags.zero))
            .collect();
        assert_eq!(
            got,
            vec![
                (K, 1, false),
                (K, 0, true),
                (K, 0, false),
                (5 * K, 1, false),
                (K, 0, true),
                (7 * K, 1, false),
            ]
        );
    }

    #[test]
    fn a_prefix_answer_gives_a_prefix() {
        let mem = Arc::new(MemoryDevice::new(16 * K));
        let changed = Arc::new(Fixed {
            runs: vec![(K, 3 * K), (8 * K, 9 * K)],
            per_answer: 2,
        });
        let dev = Filtered::new(OnlyChanged::new(changed), mem);
        let got = dev.extents(0, 16 * K).unwrap();
        assert_eq!(got.iter().map(|e| e.length).sum::<u64>(), 3 * K);
        assert_eq!(got.last().unwrap().depth, 0);
    }

    #[test]
    fn a_copy_writes_only_what_changed() {
        use crate::{CopyOptions, Progress, copy};
        let src = Arc::new(MemoryDevice::new(16 * K));
        src.write_at(&[7u8; 16 * K as usize], 0, WriteFlags::NONE)
            .unwrap();
        // Zeroed since the last copy: the destination must be zeroed there.
        src.write_zeroes(8 * K, K, diskit_core::ZeroFlags::default())
            .unwrap();
        let dst = Arc::new(MemoryDevice::new(16 * K));
        dst.write_at(&[9u8; 16 * K as usize], 0, WriteFlags::NONE)
            .unwrap();
        let changed = Arc::new(Fixed {
            runs: vec![(K, 3 * K), (8 * K, 9 * K)],
            per_answer: 1,
        });
        let view = Filtered::new(OnlyChanged::new(changed), src);
        let opts = CopyOptions {
            skip_backing: true,
            workers: 2,
            request_size: K as usize,
            ..CopyOptions::default()
        };
        copy(&view, &dst, &opts, &Progress::default()).unwrap();
        let mut got = vec![0u8; 16 * K as usize];
        dst.read_at(&mut got, 0).unwrap();
        let at = |k: u64| got[(k * K) as usize];
        assert_eq!(at(0), 9, "unchanged: left alone");
        assert_eq!((at(1), at(2)), (7, 7), "changed: copied");
        assert_eq!(at(3), 9);
        assert_eq!(at(8), 0, "changed to zeros: zeroed");
        assert_eq!(at(9), 9);
    }
}
