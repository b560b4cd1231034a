//! Where the file is shown: nbdfuse's `MOUNTPOINT[/FILENAME]`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use diskit_core::{Error, Result};

/// The file name when the mount point is a directory.
pub const DEFAULT_NAME: &str = "nbd";

/// A mount point and the name of the one file in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// What is mounted over.
    pub mountpoint: PathBuf,
    /// The file's name in the mounted directory; `None` for a "naked"
    /// mount over a regular file, which then is the file itself.
    pub name: Option<OsString>,
}

impl Target {
    /// Reads `MOUNTPOINT[/FILENAME]` as nbdfuse does: a directory holds
    /// a file named `nbd`; a regular file is mounted over (naked); any
    /// other path is `DIRECTORY/FILENAME`, whose directory must exist.
    pub fn resolve(path: &Path) -> Result<Target> {
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.is_dir() {
                return Ok(Target {
                    mountpoint: path.to_path_buf(),
                    name: Some(DEFAULT_NAME.into()),
                });
            }
            if meta.is_file() {
                return Ok(Target {
                    mountpoint: path.to_path_buf(),
                    name: None,
                });
            }
        }
        let dir = path.parent().map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        });
        match (dir, path.file_name()) {
            (Some(dir), Some(name)) if dir.is_dir() => Ok(Target {
                mountpoint: dir.to_path_buf(),
                name: Some(name.to_os_string()),
            }),
            _ => Err(Error::invalid(format!(
                "{}: mountpoint must be \"directory\" or \"directory/filename\"",
                path.display()
            ))),
        }
    }

    /// The path the file is seen at, for messages.
    pub fn target_path(&self) -> String {
        match &self.name {
            Some(n) => self.mountpoint.join(n).display().to_string(),
            None => self.mountpoint.display().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_a_file_or_a_name_in_a_directory() {
        let dir = std::env::temp_dir().join(format!("diskit-fuse-target-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = Target::resolve(&dir).unwrap();
        assert_eq!(
            (t.mountpoint.as_path(), t.name.as_deref()),
            (dir.as_path(), Some("nbd".as_ref()))
        );
        let file = dir.join("naked");
        std::fs::write(&file, b"").unwrap();
        let t = Target::resolve(&file).unwrap();
        assert_eq!((t.mountpoint, t.name), (file, None));
        let t = Target::resolve(&dir.join("disk.raw")).unwrap();
        assert_eq!(
            (t.mountpoint, t.name),
            (dir.clone(), Some("disk.raw".into()))
        );
        let e = Target::resolve(&dir.join("no/such")).unwrap_err();
        assert!(e.to_string().contains("mountpoint must be"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
