//! nbdkit's Python plugin: `diskit serve python SCRIPT.py [key=value]...`
//! (and `nbdkit python SCRIPT.py ...`) runs a script written for nbdkit's
//! python plugin, API version 1 or 2, unmodified, on CPython embedded
//! through PyO3.
//!
//! This crate is built as `libdiskit_python.so`, which links libpython;
//! the `diskit` executable does not, and loads the library when a python
//! plugin is served (`diskit_backends::shared_plugin`), through the C ABI
//! of `diskit_core::plugin_abi`. diskit's callbacks layer serves the
//! script as nbdkit serves a plugin (a handle per connection, the thread
//! model, FUA, zero and cache emulation), as it serves sh and eval
//! scripts.
//!
//! - `abi`: the table of C functions diskit loads;
//! - `plugin`: the script's callbacks as nbdkit's python plugin calls
//!   them;
//! - `module`: the `nbdkit` module the scripts import;
//! - `script`: the script run as `__main__`, its callbacks and their
//!   exceptions (EIO, or the errno given to `nbdkit.set_error`);
//! - `lend`: request buffers lent to Python as `memoryview`s, no copy.

mod abi;
mod lend;
mod module;
mod plugin;
mod script;

pub use abi::diskit_plugin_entry;
