//! What the library tests with QEMU as the oracle share: running its
//! tools, opening qcow2 images.

use std::path::Path;
use std::process::Command;

use diskit_open::{Format, Image, OpenOptions, open_image};

/// Runs `cmd ARGS`, which must succeed; returns its standard output.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let o = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} is installed (scripts/test installs it): {e}"));
    assert!(
        o.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `p` as &str.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Opens the qcow2 image at `path` with `opts`.
pub fn open_qcow2(path: &str, opts: OpenOptions) -> Image {
    open_image(path, Some(Format::QCOW2), opts).unwrap()
}

/// Options for a read-write open.
pub fn writable() -> OpenOptions {
    OpenOptions {
        writable: true,
        ..Default::default()
    }
}
