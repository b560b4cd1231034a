//! A byte budget bounding the memory of the requests in flight on one
//! connection: the request reader takes from it before buffering a request,
//! the worker gives back once the reply is written.

use std::sync::{Condvar, Mutex};

use diskit_core::sync;

/// Bytes in flight, capped.
pub struct Budget {
    cap: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl Budget {
    /// A budget of `cap` bytes.
    pub fn new(cap: u64) -> Budget {
        Budget {
            cap: cap.max(1),
            used: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    /// Takes `n` bytes (at most the whole budget), waiting while other
    /// requests hold too much. A request alone may always proceed.
    /// Returns what was taken, to give back with [`Budget::release`].
    pub fn acquire(&self, n: u64) -> u64 {
        let n = n.min(self.cap);
        let mut used = sync::lock(&self.used);
        while *used > 0 && *used + n > self.cap {
            used = self.freed.wait(used).unwrap_or_else(|p| p.into_inner());
        }
        *used += n;
        n
    }

    /// Gives back `n` bytes taken by [`Budget::acquire`].
    pub fn release(&self, n: u64) {
        let mut used = sync::lock(&self.used);
        *used -= n;
        self.freed.notify_all();
    }

    /// Bytes currently taken.
    pub fn used(&self) -> u64 {
        *sync::lock(&self.used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn acquire_waits_for_release() {
        let b = Arc::new(Budget::new(100));
        assert_eq!(b.acquire(1000), 100, "capped to the budget");
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.acquire(10));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished());
        b.release(100);
        assert_eq!(t.join().unwrap(), 10);
        assert_eq!(b.used(), 10);
    }
}
