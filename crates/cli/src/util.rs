//! Helpers shared by the subcommands: errors at the edge, format and size
//! arguments, opening images with qemu-img's messages.

use std::path::{Path, PathBuf};

use diskit_core::Error;
use diskit_core::size::{SizeError, parse_size_detailed};
use diskit_open::{Format, Image, OpenOptions, OptionList, open_image, open_image_opts};

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
            "{}\n{}",
            message.into(),
            crate::names::hint(Some(cmd))
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

/// An I/O error's text as C's strerror gives it (Rust's Display adds
/// " (os error N)").
pub fn strerror(e: &std::io::Error) -> String {
    crate::names::strip_os_error(&e.to_string())
}

/// Parses a `-f`/`-O` format name.
pub fn parse_format(name: Option<&str>) -> Result<Option<Format>, CliError> {
    name.map(|n| {
        Format::from_name(n).map_err(|e| match Format::known(n) {
            // Recognised, not read: say so rather than "unknown".
            Some(_) => CliError::new(e.to_string()),
            None => CliError::new(format!("Unknown file format '{n}'")),
        })
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
        Format::from_name(n).map_err(|e| match Format::known(n) {
            Some(_) => CliError::new(format!("Could not open '{}': {e}", path.display())),
            None => CliError::new(format!(
                "Could not open '{}': Unknown driver '{n}'",
                path.display()
            )),
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

/// What the commands that report on an image (`check`, `info`, `map`)
/// take alike: the image, its format and how to print the report.
#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Output format: human or json.
    #[arg(long = "output", default_value = "human")]
    output: String,
    /// The image.
    pub filename: PathBuf,
}

impl ReportArgs {
    /// Whether the report is JSON (`cmd` names the command in errors).
    pub fn json(&self, cmd: &str) -> Result<bool, CliError> {
        output_is_json(&self.output, cmd)
    }

    /// The format given, if one is.
    pub fn format(&self) -> Result<Option<Format>, CliError> {
        parse_source_format(self.format.as_deref(), &self.filename)
    }
}

/// qemu-img's `-U`/`--force-share`, taken alike by every command that
/// opens images it only reads.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ForceShare {
    /// Open read-only even if the image is in use (no image locks are
    /// taken: another process may be writing it).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
}

impl ForceShare {
    /// Whether `-U` was given.
    pub fn given(self) -> bool {
        self.force_share
    }

    /// `policy` with this `-U`, given or not.
    pub fn policy(self, policy: OpenPolicy) -> OpenPolicy {
        policy.sharing(self.force_share)
    }
}

/// How the command line opens the images it names: the global flags
/// (`--image-opts`, `--untrusted`), and the command's `-U`. A value each
/// command is given and passes down, never process state.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenPolicy {
    /// Names are `--image-opts` descriptions.
    pub image_opts: bool,
    /// Images are untrusted (see `diskit_open::gate`).
    pub untrusted: bool,
    /// `-U`/`--force-share`: read-only opens take no image locks.
    pub force_share: bool,
}

impl OpenPolicy {
    /// This policy with the command's `-U` (given or not).
    pub fn sharing(self, force_share: bool) -> OpenPolicy {
        OpenPolicy {
            force_share: self.force_share || force_share,
            ..self
        }
    }

    /// The options every open starts from under this policy.
    pub fn options(&self) -> OpenOptions {
        OpenOptions {
            untrusted: self.untrusted,
            force_share: self.force_share,
            ..OpenOptions::default()
        }
    }

    /// Opens the image a command-line name stands for.
    pub fn open_name(
        &self,
        path: &Path,
        format: Option<Format>,
        opts: OpenOptions,
    ) -> diskit_core::Result<Image> {
        self.open_name_as(path, format, opts, self.image_opts)
    }

    /// Opens a command-line name, read as an `--image-opts` description
    /// or not as `image_opts` says (convert's target has its own flag).
    pub fn open_name_as(
        &self,
        path: &Path,
        format: Option<Format>,
        mut opts: OpenOptions,
        image_opts: bool,
    ) -> diskit_core::Result<Image> {
        opts.untrusted |= self.untrusted;
        opts.force_share |= self.force_share;
        let name = path
            .to_str()
            .ok_or_else(|| Error::invalid("the name is not valid UTF-8"))?;
        if image_opts {
            if format.is_some() {
                return Err(Error::invalid(
                    "--image-opts and a format (-f) cannot be used together",
                ));
            }
            open_image_opts(name, opts)
        } else {
            open_image(name, format, opts)
        }
    }

    /// Opens an image, with qemu-img's "Could not open" message on
    /// failure.
    pub fn open(
        &self,
        path: &Path,
        format: Option<Format>,
        opts: OpenOptions,
    ) -> Result<Image, CliError> {
        self.open_name(path, format, opts)
            .map_err(|e| CliError::new(format!("Could not open '{}': {e}", path.display())))
    }
}

/// QEMU's warning when an image's format was probed as raw (qemu-img's
/// writing commands and qemu-nbd print it).
pub fn warn_probed_raw(path: &Path) {
    eprintln!(
        "WARNING: Image format was not specified for '{}' and probing guessed raw.\n         \
         Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n         \
         Specify the 'raw' format explicitly to remove the restrictions.",
        path.display()
    );
}

/// An image name given on the command line as text (names are paths,
/// URIs or `json:` descriptions, which the opener reads as UTF-8).
pub fn name_of(path: &Path) -> Result<&str, CliError> {
    path.to_str().ok_or_else(|| {
        CliError::new(format!(
            "Could not open '{}': the name is not valid UTF-8",
            path.display()
        ))
    })
}

/// Worker threads for a copy between local files (page cache to page
/// cache, processor-bound): one per processor, since more only take turns
/// on them, but at least 2, so that one reads while another writes, and
/// no more than qemu-img's 8 requests in flight.
pub fn local_copy_workers() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.clamp(2, 8)
}

pub use diskit_core::CacheMode;

/// Parses a cache mode (`-t`/`-T`), `default` when absent.
pub fn cache_mode(s: Option<&str>, default: &str) -> Result<CacheMode, CliError> {
    let name = s.unwrap_or(default);
    CacheMode::parse(name).ok_or_else(|| CliError::new(format!("Invalid cache option: {name}")))
}

/// A number as qemu-img's `cvtnum` reads it: digits with an optional
/// binary suffix (`k`, `M`, `G`, `T`, `P`, `E`; `b` or none for bytes).
fn cvtnum_value(value: &str) -> Option<i128> {
    let digits = value.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &value[digits.len()..];
    let n: i128 = digits.parse().ok()?;
    let shift = match suffix {
        "" | "b" | "B" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        "p" | "P" => 50,
        "e" | "E" => 60,
        _ => return None,
    };
    n.checked_mul(1i128 << shift)
}

/// A number within `min..=max` as qemu-img's `cvtnum_full` reads it,
/// with its messages (`name` is what the number is).
pub fn cvtnum(name: &str, value: &str, min: i128, max: i128) -> Result<u64, CliError> {
    let n = cvtnum_value(value)
        .ok_or_else(|| CliError::new(format!("Invalid {name} specified: '{value}'.")))?;
    if n < min || n > max {
        return Err(CliError::new(format!(
            "Invalid {name} specified. Must be between {min} and {max}."
        )));
    }
    Ok(n as u64)
}

/// `-o help` for a new image of `format` at `target` (None: no file
/// named). A format's list holds the options of the protocol under it:
/// the file's (`nocow`, `extent_size_hint`, every preallocation mode) in
/// the drivers' lists; a block or character device (QEMU's host_device
/// protocol) takes fewer, so they are taken out for one, as qemu-img does.
pub fn create_help(format: Format, target: Option<&Path>) -> String {
    use std::os::unix::fs::FileTypeExt;
    let help = format.driver().create_help(target.is_some());
    let device = target
        .and_then(|t| std::fs::metadata(t).ok())
        .is_some_and(|m| m.file_type().is_block_device() || m.file_type().is_char_device());
    if !device {
        return help;
    }
    const FILE_PREALLOC: &str =
        "  preallocation=<str>    - Preallocation mode (allowed values: off, falloc, full)";
    help.lines()
        .filter(|l| {
            !l.starts_with("  extent_size_hint=<size> ")
                && !l.starts_with("  nocow=<bool (on/off)> ")
        })
        .map(|l| {
            if l == FILE_PREALLOC {
                "  preallocation=<str>    - Preallocation mode (allowed values: off)\n".to_string()
            } else {
                format!("{l}\n")
            }
        })
        .collect()
}
