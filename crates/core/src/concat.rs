//! Concatenation of devices: `convert A B C DST` copies A, B and C end to end.

use crate::device::{BlockDevice, Capabilities, DeviceRef, WriteFlags, ZeroFlags};
use crate::error::{Error, Result};
use crate::extent::Extent;

/// Several devices end to end, seen as one.
pub struct Concat {
    parts: Vec<(u64, DeviceRef)>,
    size: u64,
}

impl Concat {
    /// Joins `devices` end to end. Fails if the total size overflows.
    pub fn new(devices: Vec<DeviceRef>) -> Result<Concat> {
        let mut parts = Vec::with_capacity(devices.len());
        let mut size = 0u64;
        for d in devices {
            let s = d.size();
            parts.push((size, d));
            size = size
                .checked_add(s)
                .ok_or_else(|| Error::new(crate::ErrorKind::Overflow, "total size too large"))?;
        }
        Ok(Concat { parts, size })
    }

    /// Calls `f` for each piece of `offset..offset+len` with the part, the
    /// offset within it, the offset within the request, and the piece's length.
    fn for_each_piece(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&DeviceRef, u64, u64, u64) -> Result<bool>,
    ) -> Result<()> {
        crate::device::check_range(self.size, offset, len)?;
        let mut done = 0u64;
        let first = self
            .parts
            .partition_point(|(start, _)| *start <= offset)
            .saturating_sub(1);
        for (start, dev) in &self.parts[first..] {
            if done == len {
                break;
            }
            let pos = offset + done;
            let end = start + dev.size();
            if pos >= end {
                continue;
            }
            let n = (end - pos).min(len - done);
            if !f(dev, pos - start, done, n)? {
                break;
            }
            done += n;
        }
        Ok(())
    }
}

impl BlockDevice for Concat {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::IN_MEMORY;
        for (_, d) in &self.parts {
            let c = d.capabilities();
            caps.can_write &= c.can_write;
            caps.can_flush |= c.can_flush;
            caps.can_fua &= c.can_fua;
            caps.can_trim &= c.can_trim;
            caps.can_write_zeroes &= c.can_write_zeroes;
            caps.can_zero &= c.can_zero;
            caps.can_fast_zero &= c.can_fast_zero;
            caps.can_extents &= c.can_extents;
            caps.can_multi_conn &= c.can_multi_conn;
            caps.can_cache |= c.can_cache;
            caps.is_rotational |= c.is_rotational;
        }
        caps
    }

    fn is_known_zero(&self) -> bool {
        self.parts.iter().all(|(_, d)| d.is_known_zero())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.for_each_piece(offset, buf.len() as u64, |d, off, at, n| {
            d.read_at(&mut buf[at as usize..(at + n) as usize], off)?;
            Ok(true)
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.for_each_piece(offset, buf.len() as u64, |d, off, at, n| {
            d.write_at(&buf[at as usize..(at + n) as usize], off, flags)?;
            Ok(true)
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.for_each_piece(offset, len, |d, off, _, n| {
            d.write_zeroes(off, n, flags)?;
            Ok(true)
        })
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.for_each_piece(offset, len, |d, off, _, n| {
            d.trim(off, n, flags)?;
            Ok(true)
        })
    }

    fn flush(&self) -> Result<()> {
        self.parts.iter().try_for_each(|(_, d)| d.flush())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.for_each_piece(offset, len, |d, off, _, n| {
            d.cache(off, n)?;
            Ok(true)
        })
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // Answer from the first part the range touches only: callers loop.
        let mut out = Vec::new();
        self.for_each_piece(offset, len, |d, off, _, n| {
            out = d.extents(off, n)?;
            for e in &mut out {
                e.host_offset = None;
            }
            Ok(false)
        })?;
        Ok(out)
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self.parts.iter().map(|(_, d)| d.describe()).collect();
        format!("concat({})", names.join(", "))
    }

    /// Closes every part, even after one fails; the first failure is returned.
    fn close(&self) -> Result<()> {
        let mut first = Ok(());
        for (_, d) in &self.parts {
            let r = d.close();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use crate::testing::Closing;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn closing_closes_every_part_even_after_a_failure() {
        let parts: Vec<Arc<Closing>> = [false, true, false, true]
            .into_iter()
            .map(|fail| {
                Arc::new(Closing {
                    closes: AtomicUsize::new(0),
                    fail,
                })
            })
            .collect();
        let c = Concat::new(parts.iter().map(|p| p.clone() as DeviceRef).collect()).unwrap();
        assert_eq!(c.close().unwrap_err().kind(), ErrorKind::NoSpace);
        assert!(parts.iter().all(|p| p.closes.load(Ordering::SeqCst) == 1));
        let ok = Arc::new(Closing {
            closes: AtomicUsize::new(0),
            fail: false,
        });
        Concat::new(vec![ok.clone() as DeviceRef])
            .unwrap()
            .close()
            .unwrap();
        assert_eq!(ok.closes.load(Ordering::SeqCst), 1);
    }
}
