//! An image's data objects seen directly in RADOS: how far each one's
//! bytes reach. librbd's fast-diff answers allocation in whole objects (its
//! object map knows only whether an object exists); an object's size
//! bounds its data more closely (a 4 MiB object holding 64 KiB written at
//! its start is 64 KiB long), asked for every object at once, one round
//! trip in all.

use std::ffi::{CString, c_char};

use crate::api::{Api, Handle};

/// How an image names its data objects (`rbd_data.ID.%016x` for format 2,
/// `rb.0.ID.%012x` for format 1), where its striping is the default one:
/// object `n` holds the image's bytes `n * object_size..`.
pub struct ObjectNames {
    prefix: String,
    /// Hex digits of the object number.
    width: usize,
}

impl ObjectNames {
    /// The names of the image whose `rbd_image_info_t` gave `prefix`;
    /// `None` for an empty or unknown prefix.
    pub fn new(prefix: &[c_char]) -> Option<ObjectNames> {
        let bytes: Vec<u8> = prefix
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let prefix = String::from_utf8(bytes).ok()?;
        let width = if prefix.starts_with("rbd_data.") {
            16
        } else if prefix.starts_with("rb.") {
            12
        } else {
            return None;
        };
        Some(ObjectNames { prefix, width })
    }

    /// The name of object `n`.
    pub fn name(&self, n: u64) -> String {
        format!("{}.{:0width$x}", self.prefix, n, width = self.width)
    }
}

/// Objects whose sizes are asked at most at once: a copy asks the
/// allocation of at most 1 GiB at a time (256 objects of 4 MiB); larger
/// questions are answered in whole objects.
pub const MAX_ASKED: usize = 1024;

/// The size of each of `objects` in the pool of `ioctx`: `None` where it
/// is not known (no such object, in this pool: it may be in a data pool,
/// or its bytes come from a parent image; or the request failed).
pub fn sizes(api: &Api, ioctx: Handle, names: &ObjectNames, objects: &[u64]) -> Vec<Option<u64>> {
    let n = objects.len();
    let names: Vec<CString> = objects
        .iter()
        .map(|&o| CString::new(names.name(o)).expect("object names hold no NUL"))
        .collect();
    // Where librados writes the answers: touched only through these
    // pointers until every request has completed.
    let mut sizes = vec![0u64; n];
    let mut mtimes: Vec<libc::time_t> = vec![0; n];
    let (size_at, mtime_at) = (sizes.as_mut_ptr(), mtimes.as_mut_ptr());
    let mut completions: Vec<Option<(Handle, bool)>> = Vec::with_capacity(n);
    for (i, name) in names.iter().enumerate() {
        let mut c: Handle = std::ptr::null_mut();
        // SAFETY: `c` is written on success; no callbacks.
        if unsafe { (api.rados_aio_create_completion)(std::ptr::null_mut(), None, None, &mut c) }
            < 0
        {
            completions.push(None);
            continue;
        }
        // SAFETY: the I/O context is live; the name and the answer's
        // places (element `i` of `sizes` and `mtimes`) outlive the
        // request, which is waited for below.
        let r = unsafe {
            (api.rados_aio_stat)(ioctx, name.as_ptr(), c, size_at.add(i), mtime_at.add(i))
        };
        completions.push(Some((c, r >= 0)));
    }
    let done: Vec<bool> = completions
        .into_iter()
        .map(|c| {
            let Some((c, issued)) = c else {
                return false;
            };
            // SAFETY: the completion is ours, waited on only if its
            // request was issued, and released once.
            unsafe {
                let ok = issued
                    && (api.rados_aio_wait_for_complete)(c) >= 0
                    && (api.rados_aio_get_return_value)(c) >= 0;
                (api.rados_aio_release)(c);
                ok
            }
        })
        .collect();
    // Every request has completed: the answers are read from here on.
    done.into_iter()
        .zip(sizes)
        .map(|(ok, size)| ok.then_some(size))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(s: &str) -> Vec<c_char> {
        let mut v: Vec<c_char> = s.bytes().map(|b| b as c_char).collect();
        v.resize(24, 0);
        v
    }

    #[test]
    fn objects_are_named_as_librbd_names_them() {
        let f2 = ObjectNames::new(&prefix("rbd_data.10226b8b4567")).unwrap();
        assert_eq!(f2.name(0x1f), "rbd_data.10226b8b4567.000000000000001f");
        let f1 = ObjectNames::new(&prefix("rb.0.1234.74b0dc51")).unwrap();
        assert_eq!(f1.name(2), "rb.0.1234.74b0dc51.000000000002");
        assert!(ObjectNames::new(&prefix("")).is_none());
        assert!(ObjectNames::new(&prefix("journal_data.x")).is_none());
    }
}
