//! The rows' openers of nbdkit's script plugins, `sh` and `eval`
//! ([`diskit_backends::script`]), and `python` (a library loaded at run
//! time, [`diskit_backends::shared_plugin`]).

use std::sync::Arc;

use diskit_backends::callbacks::CallbackDevice;
use diskit_backends::script::ScriptPlugin;
use diskit_core::{DeviceRef, Error, Result};

use crate::plugin::OrderedArgs;

/// The keys of the eval plugin: its methods (any other key is a parameter
/// for its `config` method).
pub use diskit_backends::script::EVAL_METHODS;

/// `sh SCRIPT [KEY=VALUE...]`: the first argument is the script (`-`: read
/// from standard input), the rest the script's parameters.
pub fn open_sh(args: &OrderedArgs, readonly: bool) -> Result<DeviceRef> {
    let Some(((key, script), rest)) = args.split_first() else {
        return Err(Error::invalid("missing script parameter"));
    };
    if key != "script" {
        return Err(Error::invalid(
            "the first parameter must be script=/path/to/script",
        ));
    }
    let plugin = ScriptPlugin::sh(script, rest)?;
    Ok(Arc::new(CallbackDevice::open(plugin, readonly)?))
}

/// `eval METHOD='SCRIPT'... [KEY=VALUE...]`.
pub fn open_eval(args: &OrderedArgs, readonly: bool) -> Result<DeviceRef> {
    let plugin = ScriptPlugin::eval(args)?;
    Ok(Arc::new(CallbackDevice::open(plugin, readonly)?))
}

/// The python plugin's library (crates/python), loaded at its first use.
#[cfg(feature = "python")]
const PYTHON_LIBRARY: &str = "libdiskit_python.so";

/// `python SCRIPT.py [KEY=VALUE...]`: nbdkit's python plugin, from
/// [`PYTHON_LIBRARY`].
#[cfg(feature = "python")]
pub fn open_python(args: &OrderedArgs, readonly: bool) -> Result<DeviceRef> {
    use diskit_backends::shared_plugin::SharedPlugin;
    let plugin = SharedPlugin::load("python", PYTHON_LIBRARY, args)?;
    Ok(Arc::new(CallbackDevice::open(plugin, readonly)?))
}

/// What `python --dump-plugin` adds (the Python version).
#[cfg(feature = "python")]
pub fn dump_python() -> Result<Vec<String>> {
    diskit_backends::shared_plugin::dump("python", PYTHON_LIBRARY)
}
