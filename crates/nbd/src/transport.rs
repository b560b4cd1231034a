//! Byte streams a connection runs over. The handshake uses the stream
//! whole; transmission splits it into a read half (the request reader) and
//! a write half (shared by the workers). A TLS layer is one more
//! [`Transport`]: STARTTLS wraps the plain stream and the rest of the
//! server does not change. The client's TLS sessions run over the same
//! trait ([`crate::tls`]).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// The two halves of a transport, and a way to end it from either side.
pub struct Halves {
    /// Where requests come from.
    pub reader: Box<dyn Read + Send>,
    /// Where replies go.
    pub writer: Box<dyn Write + Send>,
    /// Shuts the connection down both ways (unblocks the reader).
    pub shutdown: Box<dyn Fn() + Send + Sync>,
    /// The socket under `writer` when bytes written to it go to the client
    /// as they are (no TLS): zero-copy reads splice into it, after
    /// flushing `writer`.
    pub splice_to: Option<OwnedFd>,
}

/// The send buffer asked for on Unix sockets (the kernel caps it at
/// net.core.wmem_max, 208 KiB by default). On a Unix socket the sender's
/// buffer is all that is queued for the client, and the default holds a
/// fifth of a 1 MiB read: the server then waits for the client to drain it
/// four times per reply. Room for whole replies doubled sequential read
/// throughput. (TCP sizes its buffers itself; setting one would stop that.)
const UNIX_SEND_BUFFER: libc::c_int = 4 << 20;

/// Asks for a send buffer of [`UNIX_SEND_BUFFER`]; a refusal leaves the
/// default, which works, only slower.
fn grow_send_buffer(sock: &UnixStream) {
    let size = UNIX_SEND_BUFFER;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a valid
    // pointer to an int; the descriptor is open.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// A bidirectional byte stream to one client.
pub trait Transport: Read + Write + Send {
    /// Splits the stream for transmission.
    fn split(self: Box<Self>) -> io::Result<Halves>;

    /// Who is at the other end, for logs.
    fn peer(&self) -> String;

    /// Who is at the other end, for the checks of the layers served (see
    /// [`diskit_core::BlockDevice::preconnect`]): unknown by default.
    fn peer_info(&self) -> diskit_core::Peer {
        diskit_core::Peer::Other
    }
}

/// The credentials of the process at the other end of a Unix socket.
fn unix_peer(sock: &UnixStream) -> diskit_core::Peer {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a ucred; the
    // descriptor is open.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return diskit_core::Peer::Unix {
            pid: None,
            uid: None,
            gid: None,
        };
    }
    diskit_core::Peer::Unix {
        pid: u32::try_from(cred.pid).ok(),
        uid: Some(cred.uid),
        gid: Some(cred.gid),
    }
}

/// A socket written with MSG_NOSIGNAL: a server that goes away is an
/// EPIPE error for the request, not a SIGPIPE that ends the whole process
/// (the command line keeps SIGPIPE's default for its standard output).
pub(crate) struct NoSigPipe<S>(pub(crate) S);

impl<S: std::os::fd::AsRawFd> NoSigPipe<S> {
    pub(crate) fn send(fd: &S, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        // SAFETY: an msghdr of zeros is valid; it points at `bufs`, whose
        // IoSlices are laid out as iovecs and outlive the call.
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = bufs.len() as _;
            libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
        };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

impl<S: std::os::fd::AsRawFd> Write for NoSigPipe<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Self::send(&self.0, &[std::io::IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        Self::send(&self.0, bufs)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The halves of a socket: itself to read, a clone to write, another to
/// shut both directions down, and its descriptor for splicing.
fn socket_halves<S>(
    sock: Box<S>,
    clone: fn(&S) -> io::Result<S>,
    close: fn(&S),
) -> io::Result<Halves>
where
    S: Read + Write + AsFd + AsRawFd + Send + Sync + 'static,
{
    let writer = NoSigPipe(clone(&sock)?);
    let closer = clone(&sock)?;
    let splice_to = Some(sock.as_fd().try_clone_to_owned()?);
    Ok(Halves {
        reader: sock,
        writer: Box::new(writer),
        shutdown: Box::new(move || close(&closer)),
        splice_to,
    })
}

impl Transport for UnixStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        grow_send_buffer(&self);
        socket_halves(self, UnixStream::try_clone, |s| {
            let _ = s.shutdown(Shutdown::Both);
        })
    }

    fn peer(&self) -> String {
        String::from("unix socket")
    }

    fn peer_info(&self) -> diskit_core::Peer {
        unix_peer(self)
    }
}

impl Transport for TcpStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        socket_halves(self, TcpStream::try_clone, |s| {
            let _ = s.shutdown(Shutdown::Both);
        })
    }

    fn peer(&self) -> String {
        self.peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| String::from("tcp"))
    }

    fn peer_info(&self) -> diskit_core::Peer {
        match self.peer_addr() {
            Ok(a) => diskit_core::Peer::Ip(a.ip()),
            Err(_) => diskit_core::Peer::Other,
        }
    }
}

/// A transport made of two separate streams: stdin/stdout, a pipe pair,
/// or in-memory buffers (tests, fuzzing). Shutting it down does nothing:
/// the streams end when dropped.
pub struct Pipe<R, W> {
    reader: R,
    writer: W,
    name: String,
}

impl<R, W> Pipe<R, W> {
    /// A transport reading `reader` and writing `writer`.
    pub fn new(reader: R, writer: W, name: impl Into<String>) -> Pipe<R, W> {
        Pipe {
            reader,
            writer,
            name: name.into(),
        }
    }
}

impl<R: Read, W> Read for Pipe<R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl<R, W: Write> Write for Pipe<R, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}

impl<R: Read + Send + 'static, W: Write + Send + 'static> Transport for Pipe<R, W> {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        Ok(Halves {
            reader: Box::new(self.reader),
            writer: Box::new(self.writer),
            shutdown: Box::new(|| {}),
            splice_to: None,
        })
    }

    fn peer(&self) -> String {
        self.name.clone()
    }
}
