//! Aligned, owned I/O buffers (for O_DIRECT and for requests in flight).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, ErrorKind, Result};

/// A zero-initialised heap buffer whose start is aligned to `align` bytes.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
    /// Made by [`AlignedBuf::mapped`] with mmap (undone with munmap).
    mapped: bool,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8], like a Box<[u8]>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    pub fn new(len: usize, align: usize) -> Result<AlignedBuf> {
        let layout = Layout::from_size_align(len.max(1), align.max(1))
            .map_err(|_| Error::invalid("bad buffer alignment"))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        AlignedBuf::owning(ptr, layout, false)
    }

    /// Allocates `len` zeroed, page-aligned bytes whose pages are only
    /// made when first touched: for buffers kept in a pool that a request
    /// may leave untouched (a read handed to a sink), which would
    /// otherwise cost a page fault and a zeroing per 4 KiB up front. Small
    /// ones come from [`new`](Self::new). Not for a buffer per request: a
    /// mapping costs system calls to make and to undo.
    pub fn mapped(len: usize) -> Result<AlignedBuf> {
        if len < MAP_AT_LEAST {
            return Self::new(len, MAP_ALIGN);
        }
        let layout = Layout::from_size_align(len, MAP_ALIGN)
            .map_err(|_| Error::invalid("bad buffer size"))?;
        // SAFETY: an anonymous private mapping of a non-zero size; no
        // existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                layout.size(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let ptr = if p == libc::MAP_FAILED {
            std::ptr::null_mut()
        } else {
            p.cast::<u8>()
        };
        AlignedBuf::owning(ptr, layout, true)
    }

    /// The buffer at `ptr` (null: the allocation or mapping failed) of
    /// `layout`, `mapped` or allocated.
    fn owning(ptr: *mut u8, layout: Layout, mapped: bool) -> Result<AlignedBuf> {
        let what = if mapped { "map" } else { "allocate" };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::new(ErrorKind::OutOfMemory, format!("cannot {what} I/O buffer"))
        })?;
        Ok(AlignedBuf {
            ptr,
            layout,
            mapped,
        })
    }

    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether the buffer is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr points to layout.size() initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in mapped() with this very size.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.layout.size()) };
        } else {
            // SAFETY: allocated in new() with this very layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }
}

/// [`AlignedBuf::mapped`] maps buffers at least this long.
const MAP_AT_LEAST: usize = 256 << 10;
/// The alignment of [`AlignedBuf::mapped`] buffers (a page at least).
const MAP_ALIGN: usize = 4096;

/// A thread's reusable page-aligned buffer, for [`with_reused`].
pub type ReusedBuf = std::cell::RefCell<Option<AlignedBuf>>;

/// Runs `f` on `len` bytes of the page-aligned buffer the thread keeps in
/// `slot`: made (zeroed) or grown when too small, to `len` rounded up to a
/// power of two and at least 64 KiB, and kept for the next call, so that a
/// request neither maps nor faults in a buffer of its own. Past `keep`
/// bytes a buffer is made for the call alone. The bytes are whatever an
/// earlier call left: `f` fills what it reads. A call nested in `f` with
/// the same slot gets a buffer of its own.
pub fn with_reused<R>(
    slot: &'static std::thread::LocalKey<ReusedBuf>,
    len: usize,
    keep: usize,
    f: impl FnOnce(&mut [u8]) -> Result<R>,
) -> Result<R> {
    const PAGE: usize = 4096;
    if len > keep {
        let mut b = AlignedBuf::new(len, PAGE)?;
        return f(&mut b[..len]);
    }
    let mut b = match slot.with(|c| c.take()) {
        Some(b) if b.len() >= len => b,
        _ => AlignedBuf::new(len.next_power_of_two().max(64 << 10), PAGE)?,
    };
    let r = f(&mut b[..len]);
    slot.with(|c| c.replace(Some(b)));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_zeroed() {
        // From the allocator and mapped, small and large, odd sizes too.
        for len in [10000, (1 << 20) + 123] {
            for align in [1, 512, 4096, 8192] {
                let mut b = AlignedBuf::new(len, align).unwrap();
                assert_eq!(b.len(), len);
                assert_eq!(b.as_ptr() as usize % align, 0);
                assert!(b.iter().all(|&x| x == 0));
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
            let mut b = AlignedBuf::mapped(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 4096, 0);
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 7;
            assert_eq!(b[len - 1], 7);
        }
    }
}
