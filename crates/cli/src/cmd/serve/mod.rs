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
pub mod launch;
mod lifecycle;
pub mod listen;
mod plugin;
mod tls;

use std::fs::File;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::CmdResult;
use crate::util::CliError;
pub use compat::label_sockets;
use diskit_core::DeviceRef;
use diskit_filters::FilterSpec;
use diskit_nbd::server::{Export, ExportSet, Pipe, Server, ServerConfig};
use launch::{Bound, Place, Plan};
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
    /// The export name --run puts in $uri and $exportname, as nbdkit's -e
    /// (clients may ask for any name; listings show the plugin's).
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
    /// The plugin: file, nbd, http, curl, rbd, s3, memory, null, pattern,
    /// image, nbdkit's synthetic disks (zero, ones, full, random,
    /// sparse-random, data, split, partitioning, tmpdisk), and the other
    /// sources diskit reaches.
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
            launch::report_exports(&server);
        }
        return r;
    }

    let label = a.nbdkit.label_sockets()?;
    let activated = if a.unix.is_none() && a.port.is_none() {
        Listener::from_socket_activation()?
    } else {
        None
    };
    let activated_socket = activated.is_some();
    let bound = match (activated, &a.unix, a.port) {
        (Some(l), _, _) => Bound::activated(l),
        (None, Some(u), _) if u == "-" => Bound::bind(Place::PrivateUnix)?,
        (None, Some(u), _) => Bound::bind(Place::Unix {
            path: PathBuf::from(u),
            replace: false,
        })?,
        (None, None, port) => Bound::bind(Place::Tcp(
            a.ipaddr.unwrap_or(a.nbdkit.default_addr()),
            port.unwrap_or(NBD_PORT),
        ))?,
    };
    drop(label);
    let plan = Plan {
        foreground: a.foreground || a.run.is_some() || activated_socket || a.exit_with_parent,
        keep_stderr: a.verbose,
        pidfile: a.pidfile.clone(),
        remove_pidfile: true,
        print_uri: a.print_uri,
        verbose: a.verbose,
        what: a.plugin.clone(),
        export_name: a.exportname.clone(),
        tls_required: a.tls.required(),
        tls_env: a.tls.env_value(),
        run: a.run.clone(),
        until_last_client: false,
    };
    launch::serve(bound, plan, || build(&a, &routed, &policy))
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
    if a.verbose {
        plugin::set_verbose(true);
    }
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
        // The plugin's default export: "" unless the plugin or a filter
        // names it (default_export); -e only names it for --run.
        Export::new(String::new(), device)
            .with_read_only(a.readonly)
            .with_description(a.description.clone().unwrap_or_default())
            .with_allocation_depth(opened.allocation_depth)
            .with_bitmaps(opened.bitmaps),
    );
    // Any name a client asks for reaches the plugin, as under nbdkit.
    let exports = exports.answers_any_name(true);
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
