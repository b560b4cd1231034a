//! Where `diskit serve` listens, and the NBD URI that reaches it.

use std::net::{IpAddr, TcpListener};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use crate::util::CliError;

/// The default NBD port.
pub const NBD_PORT: u16 = 10809;

/// A bound listening socket.
pub enum Listener {
    /// A Unix socket at a path.
    Unix(UnixListener, PathBuf),
    /// A TCP socket.
    Tcp(TcpListener),
}

impl Listener {
    /// Binds a Unix socket at `path`.
    pub fn unix(path: &Path) -> Result<Listener, CliError> {
        let l = UnixListener::bind(path).map_err(|e| {
            CliError::new(format!(
                "cannot listen on {}: {}",
                path.display(),
                crate::util::strerror(&e)
            ))
        })?;
        Ok(Listener::Unix(l, path.to_path_buf()))
    }

    /// Binds TCP `port` (0: any free port) on `addr`.
    pub fn tcp(addr: IpAddr, port: u16) -> Result<Listener, CliError> {
        let l = TcpListener::bind((addr, port)).map_err(|e| {
            CliError::new(format!(
                "cannot listen on {addr} port {port}: {}",
                crate::util::strerror(&e)
            ))
        })?;
        Ok(Listener::Tcp(l))
    }

    /// Whether a socket was passed to this process by socket activation
    /// (LISTEN_PID is this process and LISTEN_FDS at least 1).
    pub fn activation_pending() -> bool {
        let pid = std::env::var("LISTEN_PID").ok();
        let fds = std::env::var("LISTEN_FDS").ok();
        let ours = pid.and_then(|p| p.parse::<u32>().ok()) == Some(std::process::id());
        ours && fds.and_then(|n| n.parse::<u32>().ok()).unwrap_or(0) > 0
    }

    /// The socket passed by systemd-style socket activation (LISTEN_PID is
    /// this process, LISTEN_FDS ≥ 1: the socket is descriptor 3), if any.
    /// The variables are removed so that children do not see them.
    pub fn from_socket_activation() -> Result<Option<Listener>, CliError> {
        if !Self::activation_pending() {
            return Ok(None);
        }
        // SAFETY: called before any other thread exists (serve sets up
        // listening first), so nothing reads the environment concurrently.
        unsafe {
            std::env::remove_var("LISTEN_PID");
            std::env::remove_var("LISTEN_FDS");
            std::env::remove_var("LISTEN_FDNAMES");
        }
        const FD: RawFd = 3;
        // SAFETY: getsockname on a descriptor number only reads its state;
        // the buffer is a zeroed sockaddr_storage of the length passed.
        let family = unsafe {
            let mut addr: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            if libc::getsockname(FD, (&raw mut addr).cast(), &mut len) != 0 {
                return Err(CliError::new(
                    "LISTEN_FDS is set but descriptor 3 is not a socket",
                ));
            }
            i32::from(addr.ss_family)
        };
        // SAFETY: the activation protocol hands descriptor 3 to this process,
        // and nothing else in it owns that descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(FD) };
        Ok(Some(if family == libc::AF_UNIX {
            let l = UnixListener::from(fd);
            let path = l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(Path::to_path_buf))
                .unwrap_or_default();
            Listener::Unix(l, path)
        } else {
            Listener::Tcp(TcpListener::from(fd))
        }))
    }

    /// The Unix socket path, if any.
    pub fn socket_path(&self) -> Option<&Path> {
        match self {
            Listener::Unix(_, p) => Some(p),
            Listener::Tcp(_) => None,
        }
    }

    /// The TCP port actually bound, if any.
    pub fn port(&self) -> Option<u16> {
        match self {
            Listener::Tcp(l) => l.local_addr().ok().map(|a| a.port()),
            Listener::Unix(..) => None,
        }
    }

    /// The URI of `export` on this listener (doc/uri.md of the NBD project).
    pub fn uri(&self, export: &str) -> String {
        let export = percent_encode(export, true);
        match self {
            Listener::Unix(_, p) => format!(
                "nbd+unix:///{export}?socket={}",
                percent_encode(&p.to_string_lossy(), true)
            ),
            Listener::Tcp(l) => {
                let addr = l.local_addr().ok();
                let host = match addr.map(|a| a.ip()) {
                    Some(ip) if !ip.is_unspecified() && !ip.is_loopback() => match ip {
                        IpAddr::V6(v6) => format!("[{v6}]"),
                        IpAddr::V4(v4) => v4.to_string(),
                    },
                    _ => String::from("localhost"),
                };
                match addr.map(|a| a.port()) {
                    Some(NBD_PORT) | None => format!("nbd://{host}/{export}"),
                    Some(port) => format!("nbd://{host}:{port}/{export}"),
                }
            }
        }
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters (and '/'
/// when `keep_slash`).
fn percent_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        let dir = tempfile::tempdir().unwrap();
        let l = Listener::unix(&dir.path().join("s ock")).unwrap();
        let uri = l.uri("my disk");
        assert!(uri.starts_with("nbd+unix:///my%20disk?socket=/"), "{uri}");
        assert!(uri.ends_with("/s%20ock"), "{uri}");
        let l = Listener::tcp("127.0.0.1".parse().unwrap(), 0).unwrap();
        let port = l.port().unwrap();
        assert_eq!(l.uri(""), format!("nbd://localhost:{port}/"));
    }
}
