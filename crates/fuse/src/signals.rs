//! SIGINT, SIGTERM and SIGHUP unmount the file (as libfuse's handlers
//! end nbdfuse's loop), so that the process ends as after
//! `fusermount3 -u`, its device flushed and closed; it then reports the
//! signal and fails, as nbdfuse does.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};

use diskit_core::{Error, Result};
use fuser::SessionUnmounter;

/// The write end of the pipe the handler writes to (-1: none yet).
static WAKE: AtomicI32 = AtomicI32::new(-1);
/// The first signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// The signal that ended the mount, if one did.
pub fn received() -> Option<i32> {
    Some(RECEIVED.load(Ordering::Relaxed)).filter(|&s| s != 0)
}

extern "C" fn on_signal(sig: libc::c_int) {
    let _ = RECEIVED.compare_exchange(0, sig, Ordering::Relaxed, Ordering::Relaxed);
    let fd = WAKE.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; one byte from the stack.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

/// Installs the handlers and the thread that unmounts when one runs.
pub fn unmount_on_signals(mut unmounter: SessionUnmounter) -> Result<()> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two descriptors of the array given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::from(std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 returned a new descriptor that nothing else owns.
    let read_end = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // The write end stays open for the life of the process.
    WAKE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only calls write(2), which is
        // async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    std::thread::Builder::new()
        .name("fuse-signals".into())
        .spawn(move || {
            let mut f = std::fs::File::from(read_end);
            let mut b = [0u8; 1];
            if f.read_exact(&mut b).is_ok() {
                let _ = unmounter.unmount();
            }
        })
        .map_err(Error::from)?;
    Ok(())
}
