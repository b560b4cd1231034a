//! The truncate filter (nbdkit-truncate-filter): changes the size of the
//! device below.
//!
//! - `truncate=SIZE`: the new size, smaller or larger than the device.
//! - `round-up=N`: round the size up to a multiple of N (a power of two).
//! - `round-down=N`: round the size down to a multiple of N (a power of two).
//!
//! They apply in that order, each to the result of the one before.
//! Beyond the end of the device below the disk reads as zeros and block
//! status reports a hole that reads as zeros. Writes there must write
//! zeros: anything else fails with ENOSPC (nbdkit's error, checked before
//! any byte is written); zeroing and trimming there do nothing. Like
//! nbdkit, the filter reports extents even when the device below cannot
//! (the tail is known), and fast zeroing, which is free on the tail.

use diskit_core::extent::clip;
use diskit_core::zero::is_zero;
use diskit_core::{
    BlockDevice, Capabilities, Error, ErrorKind, Extent, FileView, Filter, Request, Result, Route,
    WriteFlags, ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["truncate", "round-up", "round-down"];

/// The parameters, as given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TruncateConfig {
    /// The new size.
    pub truncate: Option<u64>,
    /// Round up to a multiple of this.
    pub round_up: Option<u64>,
    /// Round down to a multiple of this.
    pub round_down: Option<u64>,
}

impl Configure for TruncateConfig {
    /// Takes `truncate=`, `round-up=` and `round-down=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "truncate" => self.truncate = Some(params::size("truncate", key, value)?),
            "round-up" => self.round_up = Some(round_param(key, value)?),
            "round-down" => self.round_down = Some(round_param(key, value)?),
            _ => return Err(unknown("truncate", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Truncate::new(&*next, self)?, next))
    }
}

fn round_param(key: &str, value: &str) -> Result<u64> {
    let n = params::size("truncate", key, value)?;
    if n == 0 {
        return Err(Error::invalid(format!(
            "truncate: if set, the {key} parameter must be > 0"
        )));
    }
    if n > u64::from(u32::MAX) {
        return Err(Error::invalid(format!(
            "truncate: the {key} parameter is too large"
        )));
    }
    if !n.is_power_of_two() {
        return Err(Error::invalid(format!(
            "truncate: the {key} parameter must be a power of 2"
        )));
    }
    Ok(n)
}

impl TruncateConfig {
    /// The size the filter gives a device of `real` bytes.
    pub fn apply(&self, real: u64) -> Result<u64> {
        let mut size = self.truncate.unwrap_or(real);
        if let Some(n) = self.round_up {
            size = size
                .div_ceil(n)
                .checked_mul(n)
                .filter(|&s| s <= i64::MAX as u64)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Overflow,
                        format!("truncate: cannot round size {size} up to next boundary of {n}"),
                    )
                })?;
        }
        if let Some(n) = self.round_down {
            size -= size % n;
        }
        Ok(size)
    }
}

/// The device below with another size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncate {
    /// The size of the device below.
    real: u64,
    /// The size served.
    size: u64,
}

impl Truncate {
    /// The filter `config` describes over `next`.
    pub fn new(next: &dyn BlockDevice, config: &TruncateConfig) -> Result<Truncate> {
        let real = next.size();
        Ok(Truncate {
            real,
            size: config.apply(real)?,
        })
    }

    /// How much of `offset..offset+len` lies on the device below.
    fn inside(&self, offset: u64, len: u64) -> u64 {
        self.real.saturating_sub(offset).min(len)
    }
}

impl Filter for Truncate {
    fn name(&self) -> &str {
        "truncate"
    }
    fn file_view<'a>(
        &self,
        next: &'a dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Option<FileView<'a>> {
        // Only a range wholly on the device below: the rest reads as zeros.
        if offset.checked_add(len)? > self.size.min(self.real) {
            return None;
        }
        next.file_view(offset, len)
    }
    fn size(&self, _next: &dyn BlockDevice) -> u64 {
        self.size
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        Capabilities {
            can_extents: true,
            can_fast_zero: true,
            ..next.capabilities()
        }
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.inside(offset, buf.len() as u64) as usize;
        if n > 0 {
            next.read_at(&mut buf[..n], offset)?;
        }
        buf[n..].fill(0);
        Ok(())
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let n = self.inside(offset, buf.len() as u64) as usize;
        if !is_zero(&buf[n..]) {
            return Err(Error::new(
                ErrorKind::NoSpace,
                "truncate: write beyond end of underlying device",
            ));
        }
        if n > 0 {
            next.write_at(&buf[..n], offset, flags)?;
        }
        Ok(())
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        let n = self.inside(offset, len);
        if n == 0 {
            return Ok(());
        }
        if flags.fast && !next.capabilities().can_fast_zero {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        next.write_zeroes(offset, n, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        match self.inside(offset, len) {
            0 => Ok(()),
            n => next.trim(offset, n, flags),
        }
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        match self.inside(offset, len) {
            0 => Ok(()),
            n => next.cache(offset, n),
        }
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        match self.inside(offset, len) {
            // Beyond the device below: one hole to the end of the request.
            0 => Ok(vec![Extent::hole(len)]),
            // Only the part on the device: the caller asks again for the rest.
            n => Ok(clip(next.extents(offset, n)?, n)),
        }
    }
    fn submits_below(&self) -> bool {
        true
    }
    /// Reads and writes that lie on the device below go there as they
    /// are, and stay in flight; the rest, and zeroes, run here.
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        let (offset, len) = req.span();
        match req {
            Request::Zero { .. } => Route::Here(req),
            _ if self.inside(offset, len) == len => Route::Below(req),
            _ => Route::Here(req),
        }
    }
    fn prepare_write(&self, next: &dyn BlockDevice, buf: &[u8], offset: u64) {
        if self.inside(offset, buf.len() as u64) == buf.len() as u64 {
            next.prepare_write(buf, offset)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FAST;
    use diskit_backends::{MemoryDevice, PatternDevice};
    use diskit_core::Filtered;
    use std::sync::Arc;

    fn cfg(
        truncate: Option<u64>,
        round_up: Option<u64>,
        round_down: Option<u64>,
    ) -> TruncateConfig {
        TruncateConfig {
            truncate,
            round_up,
            round_down,
        }
    }

    #[test]
    fn sizes_apply_in_order() {
        assert_eq!(
            cfg(Some(3_500_000), Some(1 << 20), None).apply(0).unwrap(),
            4 << 20
        );
        assert_eq!(
            cfg(Some(3_500_000), None, Some(1 << 20)).apply(0).unwrap(),
            3 << 20
        );
        assert_eq!(cfg(None, Some(512), None).apply(1000).unwrap(), 1024);
        assert_eq!(cfg(None, Some(512), None).apply(1024).unwrap(), 1024);
        assert_eq!(cfg(None, Some(512), Some(4096)).apply(1000).unwrap(), 0);
        assert!(cfg(Some(i64::MAX as u64), Some(2), None).apply(0).is_err());
        let p = |k: &str, v: &str| TruncateConfig::from_params(&[(k.into(), v.into())]);
        assert!(
            p("round-up", "3")
                .unwrap_err()
                .to_string()
                .contains("power of 2")
        );
        assert!(
            p("round-up", "0")
                .unwrap_err()
                .to_string()
                .contains("must be > 0")
        );
        assert!(
            p("round-down", "8G")
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
        assert_eq!(p("truncate", "1M").unwrap().truncate, Some(1 << 20));
    }

    #[test]
    fn the_tail_reads_zeros_and_takes_only_zeros() {
        let pat = Arc::new(PatternDevice::new(1000));
        let d = Filtered::new(
            Truncate::new(&*pat, &cfg(Some(2000), None, None)).unwrap(),
            pat.clone(),
        );
        assert_eq!(d.size(), 2000);
        let mut b = vec![0xaau8; 16];
        d.read_at(&mut b, 992).unwrap();
        assert_eq!(&b[..8], &992u64.to_be_bytes());
        assert_eq!(&b[8..], &[0u8; 8]);
        assert!(d.capabilities().can_extents);
        let ex = d.extents(500, 1000).unwrap();
        assert_eq!(ex.iter().map(|e| e.length).sum::<u64>(), 500);
        assert!(ex[0].flags.data);
        let ex = d.extents(1000, 1000).unwrap();
        assert_eq!(ex, vec![Extent::hole(1000)]);

        let mem = Arc::new(MemoryDevice::new(1000));
        mem.write_at(&[7u8; 1000], 0, WriteFlags::NONE).unwrap();
        let d = Filtered::new(
            Truncate::new(&*mem, &cfg(Some(2000), None, None)).unwrap(),
            mem.clone(),
        );
        // A write straddling the end with data past it fails and writes nothing.
        let mut w = vec![1u8; 20];
        w[15] = 9;
        let e = d.write_at(&w, 990, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        let mut b = [0u8; 10];
        mem.read_at(&mut b, 990).unwrap();
        assert_eq!(b, [7u8; 10]);
        // With zeros past the end it writes the part that exists.
        w[10..].fill(0);
        d.write_at(&w, 990, WriteFlags::NONE).unwrap();
        mem.read_at(&mut b, 990).unwrap();
        assert_eq!(b, [1u8; 10]);
        d.write_zeroes(995, 1005, ZeroFlags::default()).unwrap();
        mem.read_at(&mut b, 990).unwrap();
        assert_eq!(b, [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]);
        d.write_zeroes(1500, 10, FAST).unwrap();
        d.trim(1500, 10, WriteFlags::NONE).unwrap();
        d.cache(0, 2000).unwrap();
        assert!(d.write_at(&[0], 2000, WriteFlags::NONE).is_err());

        // Cut short: the end of the device below is out of reach.
        let d = Filtered::new(
            Truncate::new(&*mem, &cfg(Some(100), None, None)).unwrap(),
            mem.clone(),
        );
        assert_eq!(d.size(), 100);
        assert!(d.read_at(&mut b, 95).is_err());
    }
}
