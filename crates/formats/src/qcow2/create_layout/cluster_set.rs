//! Sets of clusters as ranges: the refcounts of a new image (0 or 1).

use std::collections::BTreeMap;

use super::{PResult, internal};

/// A set of clusters, as disjoint half-open ranges (start → end).
#[derive(Debug, Clone, Default)]
pub(super) struct ClusterSet {
    pub(super) ranges: BTreeMap<u64, u64>,
}

impl ClusterSet {
    /// The range holding `c`, if any.
    pub(super) fn range_of(&self, c: u64) -> Option<(u64, u64)> {
        self.ranges
            .range(..=c)
            .next_back()
            .filter(|&(_, &e)| e > c)
            .map(|(&s, &e)| (s, e))
    }

    #[cfg(test)]
    pub(super) fn contains(&self, c: u64) -> bool {
        self.range_of(c).is_some()
    }

    /// The first range intersecting `start..end`.
    pub(super) fn first_overlap(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        if let Some(r) = self.range_of(start) {
            return Some(r);
        }
        self.ranges.range(start..end).next().map(|(&s, &e)| (s, e))
    }

    /// Adds `start..end`, which must not intersect the set.
    pub(super) fn insert(&mut self, start: u64, end: u64) -> PResult<()> {
        if start >= end {
            return Ok(());
        }
        if self.first_overlap(start, end).is_some() {
            return Err(internal("refcount of an allocated cluster would exceed 1"));
        }
        let mut s = start;
        let mut e = end;
        if let Some((ps, pe)) = self
            .ranges
            .range(..start)
            .next_back()
            .map(|(&a, &b)| (a, b))
            && pe == start
        {
            self.ranges.remove(&ps);
            s = ps;
        }
        if let Some(ne) = self.ranges.get(&end).copied() {
            self.ranges.remove(&end);
            e = ne;
        }
        self.ranges.insert(s, e);
        Ok(())
    }

    /// Removes `start..end`, which must be wholly in the set.
    pub(super) fn remove(&mut self, start: u64, end: u64) -> PResult<()> {
        if start >= end {
            return Ok(());
        }
        match self.range_of(start) {
            Some((s, e)) if e >= end => {
                self.ranges.remove(&s);
                if s < start {
                    self.ranges.insert(s, start);
                }
                if end < e {
                    self.ranges.insert(end, e);
                }
                Ok(())
            }
            _ => Err(internal("refcount of a free cluster would drop below 0")),
        }
    }

    /// The parts of the set within `start..end`.
    pub(super) fn clipped(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let first = self.range_of(start).map(|(s, _)| s).unwrap_or(start);
        self.ranges
            .range(first..end)
            .map(move |(&s, &e)| (s.max(start), e.min(end)))
            .filter(|(s, e)| s < e)
    }
}
