//! `diskit measure`: how much space an image needs in a given format.

use std::path::PathBuf;

use crate::CmdResult;
use crate::qjson::QJson;
use crate::util::{CliError, open, parse_format, parse_image_size, parse_options};
use diskit_formats::{Format, OpenOptions};

/// Arguments of `measure`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Output format: human or json.
    #[arg(long = "output", default_value = "human")]
    output: String,
    /// Target format.
    #[arg(short = 'O')]
    out_format: Option<String>,
    /// Target options.
    #[arg(short = 'o', action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Measure a new image of this size instead of an existing image.
    #[arg(long = "size")]
    size: Option<String>,
    /// Source format.
    #[arg(short = 'f')]
    format: Option<String>,
    /// Open read-only even if the image is in use.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image to measure.
    filename: Option<PathBuf>,
}

pub fn run(a: Args) -> CmdResult {
    let json = crate::util::output_is_json(&a.output, "measure")?;
    let out_format = parse_format(a.out_format.as_deref())?.unwrap_or(Format::Raw);
    let options = parse_options(&a.options)?;
    let _ = a.force_share;
    let virtual_size = match (&a.size, &a.filename) {
        (Some(_), Some(_)) => {
            return Err(CliError::new(
                "--size N cannot be used together with a filename.",
            ));
        }
        (None, None) => {
            return Err(CliError::new(
                "Either --size N or one filename must be specified.",
            ));
        }
        (Some(s), None) => parse_image_size(s)?.div_ceil(512) * 512,
        (None, Some(f)) => open(
            f,
            parse_format(a.format.as_deref())?,
            OpenOptions::default(),
        )?
        .virtual_size(),
    };
    let (required, fully) = match out_format {
        Format::Raw => {
            options
                .check_known(diskit_formats::raw::CREATE_OPTIONS)
                .map_err(|e| {
                    CliError::new(format!(
                        "{e}\ndiskit: Invalid options for file format 'raw'"
                    ))
                })?;
            (virtual_size, virtual_size)
        }
        other => {
            return Err(CliError::new(format!(
                "Format driver '{other}' cannot measure images in this build"
            )));
        }
    };
    if json {
        let v = QJson::dict()
            .with("required", QJson::UInt(required))
            .with("fully-allocated", QJson::UInt(fully));
        println!("{}", v.pretty());
    } else {
        println!("required size: {required}\nfully allocated size: {fully}");
    }
    Ok(0)
}
