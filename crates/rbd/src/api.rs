//! librbd and librados, loaded at the first use: `librbd.so.1` is opened
//! with dlopen() (it brings `librados.so.2` with it) and the functions
//! diskit calls are looked up once, each checked. diskit does not link
//! Ceph's libraries, so a machine without them runs everything but RBD.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use diskit_core::{Error, ErrorKind, Result};

/// The library loaded at the first RBD use.
const LIBRBD: &CStr = c"librbd.so.1";

/// `rados_t`, `rados_ioctx_t`, `rbd_image_t`: opaque handles.
pub type Handle = *mut c_void;

/// `rbd_image_info_t` (librbd.h), whose size and object size are read.
#[repr(C)]
pub struct ImageInfo {
    /// Bytes.
    pub size: u64,
    /// Bytes per object.
    pub obj_size: u64,
    /// Objects.
    pub num_objs: u64,
    /// log2 of the object size.
    pub order: c_int,
    /// The prefix of the image's data objects' names (NUL-terminated).
    pub block_name_prefix: [c_char; 24],
    parent_pool: i64,
    parent_name: [c_char; 96],
}

impl Default for ImageInfo {
    fn default() -> ImageInfo {
        ImageInfo {
            size: 0,
            obj_size: 0,
            num_objs: 0,
            order: 0,
            block_name_prefix: [0; 24],
            parent_pool: 0,
            parent_name: [0; 96],
        }
    }
}

/// `rbd_callback_t`: a finished asynchronous request's completion and
/// the argument given when it was made.
pub type AioCb = unsafe extern "C" fn(Handle, *mut c_void);

/// `rbd_snap_info_t`: one snapshot, as `rbd_snap_list` fills it.
#[repr(C)]
pub struct SnapInfo {
    /// The snapshot's id.
    pub id: u64,
    /// The image's size at the snapshot.
    pub size: u64,
    /// Its name (owned by librbd until `rbd_snap_list_end`).
    pub name: *const c_char,
}

/// `rbd_diff_iterate2`'s callback: offset, length, whether the extent
/// exists (1) or is a hole (0), and the caller's argument.
pub type DiffCb = unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

diskit_core::functions! {
    /// The functions of librados and librbd diskit calls.
    pub struct Api {
        rados_create: fn(*mut Handle, *const c_char) -> c_int;
        rados_conf_read_file: fn(Handle, *const c_char) -> c_int;
        rados_conf_set: fn(Handle, *const c_char, *const c_char) -> c_int;
        rados_connect: fn(Handle) -> c_int;
        rados_shutdown: fn(Handle);
        rados_ioctx_create: fn(Handle, *const c_char, *mut Handle) -> c_int;
        rados_ioctx_destroy: fn(Handle);
        rados_ioctx_set_namespace: fn(Handle, *const c_char);
        rbd_create: fn(Handle, *const c_char, u64, *mut c_int) -> c_int;
        rbd_remove: fn(Handle, *const c_char) -> c_int;
        rbd_open: fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int;
        rbd_open_read_only: fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int;
        rbd_close: fn(Handle) -> c_int;
        rbd_stat: fn(Handle, *mut ImageInfo, usize) -> c_int;
        rbd_get_size: fn(Handle, *mut u64) -> c_int;
        rbd_resize: fn(Handle, u64) -> c_int;
        rbd_read2: fn(Handle, u64, usize, *mut c_char, c_int) -> isize;
        rbd_write2: fn(Handle, u64, usize, *const c_char, c_int) -> isize;
        rbd_discard: fn(Handle, u64, u64) -> c_int;
        rbd_write_zeroes: fn(Handle, u64, usize, c_int, c_int) -> isize;
        rbd_flush: fn(Handle) -> c_int;
        rbd_aio_create_completion: fn(*mut c_void, Option<AioCb>, *mut Handle) -> c_int;
        rbd_aio_get_return_value: fn(Handle) -> isize;
        rbd_aio_release: fn(Handle);
        rbd_aio_read2: fn(Handle, u64, usize, *mut c_char, Handle, c_int) -> c_int;
        rbd_aio_write2: fn(Handle, u64, usize, *const c_char, Handle, c_int) -> c_int;
        rbd_aio_write_zeroes: fn(Handle, u64, usize, Handle, c_int, c_int) -> c_int;
        rbd_snap_list: fn(Handle, *mut SnapInfo, *mut c_int) -> c_int;
        rbd_snap_list_end: fn(*mut SnapInfo);
        rbd_snap_create: fn(Handle, *const c_char) -> c_int;
        rbd_snap_remove: fn(Handle, *const c_char) -> c_int;
        rbd_snap_rollback: fn(Handle, *const c_char) -> c_int;
        rbd_snap_get_timestamp: fn(Handle, u64, *mut libc::timespec) -> c_int;
        rbd_get_features: fn(Handle, *mut u64) -> c_int;
        rbd_get_flags: fn(Handle, *mut u64) -> c_int;
        rbd_diff_iterate2: fn(Handle, *const c_char, u64, u64, u8, u8, Option<DiffCb>, *mut c_void) -> c_int;
        rbd_get_stripe_unit: fn(Handle, *mut u64) -> c_int;
        rbd_get_stripe_count: fn(Handle, *mut u64) -> c_int;
        rados_aio_create_completion: fn(*mut c_void, Option<AioCb>, Option<AioCb>, *mut Handle) -> c_int;
        rados_aio_stat: fn(Handle, *const c_char, Handle, *mut u64, *mut libc::time_t) -> c_int;
        rados_aio_wait_for_complete: fn(Handle) -> c_int;
        rados_aio_get_return_value: fn(Handle) -> c_int;
        rados_aio_release: fn(Handle);
    }
}

/// librbd, loaded at the first call (from any thread; later calls wait
/// for the first and share its result).
pub fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    // SAFETY: the library's initialisers are made to run in multi-threaded
    // programs (QEMU and nbdkit load it in a module or plugin), and `Api`
    // declares the signatures of its C headers.
    unsafe { diskit_core::dynlib::load_once(&API, LIBRBD, Api::resolve) }.map_err(|why| {
        Error::new(
            ErrorKind::NotSupported,
            format!(
                "RBD needs Ceph's librbd ({}): {why}",
                LIBRBD.to_string_lossy()
            ),
        )
    })
}

/// An error for librbd's or librados's return value `r` (a negative
/// errno), with `what` failed.
pub fn failed(r: i64, what: impl std::fmt::Display) -> Error {
    let (kind, text) = errno(r);
    Error::new(kind, format!("{what}: {text}"))
}

/// The error a request's return value `r` (a negative errno) stands for,
/// said as strerror says it: the caller names the request and where.
pub fn request_failed(r: i64) -> Error {
    let (kind, text) = errno(r);
    Error::new(kind, text)
}

fn errno(r: i64) -> (ErrorKind, String) {
    let errno = i32::try_from(-r).unwrap_or(libc::EIO);
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    let text = text.split(" (os error").next().unwrap_or(&text).to_string();
    (ErrorKind::from_errno(errno), text)
}
