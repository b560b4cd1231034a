//! `diskit convert`: copy one or more images (concatenated) into a new or
//! existing image of any format, keeping holes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::CmdResult;
use crate::progress::ProgressPrinter;
use crate::util::OpenPolicy;
use crate::util::{
    CacheMode, CliError, ForceShare, cache_mode, parse_format, parse_options, parse_size_arg,
    parse_source_format,
};
use diskit_copy::{CopyOptions, Progress, copy};
use diskit_core::concat::Concat;
use diskit_core::{BlockDevice, DeviceRef, Filtered};
use diskit_open::{Capability, Format, Image, NewBitmap, OpenOptions};

/// Arguments of `convert`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Source format (probed if absent).
    #[arg(short = 'f', long = "source-format")]
    format: Option<String>,
    /// Target format (default raw).
    #[arg(short = 'O', long = "target-format", alias = "output-format")]
    out_format: Option<String>,
    /// Target creation options.
    #[arg(short = 'o', long = "target-options", alias = "options", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Zero runs of at least this many bytes become holes (default 4k; 0 = none).
    #[arg(short = 'S', long = "sparse-size")]
    sparse_size: Option<String>,
    /// The target exists already: do not create it.
    #[arg(short = 'n', long = "no-create")]
    no_create: bool,
    /// The target is an --image-opts description (with -n).
    #[arg(long = "target-image-opts")]
    target_image_opts: bool,
    /// The sources are --image-opts descriptions (as the global
    /// --image-opts).
    #[arg(long = "source-image-opts")]
    source_image_opts: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Requests in flight (1 to 16; default: 8, or the number of
    /// processors, at least 2, between local files).
    #[arg(short = 'm', long = "parallel")]
    coroutines: Option<String>,
    /// Allow writes out of order.
    #[arg(short = 'W', long = "oob-writes")]
    out_of_order: bool,
    /// Compress the target.
    #[arg(short = 'c', long = "compress")]
    compress: bool,
    /// The target reads as zeros already (with -n).
    #[arg(long = "target-is-zero")]
    target_is_zero: bool,
    /// Target cache mode: writeback, unsafe (default), none, writethrough, directsync.
    #[arg(short = 't', long = "target-cache")]
    cache: Option<String>,
    /// Source cache mode.
    #[arg(short = 'T', long = "source-cache")]
    src_cache: Option<String>,
    /// Backing file of the target: only what the source's top layer holds
    /// is written.
    #[arg(short = 'B', long = "backing")]
    backing: Option<String>,
    /// Format of the target's backing file.
    #[arg(short = 'F', long = "backing-format")]
    backing_format: Option<String>,
    /// Snapshot of the source to read.
    #[arg(short = 'l', long = "source-snapshot", alias = "snapshot")]
    snapshot: Option<String>,
    /// Copy the source's persistent bitmaps (qcow2 to qcow2).
    #[arg(long = "bitmaps")]
    bitmaps: bool,
    /// Read errors become zeros, with a warning for each sector.
    #[arg(long = "salvage")]
    salvage: bool,
    /// Read the source at most this many bytes a second (suffixes k, M, G...).
    #[arg(short = 'r', long = "rate")]
    rate: Option<String>,
    /// Copy offloading: copy_file_range between the files, where both
    /// sides are raw files.
    #[arg(short = 'C', long = "copy-range-offloading")]
    copy_offload: bool,
    /// With --bitmaps, skip bitmaps marked inconsistent instead of failing.
    #[arg(long = "skip-broken-bitmaps")]
    skip_broken_bitmaps: bool,
    #[command(flatten)]
    share: ForceShare,
    /// Sources, then the target (options may come between them, as
    /// qemu-img's getopt allows).
    #[arg(required = true, num_args = 1.., action = clap::ArgAction::Append)]
    files: Vec<PathBuf>,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    if a.files.len() < 2 {
        return Err(CliError::new("Must specify image file name"));
    }
    let (sources, target) = a.files.split_at(a.files.len() - 1);
    let target = &target[0];
    let src_format = parse_source_format(a.format.as_deref(), &sources[0])?;
    let out_format = parse_format(a.out_format.as_deref())?.unwrap_or(Format::RAW);
    let mut options = parse_options(&a.options)?;
    if options.wants_help() {
        // The target format's options, with the target's file named.
        print!("{}", crate::util::create_help(out_format, Some(target)));
        return Ok(0);
    }
    let workers: usize = match a.coroutines.as_deref().map(str::parse::<i64>) {
        None => default_workers(&a.files),
        Some(Ok(n)) if (1..=16).contains(&n) => n as usize,
        Some(Ok(_)) => {
            return Err(CliError::new(
                "Invalid number of coroutines specified. Must be between 1 and 16.",
            ));
        }
        Some(Err(_)) => {
            return Err(CliError::new(format!(
                "Invalid number of coroutines specified: '{}'.",
                a.coroutines.as_deref().unwrap_or_default()
            )));
        }
    };
    let min_sparse = match &a.sparse_size {
        None => 4096,
        Some(s) => {
            let v = parse_size_arg(s, "buffer size for sparse output")?;
            if v % 512 != 0 || v > 16 << 20 {
                return Err(CliError::new(
                    "Invalid buffer size for sparse output specified. Valid sizes are multiples \
                     of 512 up to 16777216. Select 0 to disable sparse detection (fully allocates \
                     output).",
                ));
            }
            v
        }
    };
    if a.no_create && !options.is_empty() {
        return Err(CliError::new(
            "-o has no effect when skipping image creation",
        ));
    }
    if a.copy_offload && a.compress {
        return Err(CliError::new(
            "Cannot enable copy offloading when -c is used",
        ));
    }
    if a.copy_offload && a.sparse_size.is_some() {
        return Err(CliError::new(
            "Cannot enable copy offloading when -S is used",
        ));
    }
    // -r: bytes a second (0: no limit), with qemu-img's suffixes.
    let rate = match &a.rate {
        None => None,
        Some(r) => match crate::util::cvtnum("rate limit", r, 0, i64::MAX.into())? {
            0 => None,
            n => Some(n),
        },
    };
    if a.target_image_opts && !a.no_create {
        return Err(CliError::new("--target-image-opts requires use of -n flag"));
    }
    if a.target_is_zero && !a.no_create {
        return Err(CliError::new("--target-is-zero requires use of -n flag"));
    }
    if a.compress && !out_format.supports(Capability::Compression) {
        return Err(CliError::new(
            "Compression not supported for this file format",
        ));
    }
    if a.backing.is_some() && !out_format.supports(Capability::BackingFile) {
        return Err(CliError::new(format!(
            "Backing file not supported for file format '{out_format}'"
        )));
    }
    if a.backing.is_some() && sources.len() > 1 {
        return Err(CliError::new(
            "Having a backing file for the target makes no sense when concatenating multiple \
             input images",
        ));
    }
    if !a.no_create {
        if let Some(b) = &a.backing {
            options.set("backing_file", b);
        }
        if let Some(f) = &a.backing_format {
            options.set("backing_fmt", f);
        }
        if options.get("backing_file").is_some() && options.get("backing_fmt").is_none() {
            return Err(CliError::new(
                "Use of backing file requires explicit backing format",
            ));
        }
    }
    if !a.no_create && out_format == Format::RAW {
        // Check the options before anything is opened or created.
        out_format
            .driver()
            .parse_create(&options)
            .map_err(|e| CliError::new(e.to_string()))?;
    }
    let src_cache = cache_mode(a.src_cache.as_deref(), "writeback")?;
    let dst_cache = cache_mode(a.cache.as_deref(), "unsafe")?;
    let policy = a.share.policy(policy);

    if a.skip_broken_bitmaps && !a.bitmaps {
        return Err(CliError::new("--skip-broken-bitmaps requires --bitmaps"));
    }
    if a.bitmaps && sources.len() > 1 {
        return Err(CliError::new(
            "Copying bitmaps only possible with single source",
        ));
    }
    let mut bitmaps = Vec::new();
    let mut devices: Vec<DeviceRef> = Vec::new();
    for s in sources {
        let img = policy
            .open_name_as(
                s,
                src_format,
                OpenOptions {
                    writable: false,
                    // qemu-img's sources: no one writes them while they are
                    // read, the target included, by any name.
                    source: true,
                    no_share: true,
                    direct: src_cache.direct,
                    snapshot: a.snapshot.clone(),
                    // Preallocated space never written is skipped, not read.
                    host_zeros: true,
                    ..Default::default()
                },
                a.source_image_opts || policy.image_opts,
            )
            .map_err(|e| {
                if e.kind() == diskit_core::ErrorKind::NotFound && a.snapshot.is_some() {
                    CliError::new(format!("Failed to load snapshot: {e}"))
                } else {
                    CliError::new(format!("Could not open '{}': {e}", s.display()))
                }
            })?;
        if a.snapshot.is_some() && !img.format.supports(Capability::Snapshots) {
            return Err(CliError::new(format!(
                "Failed to load snapshot: Block format '{}' used by device '' does not support \
                 temporarily loading internal snapshots",
                img.format
            )));
        }
        if a.bitmaps {
            bitmaps = source_bitmaps(&img, a.skip_broken_bitmaps)?;
        }
        devices.push(img.device);
    }
    let bitmap_target = out_format.supports(Capability::Bitmaps);
    if a.bitmaps && (!bitmap_target || target.as_os_str() == NULL_TARGET) {
        let driver = if bitmap_target {
            "null-co"
        } else {
            out_format.name()
        };
        return Err(CliError::new(format!(
            "Format driver '{driver}' does not support bitmaps"
        )));
    }
    let mut src: DeviceRef = if devices.len() == 1 {
        devices.pop().expect("one source")
    } else {
        Arc::new(Concat::new(devices)?)
    };
    if a.salvage {
        src = Arc::new(Filtered::new(crate::cmd::convert_io::salvage::Salvage, src));
    }
    if let Some(rate) = rate {
        src = crate::cmd::convert_io::rate_limited(src, rate)?;
    }
    let total = src.size();

    if target.as_os_str() == NULL_TARGET {
        // QEMU's null protocol: everything written is dropped.
        if !a.no_create {
            return Err(CliError::new(
                "Protocol driver 'null-co' does not support image creation",
            ));
        }
        let null: DeviceRef = diskit_open::local::null_sink(total);
        let how = How {
            target_is_zero: a.target_is_zero,
            zeros_from: u64::MAX,
            min_sparse,
            workers,
            ordered_writes: false,
            zero_alignment: 1,
            skip_backing: false,
        };
        return run_copy(&a, &*src, &null, &how);
    }
    // The file made for the target (none with -n: it exists, as any storage).
    let mut made: Vec<diskit_open::create::Undo> = Vec::new();
    if !a.no_create {
        let failed = |e: diskit_core::Error| {
            CliError::new(format!(
                "{}: error while converting {}: {e}",
                target.display(),
                out_format
            ))
        };
        let (_, files) = diskit_open::create::create_image(
            crate::util::name_of(target)?,
            out_format,
            Some(total),
            &options,
        )
        .map_err(failed)?;
        made = files;
    }
    let created = !a.no_create;
    // A target with a backing file (-B, or -o backing_file) gets only what
    // the source's top layer holds.
    let skip_backing = a.backing.is_some() || options.get("backing_file").is_some();
    let result = copy_into(
        &a,
        &*src,
        target,
        out_format,
        created,
        min_sparse,
        workers,
        &dst_cache,
        skip_backing,
        bitmaps,
        &policy,
    );
    if result.is_err() {
        // Leave no half-written target behind (never a device, never a
        // file that was there before).
        for u in made.into_iter().rev() {
            u.undo();
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn copy_into(
    a: &Args,
    src: &dyn BlockDevice,
    target: &Path,
    out_format: Format,
    created: bool,
    min_sparse: u64,
    workers: usize,
    cache: &CacheMode,
    skip_backing: bool,
    bitmaps: Vec<NewBitmap>,
    policy: &OpenPolicy,
) -> CmdResult {
    // cache=unsafe: no flush reaches the target file, the format's own
    // (qcow2's metadata ordering, its close) included, as in qemu-img.
    // An image made encrypted is opened with the secret it was made with.
    let created_secret = if created {
        let o = parse_options(&a.options)?;
        o.get("key-secret")
            .or(o.get("encrypt.key-secret"))
            .map(str::to_string)
    } else {
        None
    };
    let opts = OpenOptions {
        writable: true,
        direct: cache.direct,
        no_flush: cache.no_flush,
        key_secret: created_secret,
        ..Default::default()
    };
    // The target is a plain name (--image-opts is for sources) unless
    // --target-image-opts says otherwise.
    let (format, image_opts) = match a.target_image_opts {
        true => (None, true),
        false => (Some(out_format), false),
    };
    let dst = policy
        .open_name_as(target, format, opts, image_opts)
        .map_err(|e| CliError::new(format!("Could not open '{}': {e}", target.display())))?;
    if dst.virtual_size() < src.size() {
        return Err(CliError::new("output file is smaller than input file"));
    }
    // A file created just now reads as zeros (even preallocated); a block
    // device never is, whatever we did to it.
    // With a backing file the target shows it, not zeros: everything the
    // source's top layer holds is written, zeros included.
    let target_is_zero = !skip_backing
        && (a.target_is_zero
            || (created && !dst.file.is_fixed_size() && dst.ops.created_reads_as_zeros())
            || dst.device.is_known_zero());
    // A new image with a backing file reads zeros past the backing file's
    // end: zeros there need no writing (qemu-img's target_backing_sectors).
    let zeros_from = match (&dst.backing, created && skip_backing) {
        (Some(b), true) => b.virtual_size(),
        _ => u64::MAX,
    };
    let mut how = How {
        target_is_zero,
        zeros_from,
        min_sparse,
        workers,
        // Raw has no layout that depends on write order; storage written
        // front to back (a new S3 object) takes writes in order, -W or not.
        ordered_writes: (!a.out_of_order && out_format != Format::RAW)
            || dst.file.writes_in_order(),
        zero_alignment: 1,
        skip_backing,
    };
    let mut device = dst.device.clone();
    if min_sparse == 0 {
        // -S 0: zeros are written as data, as qemu-img writes them.
        device = Arc::new(Filtered::new(
            crate::cmd::convert_io::zeroes_as_data::ZeroesAsData,
            device,
        ));
    }
    let whole_clusters = dst.ops.needs_compressed_writes();
    if a.compress || whole_clusters {
        if !dst.format.supports(Capability::Compression) {
            return Err(CliError::new(
                "Compression not supported for this file format",
            ));
        }
        // Whole clusters are compressed on the copy workers' threads, in
        // parallel (announced before each worker's turn to write), and
        // stored in guest order, as qemu-img lays them out: the same
        // source gives the same bytes whatever -m.
        let (writer, cs) = dst
            .ops
            .clone()
            .compressed_writer()
            .map_err(|e| CliError::new(e.to_string()))?;
        device = writer;
        how.min_sparse = cs;
        how.zero_alignment = cs;
        how.ordered_writes = true;
    }
    if a.copy_offload
        && out_format == Format::RAW
        && bitmaps.is_empty()
        && let Some(fd) = dst.file.fd()
    {
        let done = crate::cmd::convert_io::offload::copy(src, &*dst.device, fd, how.target_is_zero)
            .map_err(|e| CliError::new(e.to_string()))?;
        if done {
            if !cache.no_flush {
                dst.device
                    .flush()
                    .map_err(|e| CliError::new(e.to_string()))?;
            }
            dst.close().map_err(|e| CliError::new(e.to_string()))?;
            return Ok(0);
        }
    }
    if !bitmaps.is_empty() {
        if !dst.ops.stores_bitmaps() {
            return Err(CliError::new(format!(
                "Format driver '{}' does not support bitmaps",
                dst.format
            )));
        }
        run_copy(a, src, &device, &how)?;
        dst.ops
            .add_bitmaps(bitmaps)
            .map_err(|e| CliError::new(e.to_string()))?;
    } else {
        run_copy(a, src, &device, &how)?;
    }
    if !cache.no_flush {
        dst.device
            .flush()
            .map_err(|e| CliError::new(e.to_string()))?;
    }
    dst.close().map_err(|e| CliError::new(e.to_string()))?;
    Ok(0)
}

/// The persistent bitmaps of a source image, with their bits, for
/// `--bitmaps` (inconsistent ones fail, or are skipped with a warning).
fn source_bitmaps(img: &Image, skip_broken: bool) -> Result<Vec<NewBitmap>, CliError> {
    if !img.format.supports(Capability::Bitmaps) {
        return Err(CliError::new("Source lacks bitmap support"));
    }
    let fail = |e: diskit_core::Error| CliError::new(e.to_string());
    let list = img.ops.bitmaps().map_err(fail)?;
    let mut out = Vec::new();
    for b in list {
        let name = b.name.clone();
        if b.in_use {
            if skip_broken {
                eprintln!(
                    "{}: warning: Skipping inconsistent bitmap '{name}'",
                    crate::names::prog()
                );
                continue;
            }
            return Err(CliError::new(format!(
                "Cannot copy inconsistent bitmap '{name}'\nTry --skip-broken-bitmaps, or use \
                 'qemu-img bitmap --remove' to delete it"
            )));
        }
        let bits = img.ops.bitmap_bits(&b).map_err(fail)?;
        out.push(NewBitmap {
            name,
            enabled: b.auto,
            bits,
        });
    }
    Ok(out)
}

/// Requests in flight (worker threads) when `-m` is not given: qemu-img's 8,
/// but no more than the processors (and at least 2, so that one reads while
/// another writes) when every name is a local file. A copy between files in
/// the page cache is processor-bound, and threads beyond the processors only
/// take turns on them: on two processors, 2 workers copied 12-15% faster than
/// 8 (raw and qcow2 targets, ext4 and tmpfs, measured). Requests to remote
/// storage wait on the network, where more in flight pay.
fn default_workers(names: &[PathBuf]) -> usize {
    const QEMU_DEFAULT: usize = 8;
    let remote = names.iter().any(|n| {
        let n = n.to_string_lossy();
        n.starts_with("json:") || diskit_open::protocol::for_name(&n).is_ok_and(|p| p.network)
    });
    if remote {
        QEMU_DEFAULT
    } else {
        crate::util::local_copy_workers()
    }
}

/// The target name of QEMU's null protocol.
const NULL_TARGET: &str = "null-co://";

/// How to copy.
struct How {
    target_is_zero: bool,
    /// The target reads as zeros from here on (see `CopyOptions::zeros_from`).
    zeros_from: u64,
    min_sparse: u64,
    workers: usize,
    ordered_writes: bool,
    zero_alignment: u64,
    skip_backing: bool,
}

/// Bytes per data request: 2 MiB between local devices; from an NBD source
/// into a local target, 1 MiB, which costs nbdkit and qemu-nbd less work per
/// byte than nbdcopy's 256 KiB (measured); into an NBD target, 256 KiB, so
/// that many requests
/// are in flight at once and a server that splits large writes (nbdkit's
/// blocksize filter runs the pieces one after another) spreads the work.
fn request_size(src: &dyn BlockDevice, dst: &dyn BlockDevice) -> usize {
    let preferred = src.block_size().preferred.max(dst.block_size().preferred) as usize;
    if dst.queue_depth() > 1 {
        (256usize << 10).max(preferred.next_power_of_two())
    } else if src.queue_depth() > 1 {
        (1usize << 20).max(preferred.next_power_of_two())
    } else {
        2 << 20
    }
}

/// Copies `src` into `dst` with the progress display.
fn run_copy(a: &Args, src: &dyn BlockDevice, dst: &DeviceRef, how: &How) -> CmdResult {
    let min_sparse = how.min_sparse;
    // A source that takes requests without waiting (NBD) keeps many in
    // flight from one worker, and reads on its connections' threads: more
    // workers only compete with them for the processors. Compression
    // needs the workers' threads.
    let workers = if src.queue_depth() > 1 && !a.compress {
        1
    } else {
        how.workers
    };
    let opts = CopyOptions {
        min_sparse,
        workers,
        target_is_zero: how.target_is_zero,
        ordered_writes: how.ordered_writes,
        flush: false,
        zero_alignment: how.zero_alignment,
        skip_backing: how.skip_backing,
        zeros_from: how.zeros_from,
        // Holes are made of whole aligned blocks of pow2floor(-S) bytes, as
        // qemu-img does; requests must hold at least one such block.
        request_size: request_size(src, dst).max(pow2_floor(min_sparse) as usize),
        // -S 0: every byte allocated.
        allocated: min_sparse == 0,
        ..CopyOptions::default()
    };
    let progress = Arc::new(Progress::default());
    let printer = (a.progress && !a.quiet).then(|| ProgressPrinter::start(progress.clone()));
    let result = copy(src, dst, &opts, &progress);
    if let (Some(p), Ok(_)) = (&printer, &result) {
        p.completed();
    }
    if let Some(p) = printer {
        p.finish();
    }
    result.map_err(|e| CliError::new(e.to_string()))?;
    Ok(0)
}

/// The largest power of two not above `v` (0 for 0).
fn pow2_floor(v: u64) -> u64 {
    if v == 0 {
        0
    } else {
        1 << (63 - v.leading_zeros())
    }
}
