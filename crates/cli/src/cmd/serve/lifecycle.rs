//! The life of a `diskit serve` process: clean-up that runs exactly once
//! (on a signal, or when `--run`'s command ends), signal handling, the pid
//! file, and the captive command.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use crate::util::CliError;
use diskit_core::DeviceRef;

/// What to undo when the server stops.
#[derive(Default)]
pub struct Cleanup {
    inner: Mutex<Option<Parts>>,
}

/// The pieces of [`Cleanup`].
#[derive(Default)]
pub struct Parts {
    /// The served device stack, closed when the server stops: its filters
    /// finalize, then the plugin's device (an image writes back its
    /// metadata).
    pub device: Option<DeviceRef>,
    /// A socket file to remove.
    pub socket: Option<PathBuf>,
    /// A private directory (for `-U -`) to remove.
    pub tempdir: Option<tempfile::TempDir>,
    /// A pid file to remove.
    pub pidfile: Option<PathBuf>,
    /// Runs first (the per-export report at -v).
    pub on_stop: Option<Box<dyn FnOnce() + Send>>,
}

impl Cleanup {
    /// Clean-up of `parts`.
    pub fn new(parts: Parts) -> Cleanup {
        Cleanup {
            inner: Mutex::new(Some(parts)),
        }
    }

    /// Closes the device stack and removes the files; later calls do
    /// nothing.
    pub fn run(&self) {
        let parts = diskit_core::sync::lock(&self.inner).take();
        let Some(mut p) = parts else { return };
        if let Some(f) = p.on_stop.take() {
            f();
        }
        if let Some(d) = &p.device
            && let Err(e) = d.close()
        {
            eprintln!("{}: closing {}: {e}", crate::names::prog(), d.describe());
        }
        if let Some(s) = &p.socket {
            let _ = std::fs::remove_file(s);
        }
        if let Some(f) = &p.pidfile {
            let _ = std::fs::remove_file(f);
        }
        drop(p.tempdir);
    }
}

/// The signals that stop the server (and run its cleanup).
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread and every thread it
/// starts later, so that they wait for [`handle_signals`] rather than kill
/// the process without its cleanup. Call before starting any thread (the
/// plugin's included). (Commands started later get an empty mask back:
/// std resets it in the child.)
pub fn block_signals() {
    let set = stop_signals();
    // SAFETY: pthread_sigmask only changes this thread's mask; `set` is
    // initialised.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Starts a thread that waits for SIGINT, SIGTERM or SIGHUP, runs
/// `cleanup` and exits. The signals must have been blocked, by
/// [`block_signals`], in every thread started before.
pub fn handle_signals(cleanup: Arc<Cleanup>) {
    block_signals();
    let set = stop_signals();
    std::thread::spawn(move || {
        let mut sig: libc::c_int = 0;
        // SAFETY: `set` is an initialised signal set and `sig` a valid out pointer.
        let rc = unsafe { libc::sigwait(&set, &mut sig) };
        if rc == 0 {
            cleanup.run();
            std::process::exit(0);
        }
    });
}

/// Ignores SIGPIPE (which `main` sets back to the default for the other
/// commands): a client that goes away while its reply is written must end
/// its connection with EPIPE, not the server. Spliced replies and writes
/// to Unix sockets cannot ask for MSG_NOSIGNAL. Commands started later get
/// the default back (std resets it in the child).
pub fn ignore_sigpipe() {
    // SAFETY: setting a disposition to SIG_IGN has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// Writes this process's id to `path`.
pub fn write_pidfile(path: &PathBuf) -> Result<(), CliError> {
    std::fs::write(path, format!("{}\n", std::process::id())).map_err(|e| {
        CliError::new(format!(
            "cannot write pid file {}: {}",
            path.display(),
            crate::util::strerror(&e)
        ))
    })
}

/// The variables `--run` sets for its command.
pub struct RunEnv {
    /// The NBD URI.
    pub uri: String,
    /// The Unix socket path ("" for TCP).
    pub unixsocket: String,
    /// The TCP port ("" for Unix sockets).
    pub port: String,
    /// The export name.
    pub exportname: String,
    /// `$tls`: "1" (on) or "2" (require); unset when TLS is off.
    pub tls: Option<&'static str>,
}

/// Runs `cmd` with /bin/sh and returns its exit status (128+N when killed
/// by signal N), as nbdkit's captive mode does.
pub fn run_captive(cmd: &str, env: &RunEnv) -> Result<u8, CliError> {
    use std::os::unix::process::ExitStatusExt;
    let mut sh = Command::new("/bin/sh");
    sh.arg("-c")
        .arg(cmd)
        .env("uri", &env.uri)
        .env("nbd", &env.uri)
        .env("unixsocket", &env.unixsocket)
        .env("port", &env.port)
        .env("exportname", &env.exportname);
    // Unset, not inherited, when TLS is off.
    match env.tls {
        Some(v) => sh.env("tls", v),
        None => sh.env_remove("tls"),
    };
    let status = sh
        .status()
        .map_err(|e| CliError::new(format!("--run: cannot start /bin/sh: {e}")))?;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => (128 + sig) as u8,
        _ => 1,
    })
}

/// Asks the kernel to send SIGTERM (which stops the server cleanly) when
/// the parent process exits; fails at once if it already has.
pub fn exit_with_parent() -> Result<(), CliError> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number; no pointers.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) };
    if r != 0 {
        return Err(CliError::new(format!(
            "--exit-with-parent: {}",
            std::io::Error::last_os_error()
        )));
    }
    // The parent may have gone before the request was made.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } == 1 {
        return Err(CliError::new(
            "--exit-with-parent: the parent has already exited",
        ));
    }
    Ok(())
}
