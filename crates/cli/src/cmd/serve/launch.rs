//! Running a server once its command line is read, whichever tool's it is
//! (`serve`, nbdkit's; `qemu-nbd`): where it listens, the foreground or a
//! daemon, the pid file, the signals, the clean-up, and what ends it (a
//! signal, `--run`'s command, or the last client leaving).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::daemon;
use super::lifecycle::{self, Cleanup, Parts, RunEnv};
use super::listen::Listener;
use crate::CmdResult;
use crate::util::CliError;
use diskit_core::DeviceRef;
use diskit_nbd::server::Server;

/// Where to listen.
pub enum Place {
    /// A Unix socket at this path; `replace` removes a file already there
    /// first (as QEMU does), else binding over it fails (as nbdkit does).
    Unix {
        /// The socket's path.
        path: PathBuf,
        /// Whether a file at the path is removed first.
        replace: bool,
    },
    /// A Unix socket in a new private directory (nbdkit's `-U -`).
    PrivateUnix,
    /// A TCP port on an address.
    Tcp(IpAddr, u16),
}

/// A listening socket and what to remove with it.
pub struct Bound {
    /// The socket.
    pub listener: Listener,
    tempdir: Option<tempfile::TempDir>,
    /// The socket file made (absolute: the daemon runs in /), removed at
    /// the end.
    socket: Option<PathBuf>,
}

impl Bound {
    /// A socket passed by socket activation: nothing to remove.
    pub fn activated(listener: Listener) -> Bound {
        Bound {
            listener,
            tempdir: None,
            socket: None,
        }
    }

    /// Binds `place`.
    pub fn bind(place: Place) -> Result<Bound, CliError> {
        match place {
            Place::PrivateUnix => {
                let dir = tempfile::Builder::new()
                    .prefix("diskit")
                    .tempdir()
                    .map_err(|e| {
                        CliError::new(format!("cannot create a temporary directory: {e}"))
                    })?;
                let listener = Listener::unix(&dir.path().join("socket"))?;
                Ok(Bound {
                    listener,
                    tempdir: Some(dir),
                    socket: None,
                })
            }
            Place::Unix { path, replace } => {
                if replace {
                    let _ = std::fs::remove_file(&path);
                }
                let listener = Listener::unix(&path)?;
                let socket = absolute(&path).inspect_err(|_| {
                    let _ = std::fs::remove_file(&path);
                })?;
                Ok(Bound {
                    listener,
                    tempdir: None,
                    socket: Some(socket),
                })
            }
            Place::Tcp(addr, port) => Ok(Bound {
                listener: Listener::tcp(addr, port)?,
                tempdir: None,
                socket: None,
            }),
        }
    }

    /// Removes the socket file made, if any.
    fn remove_socket(&self) {
        if let Some(p) = &self.socket {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// How the server runs, once listening.
#[derive(Default)]
pub struct Plan {
    /// Stay in the foreground; else fork into the background once
    /// listening and return when the daemon serves.
    pub foreground: bool,
    /// The daemon keeps the caller's standard error (else /dev/null).
    pub keep_stderr: bool,
    /// Write the server's pid here once it serves.
    pub pidfile: Option<PathBuf>,
    /// Remove the pid file when the server stops (nbdkit does, qemu-nbd
    /// leaves it).
    pub remove_pidfile: bool,
    /// Print the URI clients connect to, once listening.
    pub print_uri: bool,
    /// Log what is served and, when the server stops, each export's
    /// counters.
    pub verbose: bool,
    /// What is served, for the verbose log.
    pub what: String,
    /// The export's name, for the URI.
    pub export_name: String,
    /// Whether clients must use TLS (the URI is nbds then).
    pub tls_required: bool,
    /// `$tls` for `--run`'s command.
    pub tls_env: Option<&'static str>,
    /// Run this shell command, serve while it runs, exit with its status.
    pub run: Option<String>,
    /// Stop once a client that entered transmission leaves and no other is
    /// connected (qemu-nbd without `--persistent`).
    pub until_last_client: bool,
}

/// Serves on `bound` as `plan` says; `build` opens what is served (in the
/// daemon, after the fork: it may start threads) and makes the server,
/// returning it and the device stack to close when it stops.
pub fn serve(
    bound: Bound,
    plan: Plan,
    build: impl FnOnce() -> Result<(Arc<Server>, DeviceRef), CliError>,
) -> CmdResult {
    let uri = super::tls::uri(bound.listener.uri(&plan.export_name), plan.tls_required);
    // The daemon runs in / once ready: the files it writes or removes need
    // absolute paths.
    let pidfile = plan.pidfile.as_deref().map(absolute).transpose()?;
    // The daemon forks before the device opens: a plugin may start threads
    // (the nbd plugin's connections), which a fork would leave behind.
    let ready = if plan.foreground {
        None
    } else {
        let daemon = daemon::daemonize(plan.keep_stderr, || {
            if plan.print_uri {
                println!("{uri}");
            }
        });
        match daemon {
            Ok(r) => Some(r),
            Err(e) => {
                bound.remove_socket();
                return Err(e);
            }
        }
    };
    // Stop signals wait for the cleanup in every thread, the device's too.
    lifecycle::block_signals();
    let (server, stack) = build().inspect_err(|_| bound.remove_socket())?;
    let Bound {
        listener,
        tempdir,
        socket,
    } = bound;
    let cleanup = Arc::new(Cleanup::new(Parts {
        device: Some(stack),
        socket,
        tempdir,
        pidfile: pidfile.clone().filter(|_| plan.remove_pidfile),
        on_stop: plan.verbose.then(|| {
            let s = server.clone();
            Box::new(move || report_exports(&s)) as Box<dyn FnOnce() + Send>
        }),
    }));
    lifecycle::handle_signals(cleanup.clone());
    // A layer that stops the server (exitlast, exitwhen) stops it as a
    // signal does, once its clients have gone.
    let c = cleanup.clone();
    server.start(move || {
        c.run();
        std::process::exit(0);
    });
    if let Some(p) = &pidfile
        && let Err(e) = lifecycle::write_pidfile(p)
    {
        cleanup.run();
        return Err(e);
    }
    if plan.until_last_client {
        let c = cleanup.clone();
        server.on_last_client(move || {
            c.run();
            std::process::exit(0);
        });
    }
    if plan.foreground && plan.print_uri {
        println!("{uri}");
    }
    if plan.verbose {
        eprintln!("{}: serving {} at {uri}", crate::names::prog(), plan.what);
    }
    if let Some(r) = ready {
        r.signal();
    }

    let env = RunEnv {
        uri,
        unixsocket: listener
            .socket_path()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default(),
        port: listener.port().map(|p| p.to_string()).unwrap_or_default(),
        exportname: plan.export_name.clone(),
        tls: plan.tls_env,
    };
    match &plan.run {
        Some(cmd) => {
            let s = server.clone();
            std::thread::spawn(move || accept_loop(&s, listener));
            let status = lifecycle::run_captive(cmd, &env);
            // Let connections the command left behind finish (and log).
            server.wait_idle(Duration::from_secs(5));
            cleanup.run();
            status
        }
        None => {
            let e = accept_loop(&server, listener);
            cleanup.run();
            Err(e)
        }
    }
}

/// Logs each export's request counters (at -v, when the server stops).
pub fn report_exports(server: &Server) {
    for e in server.exports().iter() {
        let snap = e.stats().snapshot();
        eprintln!(
            "{}: export '{}': {} connections, {}",
            crate::names::prog(),
            e.name(),
            snap.connections,
            snap.summary()
        );
    }
}

/// `p` made absolute against the current directory.
fn absolute(p: &Path) -> Result<PathBuf, CliError> {
    std::path::absolute(p).map_err(|e| CliError::new(format!("{}: {e}", p.display())))
}

/// Accepts connections until the listener fails.
fn accept_loop(server: &Arc<Server>, listener: Listener) -> CliError {
    let r = match listener {
        Listener::Unix(l, _) => server.serve_unix(l),
        Listener::Tcp(l) => server.serve_tcp(l),
    };
    match r {
        Ok(()) => CliError::new("listener closed"),
        Err(e) => CliError::new(format!("accept: {e}")),
    }
}
