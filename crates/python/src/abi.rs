//! The plugin side of [`diskit_core::plugin_abi`]: the table of C
//! functions diskit finds through [`diskit_plugin_entry`], each a
//! [`PythonPlugin`] method. Failures are reported through the host's
//! `error` (errno and message) and a panic is one too: nothing unwinds
//! into diskit.

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use diskit_core::plugin_abi::{
    ABI_VERSION, AddExport, AddExtent, AddStr, Entry, FAILED, Host, Opaque, Pair, Plugin, Str,
    UNSAID,
};
use diskit_core::{Error, Result};

use crate::plugin::{Handle, PythonPlugin};

/// The host's services, given at the entry.
static HOST: OnceLock<Host> = OnceLock::new();

/// The host's services, once diskit has taken the table.
pub(crate) fn host() -> Option<&'static Host> {
    HOST.get()
}

/// The plugin's entry ([`diskit_core::plugin_abi::ENTRY`]): the table, for
/// a host of this ABI.
///
/// # Safety
///
/// `host` must be null or point to services valid for the life of the
/// process.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn diskit_plugin_entry(abi: u32, host: *const Host) -> *const Plugin {
    // SAFETY: the caller's promise.
    let Some(host) = (unsafe { host.as_ref() }) else {
        return std::ptr::null();
    };
    if abi != ABI_VERSION || host.abi != ABI_VERSION {
        return std::ptr::null();
    }
    let _ = HOST.set(*host);
    &TABLE
}

/// The entry has the ABI's type.
const _: Entry = diskit_plugin_entry;

static TABLE: Plugin = Plugin {
    abi: ABI_VERSION,
    size: std::mem::size_of::<Plugin>(),
    dump,
    load,
    name,
    thread_model,
    open,
    close,
    get_size,
    block_size,
    can,
    mode,
    pread,
    pwrite,
    flush,
    trim,
    zero,
    extents,
    cache,
    list_exports,
    default_export,
    export_description,
    preconnect,
    cleanup,
};

/// Reports `e` to the host; [`FAILED`].
fn report(e: &Error) -> c_int {
    if let Some(h) = host() {
        let text = e.to_string();
        // SAFETY: the host's function; the text lives for the call.
        unsafe { (h.error)(e.errno(), Str::new(&text)) };
    }
    FAILED
}

/// Runs `f`: its answer, or its failure (a panic included) reported.
fn guard(f: impl FnOnce() -> Result<c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => report(&e),
        Err(_) => report(&Error::io("python plugin: internal error (panic)")),
    }
}

/// Runs `f` for a new object: its address, or null with the failure
/// reported.
fn guard_new<T>(f: impl FnOnce() -> Result<T>) -> Opaque {
    let mut out = std::ptr::null_mut();
    guard(|| {
        out = Box::into_raw(Box::new(f()?)).cast();
        Ok(0)
    });
    out
}

/// The plugin of a state [`load`] returned.
///
/// # Safety
///
/// `state` must come from [`load`] (whose plugin is never freed).
unsafe fn plugin(state: Opaque) -> &'static PythonPlugin {
    // SAFETY: the caller's promise.
    unsafe { &*state.cast::<PythonPlugin>() }
}

/// The handle [`open`] returned.
///
/// # Safety
///
/// `h` must come from [`open`] and not be closed yet.
unsafe fn handle<'a>(h: Opaque) -> &'a Handle {
    // SAFETY: the caller's promise.
    unsafe { &*h.cast::<Handle>() }
}

/// `0` or `1`, or [`UNSAID`] for none.
fn answer(b: Option<bool>) -> c_int {
    b.map_or(UNSAID, c_int::from)
}

unsafe extern "C" fn dump(add: AddStr, ctx: *mut c_void) -> c_int {
    guard(|| {
        for line in PythonPlugin::dump()? {
            // SAFETY: the host's callback and context, for this call.
            unsafe { add(ctx, Str::new(&line)) };
        }
        Ok(0)
    })
}

unsafe extern "C" fn load(args: *const Pair, count: usize) -> Opaque {
    guard_new(|| {
        let pairs = if count == 0 {
            &[][..]
        } else {
            // SAFETY: the host passes `count` pairs valid for the call.
            unsafe { std::slice::from_raw_parts(args, count) }
        };
        let args: Vec<(String, String)> = pairs
            .iter()
            // SAFETY: as above, for their texts.
            .map(|p| unsafe { (p.key.text().into_owned(), p.value.text().into_owned()) })
            .collect();
        PythonPlugin::load(&args)
    })
}

unsafe extern "C" fn name(state: Opaque) -> Str {
    // SAFETY: the host passes the state of `load`.
    Str::new(&unsafe { plugin(state) }.name)
}

unsafe extern "C" fn thread_model(state: Opaque) -> c_int {
    // SAFETY: the host passes the state of `load`.
    let model = unsafe { plugin(state) }.model;
    c_int::try_from(model).unwrap_or(c_int::MAX)
}

unsafe extern "C" fn open(state: Opaque, readonly: c_int, export: Str, _tls: c_int) -> Opaque {
    guard_new(|| {
        // SAFETY: the state of `load`; the export name is valid for the
        // call.
        unsafe { plugin(state).open(readonly != 0, &export.text()) }
    })
}

unsafe extern "C" fn close(state: Opaque, h: Opaque) -> c_int {
    guard(|| {
        // SAFETY: the host closes each handle of `open` once: it is ours
        // again.
        let h = unsafe { Box::from_raw(h.cast::<Handle>()) };
        // SAFETY: the state of `load`.
        unsafe { plugin(state) }.close(*h).map(|()| 0)
    })
}

unsafe extern "C" fn get_size(state: Opaque, h: Opaque, size: *mut u64) -> c_int {
    guard(|| {
        // SAFETY: the state and a live handle; `size` is the host's out
        // pointer.
        unsafe { *size = plugin(state).get_size(handle(h))? };
        Ok(0)
    })
}

unsafe extern "C" fn block_size(state: Opaque, h: Opaque, sizes: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: the state and a live handle.
        let Some(given) = (unsafe { plugin(state).block_size(handle(h))? }) else {
            return Ok(UNSAID);
        };
        // SAFETY: `sizes` holds three values (the ABI's).
        unsafe { std::ptr::copy_nonoverlapping(given.as_ptr(), sizes, 3) };
        Ok(0)
    })
}

unsafe extern "C" fn can(state: Opaque, h: Opaque, method: Str) -> c_int {
    // SAFETY: the state, a live handle, a name valid for the call.
    guard(|| unsafe { plugin(state).can(handle(h), &method.text()) }.map(answer))
}

unsafe extern "C" fn mode(state: Opaque, h: Opaque, method: Str) -> c_int {
    guard(|| {
        // SAFETY: the state, a live handle, a name valid for the call.
        let m = unsafe { plugin(state).mode(handle(h), &method.text()) }?;
        Ok(c_int::try_from(m).unwrap_or(c_int::MAX))
    })
}

unsafe extern "C" fn pread(
    state: Opaque,
    h: Opaque,
    buf: *mut u8,
    len: usize,
    offset: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the host's buffer, ours exclusively for the call.
        let buf = unsafe { std::slice::from_raw_parts_mut(buf, len) };
        // SAFETY: the state and a live handle.
        unsafe { plugin(state).pread(handle(h), buf, offset) }.map(|()| 0)
    })
}

unsafe extern "C" fn pwrite(
    state: Opaque,
    h: Opaque,
    buf: *const u8,
    len: usize,
    offset: u64,
    flags: u32,
) -> c_int {
    guard(|| {
        // SAFETY: the host's bytes, valid for the call.
        let buf = unsafe { std::slice::from_raw_parts(buf, len) };
        // SAFETY: the state and a live handle.
        unsafe { plugin(state).pwrite(handle(h), buf, offset, flags) }.map(|()| 0)
    })
}

unsafe extern "C" fn flush(state: Opaque, h: Opaque) -> c_int {
    // SAFETY: the state and a live handle.
    guard(|| unsafe { plugin(state).flush(handle(h)) }.map(|()| 0))
}

unsafe extern "C" fn trim(state: Opaque, h: Opaque, offset: u64, len: u64, flags: u32) -> c_int {
    // SAFETY: the state and a live handle.
    guard(|| unsafe { plugin(state).trim(handle(h), offset, len, flags) }.map(|()| 0))
}

unsafe extern "C" fn zero(state: Opaque, h: Opaque, offset: u64, len: u64, flags: u32) -> c_int {
    // SAFETY: the state and a live handle.
    guard(|| unsafe { plugin(state).zero(handle(h), offset, len, flags) }.map(|()| 0))
}

unsafe extern "C" fn extents(
    state: Opaque,
    h: Opaque,
    offset: u64,
    len: u64,
    flags: u32,
    add: AddExtent,
    ctx: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: the state and a live handle; the host's callback and
        // context are valid for the call.
        unsafe {
            plugin(state).extents(handle(h), offset, len, flags, |at, n, kind| {
                add(ctx, at, n, kind)
            })
        }
        .map(|()| 0)
    })
}

unsafe extern "C" fn cache(state: Opaque, h: Opaque, offset: u64, len: u64) -> c_int {
    // SAFETY: the state and a live handle.
    guard(|| unsafe { plugin(state).cache(handle(h), offset, len) }.map(|()| 0))
}

unsafe extern "C" fn list_exports(
    state: Opaque,
    readonly: c_int,
    tls: c_int,
    add: AddExport,
    ctx: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: the state of `load`.
        let Some(list) = (unsafe { plugin(state) }).list_exports(readonly != 0, tls != 0)? else {
            return Ok(UNSAID);
        };
        for (name, desc) in &list {
            let d = desc.as_deref().unwrap_or("");
            // SAFETY: the host's callback and context, for this call.
            unsafe {
                add(
                    ctx,
                    Str::new(name),
                    Str::new(d),
                    c_int::from(desc.is_some()),
                )
            };
        }
        Ok(0)
    })
}

/// Gives `text` to `add`, or answers [`UNSAID`].
fn give(text: Option<String>, add: AddStr, ctx: *mut c_void) -> c_int {
    match text {
        Some(t) => {
            // SAFETY: the host's callback and context, for this call.
            unsafe { add(ctx, Str::new(&t)) };
            0
        }
        None => UNSAID,
    }
}

unsafe extern "C" fn default_export(
    state: Opaque,
    readonly: c_int,
    tls: c_int,
    add: AddStr,
    ctx: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: the state of `load`.
        let name = unsafe { plugin(state) }.default_export(readonly != 0, tls != 0)?;
        Ok(give(name, add, ctx))
    })
}

unsafe extern "C" fn export_description(
    state: Opaque,
    h: Opaque,
    add: AddStr,
    ctx: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: the state and a live handle.
        let text = unsafe { plugin(state).export_description(handle(h)) }?;
        Ok(give(text, add, ctx))
    })
}

unsafe extern "C" fn preconnect(state: Opaque, readonly: c_int) -> c_int {
    guard(|| {
        // SAFETY: the state of `load`.
        let p = unsafe { plugin(state) };
        p.preconnect(readonly != 0).map(|()| 0)
    })
}

unsafe extern "C" fn cleanup(state: Opaque) -> c_int {
    // SAFETY: the state of `load`.
    guard(|| unsafe { plugin(state) }.cleanup().map(|()| 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entry_is_the_symbol_the_host_looks_for() {
        assert_eq!(
            diskit_core::plugin_abi::ENTRY.to_str().unwrap(),
            "diskit_plugin_entry"
        );
        // Without the host's services there is no table.
        // SAFETY: a null host is allowed.
        assert!(unsafe { diskit_plugin_entry(ABI_VERSION, std::ptr::null()) }.is_null());
    }
}
