//! The rows' openers of nbdkit's script plugins, `sh` and `eval`
//! ([`diskit_backends::script`]).

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
