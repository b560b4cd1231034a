//! The `nbd` plugin: proxies another NBD server, with nbdkit's nbd plugin's
//! parameters. The export below is one client (several connections when it
//! allows multi-conn), opened once when the server starts and shared by every
//! client of this server, which sees the capabilities of the server below.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use diskit_nbd::client::NbdClient;
use diskit_nbd::client::conn::Stream;
use diskit_nbd::client::uri::{Address, DEFAULT_PORT, NbdUri};

use diskit_core::{DeviceRef, Error, Result};

use crate::plugin::{LIST_SEPARATOR, PluginArgs, boolean};

/// The keys the plugin takes.
pub const KEYS: &[&str] = &[
    "uri",
    "socket",
    "hostname",
    "port",
    "command",
    "arg",
    "socket-fd",
    "export",
    "retry",
    "shared",
    "tls",
    "tls-certificates",
    "tls-verify",
    "tls-username",
    "tls-psk",
];

/// Where the server below is: exactly one of these is given.
enum Target {
    /// `uri=` (its own export name and TLS settings, to which `export=`
    /// and the tls keys may not be added).
    Uri(String),
    /// `socket=`, or `hostname=` with `port=`.
    Address(Address),
    /// `command=` with its `arg=`s, run with socket activation.
    Command(Vec<String>),
    /// `socket-fd=`: a connected socket inherited from the parent.
    Fd(RawFd),
}

fn err(msg: impl std::fmt::Display) -> Error {
    Error::invalid(format!("nbd: {msg}"))
}

fn target(kv: &PluginArgs) -> Result<Target> {
    if kv.contains_key("port") && !kv.contains_key("hostname") {
        return Err(err("port= goes with hostname="));
    }
    if kv.contains_key("arg") && !kv.contains_key("command") {
        return Err(err("arg= goes with command="));
    }
    let given: Vec<&str> = ["uri", "socket", "hostname", "command", "socket-fd"]
        .into_iter()
        .filter(|k| kv.contains_key(*k))
        .collect();
    if given.len() != 1 {
        return Err(err(format!(
            "give exactly one of uri, socket, hostname, command or socket-fd{}",
            if given.is_empty() {
                String::new()
            } else {
                format!(" (given: {})", given.join(", "))
            }
        )));
    }
    Ok(match given[0] {
        "uri" => Target::Uri(kv["uri"].clone()),
        "socket" => Target::Address(Address::Unix(kv["socket"].clone())),
        "hostname" => {
            let port = match kv.get("port") {
                Some(p) => p
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| err(format!("port: not a port number: '{p}'")))?,
                None => DEFAULT_PORT,
            };
            Target::Address(Address::Tcp {
                host: kv["hostname"].clone(),
                port,
            })
        }
        "command" => {
            let mut argv = vec![kv["command"].clone()];
            if let Some(args) = kv.get("arg") {
                argv.extend(args.split(LIST_SEPARATOR).map(str::to_string));
            }
            Target::Command(argv)
        }
        _ => {
            let v = &kv["socket-fd"];
            let fd = v
                .parse::<RawFd>()
                .ok()
                .filter(|&fd| fd >= 0)
                .ok_or_else(|| err(format!("socket-fd: not a file descriptor: '{v}'")))?;
            Target::Fd(fd)
        }
    })
}

/// The TLS settings of the keys, for the non-URI forms.
struct TlsKeys {
    require: bool,
    certificates: Option<String>,
    verify: Option<bool>,
    username: Option<String>,
    psk: Option<String>,
}

fn tls_keys(kv: &PluginArgs) -> Result<TlsKeys> {
    let require = match kv.get("tls").map(String::as_str) {
        None | Some("off") => false,
        Some("require") => true,
        // Opportunistic TLS falls back to plain text when the server
        // refuses it, which an attacker in the middle can force: refused,
        // as the NBD client refuses it everywhere else.
        Some("on") => {
            return Err(err(
                "tls=on (TLS when the server offers it, plain text otherwise) is not \
                 supported, as a downgrade is silent: use tls=require or tls=off",
            ));
        }
        Some(other) => {
            return Err(err(format!("tls: expected off or require, got '{other}'")));
        }
    };
    let verify = match kv.get("tls-verify") {
        Some(v) => Some(boolean("nbd", "tls-verify", v)?),
        None => None,
    };
    let keys = TlsKeys {
        require,
        certificates: kv.get("tls-certificates").cloned(),
        verify,
        username: kv.get("tls-username").cloned(),
        psk: kv.get("tls-psk").cloned(),
    };
    let any_setting = keys.certificates.is_some()
        || keys.verify.is_some()
        || keys.username.is_some()
        || keys.psk.is_some();
    if any_setting && !keys.require {
        return Err(err("the tls-* keys need tls=require"));
    }
    Ok(keys)
}

/// Opens the server below (the plugin's `open`). With `-r` the export is
/// served read-only whatever the server below allows.
pub fn open(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    let target = target(kv)?;
    let tls = tls_keys(kv)?;
    let export = kv.get("export").cloned().unwrap_or_default();
    if let Some(v) = kv.get("shared") {
        // One client below serves every client of this server either way.
        boolean("nbd", "shared", v)?;
    }
    let retries = match kv.get("retry") {
        Some(v) => v
            .parse::<u32>()
            .map_err(|_| err(format!("retry: not a number: '{v}'")))?,
        None => 0,
    };
    if matches!(target, Target::Uri(_))
        && (kv.contains_key("export")
            || kv.contains_key("tls")
            || kv.contains_key("tls-certificates"))
    {
        return Err(err(
            "uri= carries its own export name and TLS settings (nbds://, \
             ?tls-certificates=...): export= and tls keys go with the other forms",
        ));
    }
    if tls.require && matches!(target, Target::Command(_) | Target::Fd(_)) {
        return Err(err("tls=require goes with uri, socket or hostname"));
    }
    let client = match target {
        Target::Uri(uri) => with_retries(retries, || NbdClient::connect(&uri))?,
        Target::Address(address) => {
            let uri = NbdUri {
                address,
                export,
                tls: tls.require,
                tls_in_name: tls.require,
                user: tls.username,
                tls_certificates: tls.certificates,
                tls_psk_file: tls.psk,
                tls_verify_peer: tls.verify,
                tls_hostname: None,
            };
            with_retries(retries, || {
                NbdClient::connect_to(uri.clone(), &[diskit_nbd::client::BASE_ALLOCATION])
            })?
        }
        Target::Command(argv) => {
            NbdClient::connect_command_export(&argv, &export).map_err(|e| err(e.to_string()))?
        }
        Target::Fd(fd) => {
            let stream = inherited_socket(fd)?;
            NbdClient::over(Stream::Unix(stream), &format!("socket-fd={fd}"), &export)
                .map_err(|e| err(e.to_string()))?
        }
    };
    Ok(Arc::new(client))
}

/// Connects, trying again `retries` more times a second apart (nbdkit's
/// `retry=`) when the connection itself fails.
fn with_retries(retries: u32, mut connect: impl FnMut() -> Result<NbdClient>) -> Result<NbdClient> {
    let mut left = retries;
    loop {
        match connect() {
            Ok(c) => return Ok(c),
            Err(e) if left > 0 => {
                eprintln!("diskit serve: nbd: {e}; trying again in 1 s ({left} left)");
                left -= 1;
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => return Err(err(e)),
        }
    }
}

/// The connected stream socket `fd`, checked to be one.
fn inherited_socket(fd: RawFd) -> Result<UnixStream> {
    let ty = diskit_nbd::client::conn::socket_option(fd, libc::SO_TYPE);
    if !matches!(ty, Ok(libc::SOCK_STREAM)) {
        return Err(err(format!(
            "socket-fd={fd}: not a connected stream socket ({})",
            match ty {
                Err(e) => e.to_string(),
                Ok(_) => "another kind of socket".to_string(),
            }
        )));
    }
    // SAFETY: the descriptor was handed to this process to own (nbdkit's
    // socket-fd= contract) and is a stream socket, checked above; nothing
    // else in the process uses it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(UnixStream::from(owned))
}
