//! One module per subcommand.

pub mod amend;
pub mod bench;
pub mod bitmap;
pub mod check;
pub mod checksum;
pub mod commit;
pub mod compare;
pub mod convert;
pub mod convert_io;
pub mod copy;
pub mod create;
pub mod dd;
pub mod fuse;
pub mod info;
pub mod map;
pub mod measure;
pub mod nbdinfo;
pub mod nbdsh;
pub mod qemu_nbd;
pub mod rebase;
pub mod resize;
pub mod serve;
pub mod snapshot;
