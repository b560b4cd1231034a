//! Filters: layers that change some operations of the device below and pass
//! the rest through untouched, capabilities included.
//!
//! A [`Filter`] implements only the methods it changes; every default calls
//! the next layer. [`Filtered`] joins a filter to the device below it and is
//! itself a [`BlockDevice`], so filters stack over any device.

use std::sync::Arc;

use crate::device::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, FileView, Session, WriteFlags, ZeroFlags,
};
use crate::error::Result;
use crate::extent::Extent;

/// A layer over another device. Every method receives the next layer.
#[allow(missing_docs)]
pub trait Filter: Send + Sync {
    /// The filter's name, for descriptions.
    fn name(&self) -> &str;

    fn size(&self, next: &dyn BlockDevice) -> u64 {
        next.size()
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        next.capabilities()
    }
    fn block_size(&self, next: &dyn BlockDevice) -> BlockSizeLimits {
        next.block_size()
    }
    fn is_known_zero(&self, next: &dyn BlockDevice) -> bool {
        next.is_known_zero()
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        next.read_at(buf, offset)
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        next.write_at(buf, offset, flags)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        next.write_zeroes(offset, len, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        next.trim(offset, len, flags)
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        next.flush()
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        next.cache(offset, len)
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        next.extents(offset, len)
    }
    /// Finalizes the filter, then closes the layer below (see
    /// [`BlockDevice::close`]); a filter that overrides it must still
    /// close `next`. The default only closes `next`.
    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        next.close()
    }
    /// The filter as one connection sees it (see [`BlockDevice::connect`]):
    /// `None`, the default, when it keeps no per-connection state. `next`
    /// is the connection's view of the layer below.
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Self>>
    where
        Self: Sized,
    {
        let _ = (next, session);
        Ok(None)
    }
    /// See [`BlockDevice::extents_before_reads`]: passes through, unless
    /// the filter hides extents.
    fn extents_before_reads(&self, next: &dyn BlockDevice) -> bool {
        next.extents_before_reads() && self.capabilities(next).can_extents
    }
    /// See [`BlockDevice::reopen`]: passes through.
    fn reopen(&self, next: &dyn BlockDevice) -> Result<()> {
        next.reopen()
    }
    /// Whether reads through this filter give the bytes below, at the same
    /// offsets, with nothing a view would skip (a delay, say): then a view
    /// of the bytes below is a view of the filter's own. False by default.
    fn reads_unchanged(&self) -> bool {
        false
    }
    /// Unlike the other methods this one does not pass through by default:
    /// a view of the bytes below would bypass a filter that changes reads.
    /// It does for a filter whose [`reads_unchanged`](Self::reads_unchanged)
    /// says so; a filter that maps offsets overrides it.
    fn file_view<'a>(
        &'a self,
        next: &'a dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Option<FileView<'a>> {
        if self.reads_unchanged() {
            next.file_view(offset, len)
        } else {
            None
        }
    }
}

/// A filter stacked on a device. The filter is shared with the
/// per-connection views of the stack that do not change it.
pub struct Filtered<F> {
    filter: Arc<F>,
    next: DeviceRef,
}

impl<F: Filter> Filtered<F> {
    /// Stacks `filter` on `next`.
    pub fn new(filter: F, next: DeviceRef) -> Filtered<F> {
        Filtered {
            filter: Arc::new(filter),
            next,
        }
    }

    /// The filter.
    pub fn filter(&self) -> &F {
        &self.filter
    }

    /// The device below.
    pub fn next(&self) -> &DeviceRef {
        &self.next
    }
}

impl<F: Filter + 'static> BlockDevice for Filtered<F> {
    fn size(&self) -> u64 {
        self.filter.size(&*self.next)
    }
    fn capabilities(&self) -> Capabilities {
        self.filter.capabilities(&*self.next)
    }
    fn block_size(&self) -> BlockSizeLimits {
        self.filter.block_size(&*self.next)
    }
    fn is_known_zero(&self) -> bool {
        self.filter.is_known_zero(&*self.next)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.filter.read_at(&*self.next, buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.filter.write_at(&*self.next, buf, offset, flags)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.filter.write_zeroes(&*self.next, offset, len, flags)
    }
    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.filter.trim(&*self.next, offset, len, flags)
    }
    fn flush(&self) -> Result<()> {
        self.filter.flush(&*self.next)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.filter.cache(&*self.next, offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.filter.extents(&*self.next, offset, len)
    }
    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        self.filter.file_view(&*self.next, offset, len)
    }
    fn describe(&self) -> String {
        format!("{} over {}", self.filter.name(), self.next.describe())
    }
    fn close(&self) -> Result<()> {
        self.filter.close(&*self.next)
    }
    fn connect(&self, session: &Session) -> Result<Option<DeviceRef>> {
        let below = self.next.connect(session)?;
        let next = below.clone().unwrap_or_else(|| self.next.clone());
        let mine = self.filter.connect(&next, session)?;
        if below.is_none() && mine.is_none() {
            return Ok(None);
        }
        let filter = mine.map_or_else(|| self.filter.clone(), Arc::new);
        Ok(Some(Arc::new(Filtered { filter, next })))
    }
    fn extents_before_reads(&self) -> bool {
        self.filter.extents_before_reads(&*self.next)
    }
    fn reopen(&self) -> Result<()> {
        self.filter.reopen(&*self.next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts closes.
    #[derive(Default)]
    struct Closing(AtomicUsize);

    impl BlockDevice for Closing {
        fn size(&self) -> u64 {
            512
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::READ_ONLY
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            buf.fill(0);
            Ok(())
        }
        fn close(&self) -> Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    struct Plain;
    impl Filter for Plain {
        fn name(&self) -> &str {
            "plain"
        }
    }

    /// Finalizes itself, then closes the layer below.
    #[derive(Default)]
    struct Finalizing(AtomicUsize);
    impl Filter for Finalizing {
        fn name(&self) -> &str {
            "finalizing"
        }
        fn close(&self, next: &dyn BlockDevice) -> Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            next.close()
        }
    }

    #[test]
    fn close_goes_down_the_stack() {
        let dev = Arc::new(Closing::default());
        let mid = Arc::new(Filtered::new(Finalizing::default(), dev.clone()));
        let top: DeviceRef = Arc::new(Filtered::new(Plain, mid.clone()));
        // Through Box and Arc (forward_device!) and both filters, then &T.
        let boxed: Box<dyn BlockDevice> = Box::new(top.clone());
        boxed.close().unwrap();
        assert_eq!(mid.filter().0.load(Ordering::SeqCst), 1);
        assert_eq!(dev.0.load(Ordering::SeqCst), 1);
        fn close_via<D: BlockDevice>(d: D) -> Result<()> {
            d.close()
        }
        close_via(&*top).unwrap();
        assert_eq!(dev.0.load(Ordering::SeqCst), 2);
    }
}
