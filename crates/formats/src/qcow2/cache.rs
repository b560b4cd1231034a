//! A bounded least-recently-used cache of metadata tables (L2 tables and
//! refcount blocks), keyed by their host offset, with dirty tracking.

use std::collections::{BTreeMap, HashMap};

use super::layout::HostOffset;

/// One cached table.
pub struct Slot<T> {
    /// The table.
    pub table: T,
    /// Changed in memory since it was last written.
    pub dirty: bool,
    stamp: u64,
}

/// A bounded cache: at most `capacity` tables.
pub struct TableCache<T> {
    slots: HashMap<HostOffset, Slot<T>>,
    by_age: BTreeMap<u64, HostOffset>,
    clock: u64,
    capacity: usize,
}

impl<T> TableCache<T> {
    /// An empty cache holding up to `capacity` tables (at least 2).
    pub fn new(capacity: usize) -> TableCache<T> {
        TableCache {
            slots: HashMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
            capacity: capacity.max(2),
        }
    }

    /// The cached table at `at`, marked as just used.
    pub fn get(&mut self, at: HostOffset) -> Option<&mut Slot<T>> {
        let slot = self.slots.get_mut(&at)?;
        self.by_age.remove(&slot.stamp);
        self.clock += 1;
        slot.stamp = self.clock;
        self.by_age.insert(self.clock, at);
        Some(slot)
    }

    /// Whether `at` is cached.
    pub fn contains(&self, at: HostOffset) -> bool {
        self.slots.contains_key(&at)
    }

    /// The table that the next insertion would evict, if the cache is full.
    pub fn victim(&self) -> Option<HostOffset> {
        if self.slots.len() < self.capacity {
            return None;
        }
        self.by_age.values().next().copied()
    }

    /// Inserts a table (the caller has made room with [`Self::victim`] and
    /// [`Self::remove`]).
    pub fn insert(&mut self, at: HostOffset, table: T, dirty: bool) -> &mut Slot<T> {
        self.clock += 1;
        if let Some(old) = self.slots.remove(&at) {
            self.by_age.remove(&old.stamp);
        }
        self.by_age.insert(self.clock, at);
        self.slots.entry(at).or_insert(Slot {
            table,
            dirty,
            stamp: self.clock,
        })
    }

    /// Removes a table, returning it.
    pub fn remove(&mut self, at: HostOffset) -> Option<Slot<T>> {
        let slot = self.slots.remove(&at)?;
        self.by_age.remove(&slot.stamp);
        Some(slot)
    }

    /// Offsets of every dirty table, in offset order.
    pub fn dirty(&self) -> Vec<HostOffset> {
        let mut v: Vec<_> = self
            .slots
            .iter()
            .filter(|(_, s)| s.dirty)
            .map(|(k, _)| *k)
            .collect();
        v.sort();
        v
    }

    /// Whether any table is dirty.
    pub fn any_dirty(&self) -> bool {
        self.slots.values().any(|s| s.dirty)
    }

    /// A table without touching its age.
    pub fn peek_mut(&mut self, at: HostOffset) -> Option<&mut Slot<T>> {
        self.slots.get_mut(&at)
    }

    /// Drops every table (the caller has written the dirty ones).
    pub fn clear(&mut self) {
        self.slots.clear();
        self.by_age.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut c = TableCache::new(2);
        c.insert(HostOffset(1), "a", false);
        c.insert(HostOffset(2), "b", true);
        assert_eq!(c.victim(), Some(HostOffset(1)));
        c.get(HostOffset(1));
        assert_eq!(c.victim(), Some(HostOffset(2)));
        assert_eq!(c.dirty(), vec![HostOffset(2)]);
        c.remove(HostOffset(2));
        assert_eq!(c.victim(), None);
    }
}
