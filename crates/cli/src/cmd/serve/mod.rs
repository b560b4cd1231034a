//! `diskit serve`: an NBD server with nbdkit's command line.
//!
//! `diskit serve [-U SOCKET | -U - | -p PORT [-i ADDR] | -s] [-r] [-e NAME]
//! [-f] [-v] [--print-uri] [-P PIDFILE] [--run CMD] [--timeout SECS]
//! [--max-connections N] [--filter=NAME]... PLUGIN [ARGS] [key=value]...`
//!
//! Filters (see [`filters`]) stack over the plugin's device, the first
//! `--filter` closest to the client; their `key=value` parameters mix with
//! the plugin's, as in nbdkit.
//!
//! Without -U, -p or -s, a socket passed by systemd-style socket
//! activation (LISTEN_PID/LISTEN_FDS) is used when there is one.
//! Without -f, --run, -s or socket activation the server forks into the
//! background once it listens (see [`daemon`]).

mod compat;
mod daemon;
mod filters;
pub mod introspect;
mod lifecycle;
mod listen;
mod plugin;
mod tls;

use std::fs::File;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::CmdResult;
use crate::util::CliError;
use diskit_core::DeviceRef;
use diskit_filters::FilterSpec;
use diskit_nbd::server::{Export, ExportSet, Pipe, Server, ServerConfig};
use lifecycle::{Cleanup, Parts, RunEnv};
use listen::{Listener, NBD_PORT};

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
#[command(after_help = plugin_help())]
pub struct Args {
    /// Listen on a Unix socket ("-": a private socket in a new temporary directory).
    #[arg(
        short = 'U',
        long = "unix",
        value_name = "SOCKET",
        allow_hyphen_values = true
    )]
    unix: Option<String>,
    /// Listen on this TCP port (default 10809 when no Unix socket is given).
    #[arg(short = 'p', long = "port")]
    port: Option<u16>,
    /// Listen on this address only (default: every IPv4 address).
    #[arg(short = 'i', long = "ipaddr", value_name = "ADDR")]
    ipaddr: Option<IpAddr>,
    /// Serve one client on stdin/stdout.
    #[arg(short = 's', long = "single", conflicts_with_all = ["unix", "port", "run"])]
    single: bool,
    /// Serve read-only.
    #[arg(short = 'r', long = "readonly", alias = "read-only")]
    readonly: bool,
    /// The export's name (clients asking for "" get it too).
    #[arg(
        short = 'e',
        long = "exportname",
        alias = "export-name",
        default_value = ""
    )]
    exportname: String,
    /// A description of the export, shown by nbdinfo.
    #[arg(long = "description", value_name = "TEXT")]
    description: Option<String>,
    /// Stay in the foreground (the default is to fork into the background
    /// once listening, unless --run, -s or socket activation is used).
    #[arg(short = 'f', long = "foreground")]
    foreground: bool,
    /// Cut off clients that have not finished the handshake after this
    /// many seconds (0: never).
    #[arg(long = "timeout", value_name = "SECS", default_value_t = 60)]
    timeout: u64,
    /// Serve at most this many connections at once; more are closed as
    /// soon as they are accepted (0: no limit).
    #[arg(
        long = "max-connections",
        alias = "shared",
        value_name = "N",
        default_value_t = 0
    )]
    max_connections: usize,
    /// Log one line per connection to stderr.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
    /// Print the URI clients connect to, once listening.
    #[arg(long = "print-uri")]
    print_uri: bool,
    /// Write the process id to this file once listening.
    #[arg(short = 'P', long = "pidfile", alias = "pid-file", value_name = "FILE")]
    pidfile: Option<PathBuf>,
    /// Run this shell command with $uri, $nbd, $unixsocket, $port,
    /// $exportname and $tls set, serve while it runs, and exit with its
    /// status.
    #[arg(long = "run", value_name = "CMD")]
    run: Option<String>,
    /// Exit when the parent process exits (implies staying in the
    /// foreground), as nbdkit's option.
    #[arg(long = "exit-with-parent")]
    exit_with_parent: bool,
    /// TLS options.
    #[command(flatten)]
    tls: tls::TlsArgs,
    /// nbdkit's options with nothing else to do here.
    #[command(flatten)]
    nbdkit: compat::NbdkitArgs,
    /// A filter over the plugin (repeatable; the first is the outermost,
    /// closest to the client). Its key=value parameters go with the plugin's.
    #[arg(long = "filter", value_name = "NAME")]
    filters: Vec<String>,
    /// Worker threads per connection.
    #[arg(short = 't', long = "threads", default_value_t = 16)]
    threads: usize,
    /// The plugin: file, nbd, http, curl, rbd, memory, null, pattern,
    /// image, and the other sources diskit reaches.
    plugin: String,
    /// The plugin's arguments: a bare value for its main parameter, and key=value pairs.
    args: Vec<String>,
}

fn plugin_help() -> String {
    plugin::help() + &filters::help()
}

/// `serve`'s command with nbdkit's other spellings of its options.
pub fn command(cmd: clap::Command) -> clap::Command {
    compat::aliases(cmd)
}

/// Runs `serve`.
pub fn run(a: Args, policy: crate::util::OpenPolicy) -> CmdResult {
    if a.unix.is_some() && a.port.is_some() {
        return Err(CliError::usage(
            "serve",
            "-U and -p cannot be used together",
        ));
    }
    if a.single && Listener::activation_pending() {
        return Err(CliError::new(
            "-s cannot be used with socket activation (a socket was passed in LISTEN_FDS)",
        ));
    }
    a.nbdkit.check(a.ipaddr)?;
    if a.exit_with_parent {
        lifecycle::exit_with_parent()?;
    }
    let routed = filters::route(&a.plugin, &a.filters, &a.args)?;
    a.nbdkit.apply_log()?;
    lifecycle::ignore_sigpipe();

    if a.single {
        let (server, stack) = build(&a, &routed, &policy)?;
        let r = serve_stdio(&server, &stack);
        if a.verbose {
            report_exports(&server);
        }
        return r;
    }

    let mut tempdir = None;
    let mut created_socket = None;
    let label = a.nbdkit.label_sockets()?;
    let activated = if a.unix.is_none() && a.port.is_none() {
        Listener::from_socket_activation()?
    } else {
        None
    };
    let activated_socket = activated.is_some();
    let listener = match (&a.unix, a.port) {
        _ if activated.is_some() => activated.expect("checked"),
        (Some(u), _) if u == "-" => {
            let dir = tempfile::Builder::new()
                .prefix("diskit")
                .tempdir()
                .map_err(|e| CliError::new(format!("cannot create a temporary directory: {e}")))?;
            let path = dir.path().join("socket");
            tempdir = Some(dir);
            Listener::unix(&path)?
        }
        (Some(u), _) => {
            let l = Listener::unix(Path::new(u))?;
            created_socket = Some(PathBuf::from(u));
            l
        }
        (None, port) => Listener::tcp(
            a.ipaddr.unwrap_or(a.nbdkit.default_addr()),
            port.unwrap_or(NBD_PORT),
        )?,
    };
    drop(label);
    let foreground = a.foreground || a.run.is_some() || activated_socket || a.exit_with_parent;
    // The daemon runs in / once ready: the files it removes need absolute
    // paths.
    let pidfile = a.pidfile.as_deref().map(absolute).transpose()?;
    let socket = created_socket.as_deref().map(absolute).transpose()?;
    let remove_socket = || {
        if let Some(p) = &socket {
            let _ = std::fs::remove_file(p);
        }
    };

    let uri = tls::uri(listener.uri(&a.exportname), a.tls.required());
    // The daemon forks before the plugin opens: a plugin may start threads
    // (the nbd plugin's connections), which a fork would leave behind.
    let ready = if foreground {
        None
    } else {
        let daemon = daemon::daemonize(a.verbose, || {
            if a.print_uri {
                println!("{uri}");
            }
        });
        match daemon {
            Ok(r) => Some(r),
            Err(e) => {
                remove_socket();
                return Err(e);
            }
        }
    };
    // Stop signals wait for the cleanup in every thread, the plugin's too.
    lifecycle::block_signals();
    let (server, stack) = build(&a, &routed, &policy).inspect_err(|_| remove_socket())?;
    let cleanup = Arc::new(Cleanup::new(Parts {
        device: Some(stack),
        socket,
        tempdir,
        pidfile: pidfile.clone(),
        on_stop: a.verbose.then(|| {
            let s = server.clone();
            Box::new(move || report_exports(&s)) as Box<dyn FnOnce() + Send>
        }),
    }));
    lifecycle::handle_signals(cleanup.clone());
    if let Some(p) = &pidfile
        && let Err(e) = lifecycle::write_pidfile(p)
    {
        cleanup.run();
        return Err(e);
    }
    if foreground && a.print_uri {
        println!("{uri}");
    }
    if a.verbose {
        eprintln!("{}: serving {} at {uri}", crate::names::prog(), a.plugin);
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
        exportname: a.exportname.clone(),
        tls: a.tls.env_value(),
    };
    match &a.run {
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

/// Opens the plugin, stacks the filters over it and makes the server;
/// returns the stack's top, to close when the server stops (filters
/// finalize, then the plugin's device: an image writes back its metadata).
fn build(
    a: &Args,
    routed: &filters::Routed,
    policy: &crate::util::OpenPolicy,
) -> Result<(Arc<Server>, DeviceRef), CliError> {
    let tls = a.tls.config()?;
    // Under a filter that never writes below (cow) the plugin opens
    // read-only, as nbdkit opens it: a read-only file serves.
    let plugin_readonly = a.readonly || routed.filters.iter().any(FilterSpec::reads_only_below);
    let opened = plugin::open_plugin(&a.plugin, &routed.plugin_args, plugin_readonly, policy)?;
    let device = match filters::stack(&routed.filters, opened.device.clone(), a.readonly) {
        Ok(d) => d,
        Err(e) => {
            if let Some(img) = opened.image {
                // Best effort: the stacking error is the one to report.
                let _ = img.close();
            }
            return Err(e);
        }
    };
    let stack = device.clone();
    // A bitmap describes the image's offsets: the export's must be the
    // same (no filter that moves or cuts them).
    if !opened.bitmaps.is_empty() && device.size() != opened.device.size() {
        // Best effort: closes the filters and the image below them.
        let _ = device.close();
        return Err(CliError::new(
            "bitmap: the filters change the export's size, and a dirty bitmap describes the image's bytes",
        ));
    }
    let mut exports = ExportSet::new();
    exports.add(
        Export::new(a.exportname.clone(), device)
            .with_read_only(a.readonly)
            .with_description(a.description.clone().unwrap_or_default())
            .with_allocation_depth(opened.allocation_depth)
            .with_bitmaps(opened.bitmaps),
    );
    let mut server = Server::new(
        exports,
        ServerConfig {
            threads: a.threads,
            verbose: a.verbose,
            handshake_timeout: (a.timeout > 0).then(|| Duration::from_secs(a.timeout)),
            max_connections: a.max_connections,
            ..ServerConfig::default()
        },
    );
    if let Some(tls) = tls {
        server = server.with_tls(tls);
    }
    Ok((Arc::new(server), stack))
}

/// Logs each export's request counters (at -v, when the server stops).
fn report_exports(server: &Server) {
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

/// Serves one client on stdin/stdout, then closes the device stack.
fn serve_stdio(server: &Server, stack: &DeviceRef) -> CmdResult {
    let dup = |fd: std::os::fd::BorrowedFd<'_>| {
        fd.try_clone_to_owned()
            .map(File::from)
            .map_err(|e| CliError::new(format!("cannot use stdin/stdout: {e}")))
    };
    let input = dup(std::io::stdin().as_fd())?;
    let output = dup(std::io::stdout().as_fd())?;
    let end = server.serve(Box::new(Pipe::new(input, output, "stdin/stdout")));
    stack
        .close()
        .map_err(|e| CliError::new(format!("closing {}: {e}", stack.describe())))?;
    drop(end);
    Ok(0)
}
