//! OpenSSL's errors as one line of text: the reasons on the thread's
//! error queue, or what `SSL_get_error` says when the queue is empty.

use std::ffi::{CStr, c_char, c_int};
use std::fmt;

use super::api::Api;

/// `SSL_ERROR_SSL`: a protocol or library error, explained on the queue.
pub(crate) const SSL: c_int = 1;
/// `SSL_ERROR_WANT_READ`: more ciphertext is needed.
pub(crate) const WANT_READ: c_int = 2;
/// `SSL_ERROR_SYSCALL`: the stream under the session failed or ended.
pub(crate) const SYSCALL: c_int = 5;
/// `SSL_ERROR_ZERO_RETURN`: the peer closed the session (close_notify).
pub(crate) const ZERO_RETURN: c_int = 6;

/// Empties this thread's error queue, so that what is on it after a call
/// is that call's (`SSL_get_error` needs it empty before the call).
pub(super) fn clear(api: &Api) {
    // SAFETY: ERR_clear_error takes nothing and empties this thread's
    // queue.
    unsafe { (api.ERR_clear_error)() };
}

/// A failed OpenSSL call: its `SSL_get_error` code and the reasons OpenSSL
/// queued.
#[derive(Debug, Clone)]
pub(crate) struct SslError {
    code: c_int,
    reasons: Vec<String>,
}

impl SslError {
    /// A setup call that failed (no `SSL_get_error` code): the queue.
    pub(super) fn setup(api: &Api) -> SslError {
        SslError::new(api, SSL)
    }

    /// `code`, with the reasons on this thread's error queue (which is
    /// emptied).
    pub(super) fn new(api: &Api, code: c_int) -> SslError {
        let mut reasons = Vec::new();
        loop {
            // SAFETY: ERR_get_error takes nothing and pops this thread's
            // queue.
            let e = unsafe { (api.ERR_get_error)() };
            if e == 0 {
                break;
            }
            reasons.push(reason(api, e));
        }
        SslError { code, reasons }
    }

    /// The `SSL_ERROR_*` code.
    pub(crate) fn code(&self) -> c_int {
        self.code
    }
}

/// The text of queued error `e`: its reason, else OpenSSL's whole line.
fn reason(api: &Api, e: std::ffi::c_ulong) -> String {
    // SAFETY: ERR_reason_error_string returns null or a static
    // NUL-terminated string.
    let r = unsafe { (api.ERR_reason_error_string)(e) };
    if !r.is_null() {
        // SAFETY: non-null, static and NUL-terminated (above).
        return unsafe { CStr::from_ptr(r) }.to_string_lossy().into_owned();
    }
    let mut buf = [0 as c_char; 256];
    // SAFETY: ERR_error_string_n writes at most `buf.len()` bytes, NUL
    // included, into the buffer we own.
    unsafe { (api.ERR_error_string_n)(e, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: the buffer was NUL-terminated by ERR_error_string_n (and
    // its last byte is still the 0 it started with).
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

impl fmt::Display for SslError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.reasons.is_empty() {
            return f.write_str(&self.reasons.join("; "));
        }
        f.write_str(match self.code {
            ZERO_RETURN => "the TLS session has been shut down",
            WANT_READ => "the operation should be retried",
            SYSCALL => "unexpected EOF",
            SSL => "OpenSSL failed without saying why",
            _ => "unexpected OpenSSL error",
        })
    }
}
