//! What `convert` puts around its source and how it may copy: `--salvage`
//! (read errors become zeros), `-r` (a rate limit) and `-C` (copy
//! offloading between files).

pub mod offload;
pub mod rate;
pub mod salvage;
