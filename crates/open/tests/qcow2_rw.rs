//! qcow2 read-write through the library, with qemu-img as the oracle:
//! images qemu-img creates are written by diskit (random writes, zeroes and
//! discards, from several threads), then `qemu-img check` must find no
//! error and `qemu-img compare` must find them equal to a model.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use diskit_core::{BlockDevice, WriteFlags, ZeroFlags};
use diskit_open::OpenOptions;

use common::{open_qcow2, s, writable};

fn qemu_img(args: &[&str]) -> std::process::Output {
    Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img is installed (scripts/test installs it)")
}

/// Runs qemu-img, which must succeed; returns its standard output.
fn ok(args: &[&str]) -> String {
    common::run("qemu-img", args)
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Write(u64, u64, u8),
    Zero(u64, u64, bool),
    Trim(u64, u64),
}

/// Random requests inside `size`, aligned to `align` (with some unaligned ones).
fn ops(seed: u64, n: usize, size: u64, cluster: u64) -> Vec<Op> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|i| {
            let align = match r.below(4) {
                0 => 512,
                1 => 4096,
                2 => cluster,
                _ => 1,
            };
            let len = ((r.below(3 * cluster) / align).max(1) * align).min(size);
            let off = (r.below(size - len + 1) / align * align).min(size - len);
            match r.below(10) {
                0..=5 => Op::Write(off, len, (i % 250) as u8 + 1),
                6..=8 => Op::Zero(off, len, r.below(2) == 0),
                _ => Op::Trim(off, len),
            }
        })
        .collect()
}

/// Applies `ops` to the image (on `threads` threads, each on its own
/// quarter of the disk so that the result is deterministic) and to the model.
fn apply(dev: &Arc<dyn BlockDevice>, model: &mut [u8], ops: &[Op], threads: usize) {
    let size = model.len() as u64;
    let slice = size / threads as u64;
    let mut per: Vec<Vec<Op>> = vec![Vec::new(); threads];
    for op in ops {
        let (off, len) = match *op {
            Op::Write(o, l, _) | Op::Zero(o, l, _) | Op::Trim(o, l) => (o, l),
        };
        // Clip each request into one thread's slice.
        let t = ((off / slice) as usize).min(threads - 1);
        let lo = t as u64 * slice;
        let hi = if t == threads - 1 { size } else { lo + slice };
        let end = (off + len).min(hi);
        if end <= off {
            continue;
        }
        let l = end - off;
        let clipped = match *op {
            Op::Write(_, _, p) => Op::Write(off, l, p),
            Op::Zero(_, _, m) => Op::Zero(off, l, m),
            Op::Trim(..) => Op::Trim(off, l),
        };
        per[t].push(clipped);
        match clipped {
            Op::Write(o, l, p) => model[o as usize..(o + l) as usize].fill(p),
            Op::Zero(o, l, _) => model[o as usize..(o + l) as usize].fill(0),
            Op::Trim(..) => {}
        }
    }
    std::thread::scope(|sc| {
        for list in per {
            let dev = dev.clone();
            sc.spawn(move || {
                for op in list {
                    match op {
                        Op::Write(o, l, p) => dev
                            .write_at(&vec![p; l as usize], o, WriteFlags::NONE)
                            .unwrap(),
                        Op::Zero(o, l, may_trim) => dev
                            .write_zeroes(
                                o,
                                l,
                                ZeroFlags {
                                    may_trim,
                                    ..Default::default()
                                },
                            )
                            .unwrap(),
                        Op::Trim(..) => {}
                    }
                }
            });
        }
    });
}

/// Trims whole clusters where the model says zero and there is no backing
/// file (so trimmed ranges must read back as zeros).
fn trim_zero_clusters(dev: &dyn BlockDevice, model: &[u8], cluster: u64) {
    let mut off = 0;
    while off + cluster <= model.len() as u64 {
        if model[off as usize..(off + cluster) as usize]
            .iter()
            .all(|&b| b == 0)
        {
            dev.trim(off, cluster, WriteFlags::NONE).unwrap();
        }
        off += cluster * 3;
    }
}

struct Case {
    name: &'static str,
    opts: &'static str,
    cluster: u64,
    backing: bool,
}

fn run_case(dir: &Path, case: &Case, seed: u64) {
    let size: u64 = 8 << 20;
    let img = dir.join(format!("{}.qcow2", case.name));
    let mut model = vec![0u8; size as usize];
    let mut create = vec!["create", "-q", "-f", "qcow2", "-o", case.opts];
    let base: PathBuf = dir.join(format!("{}-base.raw", case.name));
    if case.backing {
        // A base with a pattern everywhere, so that copy-on-write shows.
        let mut r = Rng(seed ^ 0xabc);
        for (i, chunk) in model.chunks_mut(4096).enumerate() {
            if r.below(3) > 0 {
                chunk.fill((i % 200) as u8 + 20);
            }
        }
        std::fs::write(&base, &model).unwrap();
        create.extend(["-b", s(&base), "-F", "raw"]);
    }
    create.push(s(&img));
    let size_s = size.to_string();
    create.push(&size_s);
    ok(&create);
    {
        let image = open_qcow2(s(&img), writable());
        let list = ops(seed, 300, size, case.cluster);
        apply(&image.device, &mut model, &list, 4);
        if !case.backing {
            trim_zero_clusters(&*image.device, &model, case.cluster);
        }
        // Read back through diskit before closing.
        let mut back = vec![0u8; size as usize];
        image.device.read_at(&mut back, 0).unwrap();
        assert!(
            back == model,
            "{}: diskit reads back what it wrote",
            case.name
        );
        image.close().unwrap();
    }
    let model_path = dir.join(format!("{}-model.raw", case.name));
    std::fs::write(&model_path, &model).unwrap();
    let check = qemu_img(&["check", s(&img)]);
    assert!(
        check.status.success(),
        "{}: qemu-img check: {}{}",
        case.name,
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(
        out.contains("No errors were found"),
        "{}: qemu-img check: {out}",
        case.name
    );
    ok(&[
        "compare",
        "-f",
        "raw",
        "-F",
        "qcow2",
        s(&model_path),
        s(&img),
    ]);
}

#[test]
fn random_writes_zeroes_and_discards_pass_qemu_check() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        Case {
            name: "v3",
            opts: "cluster_size=65536",
            cluster: 65536,
            backing: false,
        },
        Case {
            name: "v2",
            opts: "compat=0.10",
            cluster: 65536,
            backing: false,
        },
        Case {
            name: "small",
            opts: "cluster_size=4096",
            cluster: 4096,
            backing: false,
        },
        Case {
            name: "c512",
            opts: "cluster_size=512,refcount_bits=1",
            cluster: 512,
            backing: false,
        },
        Case {
            name: "rc64",
            opts: "cluster_size=16384,refcount_bits=64",
            cluster: 16384,
            backing: false,
        },
        Case {
            name: "xl2",
            opts: "extended_l2=on,cluster_size=131072",
            cluster: 131072,
            backing: false,
        },
        Case {
            name: "xl2-back",
            opts: "extended_l2=on",
            cluster: 65536,
            backing: true,
        },
        Case {
            name: "v3-back",
            opts: "cluster_size=65536",
            cluster: 65536,
            backing: true,
        },
        Case {
            name: "v2-back",
            opts: "compat=0.10,cluster_size=8192",
            cluster: 8192,
            backing: true,
        },
        Case {
            name: "prealloc",
            opts: "preallocation=metadata",
            cluster: 65536,
            backing: false,
        },
        Case {
            name: "falloc",
            opts: "preallocation=falloc,cluster_size=32768",
            cluster: 32768,
            backing: false,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        run_case(dir.path(), c, 0x1234_5678 + i as u64 * 7919);
    }
}

/// The write storm run in a child process by [`kill_during_write_storm_never_corrupts`]:
/// random writes, zeroes and discards on four threads, with a tiny L2 cache
/// (so tables are evicted and written all the time) and periodic flushes.
#[test]
fn storm_child() {
    let Ok(path) = std::env::var("DISKIT_STORM_IMAGE") else {
        return; // Only does something when the parent test runs it.
    };
    let image = open_qcow2(
        &path,
        OpenOptions {
            l2_cache_size: Some(1),
            ..writable()
        },
    );
    let dev = image.device.clone();
    let size = dev.size();
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let dev = dev.clone();
            sc.spawn(move || {
                let mut r = Rng(0x9e37_79b9 * (t + 1));
                let buf = vec![t as u8 + 1; 256 << 10];
                for i in 0.. {
                    let len = (r.below(64) + 1) * 4096;
                    let off = r.below((size - len) / 4096) * 4096;
                    match r.below(8) {
                        0 => dev
                            .write_zeroes(
                                off,
                                len,
                                ZeroFlags {
                                    may_trim: true,
                                    ..Default::default()
                                },
                            )
                            .unwrap(),
                        1 => dev.trim(off, len, WriteFlags::NONE).unwrap(),
                        _ => dev
                            .write_at(&buf[..len as usize], off, WriteFlags::NONE)
                            .unwrap(),
                    }
                    if i % 50 == 0 {
                        dev.flush().unwrap();
                    }
                }
            });
        }
    });
}

/// kill -9 in the middle of a write storm leaves an image that qemu-img
/// check finds free of corruption (leaked clusters are allowed).
#[test]
fn kill_during_write_storm_never_corrupts() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (opts, delay)) in [
        ("cluster_size=4096", 300u64),
        ("extended_l2=on", 500),
        ("cluster_size=512,refcount_bits=4", 400),
        ("compat=0.10,cluster_size=8192", 350),
    ]
    .into_iter()
    .enumerate()
    {
        let img = dir.path().join(format!("storm{i}.qcow2"));
        ok(&["create", "-q", "-f", "qcow2", "-o", opts, s(&img), "64M"]);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "storm_child", "--nocapture", "--test-threads=1"])
            .env("DISKIT_STORM_IMAGE", &img)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay));
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("{opts}: the storm ended early ({status}): {err}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let check = qemu_img(&["check", s(&img)]);
        let out = String::from_utf8_lossy(&check.stdout).into_owned();
        let code = check.status.code();
        // 0: clean; 3: leaked clusters only. 2 means corruption.
        assert!(
            matches!(code, Some(0) | Some(3)),
            "{opts}: qemu-img check exit {code:?}: {out}{}",
            String::from_utf8_lossy(&check.stderr)
        );
        // The storm got far enough to matter.
        let used: u64 = out
            .lines()
            .find_map(|l| l.strip_prefix("Image end offset: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        assert!(
            used > 256 << 10,
            "{opts}: only {used} bytes in use after the storm: {out}"
        );
    }
}
