//! What qcow2's tests share: running the real QEMU tools, opening an
//! image they made, and damaging bytes for parsers that must not panic.

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

/// Makes a qcow2 image of `size` at `p` with qemu-img, with creation
/// options `options` (`-o`).
pub fn qemu_img_create(p: &Path, options: &str, size: &str) {
    let p = p.to_str().expect("a UTF-8 path");
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", options, p, size]);
}

/// The image file at `p`, and its header.
pub fn open(p: &Path) -> (FileDevice, Header) {
    let f = FileDevice::open(p, StorageOptions::default()).unwrap();
    let h = read_header(&f).unwrap();
    (f, h)
}

/// Deterministic damage for a parser that must never panic: `rounds`
/// times, `base` with fewer than `max_flips` bytes changed and cut short
/// at random is given to `check`, with one more random number for the
/// rest of the case.
pub fn damaged(
    seed: u64,
    base: &[u8],
    rounds: usize,
    max_flips: u64,
    mut check: impl FnMut(&[u8], u64),
) {
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..rounds {
        let mut d = base.to_vec();
        for _ in 0..(next() % max_flips) {
            let at = (next() % d.len() as u64) as usize;
            d[at] = next() as u8;
        }
        let cut = (next() % (d.len() as u64 + 1)) as usize;
        check(&d[..cut], next());
    }
}
