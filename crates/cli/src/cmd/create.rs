//! `diskit create`: make a new image.

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, parse_image_size, parse_options};
use diskit_formats::raw::RawCreateOptions;
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
    filename: Option<PathBuf>,
    /// The virtual size (suffixes k, M, G, T, P, E).
    size: Option<String>,
}

pub fn run(a: Args) -> CmdResult {
    let options = parse_options(&a.options)?;
    let format_name = a.format.as_deref().unwrap_or("raw");
    if options.wants_help() {
        print!("{}", create_help(format_name, a.filename.is_some()));
        return Ok(0);
    }
    let Some(filename) = a.filename.as_ref() else {
        return Err(CliError::new("Expecting image file name"));
    };
    let name = filename.display().to_string();
    // Errors about this file are prefixed with its name, as qemu-img does.
    let at = |msg: String| CliError::new(format!("{name}: {msg}"));
    let size = a.size.as_deref().map(parse_image_size).transpose()?;
    let format = Format::from_name(format_name)
        .map_err(|_| at(format!("Unknown file format '{format_name}'")))?;
    let _ = a.unsafe_backing;
    if format == Format::Raw {
        if a.backing.is_some() || options.get("backing_file").is_some() {
            return Err(at("Backing file not supported for file format 'raw'".into()));
        }
        if a.backing_format.is_some() {
            return Err(at(
                "Backing file format not supported for file format 'raw'".into(),
            ));
        }
    }
    let raw_opts = RawCreateOptions::parse(&options).map_err(|e| at(e.to_string()))?;
    if size.is_some() && raw_opts.size.is_some() {
        return Err(at("The image size must be specified only once".into()));
    }
    if size.is_none() && raw_opts.size.is_none() {
        return Err(at("Image creation needs a size parameter".into()));
    }
    if !a.quiet {
        let mut line = format!("Formatting '{name}', fmt={}", format.name());
        if let Some(s) = size.or(raw_opts.size) {
            line.push_str(&format!(" size={s}"));
        }
        line.push_str(&raw_opts.summary(&options));
        println!("{line}");
    }
    create_image(filename, format, size, &options).map_err(|e| at(e.to_string()))?;
    Ok(0)
}

fn create_help(format: &str, with_file: bool) -> String {
    match (format, with_file) {
        ("raw", true) => diskit_formats::raw::CREATE_HELP.to_string(),
        ("raw", false) => {
            "Supported raw options:\n  size=<size>            - Virtual disk size\n\n\
             The protocol level may support further options.\n\
             Specify the target filename to include those options.\n"
                .to_string()
        }
        (other, _) => format!("Creation options for '{other}' are not available in this build\n"),
    }
}
