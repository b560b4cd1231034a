//! The row's opener of nbdkit's ssh plugin ([`diskit_ssh`]).

use std::sync::Arc;

use diskit_backends::callbacks::CallbackDevice;
use diskit_core::{DeviceRef, Result};
use diskit_ssh::SshPlugin;

use crate::plugin::OrderedArgs;

/// The keys the plugin takes.
pub use diskit_ssh::plugin::KEYS;

/// `ssh host=HOST [path=]PATH ...`: the remote file, a connection (an SSH
/// session) for each client.
pub fn open_plugin(args: &OrderedArgs, readonly: bool) -> Result<DeviceRef> {
    let plugin = SshPlugin::configure(args)?;
    Ok(Arc::new(CallbackDevice::open(plugin, readonly)?))
}
