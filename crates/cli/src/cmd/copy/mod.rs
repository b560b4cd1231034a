//! `diskit copy`: nbdcopy's command line over diskit's copy engine.
//!
//! Each side is a file or block device (raw bytes, never probed), an NBD
//! URI, `-` (a pipe), or `[ CMD ARGS ... ]` (a server run with socket
//! activation); the destination may be `null:`. Holes in the source (block
//! status, SEEK_DATA) are skipped or sent as zero requests, zero blocks in
//! the data are found, and requests stay in flight over several
//! connections where the server allows multi-conn. With `--dirty-bitmap`
//! (see [`dirty`]) only the ranges the source's dirty bitmap marks are
//! written, into the copy made before.

mod dirty;

use std::fs::OpenOptions;
use std::io::{IsTerminal, Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::sync::Arc;

use crate::CmdResult;
use crate::progress::{CopyProgressTo, ProgressPrinter};
use crate::util::CliError;
use diskit_copy::blkhash::{BlockHash, parse_spec};
use diskit_copy::changed::{ChangedRanges, OnlyChanged};
use diskit_copy::{CopyOptions, Progress, copy};
use diskit_core::{BlockDevice, DeviceRef, Filtered, WriteFlags, ZeroFlags};
use diskit_filters::noextents::Noextents;
use diskit_nbd::client::NbdClient;

/// Arguments of `copy`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Allocate every byte of the destination (zeros are written as zero
    /// requests that may not punch holes).
    #[arg(long = "allocated")]
    allocated: bool,
    /// Compute the blkhash of the data as it is copied and print it at the
    /// end: DIGEST[/SIZE], DIGEST as `checksum --digest` takes it (md5,
    /// sha1, sha256, sha512...), SIZE the block size (a power of 2);
    /// sha256/64k when not given.
    #[arg(long = "blkhash", num_args = 0..=1, require_equals = true, default_missing_value = "", value_name = "DIGEST[/SIZE]")]
    blkhash: Option<String>,
    /// Where --blkhash prints the digest (default: standard output).
    #[arg(long = "blkhash-file", value_name = "FILE")]
    blkhash_file: Option<std::path::PathBuf>,
    /// Connections to each NBD server (when it allows multi-conn).
    #[arg(short = 'C', long = "connections", default_value_t = 4)]
    connections: usize,
    /// The destination reads as zeros already: zero ranges are skipped.
    #[arg(long = "destination-is-zero", visible_alias = "target-is-zero")]
    destination_is_zero: bool,
    /// Write only the ranges the source's dirty bitmap NAME marks dirty
    /// (its `qemu:dirty-bitmap:NAME` context, served by qemu-nbd -B NAME)
    /// into an existing destination, which keeps the rest: an incremental
    /// backup.
    #[arg(
        long = "dirty-bitmap",
        value_name = "NAME",
        conflicts_with_all = ["blkhash", "blkhash_file", "destination_is_zero"]
    )]
    dirty_bitmap: Option<String>,
    /// Flush the destination at the end.
    #[arg(long = "flush")]
    flush: bool,
    /// Ignore the source's allocation (read every byte).
    #[arg(long = "no-extents")]
    no_extents: bool,
    /// Show progress (on standard error, or as N/100 lines on descriptor FD).
    #[arg(short = 'p', long = "progress", num_args = 0..=1, require_equals = true, default_missing_value = "")]
    progress: Option<String>,
    /// Bytes in flight per connection at most.
    #[arg(long = "queue-size", default_value = "16M")]
    queue_size: String,
    /// Bytes per request (a power of 2, 4 KiB to 32 MiB; default 256 KiB,
    /// or 1 MiB when reading from an NBD export into a local destination,
    /// where each request costs the server its per-request work).
    #[arg(long = "request-size")]
    request_size: Option<String>,
    /// Requests in flight per connection.
    #[arg(short = 'R', long = "requests", default_value_t = 64)]
    requests: usize,
    /// Zero blocks of this size in the data become holes (0: none).
    #[arg(short = 'S', long = "sparse", default_value = "4096")]
    sparse: String,
    /// One request at a time.
    #[arg(long = "synchronous")]
    synchronous: bool,
    /// Worker threads (default: the number of processors, at most the
    /// connections).
    #[arg(short = 'T', long = "threads")]
    threads: Option<usize>,
    /// Say what is copied how, on standard error.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
    /// SOURCE DESTINATION: - | FILE | DEVICE | NBD-URI | RBD-NAME |
    /// [ CMD ARGS ... ] (and null: as the destination, an http:// or
    /// https:// URL as the source).
    #[arg(trailing_var_arg = true, num_args = 2.., required = true)]
    sides: Vec<String>,
}

/// The largest request (the NBD protocol's portable maximum).
const MAX_REQUEST: u64 = 32 << 20;
/// Bytes per request unless told: nbdcopy's size.
const DEFAULT_REQUEST: u64 = 256 << 10;
/// Bytes per request unless told when reading from an NBD export into a
/// local destination: measured
/// against nbdkit and qemu-nbd over Unix sockets, 1 MiB reads cost the
/// server less work per byte than 256 KiB ones, while 2 MiB and more start
/// to miss the processors' caches. Writes into an export keep nbdcopy's
/// size: servers that split large writes (nbdkit's blocksize filter) run
/// the pieces of one request one after another.
const DEFAULT_NBD_READ_REQUEST: u64 = 1 << 20;
/// The smallest request.
const MIN_REQUEST: u64 = 4096;

fn usage(msg: impl Into<String>) -> CliError {
    CliError::usage("copy", msg)
}

/// One side as named on the command line.
#[derive(Debug)]
enum Side {
    Pipe,
    Null,
    Local(String),
    Network(String),
    Command(Vec<String>),
}

/// The source of the table a name selects when that source is reached
/// over a network (an NBD URI, an http URL, an RBD image): the opener
/// opens such a side, over several connections where it allows.
fn network_source(s: &str) -> Option<&'static diskit_open::protocol::Protocol> {
    diskit_open::protocol::for_name(s)
        .ok()
        .filter(|p| p.network)
}

/// Splits SOURCE and DESTINATION out of the words after the options.
fn parse_sides(words: &[String]) -> Result<(Side, Side), CliError> {
    let mut i = 0;
    let mut take = |dest: bool| -> Result<Side, CliError> {
        let Some(w) = words.get(i) else {
            return Err(usage("SOURCE and DESTINATION are needed"));
        };
        i += 1;
        if w == "[" {
            let end = words[i..]
                .iter()
                .position(|x| x == "]")
                .ok_or_else(|| usage("'[' without a matching ']'"))?;
            let argv = words[i..i + end].to_vec();
            i += end + 1;
            if argv.is_empty() {
                return Err(usage("an empty server command '[ ]'"));
            }
            return Ok(Side::Command(argv));
        }
        Ok(match w.as_str() {
            "-" => Side::Pipe,
            "null:" if dest => Side::Null,
            _ if let Some(p) = network_source(w) => {
                if dest && matches!(p.made, diskit_open::protocol::Made::Never) {
                    return Err(usage(format!(
                        "{w}: an {} URL can only be a source",
                        p.name
                    )));
                }
                Side::Network(w.clone())
            }
            _ => Side::Local(w.clone()),
        })
    };
    let src = take(false)?;
    let dst = take(true)?;
    if i != words.len() {
        return Err(usage(format!("unexpected argument '{}'", words[i])));
    }
    Ok((src, dst))
}

/// An opened side.
enum Opened {
    /// A device with a size.
    Device(DeviceRef),
    /// A pipe, socket or character device: bytes in order, size unknown.
    Stream(std::fs::File),
    /// A regular file the destination truncated (it grows as written
    /// when the source's size is unknown).
    File(diskit_core::StorageRef),
    /// Storage the copy made (a new S3 object), which may take its writes
    /// only in order.
    New(diskit_core::StorageRef),
}

/// An I/O error on `what`, as nbdcopy words it (`PATH: strerror`).
fn io_error(what: &str, e: &std::io::Error) -> CliError {
    CliError::new(format!("{what}: {}", crate::util::strerror(e)))
}

fn nbd_err(e: diskit_core::Error) -> CliError {
    CliError::new(e.to_string())
}

/// A side the opener's table of sources reaches (an NBD URI, an http
/// URL), over up to `connections` connections; or a server command.
fn open_network(
    side: &Side,
    connections: usize,
    writable: bool,
) -> Result<Option<DeviceRef>, CliError> {
    Ok(match side {
        Side::Network(name) => {
            let mode = diskit_open::protocol::StorageOptions {
                writable,
                connections,
                ..Default::default()
            };
            Some(diskit_open::open_storage_with(name, mode).map_err(nbd_err)?)
        }
        Side::Command(argv) => Some(Arc::new(NbdClient::connect_command(argv).map_err(nbd_err)?)),
        _ => None,
    })
}

fn open_source(side: &Side, connections: usize) -> Result<Opened, CliError> {
    if let Some(d) = open_network(side, connections, false)? {
        return Ok(Opened::Device(d));
    }
    match side {
        Side::Pipe => Ok(Opened::Stream(stdin_file()?)),
        Side::Local(path) => {
            let meta = std::fs::metadata(path).map_err(|e| io_error(path, &e))?;
            let ft = meta.file_type();
            if ft.is_file() || ft.is_block_device() {
                // The copy never writes its own source, by any name.
                let dev = diskit_open::local::open_source(path)
                    .map_err(|e| CliError::new(format!("{path}: {e}")))?;
                Ok(Opened::Device(dev))
            } else {
                let f = std::fs::File::open(path).map_err(|e| io_error(path, &e))?;
                Ok(Opened::Stream(f))
            }
        }
        _ => unreachable!("sources are pipes, files or NBD"),
    }
}

fn stdin_file() -> Result<std::fs::File, CliError> {
    let fd = std::io::stdin()
        .lock()
        .as_fd_dup()
        .map_err(|e| io_error("stdin", &e))?;
    Ok(fd)
}

trait DupFd {
    fn as_fd_dup(&self) -> std::io::Result<std::fs::File>;
}

impl<T: std::os::fd::AsFd> DupFd for T {
    fn as_fd_dup(&self) -> std::io::Result<std::fs::File> {
        Ok(std::fs::File::from(self.as_fd().try_clone_to_owned()?))
    }
}

/// Opens the destination: an existing file or device as it is, a new
/// file created; a regular file is truncated to the source's size and
/// so reads as zeros.
fn open_destination(
    side: &Side,
    connections: usize,
    src_size: Option<u64>,
    made: &mut Option<diskit_open::create::Undo>,
) -> Result<(Opened, bool), CliError> {
    if let (Side::Network(name), Some(size)) = (side, src_size)
        && let Some(d) = make_network(name, connections, size, made)?
    {
        return Ok((Opened::New(d), true));
    }
    if let Some(d) = open_network(side, connections, true)? {
        return Ok((Opened::Device(d), false));
    }
    match side {
        Side::Null => Ok((
            Opened::Device(diskit_open::local::null_sink(
                src_size.unwrap_or(u64::MAX >> 1),
            )),
            true,
        )),
        Side::Pipe => {
            let out = std::io::stdout();
            if out.is_terminal() {
                return Err(CliError::new("refusing to write to tty"));
            }
            Ok((
                Opened::Stream(out.as_fd_dup().map_err(|e| CliError::new(e.to_string()))?),
                false,
            ))
        }
        Side::Local(path) => {
            let at = |e: diskit_core::Error| CliError::new(format!("{path}: {e}"));
            // Opened as it is (never truncated before the checks below), or
            // made.
            let opened = OpenOptions::new().read(true).write(true).open(path);
            let file = match opened {
                Ok(f) => f,
                Err(_) => OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(path)
                    .map_err(|e| io_error(path, &e))?,
            };
            let ft = file.metadata().map_err(|e| io_error(path, &e))?.file_type();
            if !(ft.is_file() || ft.is_block_device()) {
                return Ok((Opened::Stream(file), false));
            }
            // Not the source under another name, and not a file another
            // process uses (QEMU's locks, held until the copy ends); only
            // then emptied.
            let dev = diskit_open::local::adopt_destination(file, path).map_err(at)?;
            if ft.is_file() {
                use diskit_core::Preallocation::Off;
                dev.resize(0, Off)
                    .and_then(|()| dev.resize(src_size.unwrap_or(0), Off))
                    .map_err(|e| CliError::new(format!("{path}: truncate: {e}")))?;
                Ok((Opened::File(dev), true))
            } else {
                Ok((Opened::Device(dev), false))
            }
        }
        Side::Network(_) | Side::Command(_) => unreachable!("opened above"),
    }
}

/// A destination of the table's that the source makes when it is not
/// there (a new S3 object: its source's row says `Made::New`), made of
/// `size` bytes and opened; `None` when it is there, or is never made.
fn make_network(
    name: &str,
    connections: usize,
    size: u64,
    made: &mut Option<diskit_open::create::Undo>,
) -> Result<Option<diskit_core::StorageRef>, CliError> {
    use diskit_open::protocol::{Made, for_name};
    let Ok(p) = for_name(name) else {
        return Ok(None);
    };
    let Made::New { create, remove, .. } = p.made else {
        return Ok(None);
    };
    let mode = diskit_open::protocol::StorageOptions {
        writable: false,
        ..Default::default()
    };
    match diskit_open::open_storage_with(name, mode) {
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == diskit_core::ErrorKind::NotFound => {}
        Err(e) => return Err(nbd_err(e)),
    }
    let storage = create(name, size).map_err(nbd_err)?;
    *made = Some(diskit_open::create::Undo::Storage {
        name: name.to_string(),
        remove,
    });
    drop(storage);
    let mode = diskit_open::protocol::StorageOptions {
        writable: true,
        connections,
        ..Default::default()
    };
    let opened = diskit_open::open_storage_with(name, mode)
        .and_then(|s| s.resize(size, diskit_core::Preallocation::Off).map(|()| s));
    match opened {
        Ok(s) => Ok(Some(s)),
        Err(e) => {
            if let Some(u) = made.take() {
                u.undo();
            }
            Err(nbd_err(e))
        }
    }
}

/// A power-of-two size option within bounds.
fn parse_pow2(s: &str, what: &str, min: u64, max: u64) -> Result<u64, CliError> {
    let n = crate::util::parse_size_arg(s, what)
        .map_err(|_| CliError::new(format!("--{what}: could not parse: {s}")))?;
    if n < min || n > max || !n.is_power_of_two() {
        return Err(CliError::new(format!(
            "--{what}: must be a power of 2 within {min}-{max}"
        )));
    }
    Ok(n)
}

/// Runs `diskit copy`.
pub fn run(a: Args) -> CmdResult {
    let (src_side, dst_side) = parse_sides(&a.sides)?;
    if a.connections == 0 {
        return Err(CliError::new(format!(
            "--connections: could not parse: {}",
            a.connections
        )));
    }
    let asked_request_size = a
        .request_size
        .as_deref()
        .map(|r| parse_pow2(r, "request-size", MIN_REQUEST, MAX_REQUEST))
        .transpose()?;
    let request_size = asked_request_size.unwrap_or(DEFAULT_REQUEST);
    let queue_size = crate::util::parse_size_arg(&a.queue_size, "queue-size")
        .map_err(|_| CliError::new(format!("--queue-size: could not parse: {}", a.queue_size)))?;
    let mut sparse = crate::util::parse_size_arg(&a.sparse, "sparse")
        .map_err(|_| CliError::new(format!("--sparse: could not parse: {}", a.sparse)))?;
    if sparse != 0 && (sparse < 512 || !sparse.is_power_of_two()) {
        return Err(CliError::new("--sparse: must be a power of 2 and >= 512"));
    }
    let blkhash = a
        .blkhash
        .as_deref()
        .map(|spec| parse_spec(spec).and_then(|(alg, bs)| BlockHash::new(alg, bs)))
        .transpose()
        .map_err(|e| CliError::new(format!("--blkhash: {e}")))?
        .map(Arc::new);
    let progress_to = match a.progress.as_deref() {
        None => None,
        Some("") => Some(CopyProgressTo::Stderr),
        Some(fd) => Some(CopyProgressTo::Fd(
            fd.parse::<i32>()
                .ok()
                .filter(|&f| f >= 0)
                .ok_or_else(|| CliError::new(format!("--progress: could not parse: {fd}")))?,
        )),
    };
    // A server started for the copy takes one connection; an NBD URI on
    // the other side still gets several when its server allows it.
    // No more connections than threads asked for, or processors (each
    // connection has a thread reading its replies, and the server a
    // thread pool for it).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let connections = if a.synchronous {
        1
    } else {
        a.connections.min(a.threads.unwrap_or(cores).max(1))
    };
    let (src, changed) = match &a.dirty_bitmap {
        Some(name) => {
            let (dev, changed) = dirty::open_source(&src_side, name)?;
            (Opened::Device(dev), Some(changed))
        }
        None => (open_source(&src_side, connections)?, None),
    };
    let src_size = match &src {
        Opened::Device(d) => Some(d.size()),
        _ => None,
    };
    // The checksum file is taken before anything is written, as a
    // destination is: never the copy's source or destination, nor an
    // image another process uses, and emptied only at the end.
    let dst_path = match &dst_side {
        Side::Local(p) => Some(p.as_str()),
        _ => None,
    };
    let hash_file = a
        .blkhash_file
        .as_deref()
        .map(|p| HashFile::take(p, dst_path))
        .transpose()?;
    // A destination file the copy makes goes again if the copy fails
    // (never one that was there before).
    let made = match &dst_side {
        Side::Local(path) if changed.is_none() && std::fs::symlink_metadata(path).is_err() => {
            Some(path.clone())
        }
        _ => None,
    };
    // So does storage of the table's that the copy makes (a new S3 object).
    let mut made_storage = None;
    let (dst, truncated) = if changed.is_some() {
        (
            Opened::Device(dirty::open_destination(&dst_side, connections)?),
            false,
        )
    } else {
        open_destination(&dst_side, connections, src_size, &mut made_storage).inspect_err(|_| {
            if let Some(p) = &made {
                let _ = std::fs::remove_file(p);
            }
        })?
    };
    let mut remove_made = || {
        if let Some(p) = &made {
            let _ = std::fs::remove_file(p);
        }
        if let Some(u) = made_storage.take() {
            diskit_open::create::Undo::undo(u);
        }
    };
    let destination_is_zero = a.destination_is_zero || truncated;
    // Storage written front to back (a new S3 object) takes the copy's
    // writes in order, whatever the threads and requests in flight.
    let in_order = matches!(&dst, Opened::New(s) if s.writes_in_order());

    let opts_base = CopyOptions {
        min_sparse: sparse,
        allocated: a.allocated,
        target_is_zero: destination_is_zero,
        flush: a.flush,
        blkhash: blkhash.clone(),
        // What the bitmap leaves clean, the destination holds already.
        skip_backing: changed.is_some(),
        ordered_writes: in_order,
        ..CopyOptions::default()
    };
    let progress = Arc::new(Progress::default());
    let printer = progress_to.map(|to| ProgressPrinter::start_copy(progress.clone(), to));
    // The engine shares the destination with the threads that may write
    // to it (an NBD source's connections).
    let into_device = |src, dst: DeviceRef, sparse: &mut u64, base| {
        copy_devices(
            &a,
            src,
            &dst,
            connections,
            asked_request_size,
            sparse,
            queue_size,
            base,
            &progress,
            changed.clone(),
        )
        .and_then(|()| dst.close().map_err(nbd_err))
    };
    let hash = blkhash.as_deref();
    // The bytes copied, all of the source.
    let result = match (src, dst) {
        (Opened::Device(src), Opened::Device(dst)) => {
            let size = src.size();
            into_device(src, dst, &mut sparse, opts_base).map(|()| size)
        }
        (Opened::Device(src), Opened::File(dst) | Opened::New(dst)) => {
            let size = src.size();
            into_device(src, dst, &mut sparse, opts_base).map(|()| size)
        }
        (Opened::Device(src), Opened::Stream(out)) => {
            let r = to_stream(&*src, out, request_size, hash, &progress);
            let _ = src.close();
            r.map(|()| src.size())
        }
        (Opened::Stream(input), dst) => {
            from_stream(input, dst, request_size, sparse, a.flush, hash, &progress)
        }
        (Opened::File(_) | Opened::New(_), _) => {
            unreachable!("a source is a device or a stream")
        }
    };
    let result = result.and_then(|copied| match hash {
        Some(h) => print_blkhash(h, copied, hash_file.as_ref()),
        None => Ok(()),
    });
    if result.is_err()
        && let Some(f) = &hash_file
    {
        f.remove_made();
    }
    if let Some(p) = printer {
        if result.is_ok() {
            p.completed();
        }
        p.finish();
    }
    if result.is_err() {
        remove_made();
    }
    result.map(|()| 0)
}

/// Copies between two devices with the copy engine.
#[allow(clippy::too_many_arguments)]
fn copy_devices(
    a: &Args,
    src: DeviceRef,
    dst: &DeviceRef,
    connections: usize,
    asked_request_size: Option<u64>,
    sparse: &mut u64,
    queue_size: u64,
    base: CopyOptions,
    progress: &Progress,
    changed: Option<Arc<dyn ChangedRanges>>,
) -> Result<(), CliError> {
    if !dst.capabilities().can_write {
        return Err(CliError::new(format!(
            "{}: the destination is read-only, cannot write to it",
            dst.describe()
        )));
    }
    if src.size() > dst.size() {
        return Err(CliError::new(
            "error: destination size is smaller than source size",
        ));
    }
    // --no-extents: the noextents filter, which keeps requests in flight
    // (the source is named as it was opened).
    let src_name = src.describe();
    let src: DeviceRef = if a.no_extents {
        Arc::new(Filtered::new(Noextents, src))
    } else {
        src
    };
    // --dirty-bitmap: clean ranges read as left to the destination.
    let src: DeviceRef = match changed {
        Some(c) => Arc::new(Filtered::new(OnlyChanged::new(c), src)),
        None => src,
    };
    // Requests at least the preferred size of both sides; zero blocks no
    // smaller than what the destination prefers.
    let preferred = |d: &dyn BlockDevice| {
        u64::from(d.block_size().preferred)
            .max(1)
            .next_power_of_two()
    };
    let asynchronous = src.queue_depth() > 1 || dst.queue_depth() > 1;
    let request_size = asked_request_size
        .unwrap_or(if src.queue_depth() > 1 && dst.queue_depth() <= 1 {
            DEFAULT_NBD_READ_REQUEST
        } else {
            DEFAULT_REQUEST
        })
        .max(preferred(&*src))
        .max(preferred(dst))
        .min(MAX_REQUEST);
    if *sparse > 0 {
        *sparse = (*sparse).max(preferred(dst));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = match a.threads {
        Some(t) => t.max(1),
        // Synchronous devices (files) run one request per thread: threads
        // are their parallelism, and beyond the processors they only take
        // turns on them (as nbdcopy: a thread per processor; at least two,
        // so that one reads while another writes).
        None if !asynchronous => crate::util::local_copy_workers(),
        // An NBD source reads on its connections' own threads: one worker
        // keeps them busy, and leaves the processors to them (measured
        // fastest on two cores, to null: and to a file alike).
        None if src.queue_depth() > 1 => 1,
        // A file read into an NBD export: reads on a few threads.
        None => cores.min(connections),
    };
    let requests = if a.synchronous { 1 } else { a.requests.max(1) };
    if a.verbose {
        eprintln!("diskit copy: src: {src_name} size={}", src.size());
        eprintln!("diskit copy: dst: {} size={}", dst.describe(), dst.size());
        eprintln!(
            "diskit copy: connections={connections} requests={requests} threads={threads} synchronous={}",
            a.synchronous
        );
    }
    let opts = CopyOptions {
        min_sparse: *sparse,
        workers: threads,
        request_size: request_size as usize,
        requests,
        queue_size: queue_size.max(request_size),
        ..base
    };
    let result = copy(&*src, dst, &opts, progress);
    let closed = src.close();
    let stats = result.map_err(|e| {
        let (done, total) = progress.get();
        CliError::new(format!("{e} (copied {done} of {total} bytes)"))
    })?;
    closed.map_err(nbd_err)?;
    if a.verbose {
        eprintln!(
            "diskit copy: {} bytes of data, {} zeroed, {} skipped, {} zeroed first",
            stats.data_bytes, stats.zeroed_bytes, stats.skipped_bytes, stats.prezeroed_bytes
        );
    }
    Ok(())
}

/// Prints the blkhash of the `size` bytes copied, as nbdcopy does: the
/// digest in hex on a line of its own, on standard output or in `file`.
fn print_blkhash(hash: &BlockHash, size: u64, file: Option<&HashFile>) -> Result<(), CliError> {
    let md = hash
        .finish(size)
        .map_err(|e| CliError::new(format!("--blkhash: {e}")))?;
    let line = format!("{}\n", md.hex());
    match file {
        Some(f) => f.write(&line),
        None => std::io::stdout()
            .write_all(line.as_bytes())
            .map_err(|e| CliError::new(format!("write: {e}"))),
    }
}

/// Where `--blkhash-file` writes the checksum.
enum HashFile {
    /// A regular file, locked as a destination is; its name, and whether
    /// the copy made it.
    Storage(diskit_core::StorageRef, String, bool),
    /// A pipe or character device (`/dev/stdout`), written as it is.
    Stream(std::fs::File),
}

impl HashFile {
    /// Opens `path` without emptying it: a file is refused if the copy
    /// reads it, if it is the copy's destination (`destination`, by
    /// device and inode) or if another process uses it (QEMU's locks), a
    /// block device always, and a missing file is made.
    fn take(path: &std::path::Path, destination: Option<&str>) -> Result<HashFile, CliError> {
        use std::os::unix::fs::MetadataExt;
        let name = path.display().to_string();
        let id = |m: std::fs::Metadata| (m.dev(), m.ino());
        if let (Ok(h), Some(Ok(d))) = (std::fs::metadata(path), destination.map(std::fs::metadata))
            && id(h) == id(d)
        {
            return Err(CliError::new(format!(
                "{name}: --blkhash-file: the copy's destination cannot take its checksum too"
            )));
        }
        let made = std::fs::symlink_metadata(path).is_err();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| io_error(&name, &e))?;
        let ft = file
            .metadata()
            .map_err(|e| io_error(&name, &e))?
            .file_type();
        if ft.is_block_device() {
            return Err(CliError::new(format!(
                "{name}: --blkhash-file: not a regular file"
            )));
        }
        if !ft.is_file() {
            return Ok(HashFile::Stream(file));
        }
        // Emptied and written whole: no one else may write or resize it
        // (a file a server has open for writing is refused).
        let (perm, unshare) = diskit_core::storage::lock::for_image(true, true);
        let storage = diskit_open::local::adopt_destination(file, &name)
            .and_then(|s| s.lock_image(perm, unshare).map(|()| s))
            .map_err(|e| {
                if made {
                    let _ = std::fs::remove_file(path);
                }
                CliError::new(format!("{name}: {e}"))
            })?;
        Ok(HashFile::Storage(storage, name, made))
    }

    /// Removes the file if the copy made it (the copy failed).
    fn remove_made(&self) {
        if let HashFile::Storage(_, name, true) = self {
            let _ = std::fs::remove_file(name);
        }
    }

    /// Replaces what the file holds with `line`.
    fn write(&self, line: &str) -> Result<(), CliError> {
        match self {
            HashFile::Stream(f) => (&*f)
                .write_all(line.as_bytes())
                .map_err(|e| CliError::new(format!("write: {e}"))),
            HashFile::Storage(s, name, _) => {
                use diskit_core::Preallocation::Off;
                s.resize(0, Off)
                    .and_then(|()| s.write_extend(line.as_bytes(), 0))
                    .and_then(|()| s.close())
                    .map_err(|e| CliError::new(format!("{name}: {e}")))
            }
        }
    }
}

/// Copies a device to a pipe, every byte in order (hashed on the way when
/// asked).
fn to_stream(
    src: &dyn BlockDevice,
    mut out: std::fs::File,
    request: u64,
    hash: Option<&BlockHash>,
    progress: &Progress,
) -> Result<(), CliError> {
    let size = src.size();
    progress.start(size);
    let mut buf = vec![0u8; request as usize];
    let mut off = 0;
    while off < size {
        let n = (size - off).min(request) as usize;
        src.read_at(&mut buf[..n], off)
            .map_err(|e| CliError::new(format!("{}: read at {off}: {e}", src.describe())))?;
        if let Some(h) = hash {
            h.data(off, &buf[..n]);
        }
        out.write_all(&buf[..n])
            .map_err(|e| CliError::new(format!("write: {e}")))?;
        off += n as u64;
        progress.advance(n as u64);
    }
    Ok(())
}

/// Reads `buf` full from a stream; returns how much it got (less only at
/// the end).
fn read_full(input: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Copies a pipe to its end into a device, a growing file or another pipe
/// (hashed on the way when asked); returns the bytes copied.
fn from_stream(
    mut input: std::fs::File,
    dst: Opened,
    request: u64,
    sparse: u64,
    flush: bool,
    hash: Option<&BlockHash>,
    progress: &Progress,
) -> Result<u64, CliError> {
    // A stream is written in order anyway: made storage is a device here.
    let dst = match dst {
        Opened::New(s) => Opened::Device(s),
        d => d,
    };
    let mut buf = vec![0u8; request as usize];
    let mut off = 0u64;
    let werr = |off: u64, e: diskit_core::Error| CliError::new(format!("write at {off}: {e}"));
    loop {
        let n = read_full(&mut input, &mut buf).map_err(|e| CliError::new(format!("read: {e}")))?;
        if n == 0 {
            break;
        }
        let data = &buf[..n];
        if let Some(h) = hash {
            h.data(off, data);
        }
        let zero = sparse > 0 && data.iter().all(|&b| b == 0);
        match &dst {
            Opened::Stream(out) => {
                let mut out: &std::fs::File = out;
                out.write_all(data)
                    .map_err(|e| CliError::new(format!("write: {e}")))?;
            }
            // A truncated file reads as zeros: zero blocks are left as holes.
            Opened::File(f) => {
                if !zero {
                    f.write_extend(data, off).map_err(|e| werr(off, e))?;
                }
            }
            Opened::Device(d) => {
                if off + n as u64 > d.size() {
                    return Err(CliError::new(
                        "error: destination size is smaller than source size",
                    ));
                }
                if zero {
                    d.write_zeroes(off, n as u64, ZeroFlags::default())
                } else {
                    d.write_at(data, off, WriteFlags::NONE)
                }
                .map_err(|e| werr(off, e))?;
            }
            Opened::New(_) => unreachable!("made storage is written as a device"),
        }
        off += n as u64;
        progress.advance(n as u64);
    }
    match dst {
        Opened::File(f) => {
            // The file ends where the data did, holes at the end included.
            f.resize(off, diskit_core::Preallocation::Off)
                .and_then(|()| if flush { f.flush() } else { Ok(()) })
                .and_then(|()| f.close())
                .map_err(nbd_err)?;
        }
        Opened::Device(d) => {
            if flush {
                d.flush().map_err(nbd_err)?;
            }
            d.close().map_err(nbd_err)?;
        }
        Opened::Stream(_) => {}
        Opened::New(_) => unreachable!("made storage is written as a device"),
    }
    Ok(off)
}
