//! Zero-copy reads: a READ's data goes from the page cache of a file-backed
//! device to the client's socket without passing through the server's
//! memory. The pages are spliced into a pipe first, whole, before anything
//! of the reply is on the wire, so that a short or failed read still gets
//! an error reply (and the connection lives on); then, under the writer
//! lock, from the pipe into the socket.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use diskit_core::FileView;

/// The pipe size asked for (the default limit for unprivileged processes,
/// /proc/sys/fs/pipe-max-size); a smaller one is used if that fails.
const WANTED: usize = 1 << 20;
/// Pipe capacity is counted in buffers of up to a page each.
const PAGE: u64 = 4096;

/// One worker's pipe for zero-copy reads.
pub struct SplicePipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Buffers the pipe holds.
    slots: u64,
    /// Buffers filled since the pipe was last empty (an upper bound).
    used: u64,
    /// Bytes in the pipe not yet sent.
    held: u64,
}

impl SplicePipe {
    /// A new, empty pipe.
    pub fn new() -> io::Result<SplicePipe> {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two descriptors into the array, which is valid.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and ours alone.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: F_SETPIPE_SZ/F_GETPIPE_SZ take and return integers only.
        let size = unsafe {
            libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, WANTED as libc::c_int);
            libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ)
        };
        if size <= 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SplicePipe {
            read,
            write,
            slots: size as u64 / PAGE,
            used: 0,
            held: 0,
        })
    }

    /// Whether `len` bytes at file offset `offset` fit in the room left
    /// (each page cache page it touches takes one pipe buffer).
    pub fn fits(&self, offset: u64, len: u64) -> bool {
        Self::pages(offset, len) + self.used() <= self.slots
    }

    /// Buffers in use: none once the pipe is empty.
    fn used(&self) -> u64 {
        if self.held == 0 { 0 } else { self.used }
    }

    fn pages(offset: u64, len: u64) -> u64 {
        (offset % PAGE + len).div_ceil(PAGE)
    }

    /// Moves `len` bytes of `view` into the pipe. `Ok(false)` when fewer
    /// were there to move (end of file); on `Ok(false)` or an error the
    /// pipe holds a part and must be dropped.
    pub fn fill(&mut self, view: FileView<'_>, len: u64) -> io::Result<bool> {
        self.used = self.used() + Self::pages(view.offset, len);
        let mut off = view.offset as libc::loff_t;
        let mut left = len;
        while left > 0 {
            // SAFETY: both descriptors are open; `off` is a valid in/out
            // offset for the file, the pipe end has none.
            let n = unsafe {
                libc::splice(
                    view.fd.as_raw_fd(),
                    &mut off,
                    self.write.as_raw_fd(),
                    std::ptr::null_mut(),
                    left as usize,
                    libc::SPLICE_F_NONBLOCK,
                )
            };
            match n {
                0 => return Ok(false),
                n if n > 0 => {
                    left -= n as u64;
                    self.held += n as u64;
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::Interrupted => {}
                        io::ErrorKind::WouldBlock => return Ok(false),
                        _ => return Err(e),
                    }
                }
            }
        }
        Ok(true)
    }

    /// Moves `len` bytes from the pipe into `socket`, blocking as the
    /// socket needs. On an error the pipe must be dropped.
    pub fn drain(&mut self, socket: BorrowedFd<'_>, len: u64) -> io::Result<()> {
        let mut left = len.min(self.held);
        while left > 0 {
            // SAFETY: both descriptors are open; neither end has an offset.
            let n = unsafe {
                libc::splice(
                    self.read.as_raw_fd(),
                    std::ptr::null_mut(),
                    socket.as_raw_fd(),
                    std::ptr::null_mut(),
                    left as usize,
                    libc::SPLICE_F_MOVE | libc::SPLICE_F_MORE,
                )
            };
            match n {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                n if n > 0 => {
                    left -= n as u64;
                    self.held -= n as u64;
                }
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the pipe is empty (safe to keep for the next request).
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }
}

/// A worker's zero-copy state: its pipe, made on first use, and whether
/// zero copy still works for it.
#[derive(Default)]
pub struct ZeroCopy {
    pipe: Option<SplicePipe>,
    off: bool,
}

impl ZeroCopy {
    /// The pipe, made if needed; `None` once zero copy failed for good.
    pub fn pipe(&mut self) -> Option<&mut SplicePipe> {
        if self.off {
            return None;
        }
        if self.pipe.is_none() {
            match SplicePipe::new() {
                Ok(p) => self.pipe = Some(p),
                Err(_) => {
                    self.off = true;
                    return None;
                }
            }
        }
        self.pipe.as_mut()
    }

    /// Forgets a pipe left holding bytes that will not be sent.
    pub fn reset(&mut self) {
        self.pipe = None;
    }

    /// Turns zero copy off for this worker (the file system cannot splice).
    pub fn disable(&mut self) {
        self.pipe = None;
        self.off = true;
    }
}
