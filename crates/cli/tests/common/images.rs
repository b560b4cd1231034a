//! Image files side by side: bytes patched in place, qemu-io's writes and
//! reads (on a file or over NBD through `diskit serve`), and the checks
//! that diskit reads, makes and refuses images as qemu-img does.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Output;

use super::*;

/// A change made to a copy of a good image (for the hostile-image cases).
pub type Mutation = Box<dyn Fn(&Path)>;

/// Writes `bytes` into the file `p` at `at`.
pub fn patch(p: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

/// `len` bytes of the file `p` at `at`.
pub fn read_bytes(p: &Path, at: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(p).unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, at).unwrap();
    b
}

/// Copies `good` to `bad` (both in `dir`) and applies `mutate` to the copy.
pub fn mutated(dir: &Path, good: &str, bad: &str, mutate: &dyn Fn(&Path)) {
    std::fs::copy(dir.join(good), dir.join(bad)).unwrap();
    mutate(&dir.join(bad));
}

/// qemu-io's arguments: `img` opened as `fmt` (none given: probed), each
/// of `cmds` a `-c` command.
pub fn qemu_io_args<'a>(fmt: Option<&'a str>, cmds: &[&'a str], img: &'a str) -> Vec<&'a str> {
    let mut args = Vec::new();
    if let Some(fmt) = fmt {
        args.extend(["-f", fmt]);
    }
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(img);
    args
}

/// Runs qemu-io's `cmds` in `dir` on `img` opened as `fmt`; they must
/// succeed.
pub fn qemu_io_in(dir: &Path, fmt: &str, img: &str, cmds: &[&str]) -> Output {
    good_in(dir, "qemu-io", &qemu_io_args(Some(fmt), cmds, img))
}

/// Serves `img` (in `dir`) with `diskit serve` and runs qemu-io's `cmds`
/// on the export over NBD; they must succeed. The server is gone when it
/// returns.
pub fn qemu_io_over_nbd(dir: &Path, img: &str, cmds: &[&str]) {
    let sock = dir.join("qemu-io.sock");
    let server = serve_image(&sock, &dir.join(img));
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let o = tool_in(dir, "qemu-io", &qemu_io_args(Some("raw"), cmds, &uri));
    drop(server);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// qemu-img and diskit convert `img` to raw (`opts`, such as `-f vpc`,
/// before it) and get the same bytes.
pub fn converts_alike(dir: &Path, opts: &[&str], img: &str) {
    for (tool, out) in [("qemu-img", "theirs.raw"), ("diskit", "ours.raw")] {
        let mut args = vec!["convert"];
        args.extend(opts);
        args.extend(["-O", "raw", img, out]);
        good_in(dir, tool, &args);
    }
    assert!(
        same_bytes(&dir.join("theirs.raw"), &dir.join("ours.raw")),
        "{img}: other bytes"
    );
}

/// [`alike_in`] for each of `commands` with `img` after it.
pub fn alike_each(dir: &Path, img: &str, commands: &[&[&str]]) {
    for args in commands {
        let mut args = args.to_vec();
        args.push(img);
        alike_in(dir, &args);
    }
}

/// The image reads as in qemu-img: the same bytes, and info, map and
/// check (plain and JSON) print the same.
pub fn reads_like_qemu(dir: &Path, img: &str) {
    converts_alike(dir, &[], img);
    alike_each(
        dir,
        img,
        &[
            &["info"],
            &["info", "--output=json"],
            &["map", "--output=json"],
            &["map"],
            &["check"],
            &["check", "--output=json"],
        ],
    );
}

/// Runs `args` (a `create` of `file`) with qemu-img in DIR/q and with
/// diskit in DIR/k: both succeed and print the same, and the files have
/// the same length. Returns qemu-img's file and diskit's.
pub fn create_alike(dir: &Path, args: &[&str], file: &str) -> (Vec<u8>, Vec<u8>) {
    let (q, k) = (dir.join("q"), dir.join("k"));
    std::fs::create_dir_all(&q).unwrap();
    std::fs::create_dir_all(&k).unwrap();
    let o1 = good_in(&q, "qemu-img", args);
    let o2 = good_in(&k, "diskit", args);
    assert_eq!(stdout(&o1), stdout(&o2), "{args:?}");
    let a = std::fs::read(q.join(file)).unwrap();
    let b = std::fs::read(k.join(file)).unwrap();
    assert_eq!(a.len(), b.len(), "{args:?}: length");
    (a, b)
}

/// `info` on `img` fails in both tools (exit 1), diskit's message saying
/// `msg`; returns diskit's run and qemu-img's.
pub fn info_refused(dir: &Path, img: &str, msg: &str) -> (Output, Output) {
    let ours = tool_in(dir, "diskit", &["info", img]);
    let theirs = tool_in(dir, "qemu-img", &["info", img]);
    assert_eq!(code(&ours), 1, "{msg}");
    assert!(stderr(&ours).contains(msg), "{msg}: {}", stderr(&ours));
    assert_eq!(code(&theirs), 1, "{msg}: {}", stderr(&theirs));
    (ours, theirs)
}
