//! `SSL_CTX`: the settings every session of one end shares.

use std::ffi::{CStr, c_char, c_int, c_long};
use std::ptr::{self, NonNull};

use super::api::{Api, Opaque, api};
use super::error::{SslError, clear};

/// `SSL_CTRL_SET_SESS_CACHE_MODE`.
const CTRL_SET_SESS_CACHE_MODE: c_int = 44;
/// `SSL_CTRL_SET_MIN_PROTO_VERSION`.
const CTRL_SET_MIN_PROTO_VERSION: c_int = 123;
/// `SSL_CTRL_SET_MAX_PROTO_VERSION`.
const CTRL_SET_MAX_PROTO_VERSION: c_int = 124;
/// `SSL_SESS_CACHE_OFF`.
const SESS_CACHE_OFF: c_long = 0;

/// `SSL_OP_NO_TICKET`.
pub(crate) const OP_NO_TICKET: u64 = 1 << 14;
/// `SSL_OP_CIPHER_SERVER_PREFERENCE`.
pub(crate) const OP_CIPHER_SERVER_PREFERENCE: u64 = 1 << 22;
/// `SSL_OP_NO_RENEGOTIATION`.
pub(crate) const OP_NO_RENEGOTIATION: u64 = 1 << 30;

/// Which end of the connection a context is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// `TLS_server_method`.
    Server,
    /// `TLS_client_method`.
    Client,
}

/// A protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    /// `TLS1_2_VERSION`.
    Tls12,
    /// `TLS1_3_VERSION`.
    Tls13,
}

impl Version {
    fn wire(self) -> c_long {
        match self {
            Version::Tls12 => 0x0303,
            Version::Tls13 => 0x0304,
        }
    }
}

/// An owned `SSL_CTX`. Set up through `&mut self`, then shared: making
/// sessions from it (`SSL_new`) is thread-safe.
pub(crate) struct Context {
    ptr: NonNull<Opaque>,
    side: Side,
    api: &'static Api,
}

// SAFETY: an SSL_CTX may be used from any thread; OpenSSL locks what
// SSL_new reads. Settings change only through `&mut self`.
unsafe impl Send for Context {}
// SAFETY: as above: the only `&self` use is SSL_new, which OpenSSL makes
// safe to call on one context from many threads.
unsafe impl Sync for Context {}

impl Context {
    /// A context for `side`, loading OpenSSL if this is its first use.
    /// Errors are one line: why OpenSSL cannot be loaded, or what it said.
    pub(crate) fn new(side: Side) -> Result<Context, String> {
        let api = api()?;
        clear(api);
        // SAFETY: the method functions take nothing and return a static
        // method table.
        let method = unsafe {
            match side {
                Side::Server => (api.TLS_server_method)(),
                Side::Client => (api.TLS_client_method)(),
            }
        };
        // SAFETY: `method` is OpenSSL's static method table (or null,
        // which SSL_CTX_new refuses).
        let ptr = unsafe { (api.SSL_CTX_new)(method) };
        let ptr = NonNull::new(ptr).ok_or_else(|| SslError::setup(api).to_string())?;
        Ok(Context { ptr, side, api })
    }

    /// The end this context is for.
    pub(crate) fn side(&self) -> Side {
        self.side
    }

    pub(super) fn api(&self) -> &'static Api {
        self.api
    }

    pub(super) fn as_ptr(&self) -> *mut Opaque {
        self.ptr.as_ptr()
    }

    /// `SSL_CTX_ctrl`, failing when it returns 0.
    fn ctrl(&mut self, cmd: c_int, arg: c_long) -> Result<(), SslError> {
        clear(self.api);
        // SAFETY: `ptr` is a live SSL_CTX we own; these commands take an
        // integer and no pointer.
        let r = unsafe { (self.api.SSL_CTX_ctrl)(self.as_ptr(), cmd, arg, ptr::null_mut()) };
        if r == 0 {
            return Err(SslError::setup(self.api));
        }
        Ok(())
    }

    /// The oldest protocol version allowed.
    pub(crate) fn set_min_version(&mut self, v: Version) -> Result<(), SslError> {
        self.ctrl(CTRL_SET_MIN_PROTO_VERSION, v.wire())
    }

    /// The newest protocol version allowed.
    pub(crate) fn set_max_version(&mut self, v: Version) -> Result<(), SslError> {
        self.ctrl(CTRL_SET_MAX_PROTO_VERSION, v.wire())
    }

    /// No session cache (no resumption).
    pub(crate) fn disable_session_cache(&mut self) {
        // SSL_CTX_set_session_cache_mode returns the previous mode, which
        // may be 0: nothing to check.
        // SAFETY: `ptr` is a live SSL_CTX we own; the command takes an
        // integer and no pointer.
        unsafe {
            (self.api.SSL_CTX_ctrl)(
                self.as_ptr(),
                CTRL_SET_SESS_CACHE_MODE,
                SESS_CACHE_OFF,
                ptr::null_mut(),
            )
        };
    }

    /// Adds `SSL_OP_*` options.
    pub(crate) fn set_options(&mut self, options: u64) {
        // SAFETY: `ptr` is a live SSL_CTX we own.
        unsafe { (self.api.SSL_CTX_set_options)(self.as_ptr(), options) };
    }

    /// The TLS 1.3 suites, OpenSSL's `:`-separated names.
    pub(crate) fn set_ciphersuites(&mut self, suites: &CStr) -> Result<(), SslError> {
        self.set_suites(self.api.SSL_CTX_set_ciphersuites, suites)
    }

    /// The TLS 1.2 suites, OpenSSL's `:`-separated names.
    pub(crate) fn set_cipher_list(&mut self, suites: &CStr) -> Result<(), SslError> {
        self.set_suites(self.api.SSL_CTX_set_cipher_list, suites)
    }

    /// Sets `suites` by `set` (one of the two calls above).
    fn set_suites(
        &mut self,
        set: unsafe extern "C" fn(*mut Opaque, *const c_char) -> c_int,
        suites: &CStr,
    ) -> Result<(), SslError> {
        clear(self.api);
        // SAFETY: `ptr` is a live SSL_CTX we own; `suites` is
        // NUL-terminated and only read during the call.
        let r = unsafe { set(self.as_ptr(), suites.as_ptr()) };
        if r != 1 {
            return Err(SslError::setup(self.api));
        }
        Ok(())
    }

    /// How many TLS 1.3 session tickets a server sends.
    pub(crate) fn set_num_tickets(&mut self, n: usize) -> Result<(), SslError> {
        // SAFETY: `ptr` is a live SSL_CTX we own.
        let r = unsafe { (self.api.SSL_CTX_set_num_tickets)(self.as_ptr(), n) };
        if r != 1 {
            return Err(SslError::setup(self.api));
        }
        Ok(())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we own this reference to the SSL_CTX; sessions made
        // from it hold references of their own.
        unsafe { (self.api.SSL_CTX_free)(self.as_ptr()) };
    }
}
