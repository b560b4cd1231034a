//! Daemon mode, as nbdkit does it without `-f`: once the socket listens,
//! the process forks; the child serves in the background and the parent
//! exits. Unlike nbdkit, the parent waits until the child has written its
//! pid file (so a script may read it as soon as the command returns), and
//! the child starts a new session (no controlling terminal).
//!
//! The fork happens before any thread exists: only the forking thread
//! survives a fork, so threads must be started in the child, which opens
//! the plugin and moves to / only once it is ready.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::util::CliError;

/// The child's promise to tell its parent when it is ready.
pub struct Ready {
    pipe: File,
    keep_stderr: bool,
}

impl Ready {
    /// Tells the parent that the daemon is serving (the parent then
    /// exits 0), moves to / (paths used from here on must be absolute),
    /// and sends stderr to /dev/null unless it is kept: up to here,
    /// start-up errors still reach the caller's terminal.
    pub fn signal(mut self) {
        // SAFETY: chdir has no memory-safety preconditions; the path is a
        // NUL-terminated literal.
        unsafe {
            libc::chdir(c"/".as_ptr());
        }
        if !self.keep_stderr {
            redirect(libc::STDERR_FILENO, libc::O_WRONLY);
        }
        let _ = self.pipe.write_all(b"1");
    }
}

/// Whether this process runs more than one thread (Linux: /proc/self/task).
fn threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|d| d.count() > 1)
}

/// Points `fd` at /dev/null.
fn redirect(fd: libc::c_int, flags: libc::c_int) {
    // SAFETY: open/dup2/close on descriptors this process owns; the path
    // is a NUL-terminated literal.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), flags | libc::O_CLOEXEC);
        if null >= 0 {
            libc::dup2(null, fd);
            libc::close(null);
        }
    }
}

/// Forks into the background. In the parent this never returns: it waits
/// for the child's [`Ready::signal`], runs `on_ready` (printing the URI)
/// and exits 0, or exits 1 if the child died first (its error on the
/// caller's stderr). In the child it returns after `setsid` and pointing
/// stdin and stdout at /dev/null, still in the caller's directory, so that
/// the child opens the plugin (which may start threads, as the nbd
/// plugin's connections do) with the caller's relative paths.
/// `keep_stderr`: the daemon keeps the caller's standard error once ready
/// (nbdkit's `-v`, qemu-nbd's `--fork`), else it goes to /dev/null.
pub fn daemonize(keep_stderr: bool, on_ready: impl FnOnce()) -> Result<Ready, CliError> {
    if threaded() {
        return Err(CliError::new(
            "internal error: cannot fork into the background with threads running",
        ));
    }
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 fills the two-element array on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(CliError::new(format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: the process is single-threaded (checked above), so the child
    // is a complete copy and may go on running Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(CliError::new(format!(
            "fork: {}",
            std::io::Error::last_os_error()
        )));
    }
    if pid > 0 {
        drop(wr);
        let mut byte = [0u8; 1];
        let ready = File::from(rd).read(&mut byte).is_ok_and(|n| n == 1);
        if ready {
            on_ready();
            let _ = std::io::stdout().flush();
        }
        // SAFETY: _exit ends the parent without running destructors, which
        // belong to the child now (temporary directory, socket, image).
        unsafe { libc::_exit(if ready { 0 } else { 1 }) };
    }
    drop(rd);
    // SAFETY: setsid has no memory-safety preconditions.
    unsafe {
        libc::setsid();
    }
    redirect(libc::STDIN_FILENO, libc::O_RDONLY);
    redirect(libc::STDOUT_FILENO, libc::O_WRONLY);
    debug_assert!(wr.as_raw_fd() > 2);
    Ok(Ready {
        pipe: File::from(wr),
        keep_stderr,
    })
}
