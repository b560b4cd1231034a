//! One module per subcommand.

pub mod check;
pub mod compare;
pub mod convert;
pub mod create;
pub mod info;
pub mod map;
pub mod measure;
pub mod resize;
pub mod serve;
pub mod snapshot;
