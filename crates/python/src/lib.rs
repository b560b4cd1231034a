//! nbdkit's Python plugin: `diskit serve python SCRIPT.py [key=value]...`
//! (and `nbdkit python SCRIPT.py ...`) runs a script written for nbdkit's
//! python plugin, API version 1 or 2, unmodified, on CPython embedded
//! through PyO3.
//!
//! - [`module`]: the `nbdkit` module the scripts import;
//! - `script`: the script run as `__main__`, its callbacks and their
//!   exceptions (EIO, or the errno given to `nbdkit.set_error`);
//! - `lend`: request buffers lent to Python as `memoryview`s, no copy;
//! - [`device`]: a handle of the script as a device, per connection,
//!   under the script's thread model.

pub mod device;
mod lend;
pub mod module;
mod script;

use std::sync::Arc;

use diskit_core::{DeviceRef, Error, Result};
use pyo3::prelude::*;

pub use device::PythonDevice;
pub use module::set_verbose;

use device::Shared;
use module::THREAD_MODEL_SERIALIZE_ALL_REQUESTS;
use script::Script;

/// Loads the script named by the first argument (`script=PATH`), hands it
/// the others in order (`config(key, value)`), then runs
/// `config_complete`, `thread_model`, `get_ready` and `after_fork` (the
/// server has forked already when it opens its plugin), and opens the
/// handle that answers for the export.
pub fn open(args: &[(String, String)], readonly: bool) -> Result<DeviceRef> {
    let Some(((_, path), rest)) = args.split_first().filter(|((k, _), _)| k == "script") else {
        return Err(Error::invalid(
            "the first parameter must be script=/path/to/python/script.py",
        ));
    };
    let script = Script::load(path)?;
    let model = Python::attach(|py| -> Result<i64> {
        let s = &script;
        for (k, v) in rest {
            if !s.defines(py, "config") {
                return Err(Error::invalid(format!(
                    "{path}: this plugin does not need command line configuration"
                )));
            }
            s.call(py, "config", (k, v))?;
        }
        if s.defines(py, "config_complete") {
            s.call(py, "config_complete", ())?;
        }
        let model = if s.defines(py, "thread_model") {
            s.call(py, "thread_model", ())?
                .extract::<i64>()
                .map_err(|e| s.error(py, "thread_model", &e))?
        } else {
            THREAD_MODEL_SERIALIZE_ALL_REQUESTS
        };
        for step in ["get_ready", "after_fork"] {
            if s.defines(py, step) {
                s.call(py, step, ())?;
            }
        }
        Ok(model)
    })?;
    let shared = Arc::new(Shared::new(script, model, readonly)?);
    Ok(Arc::new(PythonDevice::open(shared, "", readonly, false)?))
}
