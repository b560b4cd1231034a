//! `diskit measure`: how much space an image needs in a given format.

use std::path::PathBuf;

use crate::CmdResult;
use crate::qjson::QJson;
use crate::util::{CliError, open, parse_format, parse_image_size, parse_options};
use diskit_formats::qcow2::create::Qcow2CreateOptions;
use diskit_formats::qcow2::measure::{Measurement, Source, measure};
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
    let (size, image) = match (&a.size, &a.filename) {
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
        (Some(s), None) => (Some(parse_image_size(s)?), None),
        (None, Some(f)) => (
            None,
            Some(open(
                f,
                parse_format(a.format.as_deref())?,
                OpenOptions::default(),
            )?),
        ),
    };
    let invalid_options = |e: diskit_core::Error, fmt: Format| {
        CliError::new(format!(
            "{e}\ndiskit: Invalid options for file format '{fmt}'"
        ))
    };
    let m = match out_format {
        Format::Raw => {
            options
                .check_known(diskit_formats::raw::CREATE_OPTIONS)
                .map_err(|e| invalid_options(e, Format::Raw))?;
            let v = match (&image, size) {
                (Some(img), _) => img.virtual_size(),
                (None, s) => s.unwrap_or(0).div_ceil(512) * 512,
            };
            Measurement {
                required: v,
                fully_allocated: v,
                bitmaps: None,
            }
        }
        Format::Qcow2 => {
            let mut opts = Qcow2CreateOptions::parse(&options)
                .map_err(|e| invalid_options(e, Format::Qcow2))?;
            if let Some(s) = size {
                opts.set_size(s);
            }
            let source = image.as_ref().map(|img| Source {
                device: &*img.device,
                qcow2_file: (img.format == Format::Qcow2)
                    .then_some(&*img.file as &dyn diskit_core::BlockDevice),
            });
            measure(&opts, source)?
        }
    };
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
