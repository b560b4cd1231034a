//! Helpers shared by the subcommands: errors at the edge, format and size
//! arguments, opening images with qemu-img's messages.

use std::path::Path;

use diskit_core::Error;
use diskit_core::size::parse_size;
use diskit_formats::{Format, Image, OpenOptions, OptionList, open_image};

/// An error as the command line reports it: a message and an exit code.
#[derive(Debug)]
pub struct CliError {
    /// What to print (each line gets the program prefix).
    pub message: String,
    /// The exit status.
    pub code: u8,
}

impl CliError {
    /// An error with exit status 1.
    pub fn new(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            code: 1,
        }
    }

    /// The same error with another exit status.
    pub fn code(mut self, code: u8) -> CliError {
        self.code = code;
        self
    }
}

impl From<Error> for CliError {
    fn from(e: Error) -> CliError {
        CliError::new(e.to_string())
    }
}

/// Parses a `-f`/`-O` format name.
pub fn parse_format(name: Option<&str>) -> Result<Option<Format>, CliError> {
    name.map(|n| {
        Format::from_name(n).map_err(|_| CliError::new(format!("Unknown file format '{n}'")))
    })
    .transpose()
}

/// Parses an image size argument with qemu-img's message on failure.
pub fn parse_image_size(s: &str) -> Result<u64, CliError> {
    parse_size(s).map_err(|_| {
        CliError::new(
            "Invalid image size specified. You may use k, M, G, T, P or E suffixes for\n\
             kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.",
        )
    })
}

/// Merges every `-o` argument into one list.
pub fn parse_options(args: &[String]) -> Result<OptionList, CliError> {
    let mut o = OptionList::new();
    for a in args {
        o.parse_into(a).map_err(|e| CliError::new(e.to_string()))?;
    }
    Ok(o)
}

/// Opens an image, with qemu-img's "Could not open" message on failure.
pub fn open(path: &Path, format: Option<Format>, opts: OpenOptions) -> Result<Image, CliError> {
    open_image(path, format, opts)
        .map_err(|e| CliError::new(format!("Could not open '{}': {}", path.display(), e)))
}
