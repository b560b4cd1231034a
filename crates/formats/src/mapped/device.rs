//! [`Mapped`]: a format's [`MappedFormat`] as a [`BlockDevice`]. The
//! parts every format shares live here once: the read-only guard, range
//! checks, the split of writes at the allocation unit, the per-unit
//! allocation lock, copy-on-write around new data, zeroing by metadata
//! where the format can, and FUA as a flush.

use std::ops::Deref;

use diskit_core::buffer::{ReusedBuf, with_reused};
use diskit_core::device::{check_range, write_zero_buffer};
use diskit_core::range_lock::RangeLock;
use diskit_core::zero::is_zero;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, FileView, Result,
    WriteFlags, ZeroFlags,
};

use super::{Allocation, Fill, MappedFormat, Place, Zeroed, file_view, read, read_place};

/// The most guest bytes one allocation or one zeroing step covers.
const MAX_STEP: u64 = 32 << 20;

/// New space assembled (data and what is copied around it) in a buffer
/// kept per thread up to this size.
const MAX_KEPT: usize = 4 << 20;

thread_local! {
    /// Each thread's buffer for assembling new space before it is written.
    static FILL_BUFFER: ReusedBuf = const { std::cell::RefCell::new(None) };
}

/// What a write calls once its bytes have their place, until it is called.
type Placed<'a> = Option<&'a mut dyn FnMut()>;

/// Calls `placed` if it has not been called yet.
fn call_placed(placed: &mut Placed<'_>) {
    if let Some(p) = placed.take() {
        p();
    }
}

/// A format as a block device: the format describes, this moves bytes.
pub struct Mapped<F> {
    format: F,
    /// Guest units being allocated or zeroed (held exclusively).
    units: RangeLock,
    /// Trims and write-zeroes never deallocate (QEMU's `discard=ignore`).
    keep_allocations: bool,
}

impl<F: MappedFormat> Mapped<F> {
    /// The device of `format`.
    pub fn new(format: F) -> Mapped<F> {
        Mapped {
            format,
            units: RangeLock::new(),
            keep_allocations: false,
        }
    }

    /// The device with trims that do nothing and write-zeroes that never
    /// deallocate, when `keep` (QEMU's `discard=ignore`, see
    /// [`OpenOptions::keep_allocations`](crate::OpenOptions)): in a format
    /// that frees data only when trimming, the data space the image maps
    /// then stays its own while open, and reads of a writable image may be
    /// served as views of its file.
    pub fn keeping_allocations(mut self, keep: bool) -> Mapped<F> {
        self.keep_allocations = keep;
        self
    }

    /// Whether data space the image maps may come to hold other guest
    /// bytes while it is open (freed, then allocated again): a view of
    /// the file given out for a read (pages a server spliced into a
    /// socket outlive the read) is safe only where it cannot.
    fn data_space_reused(&self) -> bool {
        self.format.writable()
            && !(self.keep_allocations && self.format.frees_data_only_when_trimmed())
    }

    /// The format.
    pub fn format(&self) -> &F {
        &self.format
    }

    /// Refuses a change to a read-only image and a range past its end.
    fn check_change(&self, offset: u64, len: u64) -> Result<()> {
        if !self.format.writable() {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        check_range(self.format.guest_size(), offset, len)
    }

    /// Keeps FUA's promise: a flush after the request.
    fn finish(&self, fua: bool) -> Result<()> {
        if fua { self.format.flush() } else { Ok(()) }
    }

    /// The units under `[g, g+len)`, held exclusively.
    fn hold_units(&self, g: u64, len: u64) -> diskit_core::range_lock::RangeGuard<'_> {
        let u = self.format.unit();
        let end = g.saturating_add(len).div_ceil(u).saturating_mul(u);
        self.units.lock(g / u * u, end, true)
    }

    /// A write of `buf` at guest `offset`: checked, announced to the
    /// format, written (`placed` as [`write_range`](Self::write_range)
    /// calls it), then FUA kept.
    fn write_guest(
        &self,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
        placed: &mut Placed<'_>,
    ) -> Result<()> {
        self.check_change(offset, buf.len() as u64)?;
        if !buf.is_empty() {
            self.format.before_change(offset, buf.len() as u64)?;
            self.write_range(buf, offset, placed)?;
        }
        self.finish(flags.fua)
    }

    /// Writes `buf` at guest `offset` (in range); `placed`, if any, is
    /// called (taken) once the last step's bytes have their place, before
    /// they are written (see [`BlockDevice::write_placed`]).
    fn write_range(&self, buf: &[u8], offset: u64, placed: &mut Placed<'_>) -> Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            done += self.write_step(&buf[done..], offset + done as u64, placed)?;
        }
        Ok(())
    }

    /// Writes a prefix of `buf` at guest `g`: a run writable in place, or
    /// new space for a run that is not data. Returns the bytes written (0
    /// when another writer allocated the run meanwhile: it is then
    /// written in place). A step that finishes `buf` calls `placed` before
    /// its bytes move.
    fn write_step(&self, buf: &[u8], g: u64, placed: &mut Placed<'_>) -> Result<usize> {
        let f = &self.format;
        let max = (buf.len() as u64).min(MAX_STEP);
        let (n, place, held) = f.lookup(g, max, f.mappings_change())?;
        if let Some((h, n)) = f.write_in_place(g, n, place)? {
            let n = n as usize;
            if n == buf.len() {
                call_placed(placed);
            }
            f.data().write_extend(&buf[..n], h)?;
            drop(held);
            return Ok(n);
        }
        drop(held);
        let span = f.allocation_span(g, n, max);
        let _units = self.hold_units(g, span);
        // Look again under the hold: another writer may have allocated.
        let (now, place, _) = f.lookup(g, n, false)?;
        if f.write_in_place(g, now, place)?.is_some() {
            return Ok(0);
        }
        let len = if span > n { span } else { now };
        let a = f.allocate(g, &buf[..len as usize])?;
        debug_assert!(a.guest <= g && a.guest + a.len > g);
        let m = ((a.guest + a.len).min(g + len) - g) as usize;
        if m == buf.len() {
            call_placed(placed);
        }
        self.fill(&a, &buf[..m], g)?;
        f.commit(a)?;
        Ok(m)
    }

    /// Writes the bytes of new space `a`: `data` at guest `g`, and what
    /// [`Allocation::fill`] asks around it.
    fn fill(&self, a: &Allocation, data: &[u8], g: u64) -> Result<()> {
        let f = &self.format;
        match &a.fill {
            Fill::DataOnly => f.data().write_extend(data, a.host + (g - a.guest)),
            Fill::Encoded { bytes, .. } => f.data().write_extend(bytes, a.host),
            // Nothing around the data: it is written as it is.
            Fill::Whole | Fill::OverZeros if data.len() as u64 == a.len => {
                f.data().write_extend(data, a.host)
            }
            // Around the data only zeros that stay so (their mappings
            // say it, nothing is read): the data alone is written.
            Fill::OverZeros
                if self.known_zeros(a.guest, g - a.guest)?
                    && self.known_zeros(
                        g + data.len() as u64,
                        a.guest + a.len - g - data.len() as u64,
                    )? =>
            {
                f.data().write_extend(data, a.host + (g - a.guest))?;
                if g + (data.len() as u64) < a.guest + a.len {
                    // The space's last byte, so that storage ends there.
                    f.data().write_extend(&[0], a.host + a.len - 1)?;
                }
                Ok(())
            }
            Fill::Whole | Fill::OverZeros => {
                with_reused(&FILL_BUFFER, a.len as usize, MAX_KEPT, |region| {
                    let d = (g - a.guest) as usize;
                    let e = d + data.len();
                    region[d..e].copy_from_slice(data);
                    // What the range read as before, around the data.
                    let (head, tail) = region.split_at_mut(d);
                    self.read_old(a.guest, head)?;
                    self.read_old(g + data.len() as u64, &mut tail[data.len()..])?;
                    let (mut from, mut to) = (0, region.len());
                    if a.fill == Fill::OverZeros {
                        if is_zero(&region[..d]) {
                            from = d;
                        }
                        if is_zero(&region[e..]) {
                            to = e;
                        }
                    }
                    f.data()
                        .write_extend(&region[from..to], a.host + from as u64)?;
                    if to < region.len() {
                        // The space's last byte, so that storage ends there.
                        f.data().write_extend(&[0], a.host + a.len - 1)?;
                    }
                    Ok(())
                })
            }
        }
    }

    /// Runs `change` with the units under guest `[g, g+len)` held
    /// exclusively, as allocations, zeroing and discards hold them: for a
    /// change to the mappings the format makes by itself (qcow2's
    /// compressed clusters).
    pub fn with_units<R>(&self, g: u64, len: u64, change: impl FnOnce(&F) -> R) -> R {
        let _units = self.hold_units(g, len);
        change(&self.format)
    }

    /// Whether guest `[g, g+len)` reads as zeros by its mappings alone
    /// (zero places, unallocated ones without a backing image, past the
    /// end of the image), nothing read.
    fn known_zeros(&self, g: u64, len: u64) -> Result<bool> {
        let f = &self.format;
        let inside = f.guest_size().saturating_sub(g).min(len);
        let mut done = 0;
        while done < inside {
            let (n, place, _) = f.lookup(g + done, inside - done, false)?;
            match place {
                Place::Zero { .. } => {}
                Place::Unallocated { .. } if f.backing().is_none() => {}
                _ => return Ok(false),
            }
            done += n;
        }
        Ok(true)
    }

    /// Reads what `buf.len()` bytes at guest `g` held before new space
    /// took them (zeros past the end of the image).
    fn read_old(&self, g: u64, buf: &mut [u8]) -> Result<()> {
        let f = &self.format;
        let inside = f.guest_size().saturating_sub(g).min(buf.len() as u64) as usize;
        let mut done = 0usize;
        while done < inside {
            let at = g + done as u64;
            let (n, place, _) = f.lookup(at, (inside - done) as u64, false)?;
            read_place(f, place, at, &mut buf[done..done + n as usize])?;
            done += n as usize;
        }
        buf[inside..].fill(0);
        Ok(())
    }
}

impl<F> Deref for Mapped<F> {
    type Target = F;

    fn deref(&self) -> &F {
        &self.format
    }
}

impl<F: MappedFormat> BlockDevice for Mapped<F> {
    fn size(&self) -> u64 {
        self.format.guest_size()
    }

    fn capabilities(&self) -> Capabilities {
        self.format.capabilities()
    }

    fn block_size(&self) -> BlockSizeLimits {
        self.format.block_size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        read(&self.format, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.write_guest(buf, offset, flags, &mut None)
    }

    /// New space is taken in the caller's order, the bytes written after
    /// `placed`: a copy in source order lays a new image out in that order
    /// while its workers write the data side by side.
    fn write_placed(
        &self,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
        placed: &mut dyn FnMut(),
    ) -> Result<()> {
        if self.format.data().writes_in_order() {
            // Storage written front to back (a new S3 object) takes the
            // bytes themselves in order: the write comes whole first.
            let result = self.write_guest(buf, offset, flags, &mut None);
            placed();
            return result;
        }
        let mut pending: Placed<'_> = Some(placed);
        let result = self.write_guest(buf, offset, flags, &mut pending);
        // A write that failed before its last step is placed all the same.
        call_placed(&mut pending);
        result
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.check_change(offset, len)?;
        let flags = ZeroFlags {
            may_trim: flags.may_trim && !self.keep_allocations,
            ..flags
        };
        if flags.fast && !self.format.capabilities().can_fast_zero {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        if len > 0 {
            self.format.before_change(offset, len)?;
        }
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            // Steps end on multiples of MAX_STEP, and so on unit
            // boundaries: a format sees aligned ends as aligned.
            let n = (end - pos).min(MAX_STEP - pos % MAX_STEP);
            let units = self.hold_units(pos, n);
            match self.format.zero(pos, n, flags)? {
                Zeroed::Done(k) => pos += k,
                Zeroed::Write(k) => {
                    drop(units);
                    if flags.fast {
                        return Err(Error::new(
                            ErrorKind::NotSupported,
                            "zeroing this range writes zeros",
                        ));
                    }
                    write_zero_buffer(&ZeroWriter(self), pos, k, false)?;
                    pos += k;
                }
            }
        }
        self.finish(flags.fua)
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.check_change(offset, len)?;
        // Discard is advisory: one that may not deallocate does nothing.
        if len > 0 && !self.keep_allocations {
            self.format.before_change(offset, len)?;
            let _units = self.hold_units(offset, len);
            self.format.discard(offset, len)?;
        }
        self.finish(flags.fua)
    }

    fn flush(&self) -> Result<()> {
        self.format.flush()
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.format.extents(offset, len)
    }

    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        if self.data_space_reused() {
            return None;
        }
        file_view(&self.format, offset, len)
    }

    fn describe(&self) -> String {
        self.format.describe()
    }

    fn close(&self) -> Result<()> {
        self.format.close()
    }
}

/// The device as zero writing sees it: plain writes, no FUA, no checks
/// again (the request was checked).
struct ZeroWriter<'a, F>(&'a Mapped<F>);

impl<F: MappedFormat> BlockDevice for ZeroWriter<'_, F> {
    fn size(&self) -> u64 {
        self.0.size()
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        self.0.write_range(buf, offset, &mut None)
    }
}
