//! `diskit resize`: grow or shrink an image.

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, OpenPolicy, parse_option_size, parse_source_format};
use diskit_open::{Format, OpenOptions, Prealloc};

/// Arguments of `resize`.
#[derive(clap::Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// How to allocate the new space: off, falloc, full.
    #[arg(long = "preallocation")]
    preallocation: Option<String>,
    /// Allow the image to shrink.
    #[arg(long = "shrink")]
    shrink: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// The image.
    filename: PathBuf,
    /// New size, or +SIZE / -SIZE relative to the current one.
    #[arg(allow_hyphen_values = true)]
    size: String,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    let prealloc = match a.preallocation.as_deref() {
        None => None,
        Some(p) => Some(
            Prealloc::parse(p)
                .ok_or_else(|| CliError::new(format!("Invalid preallocation mode '{p}'")))?,
        ),
    };
    let (rel, digits) = match a.size.as_bytes().first() {
        Some(b'+') => (1i8, &a.size[1..]),
        Some(b'-') => (-1, &a.size[1..]),
        _ => (0, a.size.as_str()),
    };
    // The size is checked before the image is opened.
    let n = parse_option_size(digits, "size")?;
    let img = policy.open(
        &a.filename,
        format,
        OpenOptions {
            writable: true,
            direct: false,
            ..Default::default()
        },
    )?;
    if format.is_none() && img.format == Format::RAW {
        crate::util::warn_probed_raw(&a.filename);
    }
    // Relative sizes count from the size the guest sees (whole sectors).
    let current = img.virtual_size();
    let new_size = match rel {
        1 => current.saturating_add(n),
        -1 => current.saturating_sub(n),
        _ => n,
    };
    img.ops
        .check_resize(new_size, prealloc)
        .map_err(|e| CliError::new(e.to_string()))?;
    if prealloc.is_some_and(|p| p != Prealloc::Off) && new_size <= current {
        return Err(CliError::new(
            "Preallocation can only be used for growing images",
        ));
    }
    if new_size < current && !a.shrink {
        return Err(CliError::new(format!(
            "Use the --shrink option to perform a shrink operation.\n\
             {}: warning: Shrinking an image will delete all data beyond the shrunken image's end. \
             Before performing such an operation, make sure there is no important data there.",
            crate::names::prog()
        )));
    }
    let done = img
        .ops
        .resize(new_size, a.shrink, prealloc.unwrap_or_default())
        .and_then(|_| img.close());
    done.map_err(|e| CliError::new(e.to_string()))?;
    if !a.quiet {
        println!("Image resized.");
    }
    Ok(0)
}
