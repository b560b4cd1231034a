//! QEMU-compatible image locks on a file (see
//! [`diskit_core::storage::lock`]): open file description byte-range
//! locks, so that diskit and QEMU see each other's use of an image.
//!
//! And the one guard QEMU's locks leave open: a command's own sources.
//! Every file a command reads as a source (its images and their backing
//! and data files) is noted here by device and inode, and no file of the
//! process is created over, truncated or opened for writing while it is one
//! of them, whatever the names (symlinks, hard links, `-U`).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Mutex;

use diskit_core::storage::lock::{PERM_BASE, RESIZE, SHARED_BASE, WRITE, name};
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

/// Checks that no other open file description conflicts with using `perm`
/// and keeping `unshare` from others. The errors and the order of the
/// checks are QEMU's (`raw_check_lock_bytes`: every permission used, then
/// every permission kept).
fn check(file: &File, location: &str, perm: u8, unshare: u8) -> Result<()> {
    let refuse = |what: String| {
        Error::new(
            ErrorKind::PermissionDenied,
            format!("{what}\nIs another process using the image [{location}]?"),
        )
    };
    for i in 0..4u32 {
        if perm & (1 << i) != 0 && held_by_others(file, SHARED_BASE + u64::from(i))? {
            return Err(refuse(format!("Failed to get \"{}\" lock", name(i))));
        }
    }
    for i in 0..4u32 {
        if unshare & (1 << i) != 0 && held_by_others(file, PERM_BASE + u64::from(i))? {
            return Err(refuse(format!("Failed to get shared \"{}\" lock", name(i))));
        }
    }
    Ok(())
}

/// Checks that no other process conflicts with using `perm` and keeping
/// `unshare` from others (see [`check`]), then takes the locks that say
/// so, for as long as `file` stays open.
pub fn take(file: &File, location: &str, perm: u8, unshare: u8) -> Result<()> {
    check(file, location, perm, unshare)?;
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

/// What creating an image over a file uses and keeps, as QEMU's
/// file-posix creation: it writes and resizes the file, and lets no one
/// else resize it until it has its new size.
pub const CREATE: (u8, u8) = (WRITE | RESIZE, RESIZE);

/// A file's identity: the device it lives on and its inode. Two names
/// (a symlink, a hard link, a relative and an absolute path) are the same
/// file exactly when their identities are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// The device holding the file.
    pub dev: u64,
    /// The file's inode on that device.
    pub ino: u64,
}

impl FileId {
    /// The identity of an open file. A block device is known by the device
    /// it is, not by its node in /dev: two nodes of one disk are one file.
    pub fn of(fd: BorrowedFd<'_>) -> Result<FileId> {
        // SAFETY: a zeroed stat is a valid value for fstat to fill in.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor we borrow, into a valid stat.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        if st.st_mode & libc::S_IFMT == libc::S_IFBLK {
            return Ok(FileId {
                dev: st.st_rdev,
                ino: 0,
            });
        }
        Ok(FileId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// The files this process reads as the sources of its command, with the
/// names they were opened by.
static SOURCES: Mutex<Vec<(FileId, String)>> = Mutex::new(Vec::new());

/// Notes the open file `fd`, opened as `location`, as a source of the
/// running command: from now on no file of this process is created over
/// it, truncated or opened for writing. A command's sources stay its
/// sources until it exits.
pub fn hold_as_source(fd: BorrowedFd<'_>, location: &str) -> Result<()> {
    let id = FileId::of(fd)?;
    let mut sources = diskit_core::sync::lock(&SOURCES);
    if !sources.iter().any(|(s, _)| *s == id) {
        sources.push((id, location.to_string()));
    }
    Ok(())
}

/// Refuses to write the open file `file` (opened as `location`) when it
/// is a source of the running command (see [`hold_as_source`]). Where
/// QEMU's locks would refuse it too (the source is open with writes kept
/// from others), the error is theirs, as qemu-img says it.
pub fn refuse_if_source(file: &File, location: &str) -> Result<()> {
    // Commands without sources (servers, create without a backing file)
    // pay nothing.
    if diskit_core::sync::lock(&SOURCES).is_empty() {
        return Ok(());
    }
    let id = FileId::of(file.as_fd())?;
    let source = {
        let sources = diskit_core::sync::lock(&SOURCES);
        match sources.iter().find(|(s, _)| *s == id) {
            None => return Ok(()),
            Some((_, name)) => name.clone(),
        }
    };
    check(file, location, WRITE, 0)?;
    let what = if source == location {
        format!("'{location}' is a source of this command")
    } else {
        format!("'{location}' is the same file as '{source}', a source of this command")
    };
    Err(Error::new(
        ErrorKind::PermissionDenied,
        format!("{what}: it cannot be its target too"),
    ))
}
