//! What qcow2's tests share: running the real QEMU tools, and opening an
//! image they made.

use std::path::Path;
use std::process::Command;

use diskit_backends::FileDevice;
use diskit_core::StorageOptions;

use super::Header;
use super::open::read_header;

/// Runs `tool` (qemu-img, qemu-io) with `args`, which must succeed;
/// returns what it printed.
pub fn run(tool: &str, args: &[&str]) -> String {
    let o = Command::new(tool)
        .args(args)
        .output()
        .expect("qemu-img and qemu-io are needed (scripts/test installs them)");
    assert!(
        o.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs qemu-img with `args` (see [`run`]).
pub fn qemu_img(args: &[&str]) -> String {
    run("qemu-img", args)
}

/// The image file at `p`, and its header.
pub fn open(p: &Path) -> (FileDevice, Header) {
    let f = FileDevice::open(p, StorageOptions::default()).unwrap();
    let h = read_header(&f).unwrap();
    (f, h)
}
