//! Zero-copy reads: a READ's data goes from the page cache of a file-backed
//! device to the client's socket without passing through the server's
//! memory. The pages are spliced into a pipe first, whole, before anything
//! of the reply is on the wire, so that a short or failed read still gets
//! an error reply (and the connection lives on); then, under the writer
//! lock, from the pipe into the socket.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use diskit_core::FileView;

/// The pipe size asked for (the default limit for unprivileged processes,
/// /proc/sys/fs/pipe-max-size); a smaller one is used if that fails.
const WANTED: usize = 1 << 20;
/// The least pipe worth keeping: room for a read of the smallest size that
/// is spliced, unaligned.
const MIN_SIZE: u64 = (128 << 10) + PAGE;
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
        // Out of pipe quota (fs.pipe-user-pages-soft), the kernel gives a
        // pipe of two pages, which no read worth splicing would fit.
        if (size as u64) < MIN_SIZE {
            return Err(io::Error::other("pipe too small to splice reads"));
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
    /// were there to move (end of file) or the pipe filled up; on
    /// `Ok(false)` or an error the pipe may hold a part (see
    /// [`ZeroCopy::give_up`]).
    pub fn fill(&mut self, view: FileView<'_>, len: u64) -> io::Result<bool> {
        self.used = self.used() + Self::pages(view.offset, len);
        let mut off = view.offset as libc::loff_t;
        let mut left = len;
        while left > 0 {
            let n = match splice(
                view.fd,
                Some(&mut off),
                self.write.as_fd(),
                left,
                libc::SPLICE_F_NONBLOCK,
            ) {
                Ok(0) => return Ok(false),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            };
            left -= n;
            self.held += n;
        }
        Ok(true)
    }

    /// Moves `len` bytes from the pipe into `socket`, blocking as the
    /// socket needs. On an error the pipe must be dropped.
    pub fn drain(&mut self, socket: BorrowedFd<'_>, len: u64) -> io::Result<()> {
        let mut left = len.min(self.held);
        while left > 0 {
            let flags = libc::SPLICE_F_MOVE | libc::SPLICE_F_MORE;
            let n = splice(self.read.as_fd(), None, socket, left, flags)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            left -= n;
            self.held -= n;
        }
        Ok(())
    }

    /// Whether the pipe is empty (safe to keep for the next request).
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }
}

/// `splice(2)` of up to `len` bytes, retried when interrupted; `offset` is
/// the input file's (pipes have none).
fn splice(
    from: BorrowedFd<'_>,
    offset: Option<&mut libc::loff_t>,
    to: BorrowedFd<'_>,
    len: u64,
    flags: libc::c_uint,
) -> io::Result<u64> {
    let offset = offset.map_or(std::ptr::null_mut(), |o| o as *mut libc::loff_t);
    loop {
        // SAFETY: both descriptors are open; `offset` is null or points to
        // a live offset for the input file.
        let n = unsafe {
            libc::splice(
                from.as_raw_fd(),
                offset,
                to.as_raw_fd(),
                std::ptr::null_mut(),
                len as usize,
                flags,
            )
        };
        if n >= 0 {
            return Ok(n as u64);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
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

    /// After a read that could not be spliced whole (`error`: the one
    /// [`SplicePipe::fill`] gave, if any): a pipe holding a part is
    /// forgotten, and a file system that cannot splice turns zero copy off
    /// for good.
    pub fn give_up(&mut self, error: Option<&io::Error>) {
        let never = error.is_some_and(|e| {
            matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
            )
        });
        if never {
            self.off = true;
        }
        if never || self.pipe.as_ref().is_some_and(|p| !p.is_empty()) {
            self.pipe = None;
        }
    }
}
