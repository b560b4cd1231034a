//! Submitted requests on an RBD image: each goes to librbd as an
//! asynchronous request (`rbd_aio_read2`, `rbd_aio_write2`,
//! `rbd_aio_write_zeroes`) with a completion whose callback posts the
//! result to the submitter's queue. The request's buffer is owned by
//! the request while librbd works on it, and given back with the result.
//! Read data bound for a sink is handed over on the image's own threads,
//! not in librbd's callback thread (which completes the other requests).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use diskit_core::aio::{self, Completion, CompletionQueue, ReadSink, Request};
use diskit_core::buffer::AlignedBuf;
use diskit_core::workers::Workers;
use diskit_core::{Error, Result};

use crate::api::{Api, Handle, failed, request_failed};

/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: zeroes stay allocated.
pub const THICK_PROVISION: c_int = 1;

/// What a request's completion callback needs, owned by the request
/// while it is in flight.
struct InFlight {
    api: &'static Api,
    tag: u64,
    cq: CompletionQueue,
    /// The request's buffer (none for zeroing).
    buf: Option<AlignedBuf>,
    /// For a read: its offset and length (a short read past a shrunk
    /// end reads as zeros), and where the bytes go on from there.
    read: Option<(u64, usize)>,
    sink: Option<(Arc<dyn ReadSink>, Arc<Workers>)>,
}

/// What [`start`] is asked to do on the image.
pub enum Op {
    /// `rbd_aio_read2` into the request's buffer.
    Read,
    /// `rbd_aio_write2` of the request's range.
    Write,
    /// `rbd_aio_write_zeroes` with these librbd zero flags.
    Zero(c_int),
}

/// Starts `req` on `image` as `op`; its completion reaches `cq` from
/// librbd's callback; `workers` hand read data to a sink. The caller has checked the range and that
/// the request fits in one librbd call.
pub fn start(
    api: &'static Api,
    image: Handle,
    tag: u64,
    req: Request,
    cq: &CompletionQueue,
    workers: &Arc<Workers>,
) {
    let mut f = Box::new(InFlight {
        api,
        tag,
        cq: cq.clone(),
        buf: None,
        read: None,
        sink: None,
    });
    let (op, offset, len, start) = match req {
        Request::Read { offset, buf, len } => {
            f.buf = Some(buf);
            f.read = Some((offset, len));
            (Op::Read, offset, len, 0)
        }
        Request::ReadTo {
            offset,
            buf,
            len,
            sink,
        } => {
            f.buf = Some(buf);
            f.read = Some((offset, len));
            f.sink = Some((sink, workers.clone()));
            (Op::Read, offset, len, 0)
        }
        Request::Write {
            offset, buf, range, ..
        } => {
            f.buf = Some(buf);
            (Op::Write, offset, range.len(), range.start)
        }
        Request::Zero { offset, len, flags } => {
            let zflags = if flags.may_trim { 0 } else { THICK_PROVISION };
            (Op::Zero(zflags), offset, len as usize, 0)
        }
    };
    // librbd reads into or writes from the buffer by pointer: the bytes
    // it is given must lie in it.
    if let Some(b) = &f.buf
        && start.checked_add(len).is_none_or(|end| end > b.len())
    {
        f.finish(Err(Error::invalid("request outside its buffer")));
        return;
    }
    let data = f.buf.as_mut().map(|b| b.as_mut_ptr());
    let arg = Box::into_raw(f);
    let mut c: Handle = std::ptr::null_mut();
    // SAFETY: `arg` is a live `InFlight`, owned by the completion from
    // here; `c` is written on success.
    let r = unsafe { (api.rbd_aio_create_completion)(arg.cast(), Some(finished), &mut c) };
    if r < 0 {
        // SAFETY: no completion owns `arg`: it is ours again.
        let f = unsafe { Box::from_raw(arg) };
        f.finish(Err(failed(r.into(), "error creating a completion")));
        return;
    }
    // SAFETY: the buffer (`data`, the request's bytes checked to lie in
    // it above) is owned by `arg`, which lives until the callback; the
    // image is open and stays so while requests are in flight (closing
    // it waits for them).
    let r = unsafe {
        match (op, data) {
            (Op::Read, Some(p)) => (api.rbd_aio_read2)(image, offset, len, p.cast(), c, 0),
            (Op::Write, Some(p)) => {
                (api.rbd_aio_write2)(image, offset, len, p.add(start).cast(), c, 0)
            }
            (Op::Zero(z), _) => (api.rbd_aio_write_zeroes)(image, offset, len, c, z, 0),
            _ => unreachable!("reads and writes own a buffer"),
        }
    };
    if r < 0 {
        // librbd refused the request before taking it: the callback will
        // not come.
        // SAFETY: `c` is ours and not started; `arg` is ours again.
        let f = unsafe {
            (api.rbd_aio_release)(c);
            Box::from_raw(arg)
        };
        f.finish(Err(request_failed(r.into())));
    }
}

/// librbd's completion callback: takes the request back, releases the
/// completion and posts the result.
unsafe extern "C" fn finished(c: Handle, arg: *mut c_void) {
    // SAFETY: `arg` is the `InFlight` given to this completion, whose
    // callback runs once.
    let f = unsafe { Box::from_raw(arg.cast::<InFlight>()) };
    // SAFETY: `c` is the finished completion, released once, here.
    let r = unsafe {
        let r = (f.api.rbd_aio_get_return_value)(c);
        (f.api.rbd_aio_release)(c);
        r
    };
    let result = if r < 0 {
        Err(request_failed(r as i64))
    } else {
        Ok(r as usize)
    };
    f.finish(result);
}

impl InFlight {
    /// Posts the request's result (bytes done, or the error): a read's
    /// short end is zeroed, and a sink gets the bytes first, on the
    /// image's threads.
    fn finish(mut self: Box<Self>, done: Result<usize>) {
        let result = match (done, self.read, self.buf.as_mut()) {
            (Ok(n), Some((_, len)), Some(buf)) => match buf.get_mut(..len) {
                Some(b) => {
                    if n < len {
                        // Past the end of a shrunk image: zeros.
                        b[n..].fill(0);
                    }
                    Ok(())
                }
                None => Err(Error::invalid("read longer than its buffer")),
            },
            (done, ..) => done.map(|_| ()),
        };
        match self.sink.take() {
            // A sink that drops what it is given needs no hop.
            Some((sink, workers)) if result.is_ok() && !sink.discards() => {
                workers.run(move || {
                    let (offset, len) = self.read.expect("a read");
                    let buf = self.buf.as_ref().expect("a read's buffer");
                    let result = aio::hand_over(&*sink, offset, &buf[..len]);
                    (*self).post(result);
                });
            }
            _ => (*self).post(result),
        }
    }

    fn post(self, result: Result<()>) {
        let InFlight { tag, cq, buf, .. } = self;
        cq.push(Completion { tag, result, buf });
    }
}
