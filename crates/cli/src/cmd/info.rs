//! `diskit info`: what an image is.

use std::path::PathBuf;

use crate::CmdResult;
use crate::qjson::QJson;
use crate::util::{open, output_is_json, parse_source_format};
use diskit_core::BlockDevice;
use diskit_core::size::human_size;
use diskit_formats::{Image, OpenOptions};

/// Arguments of `info`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f')]
    format: Option<String>,
    /// Output format: human or json.
    #[arg(long = "output", default_value = "human")]
    output: String,
    /// Show every image of the backing chain.
    #[arg(long = "backing-chain")]
    backing_chain: bool,
    /// Open read-only even if the image is in use.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    filename: PathBuf,
}

pub fn run(a: Args) -> CmdResult {
    let json = output_is_json(&a.output, "info")?;
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    let _ = a.force_share;
    let img = open(&a.filename, format, OpenOptions::default())?;
    let actual = img.file.allocated_bytes()?;
    if json {
        let v = info_json(&img, actual);
        // --backing-chain wraps the chain (one image for raw) in a list.
        let v = if a.backing_chain {
            QJson::List(vec![v])
        } else {
            v
        };
        println!("{}", v.pretty());
    } else {
        print!("{}", info_human(&img, actual));
    }
    Ok(0)
}

fn info_json(img: &Image, actual: u64) -> QJson {
    let name = img.filename.display().to_string();
    let file_node = QJson::dict()
        .with("children", QJson::List(vec![]))
        .with("virtual-size", QJson::UInt(img.file.size()))
        .with("filename", QJson::Str(name.clone()))
        .with("format", QJson::Str("file".into()))
        .with("actual-size", QJson::UInt(actual))
        .with(
            "format-specific",
            QJson::dict()
                .with("type", QJson::Str("file".into()))
                .with("data", QJson::dict()),
        )
        .with("dirty-flag", QJson::Bool(false));
    QJson::dict()
        .with(
            "children",
            QJson::List(vec![
                QJson::dict()
                    .with("name", QJson::Str("file".into()))
                    .with("info", file_node),
            ]),
        )
        .with("virtual-size", QJson::UInt(img.virtual_size()))
        .with("filename", QJson::Str(name))
        .with("format", QJson::Str(img.format.name().into()))
        .with("actual-size", QJson::UInt(actual))
        .with("dirty-flag", QJson::Bool(false))
}

fn info_human(img: &Image, actual: u64) -> String {
    let name = img.filename.display();
    let size = img.virtual_size();
    let file_size = img.file.size();
    format!(
        "image: {name}\nfile format: {}\nvirtual size: {} ({size} bytes)\ndisk size: {}\n\
         Child node '/file':\n    filename: {name}\n    protocol type: file\n    \
         file length: {} ({file_size} bytes)\n    disk size: {}\n",
        img.format.name(),
        human_size(size),
        human_size(actual),
        human_size(file_size),
        human_size(actual),
    )
}
