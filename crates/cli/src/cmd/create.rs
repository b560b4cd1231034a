//! `diskit create`: make a new image.

use std::path::{Path, PathBuf};

use crate::CmdResult;
use crate::util::{CliError, parse_image_size, parse_options};
use diskit_open::{Capability, Creation, Format, OpenOptions, open_image};

/// Arguments of `create`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (default raw).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Format-specific options (key=value,...; `-o help` lists them).
    #[arg(short = 'o', long = "options", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Backing file.
    #[arg(short = 'b', long = "backing")]
    backing: Option<String>,
    /// Backing file format.
    #[arg(short = 'F', long = "backing-format")]
    backing_format: Option<String>,
    /// Do not open the backing file to check it.
    #[arg(short = 'u', long = "backing-unsafe")]
    unsafe_backing: bool,
    /// Quiet: print nothing on success.
    #[arg(short = 'q', long = "quiet")]
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
        print!("{}", create_help(format_name, a.filename.as_deref()));
        return Ok(0);
    }
    let Some(filename) = a.filename.as_ref() else {
        return Err(CliError::usage("create", "Expecting image file name"));
    };
    let name = filename.display().to_string();
    // Errors about this file are prefixed with its name, as qemu-img does.
    let at = |msg: String| CliError::new(format!("{name}: {msg}"));
    let size = a.size.as_deref().map(parse_image_size).transpose()?;
    let format = Format::from_name(format_name)
        .map_err(|_| at(format!("Unknown file format '{format_name}'")))?;
    diskit_open::create::check_target(crate::util::name_of(filename)?)
        .map_err(|e| at(e.to_string()))?;
    let with_backing = format.supports(Capability::BackingFile);
    if !with_backing {
        if a.backing.is_some() || options.get("backing_file").is_some() {
            return Err(at(format!(
                "Backing file not supported for file format '{format}'"
            )));
        }
        if a.backing_format.is_some() {
            return Err(at(format!(
                "Backing file format not supported for file format '{format}'"
            )));
        }
    }
    let mut new = format
        .driver()
        .parse_create(&options)
        .map_err(|e| at(e.to_string()))?;
    match (new.size(), size) {
        (Some(_), Some(_)) => {
            return Err(at("The image size must be specified only once".into()));
        }
        (None, Some(s)) => new.set_size(s),
        _ => {}
    }
    if with_backing {
        backing(&a, filename, &mut *new)?;
    }
    if new.size().is_none() {
        return Err(at("Image creation needs a size parameter".into()));
    }
    if !a.quiet {
        println!("Formatting '{name}', fmt={format}{}", new.summary());
    }
    diskit_open::create::create_planned(crate::util::name_of(filename)?, &*new)
        .map_err(|e| at(e.to_string()))?;
    Ok(0)
}

/// The backing file of a new image (QEMU's `bdrv_img_create`): `-b` and
/// `-F` over `-o`, the name checked, and the file opened (unless `-u`) to
/// check its format and take its size when none is given.
fn backing(a: &Args, filename: &Path, new: &mut dyn Creation) -> Result<(), CliError> {
    let name = filename.display().to_string();
    let at = |msg: String| CliError::new(format!("{name}: {msg}"));
    if let Some(b) = &a.backing {
        new.set_backing_file(b);
    }
    if let Some(f) = &a.backing_format {
        new.set_backing_format(f);
    }
    if let Some(b) = new.backing_file() {
        if *b == name {
            return Err(at(
                "Error: Trying to create an image with the same filename as the backing file"
                    .into(),
            ));
        }
        if b.is_empty() {
            return Err(at("Expected backing file name, got empty string".into()));
        }
    }
    match new.backing_file().map(str::to_string) {
        Some(backing) if !a.unsafe_backing => {
            let full = full_backing_path(filename, &backing);
            let format = match new.backing_format() {
                None => None,
                Some(f) => Some(Format::from_name(f).map_err(|_| {
                    at(format!(
                        "Unknown driver '{f}'\nCould not open backing image."
                    ))
                })?),
            };
            // The new image is never made over its own backing file, by
            // any name. Only its size is wanted: no key is needed, as in
            // QEMU (which opens it for no I/O).
            let opts = OpenOptions {
                source: true,
                metadata_only: true,
                ..OpenOptions::default()
            };
            let image = open_image(crate::util::name_of(&full)?, format, opts)
                .map_err(|e| at(format!("{e}\nCould not open backing image.")))?;
            if new.backing_format().is_none() {
                return Err(at(format!(
                    "Backing file specified without backing format\nDetected format of {}.",
                    image.format
                )));
            }
            if new.size().is_none() {
                new.set_size(image.virtual_size());
            }
        }
        Some(_) if new.backing_format().is_none() => {
            return Err(at("Backing file specified without backing format".into()));
        }
        _ => {}
    }
    Ok(())
}

/// Where QEMU looks for a backing file: relative names are relative to the
/// directory of the image that refers to them.
fn full_backing_path(image: &Path, backing: &str) -> PathBuf {
    let b = Path::new(backing);
    if b.is_absolute() {
        return b.to_path_buf();
    }
    match image.to_str().and_then(|s| s.rfind('/')) {
        Some(i) => PathBuf::from(format!("{}{backing}", &image.to_string_lossy()[..=i])),
        None => b.to_path_buf(),
    }
}

fn create_help(format: &str, file: Option<&Path>) -> String {
    match Format::known(format) {
        Some(f) => crate::util::create_help(f, file),
        None => format!("Creation options for '{format}' are not available in this build\n"),
    }
}
