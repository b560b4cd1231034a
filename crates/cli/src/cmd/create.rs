//! `diskit create`: make a new image.

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, parse_format, parse_image_size, parse_options};
use diskit_formats::{Format, create_image};

/// Arguments of `create`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (default raw).
    #[arg(short = 'f')]
    format: Option<String>,
    /// Format-specific options (key=value,...; `-o help` lists them).
    #[arg(short = 'o', action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Backing file.
    #[arg(short = 'b')]
    backing: Option<String>,
    /// Backing file format.
    #[arg(short = 'F')]
    backing_format: Option<String>,
    /// Do not open the backing file to check it.
    #[arg(short = 'u')]
    unsafe_backing: bool,
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// The image to create.
    filename: PathBuf,
    /// The virtual size (suffixes k, M, G, T, P, E).
    size: Option<String>,
}

pub fn run(a: Args) -> CmdResult {
    let format = parse_format(a.format.as_deref())?.unwrap_or(Format::Raw);
    let mut options = parse_options(&a.options)?;
    if options.wants_help() {
        print!("{}", create_help(format));
        return Ok(0);
    }
    if let Some(b) = &a.backing {
        options.set("backing_file", b);
    }
    if let Some(f) = &a.backing_format {
        options.set("backing_fmt", f);
    }
    let _ = a.unsafe_backing;
    let size = a.size.as_deref().map(parse_image_size).transpose()?;
    if format == Format::Raw && (a.backing.is_some() || options.get("backing_file").is_some()) {
        return Err(CliError::new(format!(
            "{}: Format driver 'raw' does not support backing files",
            a.filename.display()
        )));
    }
    let summary_size = match (size, options.get("size")) {
        (Some(s), _) => Some(s),
        (None, Some(s)) => Some(parse_image_size(s)?),
        _ => None,
    };
    if !a.quiet {
        let mut line = format!(
            "Formatting '{}', fmt={}",
            a.filename.display(),
            format.name()
        );
        if let Some(s) = summary_size {
            line.push_str(&format!(" size={s}"));
        }
        if let Some(p) = options.get("preallocation") {
            line.push_str(&format!(" preallocation={p}"));
        }
        println!("{line}");
    }
    create_image(&a.filename, format, summary_size, &options)
        .map_err(|e| CliError::new(format!("{}: {}", a.filename.display(), e)))?;
    Ok(0)
}

fn create_help(format: Format) -> String {
    match format {
        Format::Raw => diskit_formats::raw::CREATE_HELP.to_string(),
        other => format!(
            "Creation options for '{}' are not available in this build\n",
            other.name()
        ),
    }
}
