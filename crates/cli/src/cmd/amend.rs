//! `diskit amend`: change the options of an existing image, as
//! `qemu-img amend` does (qcow2 only).

use std::io::Write;
use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, OpenPolicy, parse_options, parse_source_format};
use diskit_open::{Capability, OpenOptions};

/// Arguments of `amend`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Options to change (key=value,...); "help" lists them.
    #[arg(short = 'o', long = "options", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Cache mode (accepted for compatibility).
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Allow the key slot changes qemu-img guards with --force
    /// (overwriting an active slot, erasing the last ones).
    #[arg(long = "force")]
    force: bool,
    /// The image.
    filename: PathBuf,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let _ = a.cache;
    if a.options.is_empty() {
        return Err(CliError::usage("amend", "Must specify options (-o)"));
    }
    let opts = parse_options(&a.options)?;
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    if opts.wants_help()
        && let Some(help) = format.and_then(|f| f.driver().amend_help())
    {
        print!("{help}");
        return Ok(0);
    }
    let img = policy.open(
        &a.filename,
        format,
        OpenOptions {
            writable: !opts.wants_help(),
            ..Default::default()
        },
    )?;
    let driver = img.format.driver();
    if !driver.supports(Capability::Amend) {
        return Err(CliError::new(format!(
            "Format driver '{}' does not support option amendment",
            img.format
        )));
    }
    if opts.wants_help() {
        print!("{}", driver.amend_help().unwrap_or_default());
        return Ok(0);
    }
    driver
        .check_amend_options(&opts)
        .map_err(|e| CliError::new(e.to_string()))?;
    let progress = a.progress && !a.quiet;
    if progress {
        print!("    (0.00/100%)\r");
        let _ = std::io::stdout().flush();
    }
    let result = img.ops.amend(&opts, a.force).and_then(|_| img.close());
    if progress {
        println!("    (100.00/100%)\r");
    }
    result.map_err(|e| CliError::new(e.to_string()))?;
    Ok(0)
}
