//! Plugins of `diskit serve`, nbdkit style: the nbdkit faces of the
//! opener's table of sources, and `image` (any format over any source).
//! Arguments are `key=value` pairs or bare values for the plugin's
//! "magic" key.

use crate::util::CliError;
use diskit_open::plugin::{self, Plugin};

pub use diskit_open::plugin::{Opened, dump_lines, is_key, set_verbose};

fn cli(e: diskit_core::Error) -> CliError {
    CliError::new(e.to_string())
}

/// The plugin's row, or an error listing the plugins.
pub fn find(name: &str) -> Result<&'static Plugin, CliError> {
    plugin::find(name).map_err(cli)
}

/// Opens the device a plugin describes (an image under the command's
/// policy: `--untrusted`).
pub fn open_plugin(
    name: &str,
    args: &[String],
    readonly: bool,
    policy: &crate::util::OpenPolicy,
) -> Result<Opened, CliError> {
    plugin::open_plugin(name, args, readonly, &policy.options()).map_err(cli)
}

/// The plugin list for --help.
pub fn help() -> String {
    plugin::help()
}
