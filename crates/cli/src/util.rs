//! Helpers shared by the subcommands: errors at the edge, format and size
//! arguments, opening images with qemu-img's messages.

use std::path::Path;

use diskit_core::Error;
use diskit_core::size::{SizeError, parse_size_detailed};
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

    /// A usage error of subcommand `cmd`, with the hint qemu-img adds.
    pub fn usage(cmd: &str, message: impl Into<String>) -> CliError {
        CliError::new(format!(
            "{}\nTry 'diskit {cmd} --help' for more info",
            message.into()
        ))
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

/// Parses a size argument naming `what` in qemu-img's messages on failure.
pub fn parse_size_arg(s: &str, what: &str) -> Result<u64, CliError> {
    parse_size_detailed(s).map_err(|e| match e {
        SizeError::Syntax => CliError::new(format!("Invalid {what} specified: '{s}'.")),
        SizeError::Range => CliError::new(format!(
            "Invalid {what} specified. Must be between 0 and 9223372036854775807."
        )),
    })
}

/// Parses an image size argument.
pub fn parse_image_size(s: &str) -> Result<u64, CliError> {
    parse_size_arg(s, "image size")
}

/// Parses a size given as an option value (`-o size=`, resize), with
/// qemu's option-parser messages.
pub fn parse_option_size(s: &str, name: &str) -> Result<u64, CliError> {
    parse_size_detailed(s).map_err(|e| match e {
        SizeError::Syntax => CliError::new(format!(
            "Parameter '{name}' expects a non-negative number below 2^64\n\
             Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n\
             and exabytes, respectively."
        )),
        SizeError::Range => CliError::new(format!(
            "Value '{s}' is out of range for parameter '{name}'"
        )),
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

/// Parses a source `-f` format, with qemu-img's message naming the file.
pub fn parse_source_format(name: Option<&str>, path: &Path) -> Result<Option<Format>, CliError> {
    name.map(|n| {
        Format::from_name(n).map_err(|_| {
            CliError::new(format!(
                "Could not open '{}': Unknown driver '{n}'",
                path.display()
            ))
        })
    })
    .transpose()
}

/// Checks an `--output` value of subcommand `cmd`: true for json.
pub fn output_is_json(s: &str, cmd: &str) -> Result<bool, CliError> {
    match s {
        "json" => Ok(true),
        "human" => Ok(false),
        _ => Err(CliError::usage(
            cmd,
            format!("--output expects 'human' or 'json' not '{s}'"),
        )),
    }
}

/// Opens an image, with qemu-img's "Could not open" message on failure.
pub fn open(path: &Path, format: Option<Format>, opts: OpenOptions) -> Result<Image, CliError> {
    open_image(path, format, opts)
        .map_err(|e| CliError::new(format!("Could not open '{}': {}", path.display(), e)))
}

/// What a cache mode asks for.
pub struct CacheMode {
    /// Bypass the host page cache.
    pub direct: bool,
    /// Flush when done.
    pub flush: bool,
}

/// Parses a cache mode (`-t`/`-T`), `default` when absent.
pub fn cache_mode(s: Option<&str>, default: &str) -> Result<CacheMode, CliError> {
    match s.unwrap_or(default) {
        "unsafe" => Ok(CacheMode {
            direct: false,
            flush: false,
        }),
        "writeback" | "writethrough" => Ok(CacheMode {
            direct: false,
            flush: true,
        }),
        "none" | "directsync" => Ok(CacheMode {
            direct: true,
            flush: true,
        }),
        other => Err(CliError::new(format!("Invalid cache option: {other}"))),
    }
}
