//! nbdkit's ssh plugin: a file on another machine, reached over SSH's
//! SFTP, served as a disk (virt-v2v's `-i libvirt` over ssh). Through
//! libssh, as nbdkit, loaded at run time ([`api`]); each connection has
//! its own SSH session ([`remote::Remote`]); the plugin answers nbdkit's
//! plugin API ([`diskit_backends::callbacks`]).

pub mod api;
pub mod plugin;
pub mod remote;

pub use plugin::SshPlugin;
pub use remote::Settings;
