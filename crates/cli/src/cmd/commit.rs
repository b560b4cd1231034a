//! `diskit commit`: write what an image holds into its backing file (or a
//! base further down its chain), then empty the image unless told not to.

use std::path::PathBuf;
use std::sync::Arc;

use crate::CmdResult;
use crate::progress::ProgressPrinter;
use crate::util::{CliError, OpenPolicy, cache_mode, parse_size_arg, parse_source_format};
use diskit_copy::Progress;
use diskit_copy::commit::{RateLimit, commit};
use diskit_open::{Capability, Image, OpenOptions, Prealloc};

/// Arguments of `commit`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Cache mode: writeback (default), unsafe, none, writethrough, directsync.
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// Commit into this image of the chain (implies -d).
    #[arg(short = 'b', long = "base")]
    base: Option<String>,
    /// Do not empty the image afterwards.
    #[arg(short = 'd', long = "drop")]
    drop: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Write at most this many bytes per second.
    #[arg(short = 'r', long = "rate")]
    rate_limit: Option<String>,
    /// The image to commit.
    filename: PathBuf,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    let cache = cache_mode(a.cache.as_deref(), "writeback")?;
    let rate = a
        .rate_limit
        .as_deref()
        .map(|r| parse_size_arg(r, "rate limit"))
        .transpose()?;
    // -b implies -d: emptying the image would change what the images
    // between it and the base show.
    let drop = a.drop || a.base.is_some();
    let opts = OpenOptions {
        direct: cache.direct,
        ..Default::default()
    };
    // Find the base first (a look that takes no locks: the writable open
    // below takes them, and says what holds the image as qemu-img does),
    // then open the chain writable down to it.
    let depth = {
        let look = OpenOptions {
            force_share: true,
            ..opts.clone()
        };
        let img = policy.open(&a.filename, format, look)?;
        base_depth(&img, &a)?
    };
    let img = policy.open(
        &a.filename,
        format,
        OpenOptions {
            writable: true,
            writable_backing_depth: depth,
            ..opts
        },
    )?;
    let progress = Arc::new(Progress::default());
    let printer = (a.progress && !a.quiet).then(|| ProgressPrinter::start(progress.clone()));
    let result = commit_into(&img, depth, &progress, rate);
    if let (Some(p), Ok(_)) = (&printer, &result) {
        p.completed();
    }
    if let Some(p) = printer {
        p.finish();
    }
    result?;
    if !drop {
        empty(img, &a)?;
    }
    if !a.quiet {
        println!("Image committed.");
    }
    Ok(0)
}

/// The position of the base in the chain of `img`.
fn base_depth(img: &Image, a: &Args) -> Result<usize, CliError> {
    match &a.base {
        Some(name) => img.find_backing(name).ok_or_else(|| {
            CliError::new(format!(
                "Did not find '{name}' in the backing chain of '{}'",
                a.filename.display()
            ))
        }),
        None if img.backing.is_some() => Ok(1),
        None => Err(CliError::new("Image does not have a backing file")),
    }
}

/// Grows the base to the image's size if it is smaller, then copies.
fn commit_into(
    img: &Image,
    depth: usize,
    progress: &Progress,
    rate: Option<u64>,
) -> Result<(), CliError> {
    let failed = |e: diskit_core::Error| CliError::new(format!("Block job failed: {e}"));
    let base = img.chain()[depth];
    let size = img.virtual_size();
    if base.virtual_size() < size {
        base.ops
            .resize(size, false, Prealloc::Off)
            .map_err(failed)?;
    }
    // QEMU's default block size for the job: the base's clusters, or 64 KiB.
    let granularity = base.ops.cluster_size().map_or(65536, |c| c.max(4096));
    let mut limit = RateLimit::new(rate);
    commit(
        &*img.device,
        &*base.device,
        depth as u32,
        granularity,
        progress,
        &mut limit,
    )
    .map_err(failed)?;
    base.close().map_err(failed)?;
    Ok(())
}

/// Empties the committed image: everything reads from its backing file.
fn empty(img: Image, a: &Args) -> Result<(), CliError> {
    let fail = |e: diskit_core::Error| {
        CliError::new(format!("Could not empty {}: {e}", a.filename.display()))
    };
    // A format that cannot be emptied keeps its data, which now matches
    // its backing file's: qemu-img ignores ENOTSUP from emptying too.
    if !img.format.supports(Capability::MakeEmpty) {
        return img.close().map_err(fail);
    }
    let after_close = img.ops.make_empty().map_err(fail)?;
    img.close().map_err(fail)?;
    // Resetting the file needs every handle on it closed.
    drop(img);
    match after_close {
        Some(reset) => reset().map_err(fail),
        None => Ok(()),
    }
}
