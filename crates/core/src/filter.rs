//! Filters: layers that change some operations of the device below and pass
//! the rest through untouched, capabilities included.
//!
//! A [`Filter`] implements only the methods it changes; every default calls
//! the next layer. [`Filtered`] joins a filter to the device below it and is
//! itself a [`BlockDevice`], so filters stack over any device.
//!
//! [`Filtered`] is the layer boundary, as nbdkit's backend is: it refuses a
//! request outside the filter's size before the filter sees it (so filters
//! check only the ranges they make themselves), and it forwards every
//! method of [`BlockDevice`], submission included: a filter that leaves
//! reads, writes and zeroes alone, or changes them on their way down
//! ([`Filter::submits_below`], [`Filter::route`]), keeps the requests of
//! an asynchronous device below (an NBD connection) in flight.

use std::sync::Arc;

use crate::aio::{Completion, CompletionQueue, Request};
use crate::device::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, ExportEntry, ExportQuery, FileView,
    Lent, Session, WriteFlags, ZeroFlags, check_range,
};
use crate::error::{Error, Result};
use crate::extent::Extent;
use crate::serving::{Peer, Serialize, ServerRef};

/// Where a request submitted through a filter goes (see [`Filter::route`]).
pub enum Route {
    /// On to the layer below (as it came, or changed), where it stays in
    /// flight.
    Below(Request),
    /// On to the layer below, where it stays in flight; the function is
    /// shown its completion before the submitter is (a filter that
    /// records requests and their results, a log, sends them so).
    Watched(Request, Box<dyn FnOnce(&Completion) + Send>),
    /// Through the filter's own methods, before `submit` returns.
    Here(Request),
    /// Refused by the filter: completed at once with the error, its
    /// buffer given back.
    Failed(Request, Error),
}

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
    /// See [`BlockDevice::read_or_lend`]: as [`file_view`](Self::file_view),
    /// a filter whose [`reads_unchanged`](Self::reads_unchanged) says so
    /// lets the device below lend; any other reads with
    /// [`read_at`](Self::read_at) by default, and one that holds the bytes
    /// in memory (decompressed blocks) lends them.
    fn read_or_lend(
        &self,
        next: &dyn BlockDevice,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<Option<Lent>> {
        if self.reads_unchanged() {
            return next.read_or_lend(buf, offset);
        }
        self.read_at(next, buf, offset).map(|()| None)
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
    /// is the connection's view of the layer below. An error refuses the
    /// connection (nbdkit's open failing); the value returned is dropped
    /// when the connection ends (nbdkit's close).
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Self>>
    where
        Self: Sized,
    {
        let _ = (next, session);
        Ok(None)
    }
    /// See [`BlockDevice::list_exports`]: passes through.
    fn list_exports(
        &self,
        next: &dyn BlockDevice,
        query: &ExportQuery,
    ) -> Result<Option<Vec<ExportEntry>>> {
        next.list_exports(query)
    }
    /// See [`BlockDevice::default_export`]: passes through.
    fn default_export(
        &self,
        next: &dyn BlockDevice,
        query: &ExportQuery,
    ) -> Result<Option<String>> {
        next.default_export(query)
    }
    /// See [`BlockDevice::export_description`]: passes through.
    fn export_description(&self, next: &dyn BlockDevice) -> Option<String> {
        next.export_description()
    }
    /// See [`BlockDevice::serving`]: passes through.
    fn serving(&self, next: &dyn BlockDevice, server: &ServerRef) {
        next.serving(server)
    }
    /// See [`BlockDevice::preconnect`]: passes through. A filter that
    /// refuses some clients checks them, then asks `next`.
    fn preconnect(&self, next: &dyn BlockDevice, peer: &Peer) -> Result<()> {
        next.preconnect(peer)
    }
    /// See [`BlockDevice::serialize`]: the answer below.
    fn serialize(&self, next: &dyn BlockDevice) -> Serialize {
        next.serialize()
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
    /// Whether the layer boundary ([`Filtered`]) refuses a request outside
    /// the filter's size before the filter sees it: true by default, so
    /// that filters check only the ranges they make themselves. A filter
    /// that must see every request as it came, and passes it on to the
    /// layer below unchanged, which refuses it (log, which logs the
    /// refusal), says false.
    fn checks_ranges(&self) -> bool {
        true
    }
    /// Whether requests submitted through the filter
    /// ([`BlockDevice::submit`]) go on to the layer below, where they stay
    /// in flight, as [`route`](Self::route) sends them: then the filter's
    /// queue depth is the one below. True for a filter that leaves reads,
    /// writes and zeroes alone (their bytes, offsets and flags), or that
    /// changes them in `route`, or that records them and their results
    /// there ([`Route::Watched`]). False by
    /// default, as for [`reads_unchanged`](Self::reads_unchanged): a
    /// request sent below would bypass a filter that changes it in its
    /// methods, so they run there, before `submit` returns.
    fn submits_below(&self) -> bool {
        false
    }
    /// Where a request submitted through the filter goes: below when
    /// [`submits_below`](Self::submits_below) says so, else through the
    /// filter's methods. A filter that changes some requests on their way
    /// (a wait first, another offset) or runs only some of them itself
    /// overrides it.
    fn route(&self, next: &dyn BlockDevice, req: Request) -> Route {
        let _ = next;
        if self.submits_below() {
            Route::Below(req)
        } else {
            Route::Here(req)
        }
    }
    /// See [`BlockDevice::discards_writes`]: the answer below, where
    /// writes go below ([`submits_below`](Self::submits_below)); a filter
    /// that keeps writes itself says false.
    fn discards_writes(&self, next: &dyn BlockDevice) -> bool {
        self.submits_below() && next.discards_writes()
    }
    /// See [`BlockDevice::prepare_write`]: passes the hint below where
    /// writes go below unchanged ([`submits_below`](Self::submits_below));
    /// a filter whose `route` moves writes overrides it.
    fn prepare_write(&self, next: &dyn BlockDevice, buf: &[u8], offset: u64) {
        if self.submits_below() {
            next.prepare_write(buf, offset);
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

    /// Refuses `offset..offset+len` outside the filter's size: the check
    /// at the layer boundary.
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        if !self.filter.checks_ranges() {
            return Ok(());
        }
        check_range(self.filter.size(&*self.next), offset, len)
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
        self.check(offset, buf.len() as u64)?;
        self.filter.read_at(&*self.next, buf, offset)
    }
    fn read_or_lend(&self, buf: &mut [u8], offset: u64) -> Result<Option<Lent>> {
        self.check(offset, buf.len() as u64)?;
        self.filter.read_or_lend(&*self.next, buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.filter.write_at(&*self.next, buf, offset, flags)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.check(offset, len)?;
        self.filter.write_zeroes(&*self.next, offset, len, flags)
    }
    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.check(offset, len)?;
        self.filter.trim(&*self.next, offset, len, flags)
    }
    fn flush(&self) -> Result<()> {
        self.filter.flush(&*self.next)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        self.filter.cache(&*self.next, offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.check(offset, len)?;
        self.filter.extents(&*self.next, offset, len)
    }
    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        self.check(offset, len).ok()?;
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
    fn list_exports(&self, query: &ExportQuery) -> Result<Option<Vec<ExportEntry>>> {
        self.filter.list_exports(&*self.next, query)
    }
    fn default_export(&self, query: &ExportQuery) -> Result<Option<String>> {
        self.filter.default_export(&*self.next, query)
    }
    fn export_description(&self) -> Option<String> {
        self.filter.export_description(&*self.next)
    }
    fn serving(&self, server: &ServerRef) {
        self.filter.serving(&*self.next, server)
    }
    fn preconnect(&self, peer: &Peer) -> Result<()> {
        self.filter.preconnect(&*self.next, peer)
    }
    fn serialize(&self) -> Serialize {
        self.filter.serialize(&*self.next)
    }
    fn reopen(&self) -> Result<()> {
        self.filter.reopen(&*self.next)
    }
    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        let (offset, len) = req.span();
        if let Err(e) = self.check(offset, len) {
            return cq.push(req.fail(tag, Err(e)));
        }
        match self.filter.route(&*self.next, req) {
            Route::Below(req) => self.next.submit(tag, req, cq),
            Route::Watched(req, watch) => self.next.submit(tag, req, &cq.watched(watch)),
            Route::Here(req) => cq.push(crate::aio::run(self, tag, req)),
            Route::Failed(req, e) => cq.push(req.fail(tag, Err(e))),
        }
    }
    fn queue_depth(&self) -> usize {
        if self.filter.submits_below() {
            self.next.queue_depth()
        } else {
            1
        }
    }
    fn discards_writes(&self) -> bool {
        self.filter.discards_writes(&*self.next)
    }
    fn prepare_write(&self, buf: &[u8], offset: u64) {
        self.filter.prepare_write(&*self.next, buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Closing, read_request};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

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
        assert_eq!(dev.closes(), 1);
        fn close_via<D: BlockDevice>(d: D) -> Result<()> {
            d.close()
        }
        close_via(&*top).unwrap();
        assert_eq!(dev.closes(), 2);
    }

    /// Keeps requests "in flight": counts what is submitted to it and
    /// completes it at once; also counts plain reads.
    #[derive(Default)]
    struct Queued {
        submitted: AtomicUsize,
        reads: AtomicUsize,
    }

    impl BlockDevice for Queued {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::IN_MEMORY
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            buf.fill(7);
            Ok(())
        }
        fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
            self.submitted.fetch_add(1, Ordering::SeqCst);
            cq.push(crate::aio::run(self, tag, req));
        }
        fn queue_depth(&self) -> usize {
            8
        }
        fn discards_writes(&self) -> bool {
            true
        }
    }

    /// Leaves requests alone, and counts the reads it sees.
    #[derive(Default)]
    struct Through(AtomicUsize);
    impl Filter for Through {
        fn name(&self) -> &str {
            "through"
        }
        fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            next.read_at(buf, offset)
        }
        fn submits_below(&self) -> bool {
            true
        }
    }

    #[test]
    fn submission_queue_depth_and_discards_pass_through() {
        let dev = Arc::new(Queued::default());
        let through = Filtered::new(Through::default(), dev.clone());
        assert_eq!(through.queue_depth(), 8);
        assert!(through.discards_writes());
        let cq = CompletionQueue::new();
        through.submit(1, read_request(4096, 4096, 4096), &cq);
        let c = cq.wait();
        assert!(c.result.is_ok() && c.tag == 1);
        assert_eq!(dev.submitted.load(Ordering::SeqCst), 1, "submitted below");
        assert_eq!(through.filter().0.load(Ordering::SeqCst), 0);
        // A filter that changes requests in its methods runs them there.
        let plain = Filtered::new(Plain, dev.clone());
        assert_eq!(plain.queue_depth(), 1);
        assert!(!plain.discards_writes());
        plain.submit(2, read_request(0, 512, 512), &cq);
        assert!(cq.wait().result.is_ok());
        assert_eq!(dev.submitted.load(Ordering::SeqCst), 1, "run here");
        assert_eq!(dev.reads.load(Ordering::SeqCst), 2);
    }

    /// Sends requests below, watching their completions.
    #[derive(Default)]
    struct Watching(Arc<AtomicUsize>);
    impl Filter for Watching {
        fn name(&self) -> &str {
            "watching"
        }
        fn submits_below(&self) -> bool {
            true
        }
        fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
            let seen = self.0.clone();
            Route::Watched(
                req,
                Box::new(move |c| {
                    assert!(c.result.is_ok());
                    seen.fetch_add(1, Ordering::SeqCst);
                }),
            )
        }
    }

    #[test]
    fn watched_requests_stay_in_flight_below() {
        let dev = Arc::new(Queued::default());
        let d = Filtered::new(Watching::default(), dev.clone());
        assert_eq!(d.queue_depth(), 8);
        let cq = CompletionQueue::new();
        d.submit(3, read_request(0, 512, 512), &cq);
        assert_eq!(cq.wait().tag, 3);
        assert_eq!(dev.submitted.load(Ordering::SeqCst), 1, "submitted below");
        assert_eq!(d.filter().0.load(Ordering::SeqCst), 1, "watched");
    }

    #[test]
    fn requests_out_of_range_are_refused_at_the_boundary() {
        let dev = Arc::new(Queued::default());
        let d = Filtered::new(Through::default(), dev.clone());
        let mut buf = [0u8; 16];
        let e = d.read_at(&mut buf, (1 << 20) - 8).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{e}");
        assert!(d.write_at(&buf, u64::MAX - 4, WriteFlags::NONE).is_err());
        assert!(d.write_zeroes(1 << 20, 1, ZeroFlags::default()).is_err());
        assert!(d.trim(0, (1 << 20) + 1, WriteFlags::NONE).is_err());
        assert!(d.cache(1 << 20, 1).is_err());
        assert!(d.extents(1 << 19, 1 << 20).is_err());
        assert!(d.file_view(1 << 20, 1).is_none());
        assert_eq!(
            d.filter().0.load(Ordering::SeqCst),
            0,
            "the filter saw none"
        );
        // Submitted: completed with the error, its buffer given back,
        // nothing sent below.
        let cq = CompletionQueue::new();
        d.submit(9, read_request(1 << 20, 4096, 4096), &cq);
        let c = cq.wait();
        assert_eq!((c.tag, c.buf.is_some()), (9, true));
        assert_eq!(c.result.unwrap_err().kind(), crate::ErrorKind::InvalidInput);
        assert_eq!(dev.submitted.load(Ordering::SeqCst), 0);
        assert_eq!(dev.reads.load(Ordering::SeqCst), 0);
        // At the end exactly is in range.
        d.read_at(&mut buf, (1 << 20) - 16).unwrap();
    }
}
