//! diskit under the names of the tools it stands in for (`qemu-img`,
//! `nbdkit`, `nbdcopy`, `nbdinfo`, `nbdfuse`: links to the binary under test), run
//! with the command lines their callers use, against the real tools:
//! version lines, repeated options, options after positional arguments,
//! nbdkit's introspection and options, and error messages.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A directory of links named as the tools, to the binary under test.
struct Names {
    dir: tempfile::TempDir,
}

impl Names {
    fn new() -> Names {
        let dir = workdir();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        for name in ["qemu-img", "nbdkit", "nbdcopy", "nbdinfo", "nbdfuse"] {
            std::os::unix::fs::symlink(diskit_bin(), bin.join(name)).unwrap();
        }
        Names { dir }
    }

    /// The work directory (the links are in its `bin`).
    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// diskit run as `tool`.
    fn ours(&self, tool: &str) -> PathBuf {
        self.path().join("bin").join(tool)
    }

    /// Runs diskit as `tool` with `args` in the work directory.
    fn run(&self, tool: &str, args: &[&str]) -> Output {
        timed(self.ours(tool), 60)
            .args(args)
            .current_dir(self.path())
            .output()
            .unwrap()
    }

    /// Runs the real `tool` with `args` in the work directory.
    fn real(&self, tool: &str, args: &[&str]) -> Output {
        timed(tool, 60)
            .args(args)
            .current_dir(self.path())
            .output()
            .unwrap()
    }

    /// A path in the work directory.
    fn file(&self, name: &str) -> PathBuf {
        self.path().join(name)
    }
}

/// A server stopped when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `program args` (a server in the foreground) and waits for
/// `socket` to appear.
fn start(program: impl AsRef<std::ffi::OsStr>, args: &[&str], socket: &Path) -> Server {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    let t = Instant::now();
    while !socket.exists() && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(socket.exists(), "the server did not start: {args:?}");
    server
}

/// Whether `line` is `prefix` followed by a dotted version number.
fn version_after(line: &str, prefix: &str) -> bool {
    line.strip_prefix(prefix).is_some_and(|rest| {
        let v: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        v.contains('.') && v.starts_with(|c: char| c.is_ascii_digit())
    })
}

/// The `key` of each `key=value` line.
fn keys(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_string()))
        .collect()
}

/// The value of `key` in `key=value` lines.
fn value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
}

#[test]
fn version_lines_pass_the_callers_checks() {
    let n = Names::new();
    // (tool, first line's prefix before the version, second line's)
    let checks = [
        ("qemu-img", "qemu-img version ", None),
        ("nbdkit", "nbdkit 1", None),
        ("nbdcopy", "nbdcopy 1", Some("libnbd 1")),
        ("nbdinfo", "nbdinfo 1", Some("libnbd 1")),
        ("nbdfuse", "nbdfuse 1", Some("libnbd 1")),
    ];
    for (tool, first, second) in checks {
        for (who, o) in [
            ("real", n.real(tool, &["--version"])),
            ("ours", n.run(tool, &["--version"])),
        ] {
            assert!(o.status.success(), "{who} {tool} --version: {}", stderr(&o));
            let out = stdout(&o);
            let mut lines = out.lines();
            let line = lines.next().unwrap_or_default();
            let prefix = first.trim_end_matches('1');
            assert!(version_after(line, prefix), "{who} {tool}: {out}");
            assert!(line.starts_with(first), "{who} {tool}: {out}");
            if let Some(second) = second {
                let l2 = lines.next().unwrap_or_default();
                assert!(l2.starts_with(second), "{who} {tool}: {out}");
            }
        }
        let ours = stdout(&n.run(tool, &["--version"]));
        assert!(ours.contains("(diskit "), "{tool}: {ours}");
    }
}

#[test]
fn repeated_options_are_taken_the_last_one_winning() {
    let n = Names::new();
    let img = n.file("r.qcow2");
    // -o accumulates: both options reach the image.
    let create = [
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=4096",
        "-o",
        "lazy_refcounts=on",
        s(&img),
        "1M",
    ];
    let ours = n.run("qemu-img", &create);
    assert!(ours.status.success(), "{}", stderr(&ours));
    let info = [
        "info",
        "-f",
        "qcow2",
        "-f",
        "qcow2",
        "--output=json",
        "--output=json",
        "-U",
        "--force-share",
        s(&img),
    ];
    let ours = n.run("qemu-img", &info);
    let theirs = n.real("qemu-img", &info);
    assert!(ours.status.success(), "{}", stderr(&ours));
    assert!(theirs.status.success(), "{}", stderr(&theirs));
    assert_eq!(stdout(&ours), stdout(&theirs));
    assert!(stdout(&ours).contains("\"cluster-size\": 4096"));
    assert!(stdout(&ours).contains("\"lazy-refcounts\": true"));
    // The last --output wins.
    let o = n.run(
        "qemu-img",
        &["info", "--output=json", "--output=human", s(&img)],
    );
    assert!(stdout(&o).starts_with("image: "), "{}", stdout(&o));
    // Flags given twice.
    let o = n.run("qemu-img", &["check", "-q", "-q", s(&img)]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn nbdcopy_takes_virt_v2v_options_after_its_sides() {
    let n = Names::new();
    let src = n.file("in.raw");
    sparse_file(&src, 1 << 20, &[(0, 65536, 0x11), (512 << 10, 4096, 0x22)]);
    let args = |out: &str| {
        vec![
            s(&src).to_string(),
            out.to_string(),
            "--request-size=262144".to_string(),
            "--requests=64".to_string(),
            "--flush".to_string(),
            "--progress".to_string(),
        ]
    };
    for (who, out) in [("real", "theirs.raw"), ("ours", "ours.raw")] {
        let a = args(out);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = if who == "real" {
            n.real("nbdcopy", &a)
        } else {
            n.run("nbdcopy", &a)
        };
        assert!(o.status.success(), "{who}: {}", stderr(&o));
        assert!(same_bytes(&src, &n.file(out)), "{who}: the copy differs");
    }
    // A server command keeps its options, before `--` or not; options
    // after it are still nbdcopy's.
    let nbdkit = n.ours("nbdkit");
    let dst = n.file("from-server.raw");
    let o = n.run(
        "nbdcopy",
        &["--", "[", s(&nbdkit), "-r", "file", s(&src), "]", s(&dst)],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&src, &dst));
    std::fs::remove_file(&dst).unwrap();
    let o = n.run(
        "nbdcopy",
        &[
            "[",
            s(&nbdkit),
            "-r",
            "file",
            s(&src),
            "]",
            s(&dst),
            "-R",
            "4",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&src, &dst));
    // `--` still ends the options: a side named like an option is a file.
    let o = n.run("nbdcopy", &["--", s(&src), "--flush"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&src, &n.file("--flush")));
}

#[test]
fn nbdinfo_takes_json_after_the_uri() {
    let n = Names::new();
    let sock = n.file("s");
    let _server = start(
        n.ours("nbdkit"),
        &["-f", "-U", s(&sock), "memory", "1M"],
        &sock,
    );
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let ours = n.run("nbdinfo", &[&uri, "--json"]);
    let theirs = n.real("nbdinfo", &[&uri, "--json"]);
    assert!(ours.status.success(), "{}", stderr(&ours));
    assert!(theirs.status.success(), "{}", stderr(&theirs));
    assert_eq!(stdout(&ours), stdout(&theirs));
    // --content after --no-content: the last one wins.
    let o = n.run("nbdinfo", &[&uri, "--no-content", "--content"]);
    assert_contains(&stdout(&o), "content:");
    let o = n.run("nbdinfo", &[&uri, "--content", "--no-content"]);
    assert!(!stdout(&o).contains("content:"), "{}", stdout(&o));
}

#[test]
fn nbdkit_dump_config_and_dump_plugin_answer_as_nbdkit() {
    let n = Names::new();
    let ours = n.run("nbdkit", &["--dump-config"]);
    let theirs = n.real("nbdkit", &["--dump-config"]);
    assert!(ours.status.success(), "{}", stderr(&ours));
    assert_eq!(keys(&stdout(&ours)), keys(&stdout(&theirs)));
    let ours = stdout(&ours);
    assert_eq!(value(&ours, "version_major"), Some("1"));
    let (v, major, minor) = (
        value(&ours, "version").unwrap(),
        value(&ours, "version_major").unwrap(),
        value(&ours, "version_minor").unwrap(),
    );
    assert!(v.starts_with(&format!("{major}.{minor}.")), "{ours}");

    for plugin in ["memory", "file", "null", "sh", "eval"] {
        let ours = n.run("nbdkit", &[plugin, "--dump-plugin"]);
        let theirs = n.real("nbdkit", &[plugin, "--dump-plugin"]);
        assert!(ours.status.success(), "{plugin}: {}", stderr(&ours));
        let (ours, theirs) = (stdout(&ours), stdout(&theirs));
        for key in [
            "name",
            "api_version",
            "thread_model",
            "max_thread_model",
            "magic_config_key",
        ] {
            assert_eq!(value(&ours, key), value(&theirs, key), "{plugin} {key}");
        }
        assert!(value(&ours, "path").is_some_and(|p| Path::new(p).exists()));
        for has in [
            "has_pread",
            "has_pwrite",
            "has_flush",
            "has_trim",
            "has_zero",
            "has_extents",
        ] {
            assert_eq!(value(&ours, has), value(&theirs, has), "{plugin} {has}");
        }
        // The script plugins name, list and describe their exports (the
        // file plugin's dir= does too, which diskit's has not).
        for has in [
            "has_list_exports",
            "has_default_export",
            "has_export_description",
        ] {
            if matches!(plugin, "sh" | "eval") {
                assert_eq!(value(&ours, has), value(&theirs, has), "{plugin} {has}");
            }
        }
    }
    // With filters, as virt-v2v probes them; an unknown one fails.
    let o = n.run("nbdkit", &["null", "--filter=retry", "--dump-plugin"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = n.run("nbdkit", &["null", "--filter=nosuch", "--dump-plugin"]);
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).starts_with("nbdkit: error: "), "{}", stderr(&o));
}

#[test]
fn nbdkit_plugin_version_and_help_name_the_plugin() {
    let n = Names::new();
    let args = ["null", "--filter=retry", "--version"];
    let ours = stdout(&n.run("nbdkit", &args));
    let theirs = stdout(&n.real("nbdkit", &args));
    let names = |t: &str| -> Vec<String> {
        t.lines()
            .map(|l| l.split(' ').next().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(names(&ours), names(&theirs), "{ours}");
    let help = n.run("nbdkit", &["memory", "--help"]);
    assert!(help.status.success());
    assert_contains(&stdout(&help), "plugin: memory");
    assert_contains(&stdout(&help), "--filter");
}

#[test]
fn option_lists_hold_what_the_tools_take() {
    let n = Names::new();
    let lines =
        |o: Output| -> BTreeSet<String> { stdout(&o).lines().map(str::to_string).collect() };
    // nbdcopy's and nbdinfo's lists are the real ones, with the options of
    // a later nbdcopy than the one installed that diskit takes too
    // (libnbd 1.24's --blkhash), and diskit's own (--dirty-bitmap, an
    // incremental copy).
    let later: BTreeSet<String> = ["--blkhash", "--blkhash-file", "--dirty-bitmap"]
        .map(str::to_string)
        .into();
    for (tool, flag) in [
        ("nbdcopy", "--short-options"),
        ("nbdcopy", "--long-options"),
        ("nbdinfo", "--short-options"),
    ] {
        let mut want = lines(n.real(tool, &[flag]));
        if flag == "--long-options" {
            want.extend(later.iter().cloned());
        }
        assert_eq!(lines(n.run(tool, &[flag])), want, "{tool} {flag}");
    }
    // nbdkit's hold what callers pass, and each listed option is taken.
    let long = lines(n.run("nbdkit", &["--long-options"]));
    let short = lines(n.run("nbdkit", &["--short-options"]));
    let real_long = lines(n.real("nbdkit", &["--long-options"]));
    for o in [
        "--foreground",
        "--no-fork",
        "--readonly",
        "--read-only",
        "--exit-with-parent",
        "--unix",
        "--pidfile",
        "--filter",
        "--debug",
        "--selinux-label",
        "--newstyle",
        "--oldstyle",
        "--stdin",
        "--log",
        "--threads",
        "--run",
        "--ipv4-only",
        "--ipv6-only",
        "--export-name",
        "--dump-config",
        "--dump-plugin",
        "--version",
        "--help",
    ] {
        assert!(long.contains(o), "nbdkit --long-options lacks {o}");
        assert!(real_long.contains(o), "nbdkit itself lacks {o}");
    }
    for o in [
        "-4", "-6", "-D", "-e", "-f", "-i", "-n", "-o", "-p", "-P", "-r", "-s", "-t", "-U", "-v",
        "-V",
    ] {
        assert!(short.contains(o), "nbdkit --short-options lacks {o}");
    }
}

#[test]
fn nbdkit_options_virt_v2v_passes_are_accepted() {
    let n = Names::new();
    let args = [
        "-D",
        "nbdkit.backend.datapath=0",
        "-D",
        "nbdkit.backend.controlpath=0",
        "-n",
        "--no-fork",
        "--log=stderr",
        "-4",
        "--threads=4",
        "--exit-with-parent",
        "-U",
        "-",
        "-r",
        "--readonly",
        "memory",
        "1M",
        "--run",
        "nbdinfo --size --is read-only \"$uri\"; nbdinfo --size \"$uri\"",
    ];
    let ours = n.run("nbdkit", &args);
    let theirs = n.real("nbdkit", &args);
    assert!(ours.status.success(), "{}", stderr(&ours));
    assert_eq!(stdout(&ours), stdout(&theirs));
    assert_eq!(stdout(&ours).trim(), "1048576");
    // A debug flag not of nbdkit's shape, and the oldstyle protocol, are
    // refused with a reason.
    for args in [["-D", "file", "null"], ["--dump-plugin", "-r", "-r"]] {
        let o = n.run("nbdkit", &args);
        let theirs = n.real("nbdkit", &args);
        assert_eq!(stderr(&o), stderr(&theirs), "{args:?}");
        assert_eq!(code(&o), code(&theirs), "{args:?}");
    }
    let o = n.run("nbdkit", &["-o", "null"]);
    assert_fails_with(&o, 1, "newstyle");
}

#[test]
fn kubevirt_cdi_line_serves_read_only() {
    let n = Names::new();
    let disk = n.file("disk.raw");
    sparse_file(&disk, 1 << 20, &[(4096, 8192, 0x5a)]);
    let sock = n.file("cdi.sock");
    let pid = n.file("cdi.pid");
    let _server = start(
        n.ours("nbdkit"),
        &[
            "--foreground",
            "--readonly",
            "--exit-with-parent",
            "-U",
            s(&sock),
            "--pidfile",
            s(&pid),
            "--filter=readahead",
            "--filter=retry",
            "-r",
            "file",
            s(&disk),
        ],
        &sock,
    );
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let o = n.real("nbdinfo", &["--is", "read-only", &uri]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = n.file("out.raw");
    let o = n.real("nbdcopy", &[&uri, s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&disk, &out));
    let t = Instant::now();
    while !pid.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        std::fs::read_to_string(&pid)
            .unwrap()
            .trim()
            .parse::<u32>()
            .is_ok()
    );
}

#[test]
fn a_missing_file_is_reported_as_the_real_tools_report_it() {
    let n = Names::new();
    let gone = "no-such-file";
    let sock = format!("nbd+unix:///?socket={}", s(&n.file("no-such.sock")));
    let cases: [(&str, Vec<&str>); 4] = [
        ("qemu-img", vec!["info", gone]),
        ("nbdkit", vec!["-f", "-U", "-", "file", gone]),
        ("nbdcopy", vec![gone, "out.raw"]),
        ("nbdinfo", vec![&sock]),
    ];
    for (tool, args) in cases {
        let ours = n.run(tool, &args);
        let theirs = n.real(tool, &args);
        assert_eq!(stderr(&ours), stderr(&theirs), "{tool} {args:?}");
        assert_eq!(code(&ours), code(&theirs), "{tool} {args:?}");
        assert!(!stderr(&ours).contains("os error"), "{}", stderr(&ours));
    }
    // Usage errors carry the name run as, in the tool's words.
    let o = n.run("nbdkit", &[]);
    assert_eq!(stderr(&o), stderr(&n.real("nbdkit", &[])));
    assert_eq!(code(&o), 1);
    let o = n.run("qemu-img", &["info", "--bogus", gone]);
    let theirs = n.real("qemu-img", &["info", "--bogus", gone]);
    assert_eq!(stderr(&o), stderr(&theirs));
    let o = n.run("nbdcopy", &["--bogus", "a", "b"]);
    let first = stderr(&o).lines().next().unwrap_or_default().to_string();
    let theirs = n.real("nbdcopy", &["--bogus", "a", "b"]);
    assert_eq!(Some(first.as_str()), stderr(&theirs).lines().next());
}
