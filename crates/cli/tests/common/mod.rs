//! Shared helpers for the interop tests: run diskit and the real peers,
//! build sparse test files, read allocation.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod images;
mod plugins;

#[allow(unused_imports)]
pub use images::*;
#[allow(unused_imports)]
pub use plugins::*;

/// The Python with libnbd's `nbd` module (a pyenv python3 first on PATH
/// may lack it).
pub const PYTHON: &str = "/usr/bin/python3";

/// A libnbd script of tests/nbd (checks.py, filter_ops.py).
pub fn nbd_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/nbd")
        .join(name)
}

/// The diskit binary under test.
pub fn diskit_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_diskit"))
}

/// The words of a command line written as one string (`"convert -O
/// raw"`): arguments without spaces or quoting.
pub fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// [`words`] of `line`, then `more` (file names, arguments with spaces).
pub fn argv<'a>(line: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut all = words(line);
    all.extend(more);
    all
}

/// Runs diskit with `args`.
pub fn diskit(args: &[&str]) -> Output {
    Command::new(diskit_bin())
        .args(args)
        .output()
        .expect("run diskit")
}

/// PATH with /usr/bin first, so that nbdsh and friends find their Python.
pub fn path_env() -> String {
    format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default())
}

/// A command running `program` under `timeout` (killed 5 s after `secs`
/// if it ignores the TERM), with the test PATH: a stuck server or client
/// fails the test instead of hanging it.
pub fn timed(program: impl AsRef<OsStr>, secs: u32) -> Command {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", &secs.to_string()])
        .arg(program)
        .env("PATH", path_env());
    c
}

/// The servers with nbdkit's command line that the tests compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// nbdkit itself.
    Nbdkit,
    /// `diskit serve`.
    Diskit,
}

/// The flags `nbdinfo --json` reports of an export, the export's size
/// first: what the tests compare between servers.
pub const NBDINFO_FLAGS: &[&str] = &[
    "export-size",
    "is_read_only",
    "is_rotational",
    "can_flush",
    "can_fua",
    "can_trim",
    "can_zero",
    "can_fast_zero",
    "can_cache",
    "can_multi_conn",
    "can_df",
];

/// nbdkit first, then diskit.
pub const SERVERS: [Server; 2] = [Server::Nbdkit, Server::Diskit];

impl Server {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Server::Nbdkit => "nbdkit",
            Server::Diskit => "diskit",
        }
    }

    /// A command running it under `timeout` (see [`timed`]), its
    /// arguments to follow.
    pub fn command(self, secs: u32) -> Command {
        match self {
            Server::Nbdkit => timed("nbdkit", secs),
            Server::Diskit => {
                let mut c = timed(diskit_bin(), secs);
                c.arg("serve");
                c
            }
        }
    }
}

/// Runs `diskit serve ARGS` under a timeout and returns its output.
pub fn serve(args: &[&str]) -> Output {
    timed(diskit_bin(), 120)
        .arg("serve")
        .args(args)
        .output()
        .expect("run timeout diskit serve")
}

/// Runs `diskit serve -U - OPTS PLUGIN --run CMD` under a timeout: the
/// server on a private Unix socket, stopping when `cmd` ends.
pub fn serve_run(opts: &[&str], plugin: &[&str], cmd: &str) -> Output {
    let mut args = vec!["-U", "-"];
    args.extend(opts);
    args.extend(plugin);
    args.extend(["--run", cmd]);
    serve(&args)
}

/// [`serve_run`] with `--tls-certificates DIR` after `opts`.
pub fn serve_certs(opts: &[&str], dir: &Path, plugin: &[&str], cmd: &str) -> Output {
    serve_keyed(opts, "--tls-certificates", dir, plugin, cmd)
}

/// [`serve_run`] with `--tls-psk FILE` (pre-shared keys) after `opts`.
pub fn serve_psk(opts: &[&str], file: &Path, plugin: &[&str], cmd: &str) -> Output {
    serve_keyed(opts, "--tls-psk", file, plugin, cmd)
}

fn serve_keyed(opts: &[&str], flag: &str, keys: &Path, plugin: &[&str], cmd: &str) -> Output {
    let mut all = opts.to_vec();
    all.extend([flag, s(keys)]);
    serve_run(&all, plugin, cmd)
}

/// Runs a peer tool (qemu-img, ...), failing loudly if it is not installed:
/// the test command installs the peers, so a missing one is a broken setup.
pub fn peer(tool: &str, args: &[&str]) -> Output {
    Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {tool} ({e}): install it (scripts/test does)"))
}

/// Runs qemu-img with `args`.
pub fn qemu_img(args: &[&str]) -> Output {
    peer("qemu-img", args)
}

/// Standard output as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The exit code.
pub fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// Asserts that `text` contains `needle`, showing `text` otherwise.
#[track_caller]
pub fn assert_contains(text: &str, needle: &str) {
    assert!(text.contains(needle), "{text}");
}

/// Asserts that the standard error of `o` says `msg`, showing it
/// otherwise.
#[track_caller]
pub fn assert_stderr_has(o: &Output, msg: &str) {
    assert!(stderr(o).contains(msg), "{}", stderr(o));
}

/// Asserts that the run exited with `want` and that its standard error
/// says `msg`.
#[track_caller]
pub fn assert_fails_with(o: &Output, want: i32, msg: &str) {
    assert_eq!(code(o), want, "{}", stderr(o));
    assert_stderr_has(o, msg);
}

/// Asserts success, showing stderr otherwise.
pub fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "command failed ({}): {}",
        code(&o),
        stderr(&o)
    );
    o
}

/// Makes a sparse file of `size` bytes with `(offset, len, byte)` runs of data.
/// A byte of 0xff means "random-looking": each byte differs from its neighbours.
pub fn sparse_file(path: &Path, size: u64, runs: &[(u64, usize, u8)]) {
    let f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(path)
        .unwrap();
    f.set_len(size).unwrap();
    for &(off, len, byte) in runs {
        let data: Vec<u8> = if byte == 0xff {
            (0..len)
                .map(|i| (((off as usize + i) * 2654435761usize) >> 7) as u8 | 1)
                .collect()
        } else {
            vec![byte; len]
        };
        f.write_all_at(&data, off).unwrap();
    }
    f.sync_all().unwrap();
}

/// DIR/t.raw, the file the NBD tests serve: 4 MiB, holes but for 64 KiB
/// of 0x11 at 0 and `second` bytes of 0x22 at 1 MiB.
pub fn served_file(dir: &Path, second: usize) -> PathBuf {
    let p = dir.join("t.raw");
    sparse_file(&p, 4 << 20, &[(0, 65536, 0x11), (1 << 20, second, 0x22)]);
    p
}

/// The value `NAME=V` that a `--run` command recorded on its standard
/// output (`echo NAME=$?`).
pub fn recorded(o: &Output, name: &str) -> String {
    let text = stdout(o);
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} result in {text}\n{}", stderr(o)))
        .to_string()
}

/// The connection lines of a server's `-v` log.
pub fn connections(o: &Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| l.starts_with("diskit: connection"))
        .map(String::from)
        .collect()
}

/// Bytes allocated to a file (du).
pub fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Whether two files have the same bytes.
pub fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

/// Writes `path`: `data` bytes of a pattern with no zero byte, then a
/// hole up to `size`.
pub fn data_then_hole(path: &Path, data: usize, size: u64) {
    let bytes: Vec<u8> = (0..data).map(|i| (i % 251) as u8 + 1).collect();
    std::fs::write(path, &bytes).unwrap();
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(size)
        .unwrap();
}

/// A fresh temporary directory on the work disk (not tmpfs, so holes behave
/// as on a real file system; falls back to the default temp dir).
pub fn workdir() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tempfile::tempdir_in(base).unwrap()
}

/// `p` as &str.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `args` through diskit and qemu-img, both must succeed with the same
/// standard output; returns diskit's run.
pub fn same_as_qemu_img(args: &[&str], what: &str) -> Output {
    let ours = ok(diskit(args));
    let theirs = ok(qemu_img(args));
    assert_eq!(stdout(&ours), stdout(&theirs), "{what}: {args:?}");
    ours
}

/// Runs `runs` (diskit's and a peer's, to be compared) while the file
/// system's allocation of `file` holds still, and returns their outputs:
/// qcow2's metadata-preallocation test reads st_blocks, which delayed
/// allocation or speculative preallocation trimmed in the background can
/// change between two runs. The file is synced first; a pair of runs
/// during which the allocation changed is run again.
pub fn on_settled_allocation<T>(file: &Path, mut runs: impl FnMut() -> T) -> T {
    use std::os::unix::fs::MetadataExt;
    ok(Command::new("sync").arg(file).output().unwrap());
    let blocks = || std::fs::metadata(file).unwrap().blocks();
    for _ in 0..5 {
        let before = blocks();
        let out = runs();
        if blocks() == before {
            return out;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    panic!("{} kept changing its allocation", file.display());
}

/// Runs `tool` (qemu-img, or diskit's binary) in `dir`.
pub fn run_in(tool: &Path, dir: &Path, args: &[&str]) -> Output {
    Command::new(tool)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e})", tool.display()))
}

/// qemu-img's stderr as diskit prints it: the program prefix replaced.
pub fn as_diskit(qemu_stderr: &str) -> String {
    qemu_stderr
        .lines()
        .map(|l| {
            l.replacen("qemu-img: ", "diskit: ", 1)
                .replacen("'qemu-img ", "'diskit ", 1)
                + "\n"
        })
        .collect()
}

/// Runs `tool` (`diskit` for the binary under test, else a program on
/// PATH) with `args` in `dir`.
pub fn tool_in(dir: &Path, tool: &str, args: &[&str]) -> Output {
    let program = if tool == "diskit" {
        diskit_bin()
    } else {
        tool.into()
    };
    Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// [`tool_in`], which must succeed.
pub fn good_in(dir: &Path, tool: &str, args: &[&str]) -> Output {
    let o = tool_in(dir, tool, args);
    assert!(o.status.success(), "{tool} {args:?}: {}", stderr(&o));
    o
}

/// Runs qemu-img's command line `line` (see [`words`]) in `dir`; it must
/// succeed.
pub fn qemu_img_in(dir: &Path, line: &str) -> Output {
    good_in(dir, "qemu-img", &words(line))
}

/// diskit and qemu-img run `args` in `dir` alike: the same standard
/// output, the same message (program prefix aside), the same exit status.
pub fn alike_in(dir: &Path, args: &[&str]) {
    let ours = tool_in(dir, "diskit", args);
    let theirs = tool_in(dir, "qemu-img", args);
    assert_eq!(stdout(&ours), stdout(&theirs), "{args:?}");
    assert_eq!(
        stderr(&ours).replace("diskit: ", ""),
        stderr(&theirs).replace("qemu-img: ", ""),
        "{args:?}"
    );
    assert_eq!(code(&ours), code(&theirs), "{args:?}");
}

/// Runs `script` (bash, `$T` standing for each tool in turn) from a
/// `diskit serve ARGS --run` command, so that `$unixsocket` is the served
/// socket, with `env` set; the script prints `== TOOL` before each
/// tool's turn. Both turns must print the same; returns diskit's.
pub fn alike_under_serve(
    dir: &Path,
    serve_args: &[&str],
    script: &str,
    env: &[(&str, &str)],
) -> String {
    let file = dir.join("case.sh");
    let body = format!(
        "set -u\nfor T in qemu-img \"$DISKIT\"; do\necho \"== $(basename \"$T\")\"\n{script}\ndone\n"
    );
    std::fs::write(&file, body).unwrap();
    let run = format!("unixsocket=$unixsocket bash {}", s(&file));
    let mut cmd = timed(diskit_bin(), 120);
    cmd.arg("serve")
        .args(serve_args)
        .args(["--run", &run])
        .env("DISKIT", diskit_bin());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = ok(cmd.output().unwrap());
    let text = stdout(&o);
    let (theirs, ours) = text
        .split_once("== diskit\n")
        .unwrap_or_else(|| panic!("{text}\n{}", stderr(&o)));
    let theirs = theirs.trim_start_matches("== qemu-img\n");
    assert_eq!(ours, theirs, "diskit and qemu-img differ");
    ours.to_string()
}

/// Runs `diskit ARGS` in `dir` and kills it (SIGKILL) after `ms`
/// milliseconds, wherever it has got to.
pub fn diskit_killed_after(dir: &Path, args: &[&str], ms: u64) {
    let mut child = Command::new(diskit_bin())
        .args(args)
        .current_dir(dir)
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(ms));
    let _ = child.kill();
    let _ = child.wait();
}

/// Waits up to `secs` seconds for `path` to appear (a server's socket):
/// whether it did.
pub fn appears(path: &Path, secs: u64) -> bool {
    let t = std::time::Instant::now();
    while !path.exists() {
        if t.elapsed().as_secs() >= secs {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// Waits up to `secs` seconds for `child` (a server asked to stop) to
/// exit by itself: its status, or none (it is killed then).
pub fn exits_within(
    child: &mut std::process::Child,
    secs: u64,
) -> Option<std::process::ExitStatus> {
    let t = std::time::Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if t.elapsed().as_secs() >= secs {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// One 512-byte read of the export at `uri` with libnbd's Python module:
/// the number of bytes read (`512`).
pub fn one_read(uri: &str) -> String {
    let o = ok(peer(
        PYTHON,
        &[
            "-c",
            "import nbd, sys; h = nbd.NBD(); h.connect_uri(sys.argv[1]); \
             print(len(h.pread(512, 0)))",
            uri,
        ],
    ));
    stdout(&o).trim().to_string()
}

/// Starts `diskit serve -f -U SOCKET image IMAGE` and waits for its
/// socket; the server stops when the guard is dropped.
pub fn serve_image(socket: &Path, image: &Path) -> ServeGuard {
    let _ = std::fs::remove_file(socket);
    let child = Command::new(diskit_bin())
        .args(["serve", "-f", "-U", s(socket), "image", s(image)])
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !socket.exists() && t.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(socket.exists(), "diskit serve did not start");
    ServeGuard(child)
}

/// A server stopped when dropped.
pub struct ServeGuard(std::process::Child);

impl Drop for ServeGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// qemu-nbd serving on a Unix socket until dropped; it is stopped as a
/// user stops it (SIGTERM), so that it writes back its caches.
pub struct QemuNbd {
    child: std::process::Child,
    /// Its socket.
    pub sock: PathBuf,
    /// The `nbd+unix://` URI of its export.
    pub uri: String,
}

impl QemuNbd {
    /// Starts `qemu-nbd -t -k SOCK ARGS` and waits for the socket.
    pub fn start(sock: &Path, args: &[&str]) -> QemuNbd {
        let _ = std::fs::remove_file(sock);
        let child = Command::new("qemu-nbd")
            .args(["-t", "-k", s(sock)])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("qemu-nbd is installed");
        let t = std::time::Instant::now();
        while !sock.exists() {
            assert!(t.elapsed().as_secs() < 10, "qemu-nbd did not listen");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // qemu-nbd listens before it opens (and locks) the image, and
        // greets a client only once it serves: wait for the greeting.
        while !greets(sock) {
            assert!(t.elapsed().as_secs() < 10, "qemu-nbd did not serve");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        QemuNbd {
            child,
            sock: sock.to_path_buf(),
            uri: format!("nbd+unix:///?socket={}", s(sock)),
        }
    }
}

/// Whether an NBD server on `sock` sends its greeting to a new client
/// (the connection is closed at once after).
fn greets(sock: &Path) -> bool {
    use std::io::Read;
    let Ok(mut c) = std::os::unix::net::UnixStream::connect(sock) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    let mut magic = [0u8; 8];
    c.read_exact(&mut magic).is_ok() && &magic == b"NBDMAGIC"
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which wait() has not reaped.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// Starts a server (`program ARGS`, in the foreground) and waits until
/// `ready` says it listens; the server stops when the guard is dropped.
pub fn start_server(program: &str, args: &[&str], ready: impl Fn() -> bool) -> ServeGuard {
    let child = Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program} ({e}): install it (scripts/test does)"));
    let guard = ServeGuard(child);
    let t = std::time::Instant::now();
    while !ready() && t.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(ready(), "{program} did not start");
    guard
}

/// nbdkit serving `size` of its pattern plugin on a socket in `dir`, with
/// the error filter failing that share of reads with EIO: a source that
/// fails part way. Its NBD URI, and the server (stopped when dropped).
pub fn failing_source(dir: &Path, size: &str, rate: &str) -> (String, ServeGuard) {
    let sock = dir.join("err.sock");
    let rate = format!("error-pread-rate={rate}");
    let guard = start_server(
        "nbdkit",
        &[
            "-f",
            "-U",
            s(&sock),
            "--filter=error",
            "pattern",
            size,
            &rate,
            "error=EIO",
        ],
        || sock.exists(),
    );
    (format!("nbd+unix:///?socket={}", s(&sock)), guard)
}

/// A TCP port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
