//! A server run as a subprocess for one client, as libnbd's
//! `nbd_connect_systemd_socket_activation` does (nbdcopy's and nbdinfo's
//! `[ CMD ARGS ... ]`): a listening Unix socket in a private directory is
//! passed to the command as descriptor 3 with `LISTEN_PID` and
//! `LISTEN_FDS=1`, and the client connects to it. Closing the client
//! sends the server SIGTERM and waits for it.

use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use diskit_core::sync::lock;
use diskit_core::{Error, Result};

/// The descriptor socket activation passes the first socket as.
const FIRST_FD: i32 = 3;

/// A running server subprocess and the directory of its socket.
pub struct Subprocess {
    child: Mutex<Option<Child>>,
    /// The private directory of its socket (none for a server on its
    /// standard input and output).
    dir: Option<PathBuf>,
    socket: PathBuf,
    /// The command, for messages.
    pub name: String,
}

/// Starts `argv` as a socket-activated server and connects to it.
pub fn spawn(argv: &[String]) -> Result<(Subprocess, UnixStream)> {
    let sub = start(argv)?;
    let stream = UnixStream::connect(&sub.socket)
        .map_err(|e| Error::from(e).context(format!("connecting to '{}'", sub.name)))?;
    Ok((sub, stream))
}

/// Starts `argv` as a socket-activated server; clients connect to
/// [`Subprocess::socket`].
pub fn start(argv: &[String]) -> Result<Subprocess> {
    let Some(program) = argv.first() else {
        return Err(Error::invalid("an empty server command"));
    };
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "diskit-sa-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| Error::from(e).context(format!("creating '{}'", dir.display())))?;
    let cleanup = |e: Error| {
        let _ = std::fs::remove_dir_all(&dir);
        e
    };
    let path = dir.join("sock");
    let listener = UnixListener::bind(&path).map_err(|e| cleanup(e.into()))?;
    let fd = listener.as_raw_fd();
    let mut cmd = Command::new("/bin/sh");
    // LISTEN_PID must be the server's own pid: the shell's, which exec
    // hands on to the command.
    cmd.arg("-c")
        .arg("LISTEN_PID=$$; export LISTEN_PID; exec \"$@\"")
        .arg(program)
        .args(argv)
        .env("LISTEN_FDS", "1")
        .env_remove("LISTEN_FDNAMES");
    // SAFETY: between fork and exec the closure calls only dup2 and fcntl,
    // which are async-signal-safe, and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            if fd == FIRST_FD {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, FIRST_FD) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| cleanup(Error::from(e).context(format!("running '{program}'"))))?;
    drop(listener);
    Ok(Subprocess {
        child: Mutex::new(Some(child)),
        socket: path,
        dir: Some(dir),
        name: argv.join(" "),
    })
}

/// Starts `argv` as a server talking NBD on its standard input and
/// output (libnbd's `nbd_connect_command`, `nbdkit -s`), and returns the
/// other end of that socket.
pub fn spawn_stdio(argv: &[String]) -> Result<(Subprocess, UnixStream)> {
    let Some(program) = argv.first() else {
        return Err(Error::invalid("an empty server command"));
    };
    let (ours, theirs) = UnixStream::pair()?;
    let stdin = theirs.try_clone()?;
    let child = Command::new(program)
        .args(&argv[1..])
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(stdin)))
        .stdout(std::process::Stdio::from(std::os::fd::OwnedFd::from(
            theirs,
        )))
        .spawn()
        .map_err(|e| Error::from(e).context(format!("running '{program}'")))?;
    Ok((
        Subprocess {
            child: Mutex::new(Some(child)),
            socket: PathBuf::new(),
            dir: None,
            name: argv.join(" "),
        },
        ours,
    ))
}

impl Subprocess {
    /// The socket the server listens on: more clients may connect while it
    /// runs.
    /// (Empty for a server on its standard input and output.)
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// Stops the server (SIGTERM) and waits for it.
    pub fn stop(&self) {
        if let Some(mut child) = lock(&self.child).take() {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let _ = child.wait();
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Drop for Subprocess {
    fn drop(&mut self) {
        self.stop();
    }
}
