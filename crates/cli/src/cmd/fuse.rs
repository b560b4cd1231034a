//! `diskit fuse` (and the `nbdfuse` name): an NBD export, or any image,
//! shown as one file in the local filesystem, with libnbd's nbdfuse
//! command line. The process serves the mount until it is unmounted
//! (`fusermount3 -u MOUNTPOINT`).
//!
//! As nbdfuse, options come before MOUNTPOINT; what follows it says
//! where the bytes come from: a URI, `[ CMD ARGS ... ]` (a server run
//! with socket activation), `--command CMD ARGS ...` (a server on its
//! standard input and output), `--fd N`, `--tcp HOST PORT` or
//! `--unix SOCKET`. Any other name is an image, opened as every command
//! opens one (a file of any format, http, rbd, s3).

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use crate::CmdResult;
use crate::util::{CliError, OpenPolicy, parse_source_format};
use diskit_core::DeviceRef;
use diskit_fuse::{MountOptions, Target};
use diskit_nbd::client::NbdClient;
use diskit_nbd::client::conn::{Stream, socket_option};
use diskit_nbd::client::uri::is_nbd_uri;
use diskit_open::{Format, OpenOptions};

/// Arguments of `fuse` (nbdfuse's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Connections to a server that allows multi-conn (URI, --tcp and
    /// --unix modes).
    #[arg(short = 'C', long = "connections", default_value_t = 4)]
    connections: usize,
    /// Verbose messages (as -v).
    #[arg(short = 'd')]
    debug: bool,
    /// A FUSE option: kernel_cache, direct_io, allow_other, allow_root,
    /// or one for the kernel (repeatable, comma-separated).
    #[arg(short = 'o', value_name = "FUSE-OPTION")]
    fuse_options: Vec<String>,
    /// Write the process id here once the file is mounted.
    #[arg(short = 'P', long = "pidfile", value_name = "PIDFILE")]
    pidfile: Option<PathBuf>,
    /// Read-only: the file cannot be opened for writing.
    #[arg(short = 'r', long = "readonly")]
    readonly: bool,
    /// One thread takes requests from the kernel.
    #[arg(short = 's')]
    single: bool,
    /// Verbose messages.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
    /// List the FUSE options (-o) understood and exit.
    #[arg(long = "fuse-help")]
    fuse_help: bool,
    /// The image's format, for an image name (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// MOUNTPOINT[/FILENAME]: a directory (the file is named nbd), a name
    /// in a directory, or a regular file to mount over.
    #[arg(value_name = "MOUNTPOINT", required_unless_present = "fuse_help")]
    mountpoint: Option<PathBuf>,
    /// URI | IMAGE | [ CMD ARGS ... ] | --command CMD ARGS ... | --fd N |
    /// --tcp HOST PORT | --unix SOCKET
    #[arg(
        value_name = "SOURCE",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        num_args = 1..,
        required_unless_present = "fuse_help"
    )]
    source: Vec<String>,
}

/// Where the bytes come from.
#[derive(Debug, PartialEq, Eq)]
enum Source {
    /// An NBD URI.
    Uri(String),
    /// A server run with socket activation.
    Activated(Vec<String>),
    /// A server speaking NBD on its standard input and output.
    Stdio(Vec<String>),
    /// A connected socket.
    Fd(i32),
    /// A host and port.
    Tcp(String, String),
    /// A Unix socket.
    Unix(String),
    /// Any image name.
    Image(String),
}

fn usage(message: impl Into<String>) -> CliError {
    CliError::new(message.into())
}

/// Reads the words after MOUNTPOINT.
fn parse_source(words: &[String]) -> Result<Source, CliError> {
    let rest = |n: usize, what: &str| -> Result<Vec<String>, CliError> {
        if words.len() == n + 1 {
            Ok(words[1..].to_vec())
        } else {
            Err(usage(format!("{} needs {what}", words[0])))
        }
    };
    let Some(first) = words.first() else {
        return Err(usage("missing URI or mode after MOUNTPOINT"));
    };
    Ok(match first.as_str() {
        "[" => match words.last() {
            Some(close) if close == "]" && words.len() > 2 => {
                Source::Activated(words[1..words.len() - 1].to_vec())
            }
            _ => return Err(usage("expected [ CMD ARGS ... ]")),
        },
        "--command" | "--cmd" if words.len() > 1 => Source::Stdio(words[1..].to_vec()),
        "--command" | "--cmd" => return Err(usage("--command needs CMD [ARGS ...]")),
        "--fd" => {
            let n = rest(1, "a file descriptor")?;
            match n[0].parse::<i32>() {
                Ok(fd) if fd >= 0 => Source::Fd(fd),
                _ => return Err(usage(format!("--fd: invalid file descriptor '{}'", n[0]))),
            }
        }
        "--tcp" => {
            let a = rest(2, "HOST PORT")?;
            Source::Tcp(a[0].clone(), a[1].clone())
        }
        "--unix" => Source::Unix(rest(1, "SOCKET")?.remove(0)),
        "--vsock" => return Err(usage("--vsock: AF_VSOCK is not supported")),
        _ if words.len() > 1 => {
            return Err(usage(format!("unexpected argument '{}'", words[1])));
        }
        w if is_nbd_uri(w) => Source::Uri(w.to_string()),
        w => Source::Image(w.to_string()),
    })
}

/// A server started on a socket pair, stopped with the mount.
struct StdioServer(Child);

impl Drop for StdioServer {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which is not reaped yet.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// Runs `argv` with one end of a socket pair as its standard input and
/// output (nbd_connect_command), and connects over the other.
fn connect_stdio(argv: &[String]) -> Result<(NbdClient, StdioServer), CliError> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| CliError::new(e.to_string()))?;
    let out = theirs
        .try_clone()
        .map_err(|e| CliError::new(e.to_string()))?;
    let child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::from(OwnedFd::from(out)))
        .spawn()
        .map_err(|e| CliError::new(format!("{}: {e}", argv[0])))?;
    let server = StdioServer(child);
    let name = argv.join(" ");
    let client =
        NbdClient::over(Stream::Unix(ours), &name, "").map_err(|e| CliError::new(e.to_string()))?;
    Ok((client, server))
}

/// A connected stream socket passed as descriptor `fd`.
fn connected_fd(fd: i32) -> Result<Stream, CliError> {
    let fail =
        |e: std::io::Error| CliError::new(format!("--fd {fd}: {}", crate::util::strerror(&e)));
    if socket_option(fd, libc::SO_TYPE).map_err(fail)? != libc::SOCK_STREAM {
        return Err(CliError::new(format!("--fd {fd}: not a stream socket")));
    }
    let domain = socket_option(fd, libc::SO_DOMAIN).map_err(fail)?;
    // SAFETY: the descriptor was given to this process to own (nbdfuse
    // takes it over likewise); it is a stream socket, as checked.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(if domain == libc::AF_UNIX {
        Stream::Unix(UnixStream::from(owned))
    } else {
        Stream::Tcp(std::net::TcpStream::from(owned))
    })
}

/// What keeps running beside the mount and ends with it.
type Keep = Option<StdioServer>;

/// Opens the device the source names.
fn open(a: &Args, source: &Source, policy: OpenPolicy) -> Result<(DeviceRef, Keep), CliError> {
    let nbd = |r: diskit_core::Result<NbdClient>| -> Result<(DeviceRef, Keep), CliError> {
        let c = r.map_err(|e| CliError::new(e.to_string()))?;
        Ok((Arc::new(c), None))
    };
    match source {
        Source::Uri(uri) => nbd(NbdClient::connect_multi(uri, a.connections)),
        Source::Tcp(host, port) => nbd(NbdClient::connect_multi(
            &format!("nbd://{host}:{port}"),
            a.connections,
        )),
        Source::Unix(path) => nbd(NbdClient::connect_multi(
            &format!("nbd+unix:///?socket={path}"),
            a.connections,
        )),
        Source::Activated(argv) => nbd(NbdClient::connect_command(argv)),
        Source::Fd(fd) => {
            let stream = connected_fd(*fd)?;
            nbd(NbdClient::over(stream, &format!("fd {fd}"), ""))
        }
        Source::Stdio(argv) => {
            let (c, server) = connect_stdio(argv)?;
            Ok((Arc::new(c), Some(server)))
        }
        Source::Image(name) => {
            let path = PathBuf::from(name);
            let format = parse_source_format(a.format.as_deref(), &path)?;
            let opts = OpenOptions {
                writable: !a.readonly,
                ..policy.options()
            };
            let img = policy.open(&path, format, opts)?;
            // Block 0 of a probed raw image is guarded, as qemu-nbd warns.
            if format.is_none() && !policy.image_opts && !a.readonly && img.format == Format::RAW {
                crate::util::warn_probed_raw(&path);
            }
            Ok((img.device, None))
        }
    }
}

/// The `-o` options `--fuse-help` lists.
const FUSE_HELP: &str = "\
FUSE options (-o):
    kernel_cache        keep the kernel's cached pages across opens
    direct_io           bypass the kernel's page cache
    allow_other         allow other users to use the file
    allow_root          allow root to use the file
    OPTION[=VALUE]      any other option is given to the kernel (fusermount3)";

/// Runs `diskit fuse` / `nbdfuse`.
pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    if a.fuse_help {
        println!("{FUSE_HELP}");
        return Ok(0);
    }
    if a.connections == 0 {
        return Err(CliError::new(
            "--connections parameter must be an unsigned integer >= 1",
        ));
    }
    let mountpoint = a.mountpoint.clone().expect("clap requires it");
    let target = Target::resolve(&mountpoint).map_err(|e| CliError::new(e.to_string()))?;
    let source = parse_source(&a.source)?;
    let (dev, keep) = open(&a, &source, policy)?;
    if a.verbose || a.debug {
        eprintln!(
            "{}: serving {} ({} bytes) at {}",
            crate::names::prog(),
            dev.describe(),
            dev.size(),
            target.target_path()
        );
    }
    let opts = MountOptions {
        target,
        read_only: a.readonly,
        threads: if a.single { 1 } else { FUSE_THREADS },
        fuse_options: a.fuse_options.clone(),
    };
    let mounted = diskit_fuse::mount(dev, &opts).map_err(|e| CliError::new(e.to_string()))?;
    if let Some(p) = &a.pidfile {
        // As nbdfuse: the number alone, no newline.
        std::fs::write(p, std::process::id().to_string()).map_err(|e| {
            CliError::new(format!("{}: {}", p.display(), crate::util::strerror(&e)))
        })?;
    }
    let served = mounted.serve().map_err(|e| CliError::new(e.to_string()));
    drop(keep);
    served.map(|()| 0)
}

/// Threads taking requests from the kernel: reads and writes are handed
/// on to the device without waiting, so a few keep many in flight; a
/// device that runs requests as they come (a local image) runs as many
/// at once.
const FUSE_THREADS: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_words_after_the_mountpoint_name_the_source() {
        let p = |s: &str| parse_source(&words(s));
        assert_eq!(p("nbd://h/x").unwrap(), Source::Uri("nbd://h/x".into()));
        assert_eq!(p("disk.qcow2").unwrap(), Source::Image("disk.qcow2".into()));
        assert_eq!(
            p("[ qemu-nbd -f qcow2 d ]").unwrap(),
            Source::Activated(words("qemu-nbd -f qcow2 d"))
        );
        assert_eq!(
            p("--command nbdkit -s memory 1M").unwrap(),
            Source::Stdio(words("nbdkit -s memory 1M"))
        );
        assert_eq!(p("--fd 5").unwrap(), Source::Fd(5));
        assert_eq!(
            p("--tcp h 10809").unwrap(),
            Source::Tcp("h".into(), "10809".into())
        );
        assert_eq!(p("--unix /s").unwrap(), Source::Unix("/s".into()));
        for bad in [
            "[ ]",
            "[ x",
            "--tcp h",
            "--fd x",
            "--unix",
            "a b",
            "--vsock 1 2",
            "",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }
}
