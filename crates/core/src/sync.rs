//! Locks that outlive a panic elsewhere.
//!
//! A thread that panics while holding a [`Mutex`] poisons it. diskit's
//! locks guard data that is consistent at every unlock (a counter, a
//! queue, a list of held ranges), so the next holder goes on with it
//! rather than spreading the panic to every thread of a server or copy.

use std::sync::{
    Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// Locks `m`, recovering the guard if a panic elsewhere poisoned it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes `l` to read, recovering the guard if a panic elsewhere poisoned
/// it.
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// Takes `l` to write, recovering the guard if a panic elsewhere
/// poisoned it.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `c`, giving `guard` back and taking it again when woken,
/// recovering it if a panic elsewhere poisoned the lock.
pub fn wait<'a, T>(c: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    c.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = Mutex::new(1);
        let r = std::thread::scope(|s| {
            s.spawn(|| {
                let _g = m.lock().unwrap();
                panic!("poison");
            })
            .join()
        });
        assert!(r.is_err());
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
