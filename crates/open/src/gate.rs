//! The trust gate: every file an image names (backing file, data file) is
//! checked here before it is opened.
//!
//! A trusted image (the default, as qemu-img behaves) may name any file.
//! An untrusted one (`--untrusted`: an image uploaded by someone else) may
//! only name regular files inside its own directory, by relative names,
//! no deeper than [`UNTRUSTED_MAX_DEPTH`] images down its chain: otherwise
//! a crafted qcow2 whose backing file is `/etc/shadow` (format raw) copies
//! that host file into whatever the image is converted to.

use std::path::{Component, Path, PathBuf};

use diskit_core::storage::has_protocol;
use diskit_core::{Error, ErrorKind, Result};
pub use diskit_formats::implied::Role;

/// How far an untrusted image's chain may reach.
pub const UNTRUSTED_MAX_DEPTH: usize = 16;

/// Whether the files an image names are opened as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Trust {
    /// Any named file is opened (qemu-img's behaviour).
    #[default]
    Trusted,
    /// Only regular files inside the image's directory are opened.
    Untrusted,
}

/// Why an implied file is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It names a protocol (`nbd://`, `json:`, `file:`...).
    Protocol,
    /// It is an absolute path.
    Absolute,
    /// Its path leaves the image's directory (`..`).
    LeavesDirectory,
    /// It is, or passes through, a symbolic link out of the directory.
    SymlinkOut,
    /// It is a device, FIFO or socket rather than a regular file.
    NotRegular,
    /// The chain is deeper than [`UNTRUSTED_MAX_DEPTH`].
    TooDeep,
}

impl Refusal {
    /// The rule, as messages and `info --untrusted` state it.
    pub fn rule(self) -> &'static str {
        match self {
            Refusal::Protocol => "it names a protocol",
            Refusal::Absolute => "it is an absolute path",
            Refusal::LeavesDirectory => "it leaves the image's directory",
            Refusal::SymlinkOut => "it is a symbolic link out of the image's directory",
            Refusal::NotRegular => "it is a device or special file, not a regular file",
            Refusal::TooDeep => "the backing chain is deeper than the limit for untrusted images",
        }
    }
}

/// Checks `name`, as stored in the image at `image` (`depth` images below
/// the top), against the untrusted rules. `Ok(())` when it may be opened.
pub fn check_untrusted(image: &str, name: &str, depth: usize) -> std::result::Result<(), Refusal> {
    if depth > UNTRUSTED_MAX_DEPTH {
        return Err(Refusal::TooDeep);
    }
    if has_protocol(name) {
        return Err(Refusal::Protocol);
    }
    let rel = Path::new(name);
    if rel.is_absolute() {
        return Err(Refusal::Absolute);
    }
    let mut level = 0i32;
    for c in rel.components() {
        match c {
            Component::ParentDir => level -= 1,
            Component::Normal(_) => level += 1,
            _ => {}
        }
        if level < 0 {
            return Err(Refusal::LeavesDirectory);
        }
    }
    let dir = image_dir(image);
    let path = dir.join(rel);
    // Symbolic links anywhere on the way must stay inside the directory.
    if let (Ok(real_dir), Ok(real)) = (dir.canonicalize(), path.canonicalize())
        && !real.starts_with(&real_dir)
    {
        return Err(Refusal::SymlinkOut);
    }
    if let Ok(meta) = std::fs::metadata(&path)
        && !meta.is_file()
    {
        return Err(Refusal::NotRegular);
    }
    Ok(())
}

fn image_dir(image: &str) -> PathBuf {
    match Path::new(image).parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Applies `trust` to the file `name` that the image at `image` names in
/// `role`: an error naming the file and the rule when it is refused.
pub fn admit(trust: Trust, image: &str, role: Role, name: &str, depth: usize) -> Result<()> {
    if trust == Trust::Trusted {
        return Ok(());
    }
    check_untrusted(image, name, depth).map_err(|r| {
        Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "refusing {} '{name}' of untrusted image '{image}': {}",
                role.name(),
                r.rule()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("base.raw"), b"x").unwrap();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/b"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join("out")).unwrap();
        std::os::unix::fs::symlink("base.raw", d.join("in")).unwrap();
        let img = d.join("top.qcow2");
        let img = img.to_str().unwrap();
        assert_eq!(check_untrusted(img, "base.raw", 1), Ok(()));
        assert_eq!(check_untrusted(img, "sub/b", 1), Ok(()));
        assert_eq!(check_untrusted(img, "sub/../base.raw", 1), Ok(()));
        assert_eq!(check_untrusted(img, "in", 1), Ok(()));
        assert_eq!(
            check_untrusted(img, "/etc/passwd", 1),
            Err(Refusal::Absolute)
        );
        assert_eq!(
            check_untrusted(img, "../x", 1),
            Err(Refusal::LeavesDirectory)
        );
        assert_eq!(
            check_untrusted(img, "sub/../../x", 1),
            Err(Refusal::LeavesDirectory)
        );
        assert_eq!(check_untrusted(img, "out", 1), Err(Refusal::SymlinkOut));
        assert_eq!(check_untrusted(img, "sub", 1), Err(Refusal::NotRegular));
        assert_eq!(check_untrusted(img, "nbd://h/x", 1), Err(Refusal::Protocol));
        assert_eq!(check_untrusted(img, "json:{}", 1), Err(Refusal::Protocol));
        assert_eq!(
            check_untrusted(img, "base.raw", UNTRUSTED_MAX_DEPTH + 1),
            Err(Refusal::TooDeep)
        );
        let e = admit(Trust::Untrusted, img, Role::DataFile, "/dev/sda", 1).unwrap_err();
        assert!(e.to_string().contains("data file '/dev/sda'"), "{e}");
        assert!(admit(Trust::Trusted, img, Role::Backing, "/dev/sda", 1).is_ok());
    }
}
