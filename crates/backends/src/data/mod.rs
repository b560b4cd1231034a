//! nbdkit's data plugin: a RAM disk whose starting bytes are given on the
//! command line, as `data=` (nbdkit's little language: see [`parse`]),
//! `raw=` (the bytes of the value) or `base64=`. The disk's pages are
//! nbdkit's sparse allocator's ([`pages`]), so that block status reports
//! the holes, allocated zeros and data nbdkit reports for the same
//! expression; writes, zeroes and trims change it like a memory disk.

pub mod eval;
pub mod optimize;
pub mod pages;
pub mod parse;

use std::rc::Rc;
use std::sync::RwLock;

use diskit_core::device::check_range;
use diskit_core::sync::{read, write};
use diskit_core::{BlockDevice, Capabilities, Extent, Result, WriteFlags, ZeroFlags};

use pages::Pages;
use parse::Lookup;

/// How the disk's first bytes are given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source<'a> {
    /// `data=`: an expression.
    Expression(&'a str),
    /// `raw=` (or `base64=` decoded): the bytes themselves.
    Raw(&'a [u8]),
}

/// A RAM disk made from the data plugin's parameters.
pub struct DataDevice {
    size: u64,
    pages: RwLock<Pages>,
}

impl DataDevice {
    /// The disk `source` describes, `size` bytes long if given, else as
    /// long as the source; `$VAR`s are looked up with `lookup`.
    pub fn new(source: Source<'_>, size: Option<u64>, lookup: Lookup<'_>) -> Result<DataDevice> {
        let mut pages = Pages::new();
        let implied = match source {
            Source::Raw(bytes) => {
                pages.write(bytes, 0);
                bytes.len() as u64
            }
            Source::Expression(text) => {
                let root = optimize::optimize(&Rc::new(parse::parse(text, lookup)?));
                eval::evaluate(&root, &mut pages)?
            }
        };
        Ok(DataDevice {
            size: size.unwrap_or(implied),
            pages: RwLock::new(pages),
        })
    }
}

impl BlockDevice for DataDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn capabilities(&self) -> Capabilities {
        // nbdkit's plugin: flush is a no-op, so FUA is native; every
        // zero is fast.
        Capabilities {
            can_flush: true,
            ..Capabilities::IN_MEMORY
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        read(&self.pages).read(buf, offset);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        write(&self.pages).write(buf, offset);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size, offset, len)?;
        write(&self.pages).zero(len, offset);
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        self.write_zeroes(offset, len, ZeroFlags::default())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size, offset, len)?;
        // Bound the work per call (64 MiB of pages): callers ask again.
        let len = len.min(2048 * pages::PAGE);
        Ok(read(&self.pages).extents(offset, len))
    }
    fn describe(&self) -> String {
        format!("data({})", self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_pads_or_cuts_and_extents_follow_pages() {
        let none = |_: &str| None;
        let d = DataDevice::new(Source::Expression("1 @65536 0"), Some(1 << 20), &none).unwrap();
        assert_eq!(d.size(), 1 << 20);
        let e = d.extents(0, d.size()).unwrap();
        // Page 0 data, page 1 hole, page 2 allocated zeros, rest holes.
        assert!(e[0].flags.data && !e[0].flags.zero);
        assert!(!e[1].flags.data);
        assert!(e[2].flags.data && e[2].flags.zero);
        let raw = DataDevice::new(Source::Raw(b"hello"), None, &none).unwrap();
        assert_eq!(raw.size(), 5);
        let mut b = [0u8; 5];
        raw.read_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"hello");
        raw.write_zeroes(0, 5, ZeroFlags::default()).unwrap();
        assert!(raw.extents(0, 5).unwrap()[0].flags.zero);
    }
}
