//! Buffers kept for the next request: a request's buffer is given back
//! when it completes, so that a steady stream of requests neither maps
//! nor faults in memory of its own each time. They are mapped, their
//! pages made when first touched: a 128 KiB read costs 128 KiB of a
//! buffer sized for the largest request, not the whole of it zeroed.

use std::sync::Mutex;

use diskit_core::Result;
use diskit_core::buffer::AlignedBuf;
use diskit_core::sync::lock;

/// How many idle buffers are kept (more in flight are made and dropped).
const KEEP: usize = 32;

/// Page-aligned buffers of one size.
pub struct BufPool {
    size: usize,
    idle: Mutex<Vec<AlignedBuf>>,
}

impl BufPool {
    /// An empty pool of buffers of `size` bytes.
    pub fn new(size: usize) -> BufPool {
        BufPool {
            size,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A buffer of at least `len` bytes (what it holds is unspecified).
    pub fn take(&self, len: usize) -> Result<AlignedBuf> {
        if len > self.size {
            return AlignedBuf::mapped(len);
        }
        match lock(&self.idle).pop() {
            Some(b) => Ok(b),
            None => AlignedBuf::mapped(self.size),
        }
    }

    /// Takes a buffer back (one of another size is dropped).
    pub fn give(&self, buf: AlignedBuf) {
        if buf.len() != self.size {
            return;
        }
        let mut idle = lock(&self.idle);
        if idle.len() < KEEP {
            idle.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_odd_sizes_do_not_stay() {
        let pool = BufPool::new(8192);
        let mut a = pool.take(100).unwrap();
        assert_eq!(a.len(), 8192);
        a[0] = 7;
        pool.give(a);
        assert_eq!(pool.take(8192).unwrap()[0], 7, "the same buffer again");
        let big = pool.take(10000).unwrap();
        assert!(big.len() >= 10000);
        pool.give(big);
        assert!(lock(&pool.idle).is_empty());
    }
}
