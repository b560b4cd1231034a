//! `convert -C`: copy offloading. Where the source's bytes lie in a file
//! (a raw image: [`BlockDevice::file_view`]) and the target is a raw file,
//! data runs go from file to file with copy_file_range, which lets the
//! file system share or copy the blocks without bringing them through
//! memory; holes are skipped (or zeroed in a target that is not new).
//! Anything else is copied the ordinary way.

use std::os::fd::{AsRawFd, BorrowedFd};

use diskit_core::extent::ExtentWalker;
use diskit_core::{BlockDevice, Error, Result, ZeroFlags};

/// The most bytes one copy_file_range call is asked for.
const MAX_CALL: u64 = 1 << 30;

/// Copies `src` into the raw file `dst_fd` behind `dst` with
/// copy_file_range. Returns false, having copied nothing, when the source
/// has no file view; a range the kernel cannot copy is read and written.
pub fn copy(
    src: &dyn BlockDevice,
    dst: &dyn BlockDevice,
    dst_fd: BorrowedFd<'_>,
    target_is_zero: bool,
) -> Result<bool> {
    let size = src.size();
    if size > 0 && src.file_view(0, size.min(4096)).is_none() {
        return Ok(false);
    }
    let mut offset = 0;
    for e in ExtentWalker::new(src, 0, size) {
        let e = e?;
        if e.flags.zero {
            if !target_is_zero {
                let flags = ZeroFlags {
                    may_trim: true,
                    ..ZeroFlags::default()
                };
                dst.write_zeroes(offset, e.length, flags)?;
            }
        } else {
            copy_range(src, dst, dst_fd, offset, e.length)?;
        }
        offset += e.length;
    }
    Ok(true)
}

/// One data run, with copy_file_range where it can, else by reading and
/// writing.
fn copy_range(
    src: &dyn BlockDevice,
    dst: &dyn BlockDevice,
    dst_fd: BorrowedFd<'_>,
    mut offset: u64,
    mut len: u64,
) -> Result<()> {
    while len > 0 {
        let n = len.min(MAX_CALL);
        let done = match src.file_view(offset, n) {
            Some(view) => {
                let mut off_in = view.offset as i64;
                let mut off_out = offset as i64;
                // SAFETY: both descriptors are open for the call; the
                // offsets are ours; no buffer is passed.
                let r = unsafe {
                    libc::copy_file_range(
                        view.fd.as_raw_fd(),
                        &mut off_in,
                        dst_fd.as_raw_fd(),
                        &mut off_out,
                        n as usize,
                        0,
                    )
                };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EINTR) => continue,
                        // Not between these files: the ordinary way.
                        Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL) => 0,
                        _ => return Err(Error::from(e).context("copy_file_range")),
                    }
                } else {
                    r as u64
                }
            }
            None => 0,
        };
        let done = if done == 0 {
            // Nothing copied (no view, or the kernel would not): read and
            // write this piece.
            let m = n.min(8 << 20) as usize;
            let mut buf = vec![0u8; m];
            src.read_at(&mut buf, offset)?;
            dst.write_at(&buf, offset, diskit_core::WriteFlags::NONE)?;
            m as u64
        } else {
            done
        };
        offset += done;
        len -= done;
    }
    Ok(())
}
