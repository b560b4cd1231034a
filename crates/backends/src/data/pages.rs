//! nbdkit's sparse allocator (its `common/allocators/sparse.c`), whose
//! page-level behaviour the data plugin's block status shows: 32 KiB pages
//! made by any write or non-zero fill, freed when a zero fill covers them
//! or leaves them all zeros and when a copy (blit) leaves them all zeros.
//! An allocated page of zeros is reported as allocated zeros, a missing
//! one as a hole.

use std::collections::HashMap;

use diskit_core::extent::push_merged;
use diskit_core::zero::is_zero;
use diskit_core::{Extent, ExtentFlags};

/// The page size of nbdkit's sparse allocator.
pub const PAGE: u64 = 32 * 1024;

/// Pages of bytes, by page number; a missing page reads as zeros.
#[derive(Default)]
pub struct Pages {
    pages: HashMap<u64, Box<[u8]>>,
}

/// Calls `f(page, offset in page, offset in the range, length)` for the
/// page-sized pieces of `offset..offset+len`.
fn pieces(offset: u64, len: u64, mut f: impl FnMut(u64, usize, usize, usize)) {
    let mut done = 0u64;
    while done < len {
        let pos = offset + done;
        let within = (pos % PAGE) as usize;
        let n = (PAGE - within as u64).min(len - done);
        f(pos / PAGE, within, done as usize, n as usize);
        done += n;
    }
}

impl Pages {
    /// No pages.
    pub fn new() -> Pages {
        Pages::default()
    }

    fn page_mut(&mut self, page: u64) -> &mut [u8] {
        self.pages
            .entry(page)
            .or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&self, buf: &mut [u8], offset: u64) {
        pieces(offset, buf.len() as u64, |page, within, at, n| {
            match self.pages.get(&page) {
                Some(p) => buf[at..at + n].copy_from_slice(&p[within..within + n]),
                None => buf[at..at + n].fill(0),
            }
        });
    }

    /// Writes `buf` at `offset`, making the pages it touches.
    pub fn write(&mut self, buf: &[u8], offset: u64) {
        pieces(offset, buf.len() as u64, |page, within, at, n| {
            self.page_mut(page)[within..within + n].copy_from_slice(&buf[at..at + n]);
        });
    }

    /// `len` bytes of `byte` at `offset`; zeros are [`zero`](Self::zero).
    pub fn fill(&mut self, byte: u8, len: u64, offset: u64) {
        if byte == 0 {
            return self.zero(len, offset);
        }
        pieces(offset, len, |page, within, _, n| {
            self.page_mut(page)[within..within + n].fill(byte);
        });
    }

    /// Zeros `len` bytes at `offset`, freeing each page that ends all
    /// zeros.
    pub fn zero(&mut self, len: u64, offset: u64) {
        pieces(offset, len, |page, within, _, n| {
            if let Some(p) = self.pages.get_mut(&page) {
                p[within..within + n].fill(0);
                if is_zero(p) {
                    self.pages.remove(&page);
                }
            }
        });
    }

    /// Copies `len` bytes at `from` of `src` to `to` here, freeing each
    /// page it touches that ends all zeros.
    pub fn blit(&mut self, src: &Pages, len: u64, from: u64, to: u64) {
        pieces(to, len, |page, within, at, n| {
            let p = self.page_mut(page);
            src.read(&mut p[within..within + n], from + at as u64);
            if is_zero(p) {
                self.pages.remove(&page);
            }
        });
    }

    /// The extents of `offset..offset+len`: missing pages are holes,
    /// pages whose bytes from the range's start in them to their end are
    /// zeros are allocated zeros, the rest data.
    pub fn extents(&self, offset: u64, len: u64) -> Vec<Extent> {
        let mut out = Vec::new();
        pieces(offset, len, |page, within, _, n| {
            let e = match self.pages.get(&page) {
                None => Extent::hole(n as u64),
                Some(p) if is_zero(&p[within..]) => Extent {
                    flags: ExtentFlags {
                        zero: true,
                        ..Extent::data(0).flags
                    },
                    ..Extent::data(n as u64)
                },
                Some(_) => Extent::data(n as u64),
            };
            push_merged(&mut out, e);
        });
        out
    }

    /// Bytes held in pages.
    pub fn allocated(&self) -> u64 {
        self.pages.len() as u64 * PAGE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_come_and_go_as_nbdkit_s_do() {
        let mut p = Pages::new();
        p.write(&[0], 10);
        assert_eq!(p.allocated(), PAGE, "a write of a zero makes a page");
        let e = p.extents(0, PAGE * 2);
        assert!(e[0].flags.zero && e[0].flags.data && e[0].length == PAGE);
        assert!(!e[1].flags.data);
        p.fill(7, 3, PAGE - 1);
        assert_eq!(p.allocated(), 2 * PAGE);
        p.zero(1, PAGE - 1);
        assert_eq!(p.allocated(), PAGE, "the first page is all zeros again");
        let mut src = Pages::new();
        src.write(&[0; 8], 0);
        p.blit(&src, 8, 0, PAGE);
        assert_eq!(p.allocated(), 0, "a blit leaving zeros frees the page");
        let mut b = [9u8; 4];
        p.read(&mut b, PAGE);
        assert_eq!(b, [0; 4]);
    }
}
