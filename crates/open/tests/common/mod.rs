//! What the library tests with QEMU as the oracle share: running its
//! tools.

use std::path::Path;
use std::process::Command;

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
