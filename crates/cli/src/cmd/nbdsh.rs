//! `diskit nbdsh`: libnbd's NBD shell, nbdsh's command line (`-u URI`,
//! `-c COMMAND`, `--base-allocation`, `--opt-mode`, `-n`), run by Python
//! over diskit's client: `python3 -m diskit.nbdsh` with the words given.
//! The `diskit` Python package (python/ in the source tree, built with
//! maturin) must be importable: installed, or on `PYTHONPATH`.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;

use crate::CmdResult;
use crate::util::CliError;

/// Arguments of `nbdsh`: nbdsh's own, passed on as they are.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// nbdsh's options and arguments (`-u URI`, `-c COMMAND`,
    /// `--base-allocation`, `--opt-mode`, `-n`, `--help`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    args: Vec<OsString>,
}

/// The Python that runs the shell: `$DISKIT_PYTHON`, else the system's.
fn python() -> OsString {
    std::env::var_os("DISKIT_PYTHON").unwrap_or_else(|| {
        if std::path::Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3".into()
        } else {
            "python3".into()
        }
    })
}

/// Replaces this process with the shell; returns only if it cannot start.
pub fn run(a: Args) -> CmdResult {
    let py = python();
    let e = std::process::Command::new(&py)
        .args(["-m", "diskit.nbdsh"])
        .args(&a.args)
        .exec();
    Err(CliError::new(format!(
        "nbdsh: cannot run {}: {e}",
        py.to_string_lossy()
    )))
}
