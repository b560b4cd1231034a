//! `diskit qemu-nbd`, and diskit run as `qemu-nbd`: qemu-nbd's command line
//! and behaviour over diskit's NBD server.
//!
//! `qemu-nbd [OPTIONS] FILE` serves one image as qemu-nbd does: its
//! options and messages, its defaults (one client at a time unless `-e`,
//! exit after the last client unless `-t`, a 10 s handshake limit, export
//! name ""), and its export as QEMU advertises it (flags, block sizes,
//! `qemu:allocation-depth` with `-A`). The image opens through the one
//! opener ([`image`]); listening, forking, the pid file, signals and TLS
//! are `serve`'s ([`super::serve::launch`]). `qemu-nbd -L` is the client
//! side ([`list`]). `-c`/`-d` (the kernel's NBD client) are refused.

mod image;
mod list;
mod settings;

use std::net::{IpAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::serve::launch::{self, Bound, Place, Plan};
use super::serve::listen::{Listener, NBD_PORT};
use crate::CmdResult;
use crate::getopt::Found;
use crate::names::Tool;
use crate::util::{CliError, OpenPolicy};
use diskit_core::DeviceRef;
use diskit_nbd::client::uri::Address;
use diskit_nbd::server::{
    Advertising, Export, ExportSet, OverLimit, Server, ServerConfig, TlsConfig, TlsMode,
};
use diskit_open::objects::{Endpoint, TlsKind, tls_creds};
use settings::Settings;

/// Arguments of `qemu-nbd`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Port to listen on (default 10809).
    #[arg(short = 'p', long = "port", allow_hyphen_values = true)]
    port: Option<String>,
    /// Interface to bind to (default 0.0.0.0).
    #[arg(
        short = 'b',
        long = "bind",
        value_name = "IFACE",
        allow_hyphen_values = true
    )]
    bind: Option<String>,
    /// Path to the Unix socket (absolute).
    #[arg(
        short = 'k',
        long = "socket",
        value_name = "PATH",
        allow_hyphen_values = true
    )]
    socket: Option<String>,
    /// The device can be shared by NUM clients (default 1; 0: any number).
    #[arg(
        short = 'e',
        long = "shared",
        value_name = "NUM",
        allow_hyphen_values = true
    )]
    shared: Option<String>,
    /// Do not exit on the last connection.
    #[arg(short = 't', long = "persistent")]
    persistent: bool,
    /// Display extra debugging information.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
    /// Expose the export by this name (default: the empty name).
    #[arg(
        short = 'x',
        long = "export-name",
        value_name = "NAME",
        allow_hyphen_values = true
    )]
    export_name: Option<String>,
    /// A human-readable description of the export.
    #[arg(
        short = 'D',
        long = "description",
        value_name = "TEXT",
        allow_hyphen_values = true
    )]
    description: Option<String>,
    /// Limit a client's handshake to N seconds (default 10; 0: no limit).
    #[arg(long = "handshake-limit", value_name = "N", allow_hyphen_values = true)]
    handshake_limit: Option<String>,
    /// Offset into the image.
    #[arg(
        short = 'o',
        long = "offset",
        value_name = "OFFSET",
        allow_hyphen_values = true
    )]
    offset: Option<String>,
    /// Expose the allocation depth (qemu:allocation-depth).
    #[arg(short = 'A', long = "allocation-depth")]
    allocation_depth: bool,
    /// Expose a persistent dirty bitmap (repeatable).
    #[arg(
        short = 'B',
        long = "bitmap",
        value_name = "NAME",
        action = clap::ArgAction::Append,
        allow_hyphen_values = true
    )]
    bitmaps: Vec<String>,
    /// List the exports of another NBD server.
    #[arg(short = 'L', long = "list")]
    list: bool,
    /// Define an object: secret, tls-creds-x509, tls-creds-psk, authz-simple,
    /// authz-list, authz-list-file (repeatable; key=value or JSON).
    #[arg(long = "object", value_name = "OBJECTDEF", action = clap::ArgAction::Append, allow_hyphen_values = true)]
    object: Vec<String>,
    /// Use the TLS credentials object ID (TLS is then required).
    #[arg(long = "tls-creds", value_name = "ID", allow_hyphen_values = true)]
    tls_creds: Option<String>,
    /// Authorization object (authz-simple, authz-list, authz-list-file)
    /// that TLS clients' certificates must satisfy.
    #[arg(long = "tls-authz", value_name = "ID", allow_hyphen_values = true)]
    tls_authz: Option<String>,
    /// Host name the server's certificate must carry (with -L).
    #[arg(
        long = "tls-hostname",
        value_name = "HOSTNAME",
        allow_hyphen_values = true
    )]
    tls_hostname: Option<String>,
    /// Tracing options (accepted; diskit has no trace events).
    #[arg(short = 'T', long = "trace", value_name = "PATTERN", action = clap::ArgAction::Append, allow_hyphen_values = true)]
    trace: Vec<String>,
    /// Fork off the server process and exit the parent once it serves.
    #[arg(long = "fork")]
    fork: bool,
    /// Store the server's process id in this file.
    #[arg(long = "pid-file", value_name = "PATH", allow_hyphen_values = true)]
    pid_file: Option<PathBuf>,
    /// SELinux label of the listening socket (with --socket).
    #[arg(
        long = "selinux-label",
        value_name = "LABEL",
        allow_hyphen_values = true
    )]
    selinux_label: Option<String>,
    /// Connect FILE to the kernel's NBD device DEV (refused: diskit does
    /// not drive the kernel's NBD client).
    #[arg(
        short = 'c',
        long = "connect",
        value_name = "DEV",
        allow_hyphen_values = true
    )]
    connect: Option<String>,
    /// Disconnect the kernel's NBD device (refused, as --connect).
    #[arg(short = 'd', long = "disconnect")]
    disconnect: bool,
    /// Image format (raw, qcow2, ...; probed if absent).
    #[arg(
        short = 'f',
        long = "format",
        value_name = "FORMAT",
        allow_hyphen_values = true
    )]
    format: Option<String>,
    /// Export read-only.
    #[arg(short = 'r', long = "read-only")]
    read_only: bool,
    /// Write into a temporary qcow2 overlay over FILE, dropped at exit.
    #[arg(short = 's', long = "snapshot")]
    snapshot: bool,
    /// Export an internal snapshot of FILE read-only: ID_OR_NAME, or
    /// snapshot.id=ID,snapshot.name=NAME.
    #[arg(
        short = 'l',
        long = "load-snapshot",
        value_name = "SNAPSHOT_PARAM",
        allow_hyphen_values = true
    )]
    load_snapshot: Option<String>,
    /// Disable the host cache (--cache=none).
    #[arg(short = 'n', long = "nocache")]
    nocache: bool,
    /// Cache mode: none, writeback (default), writethrough, directsync,
    /// unsafe.
    #[arg(long = "cache", value_name = "MODE", allow_hyphen_values = true)]
    cache: Option<String>,
    /// AIO mode: threads, native (with cache none or directsync), io_uring.
    #[arg(long = "aio", value_name = "MODE", allow_hyphen_values = true)]
    aio: Option<String>,
    /// Discard mode: ignore (default), unmap.
    #[arg(long = "discard", value_name = "MODE", allow_hyphen_values = true)]
    discard: Option<String>,
    /// Detect zeroes: off (default), on, unmap (with --discard=unmap).
    #[arg(
        long = "detect-zeroes",
        value_name = "MODE",
        allow_hyphen_values = true
    )]
    detect_zeroes: Option<String>,
    /// Treat FILE as a full set of image options.
    #[arg(long = "image-opts")]
    image_opts: bool,
    /// The image.
    #[arg(value_name = "FILE")]
    files: Vec<String>,
}

/// qemu-nbd's complaint about its positional arguments.
fn invalid_arguments() -> CliError {
    const MSG: &str = "Invalid number of arguments";
    match crate::names::current() {
        Tool::QemuNbd => CliError::new(format!(
            "{MSG}\nTry `qemu-nbd --help' for more information."
        )),
        _ => CliError::usage("qemu-nbd", MSG),
    }
}

/// Runs qemu-nbd with `a`; `given` are its options in command-line order
/// (see [`crate::getopt::options`]), read again for qemu-nbd's in-order
/// checks; images open under `policy`.
pub fn run(a: Args, given: &[Found], policy: OpenPolicy) -> CmdResult {
    let s = Settings::read(given)?;
    let per_device = a.export_name.is_some()
        || a.description.is_some()
        || s.offset != 0
        || a.connect.is_some()
        || a.disconnect
        || a.format.is_some()
        || s.load_snapshot.is_some()
        || !a.bitmaps.is_empty()
        || a.allocation_depth
        || s.seen_aio
        || s.seen_discard
        || s.seen_cache;
    if a.list {
        if !a.files.is_empty() {
            return Err(CliError::new("List mode is incompatible with a file name"));
        }
        if per_device {
            return Err(CliError::new(
                "List mode is incompatible with per-device settings",
            ));
        }
        if a.fork {
            return Err(CliError::new("List mode is incompatible with forking"));
        }
    } else if a.files.len() != 1 {
        return Err(invalid_arguments());
    }
    let activated = Listener::activation_pending();
    if activated {
        check_activation(&a)?;
    }
    check_tls(&a)?;
    if a.selinux_label.is_some() && a.socket.is_none() && a.connect.is_none() {
        return Err(CliError::new(
            "--selinux-label is not permitted without --socket",
        ));
    }
    if a.list {
        let host = a.bind.as_deref().unwrap_or("0.0.0.0");
        let address = match &a.socket {
            Some(path) => Address::Unix(path.clone()),
            None => Address::Tcp {
                host: host.to_string(),
                port: port(&a, host)?,
            },
        };
        let hostname = a.tls_hostname.as_deref().unwrap_or(host);
        return list::run(address, a.tls_creds.as_deref(), Some(hostname));
    }
    if let Some(dev) = &a.connect {
        return Err(CliError::new(format!(
            "--connect {dev}: diskit does not drive the kernel's NBD client (/dev/nbdN); \
             serve with -k or -p and connect a client to it"
        )));
    }
    if a.disconnect {
        return Err(CliError::new(
            "--disconnect: diskit does not drive the kernel's NBD client (/dev/nbdN)",
        ));
    }
    let tls = server_tls(a.tls_creds.as_deref(), a.tls_authz.as_deref())?;

    let label = super::serve::label_sockets(a.selinux_label.as_deref())?;
    let bound = if activated {
        match Listener::from_socket_activation()? {
            Some(l) => Bound::activated(l),
            None => return Err(CliError::new("socket activation: no socket was passed")),
        }
    } else if let Some(path) = &a.socket {
        Bound::bind(Place::Unix {
            path: PathBuf::from(path),
            replace: true,
        })?
    } else {
        let host = a.bind.as_deref().unwrap_or("0.0.0.0");
        let port = port(&a, host)?;
        Bound::bind(Place::Tcp(resolve(host, port)?, port))?
    };
    drop(label);
    let file = a.files[0].clone();
    let plan = Plan {
        foreground: !a.fork,
        keep_stderr: true,
        pidfile: a.pid_file.clone(),
        remove_pidfile: false,
        verbose: a.verbose,
        what: file.clone(),
        export_name: a.export_name.clone().unwrap_or_default(),
        tls_required: tls.is_some(),
        until_last_client: !a.persistent,
        ..Plan::default()
    };
    launch::serve(bound, plan, || build(&a, &file, &s, &policy, tls))
}

/// Socket activation takes none of the options that say where to listen.
fn check_activation(a: &Args) -> Result<(), CliError> {
    let refused = [
        (a.connect.is_some(), "NBD device can't be set"),
        (a.socket.is_some(), "Unix socket can't be set"),
        (a.bind.is_some(), "The interface can't be set"),
        (a.port.is_some(), "TCP port number can't be set"),
        (a.selinux_label.is_some(), "SELinux label can't be set"),
    ];
    if let Some((_, what)) = refused.iter().find(|(given, _)| *given) {
        return Err(CliError::new(format!(
            "{what} when using socket activation"
        )));
    }
    if a.list {
        return Err(CliError::new(
            "List mode is incompatible with socket activation",
        ));
    }
    let fds = std::env::var("LISTEN_FDS").unwrap_or_default();
    if fds.parse::<u32>().is_ok_and(|n| n > 1) {
        return Err(CliError::new(format!(
            "{} does not support socket activation with LISTEN_FDS > 1",
            crate::names::prog()
        )));
    }
    Ok(())
}

/// The TLS options, checked against each other as qemu-nbd checks them.
fn check_tls(a: &Args) -> Result<(), CliError> {
    if a.tls_creds.is_none() {
        if a.tls_authz.is_some() {
            return Err(CliError::new(
                "--tls-authz is not permitted without --tls-creds",
            ));
        }
        if a.tls_hostname.is_some() {
            return Err(CliError::new(
                "--tls-hostname is not permitted without --tls-creds",
            ));
        }
        return Ok(());
    }
    if a.connect.is_some() {
        return Err(CliError::new("TLS is not supported with a host device"));
    }
    if a.tls_authz.is_some() && a.list {
        return Err(CliError::new(
            "TLS authorization is incompatible with export list",
        ));
    }
    if a.tls_hostname.is_some() && !a.list {
        return Err(CliError::new(
            "TLS hostname is only supported with export list",
        ));
    }
    let endpoint = if a.list {
        Endpoint::Client
    } else {
        Endpoint::Server
    };
    let id = a.tls_creds.as_deref().unwrap_or_default();
    tls_creds(id, endpoint)
        .map(drop)
        .map_err(|e| CliError::new(format!("Failed to get TLS creds: {e}")))
}

/// The server's TLS, required, from the credentials object `id`, letting
/// in the clients the authorization object `authz` allows (looked up at
/// each client, as QEMU does).
fn server_tls(id: Option<&str>, authz: Option<&str>) -> Result<Option<TlsConfig>, CliError> {
    let Some(id) = id else { return Ok(None) };
    let creds = tls_creds(id, Endpoint::Server)
        .map_err(|e| CliError::new(format!("Failed to get TLS creds: {e}")))?;
    let config = match creds.kind {
        TlsKind::X509 => TlsConfig::from_dir(TlsMode::Require, &creds.dir, creds.verify_peer),
        TlsKind::Psk => TlsConfig::from_psk_file(TlsMode::Require, &creds.psk_file()),
    };
    let config = config.map_err(|e| CliError::new(format!("Failed to get TLS creds: {e}")))?;
    Ok(Some(match authz {
        Some(authz) => config.with_authz(diskit_open::authz::authorizer(authz)),
        None => config,
    }))
}

/// `-p`'s port (default 10809), in QEMU's words when it is none.
fn port(a: &Args, host: &str) -> Result<u16, CliError> {
    match &a.port {
        None => Ok(NBD_PORT),
        Some(p) => p.parse().map_err(|_| {
            CliError::new(format!(
                "address resolution failed for {host}:{p}: Servname not supported for ai_socktype"
            ))
        }),
    }
}

/// The address `-b` names (an address or a host name).
fn resolve(host: &str, port: u16) -> Result<IpAddr, CliError> {
    if let Ok(ip) = host.parse() {
        return Ok(ip);
    }
    let failed = |why: String| {
        CliError::new(format!(
            "address resolution failed for {host}:{port}: {why}"
        ))
    };
    (host, port)
        .to_socket_addrs()
        .map_err(|e| failed(crate::util::strerror(&e)))?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| failed("Name or service not known".into()))
}

/// Opens the image and makes the server (in the daemon with `--fork`).
fn build(
    a: &Args,
    file: &str,
    s: &Settings,
    policy: &OpenPolicy,
    tls: Option<TlsConfig>,
) -> Result<(Arc<Server>, DeviceRef), CliError> {
    let request = image::Request {
        file,
        format: a.format.as_deref(),
        image_opts: a.image_opts,
        read_only: a.read_only,
        snapshot: a.snapshot,
        bitmaps: &a.bitmaps,
    };
    let served = image::open(&request, s, policy)?;
    let mut exports = ExportSet::new();
    exports.add(
        Export::new(
            a.export_name.clone().unwrap_or_default(),
            served.device.clone(),
        )
        .with_read_only(served.read_only)
        .with_description(a.description.clone().unwrap_or_default())
        .with_advertising(Advertising::Qemu {
            multi_conn: s.shared != 1,
            minimum: served.minimum,
        })
        .with_allocation_depth(a.allocation_depth)
        .with_bitmaps(served.bitmaps),
    );
    let mut server = Server::new(
        exports,
        ServerConfig {
            verbose: a.verbose,
            handshake_timeout: (s.handshake_limit > 0)
                .then(|| Duration::from_secs(s.handshake_limit)),
            max_connections: s.shared,
            over_limit: OverLimit::Wait,
            ..ServerConfig::default()
        },
    );
    if let Some(tls) = tls {
        server = server.with_tls(tls);
    }
    Ok((Arc::new(server), served.device))
}
