//! `diskit resize`: grow or shrink an image.

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, open, parse_format, parse_image_size};
use diskit_backends::Preallocation;
use diskit_formats::{Format, OpenOptions};

/// Arguments of `resize`.
#[derive(clap::Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f')]
    format: Option<String>,
    /// How to allocate the new space: off, falloc, full.
    #[arg(long = "preallocation")]
    preallocation: Option<String>,
    /// Allow the image to shrink.
    #[arg(long = "shrink")]
    shrink: bool,
    /// Quiet.
    #[arg(short = 'q')]
    quiet: bool,
    /// The image.
    filename: PathBuf,
    /// New size, or +SIZE / -SIZE relative to the current one.
    #[arg(allow_hyphen_values = true)]
    size: String,
}

pub fn run(a: Args) -> CmdResult {
    let format = parse_format(a.format.as_deref())?;
    let prealloc = match a.preallocation.as_deref() {
        None => Preallocation::Off,
        Some(p) => Preallocation::parse(p)
            .map_err(|_| CliError::new(format!("Invalid preallocation mode: '{p}'")))?,
    };
    let img = open(
        &a.filename,
        format,
        OpenOptions {
            writable: true,
            direct: false,
        },
    )?;
    if img.format != Format::Raw {
        return Err(CliError::new(format!(
            "Image format '{}' cannot be resized by this build",
            img.format
        )));
    }
    let current = img.virtual_size();
    let (rel, digits) = match a.size.as_bytes().first() {
        Some(b'+') => (1i8, &a.size[1..]),
        Some(b'-') => (-1, &a.size[1..]),
        _ => (0, a.size.as_str()),
    };
    let n = parse_image_size(digits)?;
    let new_size = match rel {
        1 => current
            .checked_add(n)
            .ok_or_else(|| CliError::new("Image size is too large"))?,
        -1 => current
            .checked_sub(n)
            .ok_or_else(|| CliError::new("New image size must be positive"))?,
        _ => n,
    };
    if new_size < current {
        if !a.shrink {
            return Err(CliError::new(
                "Use the --shrink option to perform a shrink operation.\n\
                 warning: Shrinking an image will delete all data beyond the shrunken image's end. \
                 Before performing such an operation, make sure there is no important data there.",
            ));
        }
        if prealloc != Preallocation::Off {
            return Err(CliError::new(
                "Preallocation can only be used for growing images",
            ));
        }
    }
    img.file
        .resize(new_size, prealloc)
        .map_err(|e| CliError::new(e.to_string()))?;
    if !a.quiet {
        println!("Image resized.");
    }
    Ok(0)
}
