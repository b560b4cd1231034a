//! Filters that only look at requests (log, stats): a [`Watch`] is told
//! of each request as it starts (a [`Call`]) and of how it ended;
//! [`Watching`] makes it a filter that passes every request on
//! unchanged, submitted ones staying in flight below.

use diskit_core::aio::Request;

use crate::call::{Call, Op};
use diskit_core::{
    BlockDevice, DeviceRef, ErrorKind, Extent, Filter, Result, Route, Session, WriteFlags,
    ZeroFlags,
};

/// How a watched request ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome<'a> {
    /// It succeeded.
    Done,
    /// An extents request succeeded with this answer.
    Extents(&'a [Extent]),
    /// It failed so.
    Failed(ErrorKind),
}

impl Outcome<'_> {
    /// The outcome of a request that answered `result`.
    fn of(result: &Result<()>) -> Outcome<'static> {
        match result {
            Ok(()) => Outcome::Done,
            Err(e) => Outcome::Failed(e.kind()),
        }
    }
}

/// What a filter that only looks at requests (log, stats) does: it is
/// told of each request as it starts and of how it ended, and leaves it
/// alone. [`Watching`] makes it a filter.
pub(crate) trait Watch: Send + Sync + Sized + 'static {
    /// The filter's name.
    const NAME: &'static str;
    /// See [`Filter::checks_ranges`].
    const CHECKS_RANGES: bool = true;
    /// What it keeps of a request between its start and its end.
    type Started: Send + 'static;

    /// `call` starts.
    fn start(&self, call: &Call) -> Self::Started;

    /// The request `started` ended so.
    fn end(started: Self::Started, outcome: Outcome<'_>);

    /// See [`Filter::connect`].
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Self>> {
        let _ = (next, session);
        Ok(None)
    }

    /// See [`Filter::close`].
    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        next.close()
    }
}

/// A [`Watch`] as a filter: every request passes unchanged, submitted ones
/// staying in flight below; the watch sees each start and end.
pub(crate) struct Watching<W>(pub(crate) W);

impl<W: Watch> Watching<W> {
    /// Runs `f`, the request `call`, watched.
    fn run(&self, call: Call, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let started = self.0.start(&call);
        let r = f();
        W::end(started, Outcome::of(&r));
        r
    }
}

impl<W: Watch> Filter for Watching<W> {
    fn name(&self) -> &str {
        W::NAME
    }
    fn checks_ranges(&self) -> bool {
        W::CHECKS_RANGES
    }
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Watching<W>>> {
        Ok(self.0.connect(next, session)?.map(Watching))
    }
    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        self.0.close(next)
    }
    // No file view: reads spliced past the filter would go unseen.
    fn extents_before_reads(&self, _next: &dyn BlockDevice) -> bool {
        false
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let call = Call::new(Op::Read, offset, buf.len() as u64);
        self.run(call, || next.read_at(buf, offset))
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let call = Call::writing(Op::Write, offset, buf.len() as u64, flags);
        self.run(call, || next.write_at(buf, offset, flags))
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        let call = Call::zero(offset, len, flags);
        self.run(call, || next.write_zeroes(offset, len, flags))
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        let call = Call::writing(Op::Trim, offset, len, flags);
        self.run(call, || next.trim(offset, len, flags))
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        self.run(Call::new(Op::Flush, 0, 0), || next.flush())
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.run(Call::new(Op::Cache, offset, len), || {
            next.cache(offset, len)
        })
    }
    fn extents(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let started = self.0.start(&Call::new(Op::Extents, offset, len));
        let r = next.extents(offset, len);
        let outcome = match &r {
            Ok(list) => Outcome::Extents(list),
            Err(e) => Outcome::Failed(e.kind()),
        };
        W::end(started, outcome);
        r
    }
    fn submits_below(&self) -> bool {
        true
    }
    /// Submitted requests start here and go below, where they stay in
    /// flight; the watch sees them end as they complete.
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        let started = self.0.start(&Call::of(&req));
        Route::Watched(
            req,
            Box::new(move |c| W::end(started, Outcome::of(&c.result))),
        )
    }
}
