//! `diskit measure`: how much space an image needs in a given format.

use std::path::PathBuf;

use crate::CmdResult;
use crate::qjson::QJson;
use crate::util::OpenPolicy;
use crate::util::{CliError, ForceShare, parse_format, parse_image_size, parse_options};
use diskit_open::{Format, Measured, OpenOptions};

/// Arguments of `measure`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Output format: human or json.
    #[arg(long = "output", default_value = "human")]
    output: String,
    /// Target format.
    #[arg(short = 'O', long = "target-format")]
    out_format: Option<String>,
    /// Target options.
    #[arg(short = 'o', long = "options", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Measure a new image of this size instead of an existing image.
    #[arg(short = 's', long = "size")]
    size: Option<String>,
    /// Source format.
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    #[command(flatten)]
    share: ForceShare,
    /// Measure this internal snapshot of the image (by id or name).
    #[arg(short = 'l', long = "snapshot")]
    snapshot: Option<String>,
    /// The image to measure.
    filename: Option<PathBuf>,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let json = crate::util::output_is_json(&a.output, "measure")?;
    let out_format = parse_format(a.out_format.as_deref())?.unwrap_or(Format::RAW);
    let options = parse_options(&a.options)?;
    let policy = a.share.policy(policy);
    let (size, image) = match (&a.size, &a.filename) {
        (Some(_), Some(_)) => {
            return Err(CliError::new(
                "--size N cannot be used together with a filename.",
            ));
        }
        (None, None) => {
            return Err(CliError::usage(
                "measure",
                "Either --size N or one filename must be specified.",
            ));
        }
        (Some(s), None) => (Some(parse_image_size(s)?), None),
        (None, Some(f)) => (
            None,
            Some(
                policy
                    .open_name(
                        f,
                        parse_format(a.format.as_deref())?,
                        OpenOptions {
                            snapshot: a.snapshot.clone(),
                            ..OpenOptions::default()
                        },
                    )
                    .map_err(|e| {
                        if e.kind() == diskit_core::ErrorKind::NotFound && a.snapshot.is_some() {
                            CliError::new(format!("Failed to load snapshot: {e}"))
                        } else {
                            CliError::new(format!("Could not open '{}': {e}", f.display()))
                        }
                    })?,
            ),
        ),
    };
    let invalid_options = |e: diskit_core::Error, fmt: Format| {
        CliError::new(format!(
            "{e}\n{}: Invalid options for file format '{fmt}'",
            crate::names::prog()
        ))
    };
    let driver = out_format.driver();
    driver
        .check_create_options(&options)
        .map_err(|e| invalid_options(e, out_format))?;
    let of = match &image {
        Some(img) => Measured::Image(img),
        None => Measured::Size(size.unwrap_or(0)),
    };
    let m = driver.measure(&options, of)?;
    if json {
        let mut v = QJson::dict();
        if let Some(b) = m.bitmaps {
            v = v.with("bitmaps", QJson::UInt(b));
        }
        v = v
            .with("required", QJson::UInt(m.required))
            .with("fully-allocated", QJson::UInt(m.fully_allocated));
        println!("{}", v.pretty());
    } else {
        println!(
            "required size: {}\nfully allocated size: {}",
            m.required, m.fully_allocated
        );
        if let Some(b) = m.bitmaps {
            println!("bitmaps size: {b}");
        }
    }
    Ok(0)
}
