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

/// Pipes one worker keeps at most: a read larger than one pipe (1 MiB:
/// pipe-max-size for an unprivileged process) goes through several, up to
/// 4 MiB unaligned (the preferred requests of RBD's and S3's objects).
/// Each pipe counts against the user's pipe quota (fs.pipe-user-pages-soft,
/// 64 MiB), so more are made only for reads that need them.
const MAX_PIPES: usize = 5;

/// One pipe of a worker's chain.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Buffers the pipe holds.
    slots: u64,
    /// Buffers filled since the pipe was last empty (an upper bound).
    used: u64,
    /// Bytes in the pipe not yet sent.
    held: u64,
}

impl Pipe {
    /// A new, empty pipe.
    fn new() -> io::Result<Pipe> {
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
        Ok(Pipe {
            read,
            write,
            slots: size as u64 / PAGE,
            used: 0,
            held: 0,
        })
    }

    /// Buffers in use: none once the pipe is empty.
    fn used(&self) -> u64 {
        if self.held == 0 { 0 } else { self.used }
    }

    /// How many of `len` bytes at file offset `offset` fit in the room
    /// left (each page cache page they touch takes one pipe buffer).
    fn room_for(&self, offset: u64, len: u64) -> u64 {
        let free = self.slots.saturating_sub(self.used());
        (free * PAGE).saturating_sub(offset % PAGE).min(len)
    }

    /// Moves `len` bytes of `fd` from `*off` into the pipe; `Ok(false)`
    /// when fewer were there to move or the pipe filled up.
    fn fill(&mut self, fd: BorrowedFd<'_>, off: &mut libc::loff_t, len: u64) -> io::Result<bool> {
        self.used = self.used() + pages(*off as u64, len);
        let mut left = len;
        while left > 0 {
            let n = match splice(
                fd,
                Some(off),
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

    /// Moves up to `len` bytes from the pipe into `socket`; returns how
    /// many.
    fn drain(&mut self, socket: BorrowedFd<'_>, len: u64) -> io::Result<u64> {
        let want = len.min(self.held);
        let mut left = want;
        while left > 0 {
            let flags = libc::SPLICE_F_MOVE | libc::SPLICE_F_MORE;
            let n = splice(self.read.as_fd(), None, socket, left, flags)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            left -= n;
            self.held -= n;
        }
        Ok(want)
    }
}

/// Page cache pages `len` bytes at file offset `offset` touch.
fn pages(offset: u64, len: u64) -> u64 {
    (offset % PAGE + len).div_ceil(PAGE)
}

/// One worker's pipes for zero-copy reads: a chain, filled and drained in
/// order, of as many pipes as its largest read has needed.
pub struct SplicePipe {
    pipes: Vec<Pipe>,
    /// The pipe the next fill starts in.
    filling: usize,
    /// The pipe the next drain starts from.
    draining: usize,
    /// Another pipe could not be made: none is asked for again.
    no_more: bool,
}

impl SplicePipe {
    /// A chain of one new, empty pipe.
    pub fn new() -> io::Result<SplicePipe> {
        Ok(SplicePipe {
            pipes: vec![Pipe::new()?],
            filling: 0,
            draining: 0,
            no_more: false,
        })
    }

    /// Whether `len` bytes at file offset `offset` fit in the room left,
    /// pipes added for them as needed (up to [`MAX_PIPES`], as far as the
    /// pipe quota allows).
    pub fn make_room(&mut self, mut offset: u64, mut len: u64) -> bool {
        let mut at = self.filling;
        while len > 0 {
            if at == self.pipes.len() {
                if self.no_more || self.pipes.len() == MAX_PIPES {
                    return false;
                }
                match Pipe::new() {
                    Ok(p) => self.pipes.push(p),
                    Err(_) => {
                        self.no_more = true;
                        return false;
                    }
                }
            }
            let n = self.pipes[at].room_for(offset, len);
            offset += n;
            len -= n;
            if len > 0 {
                at += 1;
            }
        }
        true
    }

    /// Moves `len` bytes of `view` into the pipes (room made first with
    /// [`make_room`](Self::make_room)). `Ok(false)` when fewer were there
    /// to move (end of file) or the pipes filled up; on `Ok(false)` or an
    /// error they may hold a part (see [`ZeroCopy::give_up`]).
    pub fn fill(&mut self, view: FileView<'_>, len: u64) -> io::Result<bool> {
        let mut off = view.offset as libc::loff_t;
        let mut left = len;
        while left > 0 {
            let Some(pipe) = self.pipes.get_mut(self.filling) else {
                return Ok(false);
            };
            let n = pipe.room_for(off as u64, left);
            if n > 0 && !pipe.fill(view.fd, &mut off, n)? {
                return Ok(false);
            }
            left -= n;
            if left > 0 {
                self.filling += 1;
            }
        }
        Ok(true)
    }

    /// Moves `len` bytes from the pipes into `socket`, blocking as the
    /// socket needs. On an error the pipes must be dropped.
    pub fn drain(&mut self, socket: BorrowedFd<'_>, len: u64) -> io::Result<()> {
        let mut left = len;
        while left > 0 {
            let Some(pipe) = self.pipes.get_mut(self.draining) else {
                break;
            };
            left -= pipe.drain(socket, left)?;
            if pipe.held == 0 && self.draining < self.filling {
                self.draining += 1;
            }
        }
        if self.is_empty() {
            self.filling = 0;
            self.draining = 0;
        }
        Ok(())
    }

    /// Whether the pipes are empty (safe to keep for the next request).
    pub fn is_empty(&self) -> bool {
        self.pipes.iter().all(|p| p.held == 0)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// What `pipe` sends of `runs` (file offset, length) of `file`, filled
    /// all first and then drained run by run.
    fn through(pipe: &mut SplicePipe, file: &std::fs::File, runs: &[(u64, u64)]) -> Vec<u8> {
        for &(offset, len) in runs {
            assert!(pipe.make_room(offset, len), "{offset}+{len}");
            let view = FileView {
                fd: file.as_fd(),
                offset,
            };
            assert!(pipe.fill(view, len).unwrap());
        }
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got
        });
        for &(_, len) in runs {
            pipe.drain(a.as_fd(), len).unwrap();
        }
        drop(a);
        assert!(pipe.is_empty());
        reader.join().unwrap()
    }

    #[test]
    fn reads_larger_than_a_pipe_go_through_a_chain_of_pipes() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let want: Vec<u8> = (0..(6u32 << 20)).map(|i| (i % 253) as u8).collect();
        std::fs::write(f.path(), &want).unwrap();
        let file = std::fs::File::open(f.path()).unwrap();
        let mut pipe = SplicePipe::new().unwrap();
        let one = pipe.pipes[0].slots * PAGE;
        // 4 MiB, unaligned: several pipes, then the chain is reused.
        for round in 0..3 {
            let at = 1 + round * 4097;
            let got = through(&mut pipe, &file, &[(at, 4 << 20)]);
            assert!(got == want[at as usize..at as usize + (4 << 20)]);
        }
        assert!(pipe.pipes.len() > 1 || one >= 8 << 20, "one pipe of {one}");
        assert!(pipe.pipes.len() <= MAX_PIPES);
        // Runs of one reply across the pipes' boundaries, drained in turn.
        let runs = [(100, one - 50), (one + 7, 300 << 10), (3 << 20, one + 4096)];
        let got = through(&mut pipe, &file, &runs);
        let mut expect = Vec::new();
        for (o, l) in runs {
            expect.extend_from_slice(&want[o as usize..(o + l) as usize]);
        }
        assert!(got == expect);
        // More than the chain can hold is refused, and nothing is filled.
        assert!(!pipe.make_room(0, (MAX_PIPES as u64 + 1) * one));
        assert!(pipe.is_empty());
    }
}
