//! A script's handle as a device: each client connection opens its own
//! (`open(readonly)` when it picks the export, `close(h)` when it ends),
//! and the handle opened at start-up answers for the export (size,
//! capabilities) and is closed when the server stops, with `cleanup()`.
//!
//! The script's thread model is kept as nbdkit keeps it: with
//! `serialize_connections` one connection at a time (the next waits in
//! its handshake), with it or `serialize_all_requests` (the default) one
//! request at a time over all connections, with `serialize_requests` one
//! per connection, with `parallel` no lock but the GIL, which is released
//! whenever Python does not run. The locks are taken before the GIL.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use diskit_core::device::write_zero_buffer;
use diskit_core::sync::{lock, wait};
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, Error, ErrorKind, Extent, ExtentFlags,
    Result, Session, WriteFlags, ZeroFlags,
};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyTuple};

use crate::lend::lend;
use crate::module::{
    self, EXTENT_HOLE, EXTENT_ZERO, FLAG_FAST_ZERO, FLAG_FUA, FLAG_MAY_TRIM, MODE_EMULATE,
    MODE_NATIVE, MODE_NONE, THREAD_MODEL_PARALLEL, THREAD_MODEL_SERIALIZE_ALL_REQUESTS,
    THREAD_MODEL_SERIALIZE_CONNECTIONS, THREAD_MODEL_SERIALIZE_REQUESTS,
};
use crate::script::Script;

/// What every handle of the script shares.
pub(crate) struct Shared {
    pub script: Script,
    /// The thread model the script chose.
    pub model: i64,
    /// Served read-only: every handle is opened so.
    pub readonly: bool,
    /// Held around each request under `serialize_all_requests` and
    /// `serialize_connections`.
    all: Mutex<()>,
    /// Whether a connection is open, under `serialize_connections`.
    busy: Mutex<bool>,
    free: Condvar,
}

impl Shared {
    /// What a loaded and configured script serves.
    pub fn new(script: Script, model: i64, readonly: bool) -> Result<Shared> {
        if !(THREAD_MODEL_SERIALIZE_CONNECTIONS..=THREAD_MODEL_PARALLEL).contains(&model) {
            return Err(Error::invalid(format!(
                "{}: thread_model: unknown thread model {model}",
                script.path
            )));
        }
        Ok(Shared {
            script,
            model,
            readonly,
            all: Mutex::new(()),
            busy: Mutex::new(false),
            free: Condvar::new(),
        })
    }

    /// Waits until no other connection is open, under
    /// `serialize_connections`; true when the caller must [`leave`]
    /// (Shared::leave).
    fn enter(&self) -> bool {
        if self.model != THREAD_MODEL_SERIALIZE_CONNECTIONS {
            return false;
        }
        let mut busy = lock(&self.busy);
        while *busy {
            busy = wait(&self.free, busy);
        }
        *busy = true;
        true
    }

    fn leave(&self) {
        *lock(&self.busy) = false;
        self.free.notify_one();
    }
}

/// One handle of the script, as a device.
pub struct PythonDevice {
    shared: Arc<Shared>,
    /// What `open` returned.
    handle: Py<PyAny>,
    /// The export name the client asked for (`nbdkit.export_name()`).
    export: String,
    size: u64,
    caps: Capabilities,
    fua: i64,
    cache: i64,
    limits: BlockSizeLimits,
    /// Held around each request under `serialize_requests`.
    requests: Mutex<()>,
    /// Whether this handle holds the `serialize_connections` turn.
    turn: bool,
    closed: AtomicBool,
}

impl PythonDevice {
    /// Opens a handle for `export` and asks the script what it offers.
    pub(crate) fn open(
        shared: Arc<Shared>,
        export: &str,
        readonly: bool,
        turn: bool,
    ) -> Result<PythonDevice> {
        let _all = (shared.model <= THREAD_MODEL_SERIALIZE_ALL_REQUESTS).then(|| lock(&shared.all));
        let s = &shared.script;
        let opened = Python::attach(|py| -> Result<_> {
            module::set_export(export);
            let h = s.call(py, "open", (readonly,))?;
            let size = s.call(py, "get_size", (&h,))?;
            let size = size
                .extract::<i64>()
                .map_err(|e| s.error(py, "get_size", &e))
                .and_then(|n| {
                    u64::try_from(n).map_err(|_| {
                        Error::invalid(format!("{}: get_size: negative size {n}", s.path))
                    })
                })?;
            let limits = block_size(py, s, &h)?;
            let flag = |can: &str, plain: Option<&str>| boolean(py, s, &h, can, plain);
            let can_write = !readonly && flag("can_write", Some("pwrite"))?;
            let can_flush = flag("can_flush", Some("flush"))?;
            let can_zero = can_write && flag("can_zero", Some("zero"))?;
            let can_fast_zero = can_write
                && if s.defines(py, "can_fast_zero") {
                    flag("can_fast_zero", None)?
                } else {
                    // nbdkit's python plugin: fast zeroes fail at once when
                    // zeroing is emulated.
                    !can_zero
                };
            let fua = if !can_write {
                MODE_NONE
            } else if s.defines(py, "can_fua") {
                mode(py, s, &h, "can_fua")?
            } else if s.defines(py, "flush") {
                MODE_EMULATE
            } else {
                MODE_NONE
            };
            let cache = if s.defines(py, "can_cache") {
                mode(py, s, &h, "can_cache")?
            } else if s.defines(py, "cache") {
                MODE_NATIVE
            } else {
                MODE_NONE
            };
            let caps = Capabilities {
                can_write,
                can_flush,
                can_fua: fua != MODE_NONE,
                can_trim: can_write && flag("can_trim", Some("trim"))?,
                can_write_zeroes: can_write,
                can_zero,
                can_fast_zero,
                can_extents: flag("can_extents", Some("extents"))?,
                can_multi_conn: flag("can_multi_conn", None)?,
                can_cache: cache != MODE_NONE,
                is_rotational: flag("is_rotational", None)?,
            };
            Ok((h.unbind(), size, limits, caps, fua, cache))
        });
        let (handle, size, limits, caps, fua, cache) = opened?;
        Ok(PythonDevice {
            shared: shared.clone(),
            handle,
            export: export.to_string(),
            size,
            caps,
            fua,
            cache,
            limits,
            requests: Mutex::new(()),
            turn,
            closed: AtomicBool::new(false),
        })
    }

    /// Runs `f` on the script with this handle, under the thread model's
    /// locks and the GIL.
    fn python<R>(
        &self,
        f: impl for<'py> FnOnce(Python<'py>, &Script, &Bound<'py, PyAny>) -> Result<R>,
    ) -> Result<R> {
        let model = self.shared.model;
        let _all = (model <= THREAD_MODEL_SERIALIZE_ALL_REQUESTS).then(|| lock(&self.shared.all));
        let _one = (model == THREAD_MODEL_SERIALIZE_REQUESTS).then(|| lock(&self.requests));
        let r = Python::attach(|py| {
            module::set_export(&self.export);
            f(py, &self.shared.script, self.handle.bind(py))
        });
        if let Err(e) = &r {
            // As nbdkit logs a failed callback (the client only sees the
            // errno): the script, the callback, the traceback.
            eprintln!("nbdkit: python: error: {e}");
        }
        r
    }

    /// The flags of a request as the script gets them: FUA only when the
    /// script does it natively.
    fn fua_flag(&self, fua: bool) -> u32 {
        if fua && self.fua == MODE_NATIVE {
            FLAG_FUA
        } else {
            0
        }
    }

    /// After a request with FUA that the script took without it.
    fn emulate_fua(&self, fua: bool) -> Result<()> {
        if fua && self.fua == MODE_EMULATE {
            self.flush()?;
        }
        Ok(())
    }

    /// Closes the handle once (`close(h)`, if the script has it).
    fn close_handle(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let r = self.python(|py, s, h| {
            if s.defines(py, "close") {
                s.call(py, "close", (h,))?;
            }
            Ok(())
        });
        if self.turn {
            self.shared.leave();
        }
        r
    }
}

/// nbdkit's boolean callbacks: `can(h)` is True (nothing else counts),
/// or, without it, whether the script defines `plain`.
fn boolean(
    py: Python<'_>,
    s: &Script,
    h: &Bound<'_, PyAny>,
    can: &str,
    plain: Option<&str>,
) -> Result<bool> {
    if s.defines(py, can) {
        let r = s.call(py, can, (h,))?;
        return Ok(r.cast::<PyBool>().is_ok_and(|b| b.is_true()));
    }
    Ok(plain.is_some_and(|p| s.defines(py, p)))
}

/// `can_fua(h)` or `can_cache(h)`: one of the NONE, EMULATE, NATIVE
/// constants.
fn mode(py: Python<'_>, s: &Script, h: &Bound<'_, PyAny>, name: &str) -> Result<i64> {
    let m = s
        .call(py, name, (h,))?
        .extract::<i64>()
        .map_err(|e| s.error(py, name, &e))?;
    if !(MODE_NONE..=MODE_NATIVE).contains(&m) {
        return Err(Error::invalid(format!(
            "{}: {name}: unknown mode {m}",
            s.path
        )));
    }
    Ok(m)
}

/// `block_size(h)`: (minimum, preferred, maximum), or the defaults.
fn block_size(py: Python<'_>, s: &Script, h: &Bound<'_, PyAny>) -> Result<BlockSizeLimits> {
    if !s.defines(py, "block_size") {
        return Ok(BlockSizeLimits::default());
    }
    let (minimum, preferred, maximum) = s
        .call(py, "block_size", (h,))?
        .extract::<(u32, u32, u32)>()
        .map_err(|e| s.error(py, "block_size", &e))?;
    if minimum == 0 {
        return Ok(BlockSizeLimits::default());
    }
    Ok(BlockSizeLimits {
        minimum,
        preferred,
        maximum,
    })
}

/// The extents a script returned for `offset..end`, as nbdkit adds them:
/// contiguous and in order, those before `offset` skipped, the first one
/// cut at `offset`, those past `end` cut or dropped, neighbours of one
/// type merged.
fn extents_from(
    py: Python<'_>,
    s: &Script,
    answer: &Bound<'_, PyAny>,
    offset: u64,
    end: u64,
) -> Result<Vec<Extent>> {
    let bad = |what: &str| Error::io(format!("{}: extents method did not return {what}", s.path));
    let iter = answer
        .try_iter()
        .map_err(|_| bad("something which is iterable"))?;
    let mut out: Vec<(u64, u32)> = Vec::new();
    let mut next: Option<u64> = None;
    let mut any = false;
    for item in iter {
        let item = item.map_err(|e| s.error(py, "extents", &e))?;
        any = true;
        let (at, len, kind) = item
            .cast::<PyTuple>()
            .ok()
            .filter(|t| t.len() == 3)
            .ok_or_else(|| bad("an iterable of 3-tuples"))?
            .extract::<(u64, u64, u32)>()
            .map_err(|e| s.error(py, "PyLong", &e))?;
        if next.is_some_and(|n| n != at) {
            return Err(Error::io(format!(
                "{}: extents: extents must be added in ascending order and must be contiguous",
                s.path
            )));
        }
        next = Some(at.saturating_add(len));
        let mut len = len.min(end.saturating_sub(at));
        if len == 0 || at >= end {
            continue;
        }
        if out.is_empty() {
            if at.saturating_add(len) <= offset {
                continue;
            }
            if at > offset {
                return Err(Error::io(format!(
                    "{}: extents: first extent must not be > start ({offset})",
                    s.path
                )));
            }
            len -= offset - at;
        }
        match out.last_mut() {
            Some((l, k)) if *k == kind => *l += len,
            _ => out.push((len, kind)),
        }
    }
    if !any {
        return Err(Error::io(format!(
            "{}: extents method cannot return an empty list",
            s.path
        )));
    }
    if out.is_empty() {
        return Err(Error::io(format!(
            "{}: extents: no extent covers offset {offset}",
            s.path
        )));
    }
    Ok(out
        .into_iter()
        .map(|(length, kind)| Extent {
            length,
            flags: ExtentFlags {
                zero: kind & EXTENT_ZERO != 0,
                data: kind & EXTENT_HOLE == 0,
                present: true,
                compressed: false,
            },
            depth: 0,
            host_offset: None,
        })
        .collect())
}

/// An error from lending a buffer (making the view failed).
fn lend_failed(s: &Script, name: &str, e: PyErr) -> Error {
    Error::io(format!("{}: {name}: cannot lend the buffer: {e}", s.path))
}

impl BlockDevice for PythonDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn block_size(&self) -> BlockSizeLimits {
        self.limits
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.python(|py, s, h| {
            let len = buf.len();
            if s.api == 1 {
                let r = s.call(py, "pread", (h, len, offset))?;
                let data = PyBuffer::<u8>::get(&r).map_err(|_| {
                    Error::io(format!(
                        "{}: value returned from pread does not support the buffer protocol",
                        s.path
                    ))
                })?;
                if data.item_count() < len {
                    return Err(Error::io(format!(
                        "{}: buffer returned from pread is too small",
                        s.path
                    )));
                }
                let all = data.to_vec(py).map_err(|e| s.error(py, "pread", &e))?;
                buf.copy_from_slice(&all[..len]);
                return Ok(());
            }
            // SAFETY: `buf` is ours, exclusively, for the whole call.
            unsafe {
                lend(py, buf.as_mut_ptr(), len, true, |view| {
                    s.call(py, "pread", (h, view, offset, 0u32)).map(drop)
                })
            }
            .map_err(|e| lend_failed(s, "pread", e))?
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        let bits = self.fua_flag(flags.fua);
        self.python(|py, s, h| {
            // SAFETY: `buf` is ours for the whole call; the view is
            // read-only, so the cast to *mut is never written through.
            unsafe {
                lend(py, buf.as_ptr().cast_mut(), buf.len(), false, |view| {
                    if s.api == 1 {
                        s.call(py, "pwrite", (h, view, offset)).map(drop)
                    } else {
                        s.call(py, "pwrite", (h, view, offset, bits)).map(drop)
                    }
                })
            }
            .map_err(|e| lend_failed(s, "pwrite", e))?
        })?;
        self.emulate_fua(flags.fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let zeroed = self.caps.can_zero
            && self.python(|py, s, h| {
                let r = if s.api == 1 {
                    s.call(py, "zero", (h, len, offset, flags.may_trim))
                } else {
                    let mut bits = self.fua_flag(flags.fua);
                    if flags.may_trim {
                        bits |= FLAG_MAY_TRIM;
                    }
                    if flags.fast {
                        bits |= FLAG_FAST_ZERO;
                    }
                    s.call(py, "zero", (h, len, offset, bits))
                };
                // EOPNOTSUPP, raised or not, asks for the fall-back to
                // writing zeros.
                if module::errno() == libc::EOPNOTSUPP {
                    return Ok(false);
                }
                r.map(|_| true)
            })?;
        if zeroed {
            return self.emulate_fua(flags.fua);
        }
        if flags.fast {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        write_zero_buffer(self, offset, len, flags.fua)
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        if !self.caps.can_trim {
            return if flags.fua { self.flush() } else { Ok(()) };
        }
        let bits = self.fua_flag(flags.fua);
        self.python(|py, s, h| {
            if s.api == 1 {
                s.call(py, "trim", (h, len, offset)).map(drop)
            } else {
                s.call(py, "trim", (h, len, offset, bits)).map(drop)
            }
        })?;
        self.emulate_fua(flags.fua)
    }

    fn flush(&self) -> Result<()> {
        self.python(|py, s, h| {
            if !s.defines(py, "flush") {
                return Ok(());
            }
            if s.api == 1 {
                s.call(py, "flush", (h,)).map(drop)
            } else {
                s.call(py, "flush", (h, 0u32)).map(drop)
            }
        })
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        match self.cache {
            MODE_NATIVE => {
                self.python(|py, s, h| s.call(py, "cache", (h, len, offset, 0u32)).map(drop))
            }
            MODE_EMULATE => {
                // Read and drop, as nbdkit emulates it.
                const CHUNK: u64 = 1 << 20;
                let mut scratch = vec![0u8; len.min(CHUNK) as usize];
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(CHUNK) as usize;
                    self.read_at(&mut scratch[..n], at)?;
                    at += n as u64;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        if !self.caps.can_extents {
            return Ok(vec![Extent::data(len)]);
        }
        // nbdkit asks with a 32-bit count.
        let count = len.min(u64::from(u32::MAX));
        self.python(|py, s, h| {
            let answer = s.call(py, "extents", (h, count, offset, 0u32))?;
            extents_from(py, s, &answer, offset, offset + count)
        })
    }

    fn extents_before_reads(&self) -> bool {
        // Each is a call into the script, which nbdkit never makes unasked
        // (and which a script may count, as nbdkit's error.py does).
        false
    }

    fn describe(&self) -> String {
        format!("python script {}", self.shared.script.path)
    }

    fn connect(&self, session: &Session) -> Result<Option<DeviceRef>> {
        let turn = self.shared.enter();
        let readonly = session.read_only || self.shared.readonly;
        match PythonDevice::open(self.shared.clone(), &session.export, readonly, turn) {
            Ok(d) => Ok(Some(Arc::new(d))),
            Err(e) => {
                if turn {
                    self.shared.leave();
                }
                Err(e)
            }
        }
    }

    fn close(&self) -> Result<()> {
        let closed = self.close_handle();
        let cleanup = self.python(|py, s, _| {
            if s.defines(py, "cleanup") {
                s.call(py, "cleanup", ())?;
            }
            // The interpreter is not finalized: the script's atexit
            // handlers run now, as they would when nbdkit unloads it.
            py.import("atexit")
                .and_then(|m| m.call_method0("_run_exitfuncs"))
                .map_err(|e| s.error(py, "atexit", &e))?;
            // Nor are its files flushed at exit: what it printed goes now.
            let sys = py.import("sys").map_err(|e| s.error(py, "sys", &e))?;
            for stream in ["stdout", "stderr"] {
                let _ = sys.getattr(stream).and_then(|f| f.call_method0("flush"));
            }
            Ok(())
        });
        closed.and(cleanup)
    }
}

impl Drop for PythonDevice {
    fn drop(&mut self) {
        if let Err(e) = self.close_handle() {
            eprintln!("nbdkit: python: {e}");
        }
    }
}
