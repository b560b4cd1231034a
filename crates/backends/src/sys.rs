//! Thin, safe wrappers over the Linux system calls the file backend needs.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `fallocate(2)` with `mode` over `offset..offset+len`.
pub fn fallocate(fd: BorrowedFd<'_>, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    loop {
        // SAFETY: fallocate only reads its scalar arguments; fd is a live descriptor.
        let r = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset as i64, len as i64) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `lseek(2)` with SEEK_DATA or SEEK_HOLE. `Ok(None)` when there is no
/// data at or after `offset` (ENXIO).
pub fn seek(fd: BorrowedFd<'_>, offset: u64, whence: i32) -> io::Result<Option<u64>> {
    // SAFETY: lseek only reads its scalar arguments; fd is a live descriptor.
    let r = unsafe { libc::lseek(fd.as_raw_fd(), offset as i64, whence) };
    if r >= 0 {
        return Ok(Some(r as u64));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(e)
    }
}

/// The size of a block device (BLKGETSIZE64).
pub fn block_device_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(size)
    }
}

/// BLKZEROOUT or BLKDISCARD over a range of a block device.
pub fn block_range_ioctl(
    fd: BorrowedFd<'_>,
    request: u64,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: these ioctls read two u64s through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, range.as_ptr()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `posix_fadvise(2)`; advice failures are not errors worth reporting.
pub fn fadvise(fd: BorrowedFd<'_>, offset: u64, len: u64, advice: i32) {
    // SAFETY: posix_fadvise only reads its scalar arguments.
    unsafe {
        libc::posix_fadvise(fd.as_raw_fd(), offset as i64, len as i64, advice);
    }
}

// _IOR(0x12, 114, size_t)
const BLKGETSIZE64: u64 = 0x8008_1272;
/// _IO(0x12, 127)
pub const BLKZEROOUT: u64 = 0x127f;
/// _IO(0x12, 119)
pub const BLKDISCARD: u64 = 0x1277;
