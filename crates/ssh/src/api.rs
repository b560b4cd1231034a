//! libssh, loaded at the first use: `libssh.so.4` is opened with
//! dlopen() and the functions diskit calls are looked up once, each
//! checked. diskit does not link libssh, so a machine without it runs
//! everything but the ssh plugin. The constants are libssh.h's and
//! sftp.h's (a stable ABI: their enums only grow at the end).

use std::ffi::{CStr, c_char, c_int, c_long, c_void};
use std::sync::OnceLock;

use diskit_core::{Error, ErrorKind, Result};

/// The library loaded at the first SSH use.
const LIBSSH: &CStr = c"libssh.so.4";

/// `ssh_session`, `sftp_session`, `sftp_file`: opaque handles.
pub type Handle = *mut c_void;

/// `SSH_OK`.
pub const SSH_OK: c_int = 0;
/// `SSH_AGAIN`.
pub const SSH_AGAIN: c_int = -2;

/// `enum ssh_options_e` values used.
pub mod options {
    use std::ffi::c_int;
    /// `SSH_OPTIONS_HOST`.
    pub const HOST: c_int = 0;
    /// `SSH_OPTIONS_PORT_STR`.
    pub const PORT_STR: c_int = 2;
    /// `SSH_OPTIONS_USER`.
    pub const USER: c_int = 4;
    /// `SSH_OPTIONS_ADD_IDENTITY`.
    pub const ADD_IDENTITY: c_int = 7;
    /// `SSH_OPTIONS_KNOWNHOSTS`.
    pub const KNOWNHOSTS: c_int = 8;
    /// `SSH_OPTIONS_TIMEOUT` (a `long` of seconds).
    pub const TIMEOUT: c_int = 9;
    /// `SSH_OPTIONS_COMPRESSION`.
    pub const COMPRESSION: c_int = 22;
    /// `SSH_OPTIONS_NODELAY` (an `int`).
    pub const NODELAY: c_int = 36;
}

/// `enum ssh_auth_e`: `SSH_AUTH_SUCCESS`.
pub const AUTH_SUCCESS: c_int = 0;
/// `SSH_AUTH_ERROR`.
pub const AUTH_ERROR: c_int = -1;
/// `SSH_AUTH_METHOD_PASSWORD`.
pub const METHOD_PASSWORD: c_int = 0x0002;
/// `SSH_AUTH_METHOD_PUBLICKEY`.
pub const METHOD_PUBLICKEY: c_int = 0x0004;

/// `enum ssh_known_hosts_e`.
pub mod known {
    use std::ffi::c_int;
    /// `SSH_KNOWN_HOSTS_ERROR`.
    pub const ERROR: c_int = -2;
    /// `SSH_KNOWN_HOSTS_NOT_FOUND`.
    pub const NOT_FOUND: c_int = -1;
    /// `SSH_KNOWN_HOSTS_UNKNOWN`.
    pub const UNKNOWN: c_int = 0;
    /// `SSH_KNOWN_HOSTS_OK`.
    pub const OK: c_int = 1;
    /// `SSH_KNOWN_HOSTS_CHANGED`.
    pub const CHANGED: c_int = 2;
    /// `SSH_KNOWN_HOSTS_OTHER`.
    pub const OTHER: c_int = 3;
}

/// The head of `struct sftp_attributes_struct` (sftp.h), up to the size,
/// the one field read (the struct is only read through libssh's
/// pointer, never made here).
#[repr(C)]
pub struct AttributesHead {
    name: *mut c_char,
    longname: *mut c_char,
    flags: u32,
    kind: u8,
    /// The file's size in bytes.
    pub size: u64,
}

/// `struct sftp_attributes_struct` (sftp.h), whole, for `sftp_setstat`.
#[repr(C)]
pub struct Attributes {
    name: *mut c_char,
    longname: *mut c_char,
    /// Which fields are set (`SSH_FILEXFER_ATTR_*`).
    pub flags: u32,
    kind: u8,
    /// Bytes.
    pub size: u64,
    uid: u32,
    gid: u32,
    owner: *mut c_char,
    group: *mut c_char,
    /// Mode bits.
    pub permissions: u32,
    atime64: u64,
    atime: u32,
    atime_nseconds: u32,
    createtime: u64,
    createtime_nseconds: u32,
    mtime64: u64,
    mtime: u32,
    mtime_nseconds: u32,
    acl: *mut c_void,
    extended_count: u32,
    extended_type: *mut c_void,
    extended_data: *mut c_void,
}

/// `SSH_FILEXFER_ATTR_SIZE`.
pub const ATTR_SIZE: u32 = 0x1;
/// `SSH_FILEXFER_ATTR_PERMISSIONS`.
pub const ATTR_PERMISSIONS: u32 = 0x4;

impl Attributes {
    /// Attributes that set a size and permissions.
    pub fn size_and_mode(size: u64, mode: u32) -> Attributes {
        Attributes {
            name: std::ptr::null_mut(),
            longname: std::ptr::null_mut(),
            flags: ATTR_SIZE | ATTR_PERMISSIONS,
            kind: 0,
            size,
            uid: 0,
            gid: 0,
            owner: std::ptr::null_mut(),
            group: std::ptr::null_mut(),
            permissions: mode,
            atime64: 0,
            atime: 0,
            atime_nseconds: 0,
            createtime: 0,
            createtime_nseconds: 0,
            mtime64: 0,
            mtime: 0,
            mtime_nseconds: 0,
            acl: std::ptr::null_mut(),
            extended_count: 0,
            extended_type: std::ptr::null_mut(),
            extended_data: std::ptr::null_mut(),
        }
    }
}

diskit_core::functions! {
    /// The functions of libssh diskit calls.
    pub struct Api {
        ssh_new: fn() -> Handle;
        ssh_free: fn(Handle);
        ssh_options_set: fn(Handle, c_int, *const c_void) -> c_int;
        ssh_options_parse_config: fn(Handle, *const c_char) -> c_int;
        ssh_connect: fn(Handle) -> c_int;
        ssh_disconnect: fn(Handle);
        ssh_get_error: fn(Handle) -> *const c_char;
        ssh_session_is_known_server: fn(Handle) -> c_int;
        ssh_userauth_none: fn(Handle, *const c_char) -> c_int;
        ssh_userauth_list: fn(Handle, *const c_char) -> c_int;
        ssh_userauth_publickey_auto: fn(Handle, *const c_char, *const c_char) -> c_int;
        ssh_userauth_password: fn(Handle, *const c_char, *const c_char) -> c_int;
        sftp_new: fn(Handle) -> Handle;
        sftp_init: fn(Handle) -> c_int;
        sftp_free: fn(Handle);
        sftp_open: fn(Handle, *const c_char, c_int, libc::mode_t) -> Handle;
        sftp_close: fn(Handle) -> c_int;
        sftp_seek64: fn(Handle, u64) -> c_int;
        sftp_read: fn(Handle, *mut c_void, usize) -> isize;
        sftp_write: fn(Handle, *const c_void, usize) -> isize;
        sftp_fstat: fn(Handle) -> *mut AttributesHead;
        sftp_attributes_free: fn(*mut AttributesHead);
        sftp_fsync: fn(Handle) -> c_int;
        sftp_extension_supported: fn(Handle, *const c_char, *const c_char) -> c_int;
        sftp_get_error: fn(Handle) -> c_int;
        sftp_setstat: fn(Handle, *const c_char, *mut Attributes) -> c_int;
        sftp_unlink: fn(Handle, *const c_char) -> c_int;
    }
}

/// `long`, the type of `SSH_OPTIONS_TIMEOUT`'s value.
pub type Long = c_long;

/// libssh, loaded at the first call (from any thread; later calls wait
/// for the first and share its result).
pub fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    // SAFETY: the library's initialisers are made to run in multi-threaded
    // programs (QEMU and nbdkit load it in a module or plugin), and `Api`
    // declares the signatures of its C headers.
    unsafe { diskit_core::dynlib::load_once(&API, LIBSSH, Api::resolve) }.map_err(|why| {
        Error::new(
            ErrorKind::NotSupported,
            format!(
                "the ssh plugin needs libssh ({}): {why}",
                LIBSSH.to_string_lossy()
            ),
        )
    })
}
