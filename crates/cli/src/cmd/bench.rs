//! `diskit bench`: qemu-img bench — a run of reads or writes of one size,
//! many in parallel, at offsets that step through the image (wrapping at
//! its end), timed.

use std::path::PathBuf;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::CmdResult;
use crate::util::{CliError, ForceShare, OpenPolicy, cache_mode, cvtnum, parse_source_format};
use diskit_core::{Error, ErrorKind, WriteFlags};
use diskit_open::OpenOptions;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Requests to send (default 75000).
    #[arg(short = 'c', long = "count")]
    count: Option<String>,
    /// Requests in parallel (default 64).
    #[arg(short = 'd', long = "depth")]
    depth: Option<String>,
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Write tests: a flush every this many requests (0: none).
    #[arg(long = "flush-interval")]
    flush_interval: Option<String>,
    /// Write tests: do not wait for the requests in flight before a flush.
    #[arg(long = "no-drain")]
    no_drain: bool,
    /// Native AIO (needs a direct cache mode, -t none or directsync).
    #[arg(short = 'n', long = "native")]
    native_aio: bool,
    /// AIO mode: threads (the default) or native (as -n).
    #[arg(short = 'i', long = "aio")]
    aio: Option<String>,
    /// The first request's offset.
    #[arg(short = 'o', long = "offset")]
    offset: Option<String>,
    /// The byte written (write tests; default 0).
    #[arg(long = "pattern")]
    pattern: Option<String>,
    /// Quiet (accepted: qemu-img prints its two lines anyway).
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Bytes per request (default 4096).
    #[arg(short = 's', long = "buffer-size")]
    size: Option<String>,
    /// Bytes between the offsets of consecutive requests (default the
    /// request size).
    #[arg(short = 'S', long = "step-size")]
    step: Option<String>,
    /// Cache mode: none, writeback (default), writethrough, directsync, unsafe.
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    #[command(flatten)]
    share: ForceShare,
    /// Write instead of read.
    #[arg(short = 'w', long = "write")]
    write: bool,
    /// The image.
    filename: PathBuf,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let _ = a.quiet;
    let policy = a.share.policy(policy);
    let int_max = i128::from(i32::MAX);
    let count = match &a.count {
        Some(v) => cvtnum("request count", v, 1, int_max)?,
        None => 75000,
    };
    let depth = match &a.depth {
        Some(v) => cvtnum("queue depth", v, 1, int_max)?,
        None => 64,
    };
    let bufsize = match &a.size {
        Some(v) => cvtnum("buffer size", v, 1, int_max)?,
        None => 4096,
    };
    let step = match &a.step {
        Some(v) => cvtnum("step size", v, 0, i64::MAX.into())?,
        None => 0,
    };
    let step = if step == 0 { bufsize } else { step };
    let offset = match &a.offset {
        Some(v) => cvtnum("offset", v, 0, i64::MAX.into())?,
        None => 0,
    };
    let flush_interval = match &a.flush_interval {
        Some(v) => cvtnum("flush interval", v, 0, int_max)?,
        None => 0,
    };
    let pattern = match &a.pattern {
        Some(v) => cvtnum("pattern byte", v, 0, 255)? as u8,
        None => 0,
    };
    if !a.write && (a.flush_interval.is_some() || a.no_drain) {
        let what = if a.flush_interval.is_some() {
            "--flush-interval"
        } else {
            "--no-drain"
        };
        return Err(CliError::new(format!(
            "{what} is only available in write tests"
        )));
    }
    if flush_interval > 0 && flush_interval < depth {
        return Err(CliError::new("Flush interval can't be smaller than depth"));
    }
    let cache = cache_mode(a.cache.as_deref(), "writeback")
        .map_err(|_| CliError::new("Invalid cache mode"))?;
    let native_aio = match a.aio.as_deref() {
        None => a.native_aio,
        Some("threads") => a.native_aio,
        Some("native") => true,
        Some("io_uring") => {
            return Err(CliError::new("aio=io_uring is not supported by diskit"));
        }
        Some(other) => return Err(CliError::new(format!("Invalid aio option: {other}"))),
    };
    if native_aio && !cache.direct {
        return Err(CliError::new(format!(
            "Could not open '{}': aio=native was specified, but it requires cache.direct=on, which was not specified.",
            a.filename.display()
        )));
    }
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    let image = policy.open(
        &a.filename,
        format,
        OpenOptions {
            writable: a.write,
            direct: cache.direct,
            no_flush: cache.no_flush,
            ..OpenOptions::default()
        },
    )?;
    let dev = image.device.clone();
    let image_size = dev.size();
    println!(
        "Sending {count} {} requests, {bufsize} bytes each, {depth} in parallel (starting at offset {offset}, step size {step})",
        if a.write { "write" } else { "read" }
    );
    if flush_interval > 0 {
        println!("Sending flush every {flush_interval} requests");
    }
    // Each worker takes the next request number; its offset steps from
    // the first one, wrapping at the end of the image.
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_error: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    // Requests hold it shared; a draining flush takes it alone.
    let drain = RwLock::new(());
    let offset_of = |i: u64| -> u64 {
        let pos = offset as u128 + i as u128 * step as u128;
        if image_size == 0 {
            0
        } else if i == 0 {
            offset
        } else {
            // qemu-img wraps the offset once it passes the end.
            (pos % image_size as u128) as u64
        }
    };
    let start = Instant::now();
    let workers = depth.min(64).min(count);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut buf = vec![pattern; bufsize as usize];
                loop {
                    if failed.load(Ordering::Relaxed) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return;
                    }
                    let at = offset_of(i);
                    let r = if at.checked_add(bufsize).is_none_or(|end| end > image_size) {
                        // Past the end: QEMU's block layer says EIO.
                        Err(Error::new(
                            ErrorKind::Io,
                            "request past the end of the image",
                        ))
                    } else {
                        let _shared = diskit_core::sync::read(&drain);
                        if a.write {
                            dev.write_at(&buf, at, WriteFlags::NONE)
                        } else {
                            dev.read_at(&mut buf, at)
                        }
                    };
                    let r = r.and_then(|()| {
                        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                        if flush_interval > 0 && n.is_multiple_of(flush_interval) {
                            if a.no_drain {
                                dev.flush()
                            } else {
                                let _alone = diskit_core::sync::write(&drain);
                                dev.flush()
                            }
                        } else {
                            Ok(())
                        }
                    });
                    if let Err(e) = r {
                        failed.store(true, Ordering::Relaxed);
                        let mut slot = diskit_core::sync::lock(&first_error);
                        slot.get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(CliError::new(format!(
            "Failed request: {}",
            e.kind().description()
        )));
    }
    if a.write && flush_interval > 0 && !a.no_drain {
        dev.flush().map_err(|e| {
            CliError::new(format!("Failed flush request: {}", e.kind().description()))
        })?;
    }
    println!(
        "Run completed in {:.3} seconds.",
        start.elapsed().as_secs_f64()
    );
    image.close().map_err(|e| CliError::new(e.to_string()))?;
    Ok(0)
}
