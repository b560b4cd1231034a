//! The C ABI between diskit and a plugin built as a shared object (the
//! python plugin, `libdiskit_python.so`, which links libpython so that the
//! `diskit` executable does not). Only C types cross it: `#[repr(C)]`
//! tables of `extern "C"` function pointers, integers, pointers and
//! [`Str`] (UTF-8 bytes and a length); no Rust type, allocation or static
//! of one side is seen by the other, so each side may carry its own copy
//! of std and diskit-core.
//!
//! The shape is nbdkit's plugin API: the plugin exports [`ENTRY`], which
//! takes the [`Host`]'s services and gives its [`Plugin`] table; `load`
//! configures it (nbdkit's load, config, config_complete, get_ready) and
//! returns its state, `open` a handle per connection, and the other
//! functions answer for a handle. A function that fails reports errno and
//! message through [`Host::error`] on the calling thread (nbdkit_error and
//! nbdkit_set_error) and returns [`FAILED`] (or a null pointer). Every
//! function may be called from any thread, concurrently; the host keeps
//! the thread model the plugin states.

use std::ffi::{CStr, c_int, c_void};

/// The version of this ABI; plugin and host must speak the same.
pub const ABI_VERSION: u32 = 1;

/// The symbol a plugin exports, of type [`Entry`].
pub const ENTRY: &CStr = c"diskit_plugin_entry";

/// The plugin's entry: given the ABI version the host speaks and its
/// services (valid for the life of the process), the plugin's table (null
/// when the plugin does not speak `abi`).
pub type Entry = unsafe extern "C" fn(abi: u32, host: *const Host) -> *const Plugin;

/// A function's failure: the error was reported through [`Host::error`].
pub const FAILED: c_int = -1;
/// An answer the plugin does not give (nbdkit's default applies).
pub const UNSAID: c_int = -2;

/// Request flags, nbdkit's values: a zero may deallocate.
pub const FLAG_MAY_TRIM: u32 = 1 << 0;
/// Force unit access.
pub const FLAG_FUA: u32 = 1 << 1;
/// Extents: one is enough.
pub const FLAG_REQ_ONE: u32 = 1 << 2;
/// A zero fails at once unless it is fast.
pub const FLAG_FAST_ZERO: u32 = 1 << 3;

/// Extent types, nbdkit's: a hole (reads as zeros when [`EXTENT_ZERO`]
/// is set too).
pub const EXTENT_HOLE: u32 = 1 << 0;
/// Reads as zeros.
pub const EXTENT_ZERO: u32 = 1 << 1;

/// Borrowed UTF-8 text: valid for the call it is passed to (or as long as
/// the function that returns it says).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Str {
    /// The first byte (any non-null value when `len` is 0).
    pub ptr: *const u8,
    /// The number of bytes.
    pub len: usize,
}

impl Str {
    /// Borrows `s`.
    pub fn new(s: &str) -> Str {
        Str {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// The text (invalid UTF-8 replaced).
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads of `len` bytes for `'a`.
    pub unsafe fn text<'a>(self) -> std::borrow::Cow<'a, str> {
        if self.len == 0 {
            return std::borrow::Cow::Borrowed("");
        }
        // SAFETY: the caller's promise.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        String::from_utf8_lossy(bytes)
    }
}

/// A `key=value` parameter of the command line.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Pair {
    /// The key (`script` for the plugin's magic key).
    pub key: Str,
    /// The value.
    pub value: Str,
}

/// What the host does for the plugin, from any thread.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Host {
    /// [`ABI_VERSION`] of the host.
    pub abi: u32,
    /// The failure of the call running on this thread: its errno and its
    /// message (nbdkit_error, nbdkit_set_error).
    pub error: unsafe extern "C" fn(errno: c_int, message: Str),
    /// A debug message, shown when the server is verbose (nbdkit_debug).
    pub debug: unsafe extern "C" fn(message: Str),
    /// The server is to stop once the connections end (nbdkit_shutdown).
    pub shutdown: unsafe extern "C" fn(),
    /// The calling connection is to be closed after this request
    /// (nbdkit_disconnect); `force` closes it at once.
    pub disconnect: unsafe extern "C" fn(force: c_int),
}

/// Receives a string (a `--dump-plugin` line, an export's name).
pub type AddStr = unsafe extern "C" fn(ctx: *mut c_void, s: Str);
/// Receives an extent: offset, length, nbdkit's type bits (1 hole, 2 zero).
pub type AddExtent = unsafe extern "C" fn(ctx: *mut c_void, offset: u64, len: u64, kind: u32);
/// Receives an export of a listing: name, and description when
/// `has_description` is not 0.
pub type AddExport =
    unsafe extern "C" fn(ctx: *mut c_void, name: Str, description: Str, has_description: c_int);

/// The plugin's state (after `load`) and a connection's handle (after
/// `open`): opaque to the host.
pub type Opaque = *mut c_void;

/// A plugin's functions. Integers returned are 0 for success unless said
/// otherwise, [`FAILED`] for a failure.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Plugin {
    /// [`ABI_VERSION`] of the plugin.
    pub abi: u32,
    /// `size_of::<Plugin>()` on the plugin's side.
    pub size: usize,
    /// `--dump-plugin`: the plugin's own `key=value` lines, each to `add`.
    pub dump: unsafe extern "C" fn(add: AddStr, ctx: *mut c_void) -> c_int,
    /// Loads and configures the plugin with the command line's parameters
    /// in order; its state, or null.
    pub load: unsafe extern "C" fn(args: *const Pair, count: usize) -> Opaque,
    /// The plugin as messages name it; valid as long as the state.
    pub name: unsafe extern "C" fn(state: Opaque) -> Str,
    /// nbdkit's thread model, 0 (serialize_connections) to 3 (parallel).
    pub thread_model: unsafe extern "C" fn(state: Opaque) -> c_int,
    /// Opens a connection's handle, or null.
    pub open:
        unsafe extern "C" fn(state: Opaque, readonly: c_int, export: Str, tls: c_int) -> Opaque,
    /// Closes a handle (which is freed even when this fails).
    pub close: unsafe extern "C" fn(state: Opaque, h: Opaque) -> c_int,
    /// The size, into `size`.
    pub get_size: unsafe extern "C" fn(state: Opaque, h: Opaque, size: *mut u64) -> c_int,
    /// Block size constraints (minimum, preferred, maximum) into
    /// `sizes`; [`UNSAID`] for none.
    pub block_size: unsafe extern "C" fn(state: Opaque, h: Opaque, sizes: *mut u32) -> c_int,
    /// A yes-or-no capability named by nbdkit's method (`can_write`,
    /// `is_rotational`...): 1, 0 or [`UNSAID`].
    pub can: unsafe extern "C" fn(state: Opaque, h: Opaque, method: Str) -> c_int,
    /// `can_fua` or `can_cache`: nbdkit's 0 (none), 1 (emulate), 2
    /// (native), or [`UNSAID`].
    pub mode: unsafe extern "C" fn(state: Opaque, h: Opaque, method: Str) -> c_int,
    /// Fills `len` bytes at `buf` from `offset`.
    pub pread: unsafe extern "C" fn(
        state: Opaque,
        h: Opaque,
        buf: *mut u8,
        len: usize,
        offset: u64,
    ) -> c_int,
    /// Writes `len` bytes from `buf` at `offset`.
    pub pwrite: unsafe extern "C" fn(
        state: Opaque,
        h: Opaque,
        buf: *const u8,
        len: usize,
        offset: u64,
        flags: u32,
    ) -> c_int,
    /// Makes writes durable.
    pub flush: unsafe extern "C" fn(state: Opaque, h: Opaque) -> c_int,
    /// Discards a range.
    pub trim:
        unsafe extern "C" fn(state: Opaque, h: Opaque, offset: u64, len: u64, flags: u32) -> c_int,
    /// Zeroes a range; a failure with errno ENOTSUP or EOPNOTSUPP asks the
    /// host to write zeros instead.
    pub zero:
        unsafe extern "C" fn(state: Opaque, h: Opaque, offset: u64, len: u64, flags: u32) -> c_int,
    /// The extents from `offset`, in ascending order, each to `add`.
    pub extents: unsafe extern "C" fn(
        state: Opaque,
        h: Opaque,
        offset: u64,
        len: u64,
        flags: u32,
        add: AddExtent,
        ctx: *mut c_void,
    ) -> c_int,
    /// Prefetches a range.
    pub cache: unsafe extern "C" fn(state: Opaque, h: Opaque, offset: u64, len: u64) -> c_int,
    /// nbdkit's `list_exports`: each export to `add`, or [`UNSAID`].
    pub list_exports: unsafe extern "C" fn(
        state: Opaque,
        readonly: c_int,
        tls: c_int,
        add: AddExport,
        ctx: *mut c_void,
    ) -> c_int,
    /// nbdkit's `default_export`: the name to `add`, or [`UNSAID`].
    pub default_export: unsafe extern "C" fn(
        state: Opaque,
        readonly: c_int,
        tls: c_int,
        add: AddStr,
        ctx: *mut c_void,
    ) -> c_int,
    /// nbdkit's `export_description`: the text to `add`, or [`UNSAID`].
    pub export_description:
        unsafe extern "C" fn(state: Opaque, h: Opaque, add: AddStr, ctx: *mut c_void) -> c_int,
    /// nbdkit's `preconnect`: a client connects, before its handshake; a
    /// failure refuses it.
    pub preconnect: unsafe extern "C" fn(state: Opaque, readonly: c_int) -> c_int,
    /// The server stops: nbdkit's `cleanup` (after the last handle closed).
    pub cleanup: unsafe extern "C" fn(state: Opaque) -> c_int,
}
