//! The temporary files the cow and cache filters keep blocks in: unlinked,
//! in $TMPDIR or else /var/tmp (as nbdkit: /tmp is often memory), sized
//! to hold every block of the device, sparse.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use diskit_core::{Error, Result};

/// A new unlinked file of `len` bytes for `filter`.
pub(crate) fn temp_file(filter: &str, len: u64) -> Result<File> {
    let dir = std::env::var_os("TMPDIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let f = tempfile::tempfile_in(&dir).map_err(|e| {
        Error::from(e).context(format!(
            "{filter}: cannot create a temporary file in {} (set TMPDIR)",
            dir.display()
        ))
    })?;
    f.set_len(len)
        .map_err(|e| Error::from(e).context(format!("{filter}: cannot size the temporary file")))?;
    Ok(f)
}

/// Frees `len` bytes of `f` at `offset` (best effort: the callers' maps
/// say what the blocks hold whatever happens here).
pub(crate) fn punch(f: &File, offset: u64, len: u64) {
    // SAFETY: fallocate on a file the caller owns.
    unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        );
    }
}
