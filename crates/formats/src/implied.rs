//! The files an image names: its backing file, its external data file (and,
//! in formats to come, vmdk extents and vhdx/vpc parents).
//!
//! A format driver never opens them itself. It hands the name as stored in
//! the image to its opener ([`ImpliedFiles`]), which resolves it against
//! the image's storage, applies the trust policy (an untrusted image may
//! not name files outside its directory) and opens it with the right
//! format and mode. One place decides what an image may reach.

use diskit_core::{DeviceRef, Error, Result, StorageRef};

/// What role a named file plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The image below in the backing chain.
    Backing,
    /// An external data file.
    DataFile,
    /// A file holding part of the disk (a vmdk extent).
    Extent,
}

impl Role {
    /// The role as messages name it.
    pub fn name(self) -> &'static str {
        match self {
            Role::Backing => "backing file",
            Role::DataFile => "data file",
            Role::Extent => "extent file",
        }
    }
}

/// A file an image names, as stored in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// What it is for.
    pub role: Role,
    /// The name as the image stores it.
    pub name: String,
    /// The format the image records for it, if any.
    pub format: Option<String>,
}

/// What a format needs opened for it, by the name stored in the image.
pub trait ImpliedFiles {
    /// Opens the image named as the backing file, with its format when the
    /// image records one; returns the guest-visible device and its size.
    fn backing(&mut self, name: &str, format: Option<&str>) -> Result<(DeviceRef, u64)>;

    /// Opens the storage named as the image's external data file.
    fn data_file(&mut self, name: &str, writable: bool) -> Result<StorageRef>;

    /// Opens the storage named as one of the image's extents.
    fn extent(&mut self, name: &str, writable: bool) -> Result<StorageRef> {
        let _ = writable;
        Err(Error::invalid(format!(
            "Could not open extent file '{name}': not opened here"
        )))
    }
}

/// Refuses every implied file: for tools that read one image's own
/// metadata and nothing it names.
pub struct NoImpliedFiles;

impl ImpliedFiles for NoImpliedFiles {
    fn backing(&mut self, name: &str, _format: Option<&str>) -> Result<(DeviceRef, u64)> {
        Err(Error::invalid(format!(
            "Could not open backing file '{name}': not opened here"
        )))
    }

    fn data_file(&mut self, name: &str, _writable: bool) -> Result<StorageRef> {
        Err(Error::invalid(format!(
            "Could not open data file '{name}': not opened here"
        )))
    }
}
