//! Filters that only act before requests pass (delay, error, rate): a
//! [`Gate`] may wait, or refuse a request, before it goes below unchanged;
//! [`Gated`] makes it a filter, through which submitted requests wait in
//! the submitter's thread and then stay in flight below.

use diskit_core::aio::Request;
use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Extent, Filter, Result, Route, Session, WriteFlags,
    ZeroFlags,
};

use crate::call::{Call, Op};

/// What a filter that only acts before requests does.
pub(crate) trait Gate: Send + Sync + Sized + 'static {
    /// The filter's name.
    const NAME: &'static str;

    /// Before `call` goes below: waits, or refuses it with an error.
    fn before(&self, call: &Call) -> Result<()>;

    /// See [`Filter::capabilities`].
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        next.capabilities()
    }

    /// See [`Filter::connect`].
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Self>> {
        let _ = (next, session);
        Ok(None)
    }

    /// See [`Filter::reads_unchanged`]: true only where
    /// [`before`](Self::before) does nothing to reads, which a view of
    /// the bytes below would skip.
    fn reads_unchanged(&self) -> bool {
        false
    }
}

/// A [`Gate`] as a filter.
pub(crate) struct Gated<G>(pub(crate) G);

impl<G: Gate> Filter for Gated<G> {
    fn name(&self) -> &str {
        G::NAME
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        self.0.capabilities(next)
    }
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Gated<G>>> {
        Ok(self.0.connect(next, session)?.map(Gated))
    }
    fn reads_unchanged(&self) -> bool {
        self.0.reads_unchanged()
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0
            .before(&Call::new(Op::Read, offset, buf.len() as u64))?;
        next.read_at(buf, offset)
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let len = buf.len() as u64;
        self.0
            .before(&Call::writing(Op::Write, offset, len, flags))?;
        next.write_at(buf, offset, flags)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.0.before(&Call::zero(offset, len, flags))?;
        next.write_zeroes(offset, len, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.0
            .before(&Call::writing(Op::Trim, offset, len, flags))?;
        next.trim(offset, len, flags)
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        self.0.before(&Call::new(Op::Flush, 0, 0))?;
        next.flush()
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.0.before(&Call::new(Op::Cache, offset, len))?;
        next.cache(offset, len)
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.0.before(&Call::new(Op::Extents, offset, len))?;
        next.extents(offset, len)
    }
    fn submits_below(&self) -> bool {
        true
    }
    /// Submitted requests pass the gate in the submitter's thread, then go
    /// below, where they stay in flight; a refused one completes at once.
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        match self.0.before(&Call::of(&req)) {
            Ok(()) => Route::Below(req),
            Err(e) => Route::Failed(req, e),
        }
    }
}
