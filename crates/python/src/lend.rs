//! Request buffers lent to a script for the length of one call, without a
//! copy: `pread` gets a writable `memoryview` over the buffer the server
//! reads into, `pwrite` a read-only one over the bytes the client sent.
//!
//! The view's memory is not Python's, so it must be back when the call
//! returns. The memory is exported by a [`Loan`] object; every view
//! derived from the `memoryview` (slices, `memoryview(buf)`, NumPy arrays)
//! holds a reference to it through the managed buffer they share, so the
//! loan's reference count says whether any is left. One kept by the script
//! past its call (stored in a global) would read or write memory the
//! server has reused: diskit stops with a message instead (nbdkit would
//! let it happen).

use std::ffi::c_int;

use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::PyMemoryView;
use pyo3::{PyErr, ffi};

/// The address of lent memory; it only travels with the [`Loan`] that the
/// lending call drops before it returns.
struct Address(*mut u8);

// SAFETY: the address is only dereferenced by Python, under the GIL,
// while the lending call (which holds the memory exclusively) runs.
unsafe impl Send for Address {}
// SAFETY: as above; the loan itself never dereferences it.
unsafe impl Sync for Address {}

/// Memory of the caller's exported to Python through the buffer protocol.
#[pyclass(frozen)]
pub(crate) struct Loan {
    addr: Address,
    len: usize,
    writable: bool,
}

#[pymethods]
impl Loan {
    /// Fills `view` with the lent memory (a writable request on
    /// read-only memory is refused with BufferError by
    /// PyBuffer_FillInfo).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("View is null"));
        }
        let me = slf.get();
        let len = isize::try_from(me.len).map_err(|_| PyBufferError::new_err("too long"))?;
        // SAFETY: `view` is the non-null Py_buffer Python gave us; the
        // memory is valid for `len` bytes while the loan is alive, which
        // the view keeps it (FillInfo takes a reference to `slf`).
        let r = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.addr.0.cast(),
                len,
                c_int::from(!me.writable),
                flags,
            )
        };
        if r == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// Runs `call` with a `memoryview` of `len` bytes at `addr` (writable
/// when `writable`), then makes sure that no view of it is left.
///
/// # Safety
///
/// `addr` must be valid for reads (and writes when `writable`) of `len`
/// bytes, and not used otherwise, for the whole call.
pub(crate) unsafe fn lend<'py, R>(
    py: Python<'py>,
    addr: *mut u8,
    len: usize,
    writable: bool,
    call: impl FnOnce(&Bound<'py, PyAny>) -> R,
) -> PyResult<R> {
    let loan = Bound::new(
        py,
        Loan {
            addr: Address(addr),
            len,
            writable,
        },
    )?;
    let view = PyMemoryView::from(loan.as_any())?;
    let out = call(view.as_any());
    drop(view);
    returned(py, &loan);
    Ok(out)
}

/// Stops the process if a view of `loan` outlived the call (the loan is
/// held by our reference alone once every view is gone).
fn returned(py: Python<'_>, loan: &Bound<'_, Loan>) {
    // SAFETY: a live object's reference count, read under the GIL.
    let alone = || unsafe { ffi::Py_REFCNT(loan.as_ptr()) } == 1;
    if alone() {
        return;
    }
    // A view may only be caught in a reference cycle (an exception's
    // frames): a collection frees it.
    if let Ok(gc) = py.import("gc") {
        let _ = gc.call_method0("collect");
    }
    if alone() {
        return;
    }
    eprintln!(
        "nbdkit: python: the script kept a view of a request's buffer after its call \
         returned; stopping, as that memory is the server's again (copy it: bytes(buf))"
    );
    std::process::abort();
}
