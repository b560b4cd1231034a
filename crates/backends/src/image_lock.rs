//! QEMU-compatible image locks on a file (see
//! [`diskit_core::storage::lock`]): open file description byte-range
//! locks, so that diskit and QEMU see each other's use of an image.

use std::fs::File;
use std::os::fd::AsRawFd;

use diskit_core::storage::lock::{PERM_BASE, SHARED_BASE, name};
use diskit_core::{Error, ErrorKind, Result};

/// Whether another open file description holds a lock on `byte` that an
/// exclusive lock would conflict with.
fn held_by_others(file: &File, byte: u64) -> Result<bool> {
    // SAFETY: a zeroed flock is a valid value to fill in.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = byte as _;
    fl.l_len = 1;
    // SAFETY: F_OFD_GETLK on our descriptor with a valid flock.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(fl.l_type != libc::F_UNLCK as _)
}

/// Takes a shared lock on `byte` for this open file description.
fn lock_byte(file: &File, byte: u64) -> Result<()> {
    // SAFETY: as above.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_RDLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = byte as _;
    fl.l_len = 1;
    // SAFETY: F_OFD_SETLK on our descriptor with a valid flock.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// Checks that no other process conflicts with using `perm` and keeping
/// `unshare` from others, then takes the locks that say so. The errors are
/// QEMU's.
pub fn take(file: &File, location: &str, perm: u8, unshare: u8) -> Result<()> {
    let refuse = |what: String| {
        Error::new(
            ErrorKind::PermissionDenied,
            format!("{what}\nIs another process using the image [{location}]?"),
        )
    };
    for i in 0..4u32 {
        let bit = 1u8 << i;
        if perm & bit != 0 && held_by_others(file, SHARED_BASE + u64::from(i))? {
            return Err(refuse(format!("Failed to get \"{}\" lock", name(i))));
        }
        if unshare & bit != 0 && held_by_others(file, PERM_BASE + u64::from(i))? {
            return Err(refuse(format!("Failed to get shared \"{}\" lock", name(i))));
        }
    }
    for i in 0..4u32 {
        let bit = 1u8 << i;
        if perm & bit != 0 {
            lock_byte(file, PERM_BASE + u64::from(i))?;
        }
        if unshare & bit != 0 {
            lock_byte(file, SHARED_BASE + u64::from(i))?;
        }
    }
    Ok(())
}
