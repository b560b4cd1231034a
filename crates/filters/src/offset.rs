//! The offset filter (nbdkit-offset-filter): serves the window
//! `offset .. offset+range` of the device below.
//!
//! - `offset=SIZE`: where the window starts (default 0).
//! - `range=SIZE`: its length (default: up to the end of the device).
//!
//! A window that does not fit in the device is an error (nbdkit reports it
//! when a client connects; diskit when the filter is stacked, before
//! serving). Every request is checked against the window before it is
//! shifted, so nothing outside it is ever reached; extents come back from
//! the device below cut to the window.

use diskit_core::extent::clip;
use diskit_core::{
    BlockDevice, Error, Extent, FileView, Filter, Request, Result, Route, WriteFlags, ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["offset", "range"];

/// The parameters, as given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffsetConfig {
    /// Start of the window.
    pub offset: u64,
    /// Length of the window; `None` reaches the end of the device.
    pub range: Option<u64>,
}

impl Configure for OffsetConfig {
    /// Takes `offset=` and `range=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "offset" => self.offset = params::size("offset", key, value)?,
            "range" => self.range = Some(params::size("offset", key, value)?),
            _ => return Err(unknown("offset", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Offset::new(&*next, self)?, next))
    }
}

/// A window of the device below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offset {
    offset: u64,
    size: u64,
    /// The filter's name in descriptions ("partition" for the window the
    /// partition filter finds).
    name: &'static str,
}

impl Offset {
    /// The window `config` describes over `next`; it must fit.
    pub fn new(next: &dyn BlockDevice, config: &OffsetConfig) -> Result<Offset> {
        let real = next.size();
        let OffsetConfig { offset, range } = *config;
        let size = match range {
            Some(range) => {
                if offset.checked_add(range).is_none_or(|end| end > real) {
                    return Err(Error::invalid(format!(
                        "offset: offset+range ({offset}+{range}) is larger than the real size \
                         ({real}) of the underlying device"
                    )));
                }
                range
            }
            None => real.checked_sub(offset).ok_or_else(|| {
                Error::invalid(format!(
                    "offset: offset ({offset}) is larger than the real size ({real}) \
                     of the underlying device"
                ))
            })?,
        };
        Ok(Offset {
            offset,
            size,
            name: "offset",
        })
    }

    /// The same window, described as `name`.
    pub fn named(self, name: &'static str) -> Offset {
        Offset { name, ..self }
    }
}

impl Offset {
    /// Where `offset` of the window lies on the device below (the layer
    /// boundary has checked the request lies in the window).
    fn map(&self, offset: u64) -> u64 {
        offset + self.offset
    }
}

impl Filter for Offset {
    fn name(&self) -> &str {
        self.name
    }
    fn file_view<'a>(
        &self,
        next: &'a dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Option<FileView<'a>> {
        next.file_view(self.map(offset), len)
    }
    fn size(&self, _next: &dyn BlockDevice) -> u64 {
        self.size
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        next.read_at(buf, self.map(offset))
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        next.write_at(buf, self.map(offset), flags)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        next.write_zeroes(self.map(offset), len, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        next.trim(self.map(offset), len, flags)
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        next.cache(self.map(offset), len)
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(clip(next.extents(self.map(offset), len)?, len))
    }
    fn submits_below(&self) -> bool {
        true
    }
    /// Submitted requests go below moved into the window, where they
    /// stay in flight.
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        let to = self.map(req.span().0);
        Route::Below(req.moved_to(to))
    }
    fn prepare_write(&self, next: &dyn BlockDevice, buf: &[u8], offset: u64) {
        next.prepare_write(buf, self.map(offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::{ErrorKind, Filtered};
    use std::sync::Arc;

    fn window(offset: u64, range: Option<u64>) -> (Arc<MemoryDevice>, Filtered<Offset>) {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let f = Offset::new(&*mem, &OffsetConfig { offset, range }).unwrap();
        (mem.clone(), Filtered::new(f, mem))
    }

    #[test]
    fn io_lands_shifted_and_stays_inside_the_window() {
        let (mem, d) = window(300_000, Some(200_000));
        assert_eq!(d.size(), 200_000);
        d.write_at(b"abc", 10, WriteFlags::NONE).unwrap();
        let mut b = [0u8; 3];
        mem.read_at(&mut b, 300_010).unwrap();
        assert_eq!(&b, b"abc");
        assert_eq!(
            d.write_at(b"x", 200_000, WriteFlags::NONE)
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidInput
        );
        assert!(d.read_at(&mut b, 199_998).is_err());
        assert!(d.write_zeroes(199_999, 2, ZeroFlags::default()).is_err());
        assert!(d.trim(0, 200_001, WriteFlags::NONE).is_err());
        assert!(d.extents(0, 200_001).is_err());
        // Memory pages are 64 KiB: the data page around 300_010 starts at
        // 262_144, inside the window at -37_856, so the window starts in data.
        let ex = d.extents(0, 200_000).unwrap();
        assert_eq!(ex.iter().map(|e| e.length).sum::<u64>(), 200_000);
        assert!(ex[0].flags.data);
        assert_eq!(ex[0].length, 327_680 - 300_000);
        assert!(!ex[1].flags.data);
        d.write_zeroes(0, 20, ZeroFlags::default()).unwrap();
        mem.read_at(&mut b, 300_010).unwrap();
        assert_eq!(b, [0; 3]);
    }

    #[test]
    fn windows_that_do_not_fit_are_refused() {
        let mem = MemoryDevice::new(1 << 20);
        let mk = |offset, range| Offset::new(&mem, &OffsetConfig { offset, range });
        assert_eq!(mk(1 << 20, None).unwrap().size, 0);
        assert!(mk((1 << 20) + 1, None).is_err());
        assert!(
            mk(1, Some(1 << 20))
                .unwrap_err()
                .to_string()
                .contains("larger than the real size")
        );
        assert!(mk(u64::MAX, Some(2)).is_err());
        assert_eq!(mk(0, Some(1 << 20)).unwrap().size, 1 << 20);
        let c = OffsetConfig::from_params(&[
            ("offset".into(), "1k".into()),
            ("range".into(), "2k".into()),
            ("offset".into(), "3k".into()),
        ])
        .unwrap();
        assert_eq!(
            c,
            OffsetConfig {
                offset: 3072,
                range: Some(2048)
            }
        );
        assert!(OffsetConfig::from_params(&[("offset".into(), "-1".into())]).is_err());
    }
}
