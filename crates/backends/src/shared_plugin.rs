//! A plugin built as a shared object (`libdiskit_python.so`), loaded at
//! its first use and served through [`CallbackDevice`](crate::callbacks::CallbackDevice):
//! the host side of [`diskit_core::plugin_abi`]. diskit does not link the
//! plugin, nor what the plugin links (libpython), so the other commands do
//! not pay for loading them and run where they are missing.
//!
//! The library is looked for in `$DISKIT_PLUGIN_DIR` when that is set,
//! otherwise beside the executable: in its directory's `deps` (cargo's
//! build tree, where `cargo test` leaves it), its directory, and
//! `../lib/diskit` (an installed tree).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_int, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use diskit_core::dynlib::Library;
use diskit_core::plugin_abi::{
    self as abi, ABI_VERSION, FAILED, FLAG_FAST_ZERO, FLAG_FUA, FLAG_MAY_TRIM, FLAG_REQ_ONE, Host,
    Opaque, Pair, Plugin, Str, UNSAID,
};
use diskit_core::sync::lock;
use diskit_core::{BlockSizeLimits, Error, ErrorKind, ExportEntry, Result, ZeroFlags};

use crate::callbacks::{self, Callbacks, Can, Support, ThreadModel};

/// The variable naming the one directory plugins are looked for in.
pub const DIR_VARIABLE: &str = "DISKIT_PLUGIN_DIR";

static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Shows plugins' debug messages (nbdkit_debug) on standard error from now
/// on: the server's `-v`.
pub fn set_verbose(on: bool) {
    VERBOSE.store(on, Ordering::Relaxed);
}

thread_local! {
    /// The failure a plugin reported during its call on this thread.
    static FAILURE: RefCell<Option<(c_int, String)>> = const { RefCell::new(None) };
}

/// [`Host::error`].
unsafe extern "C" fn host_error(errno: c_int, message: Str) {
    // SAFETY: the plugin passes text valid for the call.
    let text = unsafe { message.text() }.into_owned();
    FAILURE.set(Some((errno, text)));
}

/// [`Host::debug`].
unsafe extern "C" fn host_debug(message: Str) {
    if VERBOSE.load(Ordering::Relaxed) {
        // SAFETY: the plugin passes text valid for the call.
        let text = unsafe { message.text() };
        let who = LOADED_AS.get().map_or("plugin", String::as_str);
        eprintln!("nbdkit: {who}: debug: {text}");
    }
}

/// [`Host::shutdown`].
unsafe extern "C" fn host_shutdown() {
    callbacks::request_shutdown();
}

/// [`Host::disconnect`]: after the reply either way (diskit closes a
/// connection between requests).
unsafe extern "C" fn host_disconnect(_force: c_int) {
    callbacks::request_disconnect();
}

/// The services every plugin gets.
static HOST: Host = Host {
    abi: ABI_VERSION,
    error: host_error,
    debug: host_debug,
    shutdown: host_shutdown,
    disconnect: host_disconnect,
};

/// The name of the first plugin loaded, in its debug messages.
static LOADED_AS: OnceLock<String> = OnceLock::new();

/// The failure the plugin reported for `call` on this thread (EIO with a
/// plain message if it reported none).
fn failure(who: &str, call: &str) -> Error {
    match FAILURE.take() {
        Some((errno, text)) => Error::new(ErrorKind::from_errno(errno), text),
        None => Error::io(format!("{who}: {call} failed")),
    }
}

/// Where `file` may be, in order.
fn places(file: &str) -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os(DIR_VARIABLE) {
        return vec![PathBuf::from(dir).join(file)];
    }
    let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(PathBuf::from))
    else {
        return Vec::new();
    };
    vec![
        dir.join("deps").join(file),
        dir.join(file),
        dir.join("../lib/diskit").join(file),
    ]
}

/// Opens `file` and takes its table, or says why not.
fn open_library(file: &str) -> std::result::Result<&'static Plugin, String> {
    let places = places(file);
    let Some(path) = places.iter().find(|p| p.exists()) else {
        let dirs: Vec<String> = places
            .iter()
            .filter_map(|p| p.parent().map(|d| d.display().to_string()))
            .collect();
        return Err(format!(
            "{file} is not in {} (set {DIR_VARIABLE} to its directory)",
            dirs.join(", ")
        ));
    };
    let name = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // The library is never closed: its name lives as long.
    let name: &'static CStr = Box::leak(name.into_boxed_c_str());
    // SAFETY: diskit's own plugin libraries, whose initialisers (Rust's
    // and libpython's) are safe in a multi-threaded process.
    let lib = unsafe { Library::open(name) }?;
    let entry = lib.symbol(abi::ENTRY)?;
    // SAFETY: the symbol of that name is the plugin's entry, of type
    // `Entry` (the ABI's definition, which both sides share); a function
    // pointer has the size of a data pointer where dlsym() exists.
    let entry = unsafe { std::mem::transmute::<*mut c_void, abi::Entry>(entry) };
    // SAFETY: `HOST` lives for the process, as the ABI asks.
    let table = unsafe { entry(ABI_VERSION, &HOST) };
    // SAFETY: a non-null table lives as long as the library: forever.
    let table = unsafe { table.as_ref() }
        .filter(|t| t.abi == ABI_VERSION && t.size == std::mem::size_of::<Plugin>());
    table.ok_or_else(|| {
        format!(
            "{}: not a plugin of this diskit (plugin ABI {ABI_VERSION} expected)",
            path.display()
        )
    })
}

/// The table of `file`, loaded at the first call (later calls share its
/// result, a failure included); `what` names the plugin in the error.
fn library(what: &str, file: &str) -> Result<&'static Plugin> {
    type Loaded = Vec<(String, std::result::Result<&'static Plugin, String>)>;
    static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());
    let mut loaded = lock(&LOADED);
    let r = match loaded.iter().find(|(f, _)| f == file) {
        Some((_, r)) => r.clone(),
        None => {
            let r = open_library(file);
            loaded.push((file.to_string(), r.clone()));
            r
        }
    };
    let _ = LOADED_AS.set(what.to_string());
    r.map_err(|why| {
        Error::new(
            ErrorKind::NotSupported,
            format!("cannot load the {what} plugin: {why}"),
        )
    })
}

/// What a shared object's `--dump-plugin` adds: its `key=value` lines.
pub fn dump(what: &str, file: &str) -> Result<Vec<String>> {
    let table = library(what, file)?;
    let mut lines: Vec<String> = Vec::new();
    // SAFETY: `add_string` matches `AddStr` and `ctx` is `lines`, alive
    // for the call.
    let rc = unsafe { (table.dump)(add_string, (&raw mut lines).cast()) };
    if rc == FAILED {
        return Err(failure(what, "dump_plugin"));
    }
    Ok(lines)
}

/// [`abi::AddStr`] into a `Vec<String>`.
unsafe extern "C" fn add_string(ctx: *mut c_void, s: Str) {
    // SAFETY: `ctx` is the `Vec<String>` of the call that passed it, and
    // `s` is valid for this call.
    unsafe { (*ctx.cast::<Vec<String>>()).push(s.text().into_owned()) };
}

/// [`abi::AddExtent`] into a `Vec<(u64, u64, u32)>`.
unsafe extern "C" fn add_extent(ctx: *mut c_void, offset: u64, len: u64, kind: u32) {
    // SAFETY: `ctx` is the vector of the call that passed it.
    unsafe { (*ctx.cast::<Vec<(u64, u64, u32)>>()).push((offset, len, kind)) };
}

/// [`abi::AddExport`] into a `Vec<ExportEntry>`.
unsafe extern "C" fn add_export(ctx: *mut c_void, name: Str, description: Str, has: c_int) {
    // SAFETY: `ctx` is the vector of the call that passed it; the texts
    // are valid for this call.
    unsafe {
        let d = (has != 0).then(|| description.text().into_owned());
        (*ctx.cast::<Vec<ExportEntry>>()).push(ExportEntry::new(name.text(), d));
    }
}

/// A connection's handle in a shared-object plugin.
pub struct Handle(NonNull<c_void>);

// SAFETY: an opaque token; the ABI makes the plugin's functions callable
// with it from any thread.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// A plugin in a shared object, loaded and configured.
pub struct SharedPlugin {
    table: &'static Plugin,
    state: NonNull<c_void>,
    /// The plugin's kind (`python`), in the log.
    what: String,
    /// What the plugin calls itself (`python script PATH`).
    name: String,
    model: ThreadModel,
}

// SAFETY: the state is opaque to the host, and the ABI makes every
// function of the table callable from any thread, concurrently.
unsafe impl Send for SharedPlugin {}
// SAFETY: as above.
unsafe impl Sync for SharedPlugin {}

impl SharedPlugin {
    /// Loads the plugin `what` from `file` (at the first use) and
    /// configures it with `args`, in order.
    pub fn load(what: &str, file: &str, args: &[(String, String)]) -> Result<SharedPlugin> {
        let table = library(what, file)?;
        let pairs: Vec<Pair> = args
            .iter()
            .map(|(k, v)| Pair {
                key: Str::new(k),
                value: Str::new(v),
            })
            .collect();
        // SAFETY: `pairs` and the strings it borrows live for the call.
        let state = unsafe { (table.load)(pairs.as_ptr(), pairs.len()) };
        let state = NonNull::new(state).ok_or_else(|| failure(what, "load"))?;
        // SAFETY: `state` is the plugin's; the name lives as long.
        let name = unsafe { (table.name)(state.as_ptr()).text() }.into_owned();
        // SAFETY: as above.
        let model = match unsafe { (table.thread_model)(state.as_ptr()) } {
            0 => ThreadModel::SerializeConnections,
            1 => ThreadModel::SerializeAllRequests,
            2 => ThreadModel::SerializeRequests,
            3 => ThreadModel::Parallel,
            n => {
                return Err(Error::invalid(format!(
                    "{name}: thread_model: unknown thread model {n}"
                )));
            }
        };
        Ok(SharedPlugin {
            table,
            state,
            what: what.to_string(),
            name,
            model,
        })
    }

    fn state(&self) -> Opaque {
        self.state.as_ptr()
    }

    /// `rc` of `call`: the failure reported, or the answer.
    fn check(&self, rc: c_int, call: &str) -> Result<c_int> {
        if rc == FAILED {
            Err(failure(&self.name, call))
        } else {
            Ok(rc)
        }
    }

    /// A request's outcome, its failure written in the server's log as
    /// nbdkit writes it (the client only gets the errno).
    fn logged<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            eprintln!("nbdkit: {}: error: {e}", self.what);
        }
        r
    }

    /// A request that answers nothing but success.
    fn request(&self, rc: c_int, call: &str) -> Result<()> {
        self.logged(self.check(rc, call).map(drop))
    }

    /// A text answer given through [`add_string`], if any.
    fn text(&self, call: &str, f: impl FnOnce(*mut c_void) -> c_int) -> Result<Option<String>> {
        let mut out: Vec<String> = Vec::new();
        let rc = self.check(f((&raw mut out).cast()), call)?;
        Ok((rc != UNSAID).then(|| out.pop()).flatten())
    }

    fn support(&self, h: &Handle, method: &str) -> Result<Option<Support>> {
        // SAFETY: the plugin's state and handle; the name lives for the call.
        let rc = unsafe { (self.table.mode)(self.state(), h.0.as_ptr(), Str::new(method)) };
        Ok(match self.check(rc, method)? {
            0 => Some(Support::None),
            1 => Some(Support::Emulate),
            2 => Some(Support::Native),
            UNSAID => None,
            n => {
                return Err(Error::invalid(format!(
                    "{}: {method}: unknown mode {n}",
                    self.name
                )));
            }
        })
    }
}

/// The request flag for FUA.
fn fua_flag(fua: bool) -> u32 {
    if fua { FLAG_FUA } else { 0 }
}

impl Callbacks for SharedPlugin {
    type Handle = Handle;

    fn name(&self) -> String {
        self.name.clone()
    }
    fn thread_model(&self) -> ThreadModel {
        self.model
    }
    fn open(&self, readonly: bool, export: &str, tls: bool) -> Result<Handle> {
        // SAFETY: the plugin's state; the export name lives for the call.
        let h = unsafe {
            (self.table.open)(
                self.state(),
                c_int::from(readonly),
                Str::new(export),
                c_int::from(tls),
            )
        };
        NonNull::new(h)
            .map(Handle)
            .ok_or_else(|| failure(&self.name, "open"))
    }
    fn close(&self, h: &Handle) {
        // SAFETY: the plugin's state and one of its handles, closed once
        // (CallbackDevice closes each handle once).
        let rc = unsafe { (self.table.close)(self.state(), h.0.as_ptr()) };
        let _ = self.request(rc, "close");
    }
    fn get_size(&self, h: &Handle) -> Result<u64> {
        let mut size = 0u64;
        // SAFETY: the plugin's state and handle; `size` is a valid out
        // pointer.
        let rc = unsafe { (self.table.get_size)(self.state(), h.0.as_ptr(), &mut size) };
        self.check(rc, "get_size")?;
        Ok(size)
    }
    fn block_size(&self, h: &Handle) -> Result<Option<BlockSizeLimits>> {
        let mut sizes = [0u32; 3];
        // SAFETY: the plugin's state and handle; `sizes` holds the three
        // values the ABI writes.
        let rc = unsafe { (self.table.block_size)(self.state(), h.0.as_ptr(), sizes.as_mut_ptr()) };
        Ok(
            (self.check(rc, "block_size")? != UNSAID).then_some(BlockSizeLimits {
                minimum: sizes[0],
                preferred: sizes[1],
                maximum: sizes[2],
            }),
        )
    }
    fn can(&self, h: &Handle, what: Can) -> Result<Option<bool>> {
        let method = what.method();
        // SAFETY: the plugin's state and handle; the name lives for the call.
        let rc = unsafe { (self.table.can)(self.state(), h.0.as_ptr(), Str::new(method)) };
        Ok(match self.check(rc, method)? {
            UNSAID => None,
            n => Some(n != 0),
        })
    }
    fn can_fua(&self, h: &Handle) -> Result<Option<Support>> {
        self.support(h, "can_fua")
    }
    fn can_cache(&self, h: &Handle) -> Result<Option<Support>> {
        self.support(h, "can_cache")
    }
    fn pread(&self, h: &Handle, buf: &mut [u8], offset: u64) -> Result<()> {
        // SAFETY: `buf` is ours, exclusively, for the call.
        let rc = unsafe {
            (self.table.pread)(
                self.state(),
                h.0.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
                offset,
            )
        };
        self.request(rc, "pread")
    }
    fn pwrite(&self, h: &Handle, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        // SAFETY: `buf` is valid for reads for the call.
        let rc = unsafe {
            (self.table.pwrite)(
                self.state(),
                h.0.as_ptr(),
                buf.as_ptr(),
                buf.len(),
                offset,
                fua_flag(fua),
            )
        };
        self.request(rc, "pwrite")
    }
    fn flush(&self, h: &Handle) -> Result<()> {
        // SAFETY: the plugin's state and handle.
        let rc = unsafe { (self.table.flush)(self.state(), h.0.as_ptr()) };
        self.request(rc, "flush")
    }
    fn trim(&self, h: &Handle, offset: u64, len: u64, fua: bool) -> Result<()> {
        // SAFETY: the plugin's state and handle.
        let rc =
            unsafe { (self.table.trim)(self.state(), h.0.as_ptr(), offset, len, fua_flag(fua)) };
        self.request(rc, "trim")
    }
    fn zero(&self, h: &Handle, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let mut bits = fua_flag(flags.fua);
        if flags.may_trim {
            bits |= FLAG_MAY_TRIM;
        }
        if flags.fast {
            bits |= FLAG_FAST_ZERO;
        }
        // SAFETY: the plugin's state and handle.
        let rc = unsafe { (self.table.zero)(self.state(), h.0.as_ptr(), offset, len, bits) };
        match self.check(rc, "zero") {
            // Not a failure: the server writes zeros instead.
            Err(e) if e.kind() == ErrorKind::NotSupported => Err(e),
            r => self.logged(r.map(drop)),
        }
    }
    fn extents(
        &self,
        h: &Handle,
        offset: u64,
        len: u64,
        req_one: bool,
    ) -> Result<Vec<(u64, u64, u32)>> {
        let mut out: Vec<(u64, u64, u32)> = Vec::new();
        let flags = if req_one { FLAG_REQ_ONE } else { 0 };
        // SAFETY: the plugin's state and handle; `add_extent` matches
        // `AddExtent` and `ctx` is `out`, alive for the call.
        let rc = unsafe {
            (self.table.extents)(
                self.state(),
                h.0.as_ptr(),
                offset,
                len,
                flags,
                add_extent,
                (&raw mut out).cast(),
            )
        };
        self.request(rc, "extents")?;
        Ok(out)
    }
    fn cache(&self, h: &Handle, offset: u64, len: u64) -> Result<()> {
        // SAFETY: the plugin's state and handle.
        let rc = unsafe { (self.table.cache)(self.state(), h.0.as_ptr(), offset, len) };
        self.request(rc, "cache")
    }
    fn list_exports(&self, readonly: bool, tls: bool) -> Result<Option<Vec<ExportEntry>>> {
        let mut out: Vec<ExportEntry> = Vec::new();
        // SAFETY: the plugin's state; `add_export` matches `AddExport` and
        // `ctx` is `out`, alive for the call.
        let rc = unsafe {
            (self.table.list_exports)(
                self.state(),
                c_int::from(readonly),
                c_int::from(tls),
                add_export,
                (&raw mut out).cast(),
            )
        };
        Ok((self.check(rc, "list_exports")? != UNSAID).then_some(out))
    }
    fn default_export(&self, readonly: bool, tls: bool) -> Result<Option<String>> {
        self.text("default_export", |ctx| {
            // SAFETY: the plugin's state; `add_string` matches `AddStr` and
            // `ctx` is the caller's vector, alive for the call.
            unsafe {
                (self.table.default_export)(
                    self.state(),
                    c_int::from(readonly),
                    c_int::from(tls),
                    add_string,
                    ctx,
                )
            }
        })
    }
    fn export_description(&self, h: &Handle) -> Result<Option<String>> {
        self.text("export_description", |ctx| {
            // SAFETY: as in `default_export`, with the plugin's handle.
            unsafe { (self.table.export_description)(self.state(), h.0.as_ptr(), add_string, ctx) }
        })
    }
    fn preconnect(&self, readonly: bool) -> Result<()> {
        // SAFETY: the plugin's state.
        let rc = unsafe { (self.table.preconnect)(self.state(), c_int::from(readonly)) };
        self.check(rc, "preconnect").map(drop)
    }
    fn cleanup(&self) -> Result<()> {
        // SAFETY: the plugin's state.
        let rc = unsafe { (self.table.cleanup)(self.state()) };
        self.request(rc, "cleanup")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_one_clear_line() {
        let e = library("test", "libdiskit-no-such-plugin.so").expect_err("no such library");
        let text = e.to_string();
        assert!(
            text.starts_with("cannot load the test plugin: libdiskit-no-such-plugin.so is not in "),
            "{text}"
        );
        assert!(!text.contains('\n'), "{text}");
    }
}
