//! What `convert` puts around its source and target and how it may copy:
//! `--salvage` (read errors become zeros), `-r` (a rate limit), `-C` (copy
//! offloading between files) and `-S 0` (zeros written as data).

pub mod offload;
pub mod rate;
pub mod salvage;
pub mod zeroes_as_data;
