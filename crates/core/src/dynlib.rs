//! System libraries loaded at run time (dlopen()), for the optional parts
//! that need one (OpenSSL for pre-shared keys, librbd for Ceph): diskit
//! does not link them, so commands that never use them do not pay for
//! loading them, and a machine without them runs everything else. A
//! library is never closed once opened, so what is looked up in it is
//! valid for `'static`.

use std::ffi::{CStr, c_void};

/// A library opened with dlopen(), never closed.
#[derive(Debug, Clone, Copy)]
pub struct Library {
    handle: *mut c_void,
    name: &'static CStr,
}

// SAFETY: a dlopen() handle is an opaque token the dl* functions accept
// from any thread.
unsafe impl Send for Library {}
// SAFETY: as above; the handle is never written through.
unsafe impl Sync for Library {}

impl Library {
    /// Opens `name` (a soname), or says why not (dlerror()'s text).
    ///
    /// # Safety
    ///
    /// Loading runs the library's initialisers: the library must be one
    /// whose initialisers are safe to run in a multi-threaded process.
    pub unsafe fn open(name: &'static CStr) -> Result<Library, String> {
        // SAFETY: `name` is NUL-terminated; the caller vouches for the
        // library's initialisers.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(last_error());
        }
        Ok(Library { handle, name })
    }

    /// The library's soname.
    pub fn name(&self) -> &'static CStr {
        self.name
    }

    /// The address of `symbol` (NUL-terminated) in the library or the
    /// libraries it depends on, or dlerror()'s explanation.
    pub fn symbol(&self, symbol: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: dlerror() has no preconditions; calling it clears any
        // earlier error so that the one read below is dlsym()'s.
        unsafe { libc::dlerror() };
        // SAFETY: `handle` is a live dlopen() handle (never closed) and
        // `symbol` is NUL-terminated.
        let p = unsafe { libc::dlsym(self.handle, symbol.as_ptr()) };
        if p.is_null() {
            return Err(last_error());
        }
        Ok(p)
    }
}

/// A library's table of functions, loaded by the first caller (from any
/// thread; later callers wait for the first and share its result, a
/// failure included): `name` opened and `T` resolved in it once.
///
/// # Safety
///
/// As [`Library::open`] for `name`'s initialisers, and `resolve` must be
/// a table's `resolve` (see [`functions!`](crate::functions)) whose
/// declared signatures are `name`'s.
pub unsafe fn load_once<T>(
    cell: &'static std::sync::OnceLock<Result<T, String>>,
    name: &'static CStr,
    resolve: unsafe fn(&Library) -> Result<T, String>,
) -> Result<&'static T, String> {
    cell.get_or_init(|| {
        // SAFETY: the caller vouches for the library and the table.
        let lib = unsafe { Library::open(name) }?;
        // SAFETY: as above.
        unsafe { resolve(&lib) }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// dlerror()'s text for the last failure on this thread.
fn last_error() -> String {
    // SAFETY: dlerror() returns null or a NUL-terminated string that stays
    // valid until the next dl* call on this thread; it is copied at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".to_owned()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Declares a table of C functions looked up in a [`Library`]:
/// `functions! { Name { c_function: fn(args) -> ret; ... } }` makes
/// `struct Name` with one field per function and `Name::resolve(&lib)`.
#[macro_export]
macro_rules! functions {
    ($(#[$meta:meta])* $vis:vis struct $table:ident {
        $($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*
    }) => {
        $(#[$meta])*
        #[allow(non_snake_case)]
        $vis struct $table {
            $(
                #[doc = concat!("`", stringify!($name), "`")]
                pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,
            )*
        }

        impl $table {
            /// Looks every function up in `lib`.
            ///
            /// # Safety
            ///
            /// `lib` must be the library whose symbols of these names
            /// have the C signatures declared here.
            $vis unsafe fn resolve(lib: &$crate::dynlib::Library) -> Result<$table, String> {
                Ok($table {
                    $(
                        $name: {
                            let p = lib.symbol(
                                ::std::ffi::CStr::from_bytes_with_nul(
                                    concat!(stringify!($name), "\0").as_bytes(),
                                )
                                .expect("a C name"),
                            )?;
                            // SAFETY: `p` is the non-null address of the
                            // function of that name, whose C signature is
                            // the one declared (the caller's promise); a
                            // function pointer has the size of a data
                            // pointer on the platforms with dlsym().
                            unsafe {
                                ::std::mem::transmute::<
                                    *mut ::std::ffi::c_void,
                                    unsafe extern "C" fn($($arg),*) $(-> $ret)?,
                                >(p)
                            }
                        },
                    )*
                })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libraries_and_symbols_are_clear_errors() {
        // SAFETY: nothing is loaded.
        let e = unsafe { Library::open(c"libdiskit-no-such-library.so.9") }.unwrap_err();
        assert!(e.contains("libdiskit-no-such-library.so.9"), "{e}");
        // SAFETY: libc's initialisers have run already.
        let libc = unsafe { Library::open(c"libc.so.6") }.unwrap();
        assert!(libc.symbol(c"getpid").is_ok());
        let e = libc.symbol(c"diskit_no_such_symbol").unwrap_err();
        assert!(e.contains("diskit_no_such_symbol"), "{e}");
    }
}
