//! `SSL`: one session over two memory BIOs (ciphertext in, records out),
//! doing no I/O of its own, with its PSK callback's state beside it.

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::{self, NonNull};

use super::api::{Api, Opaque, api};
use super::context::{Context, Side};
use super::error::{SslError, clear};

/// `BIO_C_SET_BUF_MEM_EOF_RETURN`.
const BIO_C_SET_BUF_MEM_EOF_RETURN: c_int = 130;
/// `BIO_CTRL_PENDING`.
const BIO_CTRL_PENDING: c_int = 10;
/// The ex_data index OpenSSL reserves for the application
/// (`SSL_set_app_data`).
const APP_DATA: c_int = 0;

/// What OpenSSL's PSK callbacks ask of a session: its key (server) or its
/// identity and key (client). Runs inside the handshake, on the thread
/// that drives it.
pub(crate) trait PskCallback: Send + 'static {
    /// Server: writes the key of `identity` (`None`: the client sent
    /// none) to the start of `key` and returns its length; 0 refuses.
    fn server_key(&mut self, identity: Option<&[u8]>, key: &mut [u8]) -> usize {
        let _ = (identity, key);
        0
    }

    /// Client: writes the identity, NUL-terminated, to the start of
    /// `identity` and the key to the start of `key`, and returns the
    /// key's length; 0 gives up.
    fn client_key(&mut self, identity: &mut [u8], key: &mut [u8]) -> usize {
        let _ = (identity, key);
        0
    }
}

/// An owned `SSL` with its memory BIOs and its callback's state `S`.
pub(crate) struct Ssl<S> {
    ptr: NonNull<Opaque>,
    /// Ciphertext from the peer, for OpenSSL to read (owned by the SSL).
    rbio: NonNull<Opaque>,
    /// Records for the peer, written by OpenSSL (owned by the SSL).
    wbio: NonNull<Opaque>,
    /// The callback's state, reachable from the SSL's app data; freed
    /// after the SSL.
    state: NonNull<S>,
    /// The end of the peer's stream was noted.
    eof: bool,
    api: &'static Api,
}

// SAFETY: an SSL may move between threads when no call is in progress:
// every use goes through `&mut self` (or `&self` for reads of settled
// state), and `S` is Send.
unsafe impl<S: Send> Send for Ssl<S> {}

impl<S: PskCallback> Ssl<S> {
    /// A session from `ctx`, its end (accept or connect) set by the
    /// context's side, with `state` answering the PSK callback.
    pub(crate) fn new(ctx: &Context, state: S) -> Result<Ssl<S>, SslError> {
        let api = ctx.api();
        clear(api);
        // SAFETY: `ctx` is a live SSL_CTX; SSL_new takes its own reference.
        let ptr = NonNull::new(unsafe { (api.SSL_new)(ctx.as_ptr()) })
            .ok_or_else(|| SslError::setup(api))?;
        let (rbio, wbio) = match (mem_bio(api), mem_bio(api)) {
            (Some(r), Some(w)) => (r, w),
            (r, w) => {
                // SAFETY: each BIO that was made is ours alone, as is the
                // SSL.
                unsafe {
                    for b in [r, w].into_iter().flatten() {
                        (api.BIO_free)(b.as_ptr());
                    }
                    (api.SSL_free)(ptr.as_ptr());
                }
                return Err(SslError::setup(api));
            }
        };
        // SAFETY: `ptr` is a live SSL and the BIOs are live and ours: the
        // SSL takes them over (SSL_free frees them).
        unsafe { (api.SSL_set_bio)(ptr.as_ptr(), rbio.as_ptr(), wbio.as_ptr()) };
        let state = NonNull::from(Box::leak(Box::new(state)));
        let ssl = Ssl {
            ptr,
            rbio,
            wbio,
            state,
            eof: false,
            api,
        };
        // SAFETY: the app data points to `state`, which outlives the SSL
        // (freed after it when `ssl` drops, also on the error path).
        let set = unsafe { (api.SSL_set_ex_data)(ptr.as_ptr(), APP_DATA, state.as_ptr().cast()) };
        if set != 1 {
            return Err(SslError::setup(api));
        }
        // SAFETY: `ptr` is a live SSL whose app data is an `S`, as the
        // callbacks registered for `S` read it.
        unsafe {
            match ctx.side() {
                Side::Server => {
                    (api.SSL_set_psk_server_callback)(ptr.as_ptr(), Some(server_callback::<S>));
                    (api.SSL_set_accept_state)(ptr.as_ptr());
                }
                Side::Client => {
                    (api.SSL_set_psk_client_callback)(ptr.as_ptr(), Some(client_callback::<S>));
                    (api.SSL_set_connect_state)(ptr.as_ptr());
                }
            }
        }
        Ok(ssl)
    }
}

impl<S> Ssl<S> {
    /// The callback's state.
    pub(crate) fn state(&self) -> &S {
        // SAFETY: `state` is live until Drop, and OpenSSL only hands it to
        // a callback during a call made through `&mut self`, so no `&mut`
        // to it exists while `&self` is borrowed.
        unsafe { self.state.as_ref() }
    }

    /// Whether the end of the peer's stream was noted.
    pub(crate) fn eof(&self) -> bool {
        self.eof
    }

    /// Queues ciphertext from the peer.
    pub(crate) fn push(&mut self, mut data: &[u8]) -> Result<(), SslError> {
        while !data.is_empty() {
            let n = data.len().min(c_int::MAX as usize);
            clear(self.api);
            // SAFETY: `rbio` is a live memory BIO owned by our SSL; it
            // copies `n` readable bytes from `data`.
            let r = unsafe {
                (self.api.BIO_write)(self.rbio.as_ptr(), data.as_ptr().cast(), n as c_int)
            };
            let Ok(written) = usize::try_from(r) else {
                return Err(SslError::setup(self.api));
            };
            if written == 0 {
                return Err(SslError::setup(self.api));
            }
            data = &data[written.min(data.len())..];
        }
        Ok(())
    }

    /// Notes the end of the peer's stream: once the queued ciphertext is
    /// read, OpenSSL sees EOF instead of "want read".
    pub(crate) fn set_eof(&mut self) {
        self.eof = true;
        // SAFETY: `rbio` is a live memory BIO; this command takes an
        // integer and no pointer.
        unsafe {
            (self.api.BIO_ctrl)(
                self.rbio.as_ptr(),
                BIO_C_SET_BUF_MEM_EOF_RETURN,
                0,
                ptr::null_mut(),
            )
        };
    }

    /// Appends the records OpenSSL wrote for the peer to `out`.
    pub(crate) fn take_outgoing(&mut self, out: &mut Vec<u8>) {
        loop {
            // SAFETY: `wbio` is a live memory BIO; BIO_CTRL_PENDING takes
            // no pointer and returns how many bytes it holds.
            let pending = unsafe {
                (self.api.BIO_ctrl)(self.wbio.as_ptr(), BIO_CTRL_PENDING, 0, ptr::null_mut())
            };
            let Ok(pending) = usize::try_from(pending) else {
                return;
            };
            let want = pending.min(c_int::MAX as usize);
            if want == 0 {
                return;
            }
            out.reserve(want);
            let spare = out.spare_capacity_mut();
            // SAFETY: `spare` has room for at least `want` bytes, which
            // BIO_read writes at most (it returns how many it did).
            let r = unsafe {
                (self.api.BIO_read)(self.wbio.as_ptr(), spare.as_mut_ptr().cast(), want as c_int)
            };
            let Ok(n) = usize::try_from(r) else {
                return;
            };
            if n == 0 {
                return;
            }
            // SAFETY: BIO_read initialised the first `n <= want` bytes of
            // the spare capacity.
            unsafe { out.set_len(out.len() + n.min(want)) };
        }
    }

    /// Advances the handshake.
    pub(crate) fn do_handshake(&mut self) -> Result<(), SslError> {
        clear(self.api);
        // SAFETY: `ptr` is a live SSL with its BIOs; the PSK callback it
        // may call reads the state, which nothing else borrows now
        // (`&mut self`).
        let r = unsafe { (self.api.SSL_do_handshake)(self.ptr.as_ptr()) };
        if r == 1 { Ok(()) } else { Err(self.error(r)) }
    }

    /// Whether the handshake is done.
    pub(crate) fn is_init_finished(&self) -> bool {
        // SAFETY: `ptr` is a live SSL; this only reads its state.
        unsafe { (self.api.SSL_is_init_finished)(self.ptr.as_ptr()) == 1 }
    }

    /// Decrypts plaintext into `out`.
    pub(crate) fn read(&mut self, out: &mut [u8]) -> Result<usize, SslError> {
        if out.is_empty() {
            return Ok(0);
        }
        clear(self.api);
        let mut n = 0usize;
        // SAFETY: `ptr` is a live SSL; it writes at most `out.len()`
        // bytes into `out` and the count into `n`.
        let r = unsafe {
            (self.api.SSL_read_ex)(
                self.ptr.as_ptr(),
                out.as_mut_ptr().cast(),
                out.len(),
                &mut n,
            )
        };
        if r == 1 {
            Ok(n.min(out.len()))
        } else {
            Err(self.error(r))
        }
    }

    /// Encrypts `data` (all of it: the memory BIO never fills up).
    pub(crate) fn write(&mut self, data: &[u8]) -> Result<usize, SslError> {
        if data.is_empty() {
            return Ok(0);
        }
        clear(self.api);
        let mut n = 0usize;
        // SAFETY: `ptr` is a live SSL; it reads `data.len()` bytes from
        // `data` and writes the count into `n`.
        let r = unsafe {
            (self.api.SSL_write_ex)(self.ptr.as_ptr(), data.as_ptr().cast(), data.len(), &mut n)
        };
        if r == 1 {
            Ok(n.min(data.len()))
        } else {
            Err(self.error(r))
        }
    }

    /// Queues our close_notify (the peer's is not waited for).
    pub(crate) fn shutdown(&mut self) {
        clear(self.api);
        // SAFETY: `ptr` is a live SSL.
        unsafe { (self.api.SSL_shutdown)(self.ptr.as_ptr()) };
        clear(self.api);
    }

    /// The negotiated protocol version, as OpenSSL names it ("TLSv1.3").
    pub(crate) fn version(&self) -> String {
        // SAFETY: `ptr` is a live SSL; SSL_get_version returns a static
        // NUL-terminated string.
        text(unsafe { (self.api.SSL_get_version)(self.ptr.as_ptr()) })
    }

    /// The negotiated suite, as OpenSSL names it; empty before one is.
    pub(crate) fn cipher(&self) -> String {
        // SAFETY: `ptr` is a live SSL; the cipher is null or static, and
        // SSL_CIPHER_get_name returns a static NUL-terminated string.
        unsafe {
            let c = (self.api.SSL_get_current_cipher)(self.ptr.as_ptr());
            if c.is_null() {
                return String::new();
            }
            text((self.api.SSL_CIPHER_get_name)(c))
        }
    }

    /// Why the call that returned `r` failed.
    fn error(&self, r: c_int) -> SslError {
        // SAFETY: `ptr` is a live SSL and `r` what the last call on it
        // returned, on this thread.
        let code = unsafe { (self.api.SSL_get_error)(self.ptr.as_ptr(), r) };
        SslError::new(self.api, code)
    }
}

impl<S> Drop for Ssl<S> {
    fn drop(&mut self) {
        // SAFETY: we own the SSL (and through it the BIOs); the state was
        // leaked from a Box in `new` and nothing refers to it once the SSL
        // is freed.
        unsafe {
            (self.api.SSL_free)(self.ptr.as_ptr());
            drop(Box::from_raw(self.state.as_ptr()));
        }
    }
}

/// A new memory BIO: it grows as it is written, and reading it when empty
/// is "retry" until the end of the stream is set.
fn mem_bio(api: &Api) -> Option<NonNull<Opaque>> {
    // SAFETY: BIO_s_mem returns a static method table, which BIO_new
    // takes.
    NonNull::new(unsafe { (api.BIO_new)((api.BIO_s_mem)()) })
}

/// A static C string from OpenSSL, or "" for null.
fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null strings from the callers are static and
    // NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The state of the session `ssl`, for its callbacks.
///
/// # Safety
///
/// `ssl` is a live SSL made by [`Ssl::new`] with state type `S`, inside a
/// call made through `&mut Ssl<S>`.
unsafe fn state_of<'a, S>(ssl: *mut Opaque) -> Option<&'a mut S> {
    let api = api().ok()?;
    // SAFETY: `ssl` is live (caller); its app data is the state pointer
    // Ssl::new set, of type `S`, uniquely borrowed for the call.
    unsafe {
        let p = (api.SSL_get_ex_data)(ssl, APP_DATA).cast::<S>();
        p.as_mut()
    }
}

/// A mutable byte slice from OpenSSL's buffer, empty for null.
///
/// # Safety
///
/// `p` is null or writable for `len` bytes for `'a`.
unsafe fn buffer<'a>(p: *mut u8, len: c_uint) -> &'a mut [u8] {
    if p.is_null() {
        return &mut [];
    }
    // SAFETY: writable for `len` bytes (caller).
    unsafe { std::slice::from_raw_parts_mut(p, len as usize) }
}

/// What a PSK callback of the session `ssl` answers OpenSSL: the length
/// of the key `fill` writes, for the session's state, into OpenSSL's
/// buffer (`psk`, `max_psk_len` bytes); or 0 (no key) when the session
/// has no state, or `fill` panicked or says it wrote more than there was
/// room for.
///
/// # Safety
///
/// As for [`state_of`] with `ssl`, and for [`buffer`] with `psk`.
unsafe fn answer<S>(
    ssl: *mut Opaque,
    psk: *mut u8,
    max_psk_len: c_uint,
    fill: impl FnOnce(&mut S, &mut [u8]) -> usize,
) -> c_uint {
    // SAFETY: as the caller promises.
    let (state, key) = unsafe {
        let Some(state) = state_of::<S>(ssl) else {
            return 0;
        };
        (state, buffer(psk, max_psk_len))
    };
    let room = key.len();
    catch_unwind(AssertUnwindSafe(|| fill(state, key)))
        .ok()
        .filter(|&n| n <= room)
        .and_then(|n| c_uint::try_from(n).ok())
        .unwrap_or(0)
}

/// OpenSSL's PSK server callback, handing the lookup to `S`.
unsafe extern "C" fn server_callback<S: PskCallback>(
    ssl: *mut Opaque,
    identity: *const c_char,
    psk: *mut u8,
    max_psk_len: c_uint,
) -> c_uint {
    // SAFETY: OpenSSL calls this on a session made by Ssl::new with state
    // `S`, during SSL_do_handshake through `&mut Ssl<S>`; `identity` is
    // null or NUL-terminated and `psk` writable for `max_psk_len` bytes,
    // all for the duration of the call.
    unsafe {
        let identity = (!identity.is_null()).then(|| CStr::from_ptr(identity).to_bytes());
        answer(ssl, psk, max_psk_len, |state: &mut S, key| {
            state.server_key(identity, key)
        })
    }
}

/// OpenSSL's PSK client callback, asking `S` for the identity and key.
unsafe extern "C" fn client_callback<S: PskCallback>(
    ssl: *mut Opaque,
    _hint: *const c_char,
    identity: *mut c_char,
    max_identity_len: c_uint,
    psk: *mut u8,
    max_psk_len: c_uint,
) -> c_uint {
    // SAFETY: as in server_callback; `identity` is writable for
    // `max_identity_len` bytes and `psk` for `max_psk_len`.
    unsafe {
        let identity = buffer(identity.cast(), max_identity_len);
        answer(ssl, psk, max_psk_len, |state: &mut S, key| {
            state.client_key(identity, key)
        })
    }
}
