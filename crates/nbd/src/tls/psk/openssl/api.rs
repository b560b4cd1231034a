//! Loading OpenSSL 3 at run time: `libssl.so.3` is opened with dlopen()
//! the first time a PSK session is set up (it brings `libcrypto.so.3`
//! with it), and the functions the PSK engine calls are looked up once,
//! each checked. diskit does not link OpenSSL, so the commands that never
//! use pre-shared keys do not pay for loading it.
//!
//! The library stays loaded for the life of the process (never
//! dlclose()d), so the function pointers are valid for `'static`.

use std::ffi::{CStr, c_char, c_int, c_long, c_uint, c_ulong, c_void};

use diskit_core::dynlib::Library;
use std::sync::OnceLock;

/// The library loaded at the first PSK use.
pub(super) const LIBSSL: &CStr = c"libssl.so.3";

/// OpenSSL's `SSL_CTX`, `SSL`, `SSL_METHOD`, `SSL_CIPHER` and `BIO`: only
/// ever behind pointers.
#[repr(C)]
pub(super) struct Opaque {
    _private: [u8; 0],
}

/// `SSL_psk_server_cb_func`: the key of `identity`, written to
/// `psk[..max_psk_len]`; returns its length, 0 to refuse.
pub(super) type PskServerCb = unsafe extern "C" fn(
    ssl: *mut Opaque,
    identity: *const c_char,
    psk: *mut u8,
    max_psk_len: c_uint,
) -> c_uint;

/// `SSL_psk_client_cb_func`: the identity (NUL-terminated) and its key;
/// returns the key's length, 0 to give up.
pub(super) type PskClientCb = unsafe extern "C" fn(
    ssl: *mut Opaque,
    hint: *const c_char,
    identity: *mut c_char,
    max_identity_len: c_uint,
    psk: *mut u8,
    max_psk_len: c_uint,
) -> c_uint;

diskit_core::functions! {
    /// The OpenSSL functions the PSK engine calls, resolved at load.
    pub(super) struct Api {
    TLS_server_method: fn() -> *const Opaque;
    TLS_client_method: fn() -> *const Opaque;
    SSL_CTX_new: fn(*const Opaque) -> *mut Opaque;
    SSL_CTX_free: fn(*mut Opaque);
    SSL_CTX_ctrl: fn(*mut Opaque, c_int, c_long, *mut c_void) -> c_long;
    SSL_CTX_set_options: fn(*mut Opaque, u64) -> u64;
    SSL_CTX_set_ciphersuites: fn(*mut Opaque, *const c_char) -> c_int;
    SSL_CTX_set_cipher_list: fn(*mut Opaque, *const c_char) -> c_int;
    SSL_CTX_set_num_tickets: fn(*mut Opaque, usize) -> c_int;
    SSL_new: fn(*mut Opaque) -> *mut Opaque;
    SSL_free: fn(*mut Opaque);
    SSL_set_ex_data: fn(*mut Opaque, c_int, *mut c_void) -> c_int;
    SSL_get_ex_data: fn(*const Opaque, c_int) -> *mut c_void;
    SSL_set_psk_server_callback: fn(*mut Opaque, Option<PskServerCb>);
    SSL_set_psk_client_callback: fn(*mut Opaque, Option<PskClientCb>);
    SSL_set_bio: fn(*mut Opaque, *mut Opaque, *mut Opaque);
    SSL_set_accept_state: fn(*mut Opaque);
    SSL_set_connect_state: fn(*mut Opaque);
    SSL_do_handshake: fn(*mut Opaque) -> c_int;
    SSL_is_init_finished: fn(*const Opaque) -> c_int;
    SSL_read_ex: fn(*mut Opaque, *mut c_void, usize, *mut usize) -> c_int;
    SSL_write_ex: fn(*mut Opaque, *const c_void, usize, *mut usize) -> c_int;
    SSL_get_error: fn(*const Opaque, c_int) -> c_int;
    SSL_shutdown: fn(*mut Opaque) -> c_int;
    SSL_get_current_cipher: fn(*const Opaque) -> *const Opaque;
    SSL_CIPHER_get_name: fn(*const Opaque) -> *const c_char;
    SSL_get_version: fn(*const Opaque) -> *const c_char;
    BIO_s_mem: fn() -> *const Opaque;
    BIO_new: fn(*const Opaque) -> *mut Opaque;
    BIO_free: fn(*mut Opaque) -> c_int;
    BIO_ctrl: fn(*mut Opaque, c_int, c_long, *mut c_void) -> c_long;
    BIO_write: fn(*mut Opaque, *const c_void, c_int) -> c_int;
    BIO_read: fn(*mut Opaque, *mut c_void, c_int) -> c_int;
    ERR_get_error: fn() -> c_ulong;
    ERR_clear_error: fn();
    ERR_reason_error_string: fn(c_ulong) -> *const c_char;
    ERR_error_string_n: fn(c_ulong, *mut c_char, usize);
    }
}

/// Opens `library` and resolves every function of [`Api`] in it (and in
/// the libraries it depends on: libcrypto for `BIO_*` and `ERR_*`). The
/// library is never closed.
pub(super) fn load(library: &'static CStr) -> Result<Api, String> {
    let why = |e: String| {
        format!(
            "TLS-PSK needs OpenSSL 3 ({}): {e}",
            library.to_string_lossy()
        )
    };
    // SAFETY: loading runs the library's initialisers, which OpenSSL 3 and
    // its dependencies make safe to run in a multi-threaded process.
    let lib = unsafe { Library::open(library) }.map_err(why)?;
    // SAFETY: `library` is the OpenSSL 3 libssl by its soname, whose
    // functions have the declared signatures. A library that is not
    // OpenSSL 3 lacks some of them and fails here (OpenSSL 1.1 has no
    // `SSL_CTX_set_options`, a macro there).
    unsafe { Api::resolve(&lib) }.map_err(why)
}

/// OpenSSL, loaded at the first call (from any thread; later calls wait
/// for the first and share its result).
pub(super) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| load(LIBSSL))
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let e = load(c"libdiskit-no-such-ssl.so.3")
            .err()
            .expect("no such library");
        assert!(
            e.starts_with("TLS-PSK needs OpenSSL 3 (libdiskit-no-such-ssl.so.3): "),
            "{e}"
        );
        assert!(e.contains("cannot open shared object file"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn a_library_without_the_functions_is_a_clear_error() {
        // The C library is there but is not OpenSSL: the first function
        // looked up is named.
        let e = load(c"libc.so.6").err().expect("libc is not libssl");
        assert!(
            e.starts_with("TLS-PSK needs OpenSSL 3 (libc.so.6): "),
            "{e}"
        );
        assert!(e.contains("TLS_server_method"), "{e}");
    }

    #[test]
    fn openssl_3_loads() {
        let api = api().expect("the test machine has libssl.so.3");
        // SAFETY: TLS_server_method takes nothing and returns a static.
        assert!(!unsafe { (api.TLS_server_method)() }.is_null());
    }
}
