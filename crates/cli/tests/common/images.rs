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

/// qemu-img's commands that print alike for an image of a format whose
/// qemu-img has them all: info, map and check, plain and JSON.
pub const READS_ALL: &[&str] = &[
    "info",
    "info --output=json",
    "map --output=json",
    "map",
    "check",
    "check --output=json",
];

/// [`alike_in`] for each command line of `lines` (see [`words`]).
pub fn alike_lines(dir: &Path, lines: &[&str]) {
    for line in lines {
        alike_in(dir, &words(line));
    }
}

/// An image format as its interop tests see it: what its qemu-img
/// offers, and how qemu-io writes into its images.
pub struct Format {
    /// qemu-img's name for it (`-f`, `-O`).
    pub name: &'static str,
    /// The options of `convert` when its images are read back (none: the
    /// format is probed).
    pub convert: &'static [&'static str],
    /// The qemu-img command lines that print alike for its images (the
    /// image put after each): those its qemu-img offers. A `check` among
    /// them means that qemu-img checks images of it.
    pub reads: &'static [&'static str],
    /// qemu-io's writes after the two every format takes (see
    /// [`Format::scribble`]).
    pub writes: &'static [&'static str],
}

impl Format {
    /// Whether its qemu-img has `check`.
    fn checks(&self) -> bool {
        self.reads.iter().any(|l| l.starts_with("check"))
    }

    /// The image reads as in qemu-img: converted to raw, the same bytes;
    /// each of `reads` prints the same.
    pub fn reads_like_qemu(&self, dir: &Path, img: &str) {
        converts_alike(dir, self.convert, img);
        for line in self.reads {
            alike_in(dir, &argv(line, &[img]));
        }
    }

    /// qemu-io writes into `img` at odd offsets: 100 KiB of 0x5a at 5 MiB,
    /// 70,000 bytes of 0x33 at 1000, then the format's `writes`.
    pub fn scribble(&self, dir: &Path, img: &str) {
        let mut cmds = vec!["write -P 0x5a 5M 100k", "write -P 0x33 1000 70000"];
        cmds.extend(self.writes);
        qemu_io_in(dir, self.name, img, &cmds);
    }

    /// Images qemu-img makes (`create -q -f NAME OPTS IMG SIZE` for each
    /// `(img, opts, size)`) read as in qemu-img, before and after
    /// [`Format::scribble`].
    pub fn qemu_images_read_alike(&self, dir: &Path, cases: &[(&str, &str, &str)]) {
        for &(img, opts, size) in cases {
            let mut create = argv("create -q -f", &[self.name]);
            create.extend(words(opts));
            create.extend([img, size]);
            good_in(dir, "qemu-img", &create);
            self.reads_like_qemu(dir, img);
            self.scribble(dir, img);
            self.reads_like_qemu(dir, img);
        }
    }

    /// `diskit convert -O NAME OPTS src img` in `dir` makes an image that
    /// `qemu-img check` finds clean (where it checks the format), in which
    /// `qemu-img compare -f NAME -F raw` finds `src`, and that reads as in
    /// qemu-img.
    pub fn converts_into(&self, dir: &Path, opts: &[&str], src: &str, img: &str) {
        let mut convert = argv("convert -O", &[self.name]);
        convert.extend(opts);
        convert.extend([src, img]);
        good_in(dir, "diskit", &convert);
        if self.checks() {
            good_in(dir, "qemu-img", &["check", img]);
        }
        let compare = argv("compare -f", &[self.name, "-F", "raw", img, src]);
        good_in(dir, "qemu-img", &compare);
        self.reads_like_qemu(dir, img);
    }

    /// qemu-io's `writes` over NBD through `diskit serve` into `img`;
    /// then qemu-img checks it (where it checks the format) and qemu-io,
    /// opening it as the format, finds what `reads` says.
    pub fn written_over_nbd(&self, dir: &Path, img: &str, writes: &[&str], reads: &[&str]) {
        qemu_io_over_nbd(dir, img, writes);
        if self.checks() {
            good_in(dir, "qemu-img", &["check", img]);
        }
        qemu_io_in(dir, self.name, img, reads);
    }
}

/// DIR/src.raw: `size` bytes, holes but for three runs: 70,000 bytes of
/// `fill[0]` at 0, 2 MiB of `fill[1]` at 3 MiB (0xff: varied bytes, as in
/// [`sparse_file`]) and the last 4 KiB of `fill[2]`.
pub fn three_run_source(dir: &Path, size: u64, fill: [u8; 3]) {
    sparse_file(
        &dir.join("src.raw"),
        size,
        &[
            (0, 70_000, fill[0]),
            (3 << 20, 2 << 20, fill[1]),
            (size - 4096, 4096, fill[2]),
        ],
    );
}

/// What `qemu-img map --output=json` says of `img`: each extent's start,
/// length and whether it holds data (where the data lies left out).
pub fn data_extents(img: &Path) -> Vec<(u64, u64, bool)> {
    let out = stdout(&ok(qemu_img(&["map", "--output=json", s(img)])));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"].as_bool().unwrap(),
            )
        })
        .collect()
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
