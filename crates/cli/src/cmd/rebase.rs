//! `diskit rebase`: change the backing file of an image. Safe mode first
//! writes into the image whatever would read differently through the new
//! backing file; `-u` only changes the name in the header.

use std::path::PathBuf;
use std::sync::Arc;

use crate::CmdResult;
use crate::progress::ProgressPrinter;
use crate::util::{CliError, ForceShare, OpenPolicy, cache_mode, parse_source_format};
use diskit_copy::Progress;
use diskit_copy::rebase::{Backings, copy_differences, copy_differences_into};
use diskit_core::storage::resolve_relative;
use diskit_core::{DeviceRef, ErrorKind};
use diskit_open::{BackingName, Format, Image, OpenOptions, open_image};

/// Arguments of `rebase`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// The new backing file ("" for none).
    #[arg(short = 'b', long = "backing")]
    backing: Option<String>,
    /// Format of the new backing file (-B in newer qemu-img).
    #[arg(short = 'F', long = "backing-format", short_alias = 'B')]
    backing_format: Option<String>,
    /// Unsafe: only change the name; the old backing file is not read.
    #[arg(short = 'u', long = "backing-unsafe")]
    unsafe_mode: bool,
    /// Compress what safe mode writes into the image.
    #[arg(short = 'c', long = "compress")]
    compress: bool,
    /// Cache mode of the image (default writeback).
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// Cache mode of the backing files (default writeback).
    #[arg(short = 'T', long = "backing-cache")]
    src_cache: Option<String>,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    #[command(flatten)]
    share: ForceShare,
    /// The image.
    filename: PathBuf,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    if !a.unsafe_mode && a.backing.is_none() {
        return Err(CliError::usage(
            "rebase",
            "Must specify backing file (-b) or use unsafe mode (-u)",
        ));
    }
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    let cache = cache_mode(a.cache.as_deref(), "writeback")?;
    let src_cache = cache_mode(a.src_cache.as_deref(), "writeback").map_err(|_| {
        CliError::new(format!(
            "Invalid source cache option: {}",
            a.src_cache.as_deref().unwrap_or_default()
        ))
    })?;
    let policy = a.share.policy(policy);
    let img = policy.open(
        &a.filename,
        format,
        OpenOptions {
            writable: true,
            direct: cache.direct,
            no_backing: a.unsafe_mode,
            ..Default::default()
        },
    )?;
    if format.is_none() && img.format == Format::RAW {
        crate::util::warn_probed_raw(&a.filename);
    }
    let new_format = match &a.backing_format {
        Some(f) => Some(
            Format::from_name(f)
                .map_err(|_| CliError::new(format!("Invalid format name: '{f}'")))?,
        ),
        None => None,
    };
    let name = a.backing.as_deref().filter(|b| !b.is_empty());
    if !a.unsafe_mode {
        let new = match name {
            Some(n) => Some(open_new_backing(&img, n, new_format, src_cache.direct)?),
            None => None,
        };
        let progress = Arc::new(Progress::default());
        let printer = (a.progress && !a.quiet).then(|| ProgressPrinter::start(progress.clone()));
        let backings = Backings {
            old: img.backing.as_ref().map(|b| &*b.device),
            new: new.as_deref(),
        };
        let result = if a.compress {
            // Whole clusters, compressed, as qemu-img rebase -c writes them.
            let (writer, cs) = img
                .ops
                .clone()
                .compressed_writer()
                .map_err(|e| CliError::new(e.to_string()))?;
            copy_differences_into(&*img.device, &*writer, &backings, cs, &progress)
        } else {
            let align = img.ops.subcluster_size().unwrap_or(1);
            copy_differences(&*img.device, &backings, align, &progress)
        };
        if let (Some(p), Ok(_)) = (&printer, &result) {
            p.completed();
        }
        if let Some(p) = printer {
            p.finish();
        }
        result.map_err(|e| CliError::new(format!("Error while writing to COW image: {e}")))?;
    }
    let driver = img.format.driver();
    let file = img.file.clone();
    img.close().map_err(|e| CliError::new(e.to_string()))?;
    drop(img);
    let shown = a.backing.as_deref().unwrap_or("(null)");
    let changed = if name.is_some() && a.backing_format.is_none() {
        Err(diskit_core::Error::invalid(
            "backing format must be specified",
        ))
    } else {
        let to = name.zip(a.backing_format.as_deref());
        driver.change_backing_file(
            &*file,
            to.map(|(file, format)| BackingName { file, format }),
        )
    };
    changed.map_err(|e| {
        let why = match e.kind() {
            ErrorKind::NoSpace => "No space left in the file header".to_string(),
            ErrorKind::NotSupported => "Operation not supported".to_string(),
            _ => e.to_string(),
        };
        CliError::new(format!(
            "Could not change the backing file to '{shown}': {why}"
        ))
    })?;
    Ok(0)
}

/// Opens the new backing file, named as the image will record it (relative
/// to the image's directory): the image of the current chain when it is one.
fn open_new_backing(
    img: &Image,
    name: &str,
    format: Option<Format>,
    direct: bool,
) -> Result<DeviceRef, CliError> {
    if let Some(i) = img.find_backing(name) {
        return Ok(img.chain()[i].device.clone());
    }
    let path = resolve_relative(crate::util::name_of(&img.filename)?, name);
    let below = open_image(
        &path,
        format,
        OpenOptions {
            direct,
            ..Default::default()
        },
    )
    .map_err(|e| CliError::new(format!("Could not open new backing file '{name}': {e}")))?;
    Ok(below.device.clone())
}
