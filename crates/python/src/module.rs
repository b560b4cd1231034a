//! The `nbdkit` module scripts import: nbdkit's functions (`debug`,
//! `set_error`, `export_name`, `parse_size`, `shutdown`, `disconnect`)
//! and constants
//! (thread models, request flags, FUA and cache modes, extent types), with
//! nbdkit's values.
//!
//! `set_error` and `export_name` are per thread, as in nbdkit: the errno a
//! script sets is read back by the call that ran it on the same thread,
//! and the export name is the one of the connection whose request runs.
//! `debug`, `shutdown` and `disconnect` are the server's: they go to
//! diskit through the host's services ([`crate::abi::host`]).

use std::cell::{Cell, RefCell};

use diskit_core::plugin_abi::Str;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyModule;

/// nbdkit's thread models (`thread_model()`'s answers).
pub const THREAD_MODEL_SERIALIZE_CONNECTIONS: i64 = 0;
/// All requests of all connections one at a time (the default).
pub const THREAD_MODEL_SERIALIZE_ALL_REQUESTS: i64 = 1;
/// Each connection's requests one at a time.
pub const THREAD_MODEL_SERIALIZE_REQUESTS: i64 = 2;
/// Requests in parallel (Python code still under the GIL).
pub const THREAD_MODEL_PARALLEL: i64 = 3;

/// Request flags and extent types, with nbdkit's values (the plugin
/// ABI's).
pub use diskit_core::plugin_abi::{
    EXTENT_HOLE, EXTENT_ZERO, FLAG_FAST_ZERO, FLAG_FUA, FLAG_MAY_TRIM, FLAG_REQ_ONE,
};

/// `can_fua()`/`can_cache()`: not at all.
pub const MODE_NONE: i64 = 0;
/// `can_fua()`/`can_cache()`: emulated (flush after, read and discard).
pub const MODE_EMULATE: i64 = 1;
/// `can_fua()`/`can_cache()`: the script's own.
pub const MODE_NATIVE: i64 = 2;

thread_local! {
    static ERRNO: Cell<i32> = const { Cell::new(0) };
    static EXPORT: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Forgets the errno a script set on this thread (before each call).
pub(crate) fn clear_errno() {
    ERRNO.set(0);
}

/// The errno the script set on this thread with `nbdkit.set_error`, 0 if
/// none.
pub(crate) fn errno() -> i32 {
    ERRNO.get()
}

/// The export name `nbdkit.export_name()` answers on this thread.
pub(crate) fn set_export(name: &str) {
    EXPORT.with_borrow_mut(|e| {
        if e != name {
            name.clone_into(e);
        }
    });
}

#[pyfunction]
fn debug(msg: &str) {
    if let Some(host) = crate::abi::host() {
        // SAFETY: the host's function; `msg` lives for the call.
        unsafe { (host.debug)(Str::new(msg)) };
    }
}

#[pyfunction]
fn set_error(err: i32) {
    ERRNO.set(err);
}

#[pyfunction]
fn export_name() -> String {
    EXPORT.with_borrow(Clone::clone)
}

#[pyfunction]
fn parse_size(s: &str) -> PyResult<u64> {
    diskit_core::size::parse_size(s)
        .map_err(|_| PyValueError::new_err("Unable to parse string as size"))
}

#[pyfunction]
fn shutdown() {
    if let Some(host) = crate::abi::host() {
        // SAFETY: the host's function, which takes nothing.
        unsafe { (host.shutdown)() };
    }
}

#[pyfunction]
#[pyo3(signature = (force = false))]
fn disconnect(force: bool) {
    if let Some(host) = crate::abi::host() {
        // SAFETY: the host's function, given an integer.
        unsafe { (host.disconnect)(std::ffi::c_int::from(force)) };
    }
}

/// Makes `import nbdkit` give the module.
pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
    let m = PyModule::new(py, "nbdkit")?;
    m.add(
        "__doc__",
        "Module used to access nbdkit server API (diskit's)",
    )?;
    m.add_function(wrap_pyfunction!(debug, &m)?)?;
    m.add_function(wrap_pyfunction!(set_error, &m)?)?;
    m.add_function(wrap_pyfunction!(export_name, &m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, &m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, &m)?)?;
    m.add_function(wrap_pyfunction!(disconnect, &m)?)?;
    let ints: [(&str, i64); 16] = [
        (
            "THREAD_MODEL_SERIALIZE_CONNECTIONS",
            THREAD_MODEL_SERIALIZE_CONNECTIONS,
        ),
        (
            "THREAD_MODEL_SERIALIZE_ALL_REQUESTS",
            THREAD_MODEL_SERIALIZE_ALL_REQUESTS,
        ),
        (
            "THREAD_MODEL_SERIALIZE_REQUESTS",
            THREAD_MODEL_SERIALIZE_REQUESTS,
        ),
        ("THREAD_MODEL_PARALLEL", THREAD_MODEL_PARALLEL),
        ("FLAG_MAY_TRIM", FLAG_MAY_TRIM.into()),
        ("FLAG_FUA", FLAG_FUA.into()),
        ("FLAG_REQ_ONE", FLAG_REQ_ONE.into()),
        ("FLAG_FAST_ZERO", FLAG_FAST_ZERO.into()),
        ("FUA_NONE", MODE_NONE),
        ("FUA_EMULATE", MODE_EMULATE),
        ("FUA_NATIVE", MODE_NATIVE),
        ("CACHE_NONE", MODE_NONE),
        ("CACHE_EMULATE", MODE_EMULATE),
        ("CACHE_NATIVE", MODE_NATIVE),
        ("EXTENT_HOLE", EXTENT_HOLE.into()),
        ("EXTENT_ZERO", EXTENT_ZERO.into()),
    ];
    for (name, value) in ints {
        m.add(name, value)?;
    }
    py.import("sys")?
        .getattr("modules")?
        .set_item("nbdkit", m)?;
    Ok(())
}
