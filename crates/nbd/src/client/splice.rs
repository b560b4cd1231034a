//! Dropping read data the caller does not want (a copy into `null:`)
//! straight from the socket: spliced into a pipe and from there into
//! /dev/null, the kernel moves page references and no byte is copied.
//! Over TLS, or where splice is refused, the data is read into a small
//! buffer and dropped.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use diskit_core::Result;

/// How many bytes the pipe holds (and so one splice moves at most).
const PIPE_SIZE: usize = 1 << 20;
/// The buffer data is read into and dropped from when it cannot be spliced.
const SCRATCH: usize = 64 << 10;

/// A pipe and /dev/null, opened at the first use.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    null: OwnedFd,
    /// Bytes one splice into the pipe may move.
    size: usize,
}

impl Pipe {
    fn open() -> std::io::Result<Pipe> {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both descriptors are open and ours.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A larger pipe moves more per call; the default (64 KiB) if the
        // system refuses.
        // SAFETY: F_SETPIPE_SZ on a pipe we own.
        let set = unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                PIPE_SIZE as libc::c_int,
            )
        };
        let size = if set > 0 { set as usize } else { 64 << 10 };
        let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
        Ok(Pipe {
            read,
            write,
            null: null.into(),
            size,
        })
    }
}

/// Drops read data for one connection's reader.
pub(crate) struct Discarder {
    /// The plain socket the reader reads, when it is one.
    socket: Option<RawFd>,
    /// The pipe, once opened; `None` inside once splicing failed.
    pipe: Option<Option<Pipe>>,
    scratch: Vec<u8>,
}

impl Discarder {
    /// A discarder for a reader of `socket` (None: read and drop).
    pub(crate) fn new(socket: Option<RawFd>) -> Discarder {
        Discarder {
            socket,
            pipe: None,
            scratch: Vec::new(),
        }
    }

    /// Takes `len` bytes of reply data off `r` and drops them.
    pub(crate) fn discard<R: Read>(&mut self, r: &mut BufReader<R>, len: u64) -> Result<()> {
        // What the reader's buffer holds already goes first.
        let have = r.buffer().len().min(len.try_into().unwrap_or(usize::MAX));
        r.consume(have);
        let mut left = len - have as u64;
        if let Some(fd) = self.socket
            && left > 0
        {
            left = self.splice(fd, left)?;
        }
        while left > 0 {
            if self.scratch.is_empty() {
                self.scratch = vec![0; SCRATCH];
            }
            let n = left.min(SCRATCH as u64) as usize;
            r.get_mut().read_exact(&mut self.scratch[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Splices up to `left` bytes from `socket` into /dev/null; returns
    /// how many are left (all of them if splicing is not possible here).
    fn splice(&mut self, socket: RawFd, mut left: u64) -> Result<u64> {
        let pipe = self.pipe.get_or_insert_with(|| Pipe::open().ok());
        let Some(p) = pipe.as_ref() else {
            return Ok(left);
        };
        while left > 0 {
            let want = left.min(p.size as u64) as usize;
            // SAFETY: both descriptors are open; null offsets: both ends
            // are streams.
            let n = unsafe {
                libc::splice(
                    socket,
                    std::ptr::null_mut(),
                    p.write.as_raw_fd(),
                    std::ptr::null_mut(),
                    want,
                    libc::SPLICE_F_MOVE,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // Nothing moved yet on this call: read the rest.
                    Some(libc::EINVAL) | Some(libc::ENOSYS) => {
                        *pipe = None;
                        return Ok(left);
                    }
                    _ => return Err(e.into()),
                }
            }
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            drain(p, n as usize)?;
            left -= n as u64;
        }
        Ok(0)
    }
}

/// Moves `n` bytes from the pipe into /dev/null.
fn drain(p: &Pipe, mut n: usize) -> Result<()> {
    while n > 0 {
        // SAFETY: as in `Discarder::splice`.
        let k = unsafe {
            libc::splice(
                p.read.as_raw_fd(),
                std::ptr::null_mut(),
                p.null.as_raw_fd(),
                std::ptr::null_mut(),
                n,
                libc::SPLICE_F_MOVE,
            )
        };
        if k < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e.into());
        }
        if k == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
        }
        n -= k as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    /// Data after the dropped bytes is read intact, whether the bytes
    /// were spliced, read from the buffer, or read and dropped.
    #[test]
    fn discards_exactly_the_bytes_asked() {
        for splice in [true, false] {
            let (a, mut b) = UnixStream::pair().unwrap();
            let writer = std::thread::spawn(move || {
                let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
                b.write_all(&data).unwrap();
            });
            let fd = a.as_raw_fd();
            let mut r = BufReader::with_capacity(4096, a);
            let mut first = [0u8; 10];
            r.read_exact(&mut first).unwrap();
            let mut d = Discarder::new(splice.then_some(fd));
            d.discard(&mut r, 2_500_000).unwrap();
            let mut next = [0u8; 5];
            r.read_exact(&mut next).unwrap();
            let want: Vec<u8> = (2_500_010..2_500_015u32).map(|i| (i % 251) as u8).collect();
            assert_eq!(&next[..], &want[..], "splice={splice}");
            // Past the end of the stream: an error, not a hang.
            let e = d.discard(&mut r, 1_000_000).unwrap_err();
            assert!(!e.to_string().is_empty());
            writer.join().unwrap();
        }
    }
}
