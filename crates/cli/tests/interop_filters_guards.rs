//! The guard and limit filters (protect, checkwrite, swab, nocache,
//! cacheextents, ddrescue, noparallel, limit, ip, exitlast, exitwhen, scan)
//! against nbdkit 1.32 on the same command lines: what nbdinfo reports, and the
//! answers to the same requests (tests/nbd/filter_ops.py through libnbd:
//! EPERM, EIO, EINVAL where the filters refuse), each server over its own
//! copy of the disk. nbdkit 1.32 has no readonly, count or time-limit
//! filter: those are checked against their manual pages.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;
use serde_json::{Value, json};

/// Runs `nbdkit` or `diskit serve` (`diskit` true) with `-U - ARGS --run
/// CMD`, each "FILE" in ARGS replaced by `file`.
fn served(diskit: bool, args: &[&str], file: &Path, cmd: &str) -> Output {
    let mut c = if diskit {
        let mut c = timed(diskit_bin(), 120);
        c.arg("serve");
        c
    } else {
        timed("nbdkit", 120)
    };
    c.args(["-U", "-"]);
    c.args(args.iter().map(|a| if *a == "FILE" { s(file) } else { a }));
    c.args(["--run", cmd]);
    c.output().expect("run a server")
}

/// Runs both servers, each over its own copy of `src`; both must succeed
/// and print the same. Returns diskit's output.
fn alike(dir: &Path, src: &Path, args: &[&str], cmd: &str) -> String {
    alike_with(dir, src, args, args, cmd)
}

/// [`alike`] with nbdkit given `theirs` and diskit `ours` (where nbdkit
/// 1.32 has a bug, the command line that does what its manual says).
fn alike_with(dir: &Path, src: &Path, theirs: &[&str], ours: &[&str], cmd: &str) -> String {
    let outs = [false, true].map(|diskit| {
        let copy = dir.join(if diskit { "diskit.raw" } else { "nbdkit.raw" });
        std::fs::copy(src, &copy).unwrap();
        ok(served(
            diskit,
            if diskit { ours } else { theirs },
            &copy,
            cmd,
        ))
    });
    let [theirs_out, ours_out] = outs.each_ref().map(stdout);
    assert_eq!(
        theirs_out, ours_out,
        "nbdkit {theirs:?} (left) and diskit {ours:?} (right) differ"
    );
    ours_out
}

/// The command that runs `ops` (see filter_ops.py).
fn ops(ops: &Value) -> String {
    format!(
        "{PYTHON} {} \"$uri\" '{ops}'",
        s(&nbd_script("filter_ops.py"))
    )
}

/// nbdinfo's JSON, its export's fields (less those the two file plugins
/// differ on), and the map.
const INFO: &str = "nbdinfo --json \"$uri\" | jq -c '.exports[0] | del(.uri, .contexts, .\"export-name\", .description, .block_size_minimum, .block_size_preferred, .block_size_maximum, .is_rotational, .can_df, .can_fast_zero)' && nbdinfo --map \"$uri\"";

/// A 1 MiB disk: data in the first 64 KiB and at 512 KiB, holes between.
fn disk(dir: &Path) -> PathBuf {
    let p = dir.join("src.raw");
    sparse_file(&p, 1 << 20, &[(0, 65536, 0x5a), (512 << 10, 8192, 0xc3)]);
    p
}

#[test]
fn protect_refuses_changes_to_protected_ranges_with_eperm() {
    let dir = workdir();
    let src = disk(dir.path());
    let writes = json!([
        ["write", 0, 512, 3],
        ["write", 4096, 4096, 0],
        ["read", 0, 8192],
        ["write", 70000, 100, 4],
        ["zero", 65536, 4096],
        ["zero", 60000, 10000],
        ["trim", 600_000, 4096],
        ["write", 1000, 100, 5, "fua"],
    ]);
    for params in [
        &["protect=0-0x1ff"][..],
        &["protect=0x1000-0x1fff", "protect=0x2000-0x10fff"],
        &["protect=~65536-"],
        &["protect=-4095", "protect=600000-"],
    ] {
        let args: Vec<&str> = ["--filter=protect", "file", "FILE"]
            .iter()
            .chain(params)
            .copied()
            .collect();
        let out = alike(
            dir.path(),
            &src,
            &args,
            &format!("{INFO} && {}", ops(&writes)),
        );
        assert!(out.contains("error EPERM"), "{params:?}: {out}");
    }
}

#[test]
fn checkwrite_passes_a_faithful_copy_and_fails_a_change_with_eio() {
    let dir = workdir();
    let src = disk(dir.path());
    let args = ["--filter=checkwrite", "file", "FILE"];
    let copy = "nbdcopy \"$uri\" \"$uri\" && echo copied";
    assert!(alike(dir.path(), &src, &args, copy).contains("copied"));
    let ops_ = json!([
        ["write", 0, 4096, 0],
        ["write", 100_000, 4096, 0],
        ["zero", 100_000, 65536],
        ["zero", 0, 4096],
        ["trim", 200_000, 4096],
        ["flush"],
        ["write", 70000, 10, 7],
    ]);
    let out = alike(
        dir.path(),
        &src,
        &args,
        &format!("{INFO} && {}", ops(&ops_)),
    );
    assert!(out.contains("error EIO"), "{out}");
    // Nothing was written.
    let copy = dir.path().join("diskit.raw");
    assert!(same_bytes(&src, &copy));
}

#[test]
fn swab_swaps_words_and_refuses_unaligned_requests() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    let bytes: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&src, bytes).unwrap();
    for bits in ["8", "16", "32", "64"] {
        let param = format!("swab-bits={bits}");
        let args = ["--filter=swab", "file", "FILE", &param];
        let ops_ = json!([
            ["size"],
            ["read", 0, 4096],
            ["read", 999_936, 64],
            ["write", 8, 64, 9],
            ["read", 0, 128],
            ["zero", 4096, 4096],
            ["status", 0, 65536],
        ]);
        // nbdkit 1.32's swab-bits=8 writes an uninitialised buffer (its
        // pwrite copies nothing when there is nothing to swap): its
        // manual's "does nothing" is the file plugin alone.
        let theirs: &[&str] = if bits == "8" {
            &["file", "FILE"]
        } else {
            &args
        };
        alike_with(
            dir.path(),
            &src,
            theirs,
            &args,
            &format!("{INFO} && {}", ops(&ops_)),
        );
    }
}

#[test]
fn nocache_modes_advertise_and_answer_cache_as_nbdkit() {
    let dir = workdir();
    let src = disk(dir.path());
    for mode in ["none", "emulate", "nop", "no-op"] {
        let param = format!("cachemode={mode}");
        let args = ["--filter=nocache", "file", "FILE", &param];
        let cmd = format!(
            "nbdinfo --can cache \"$uri\"; echo $?; {}",
            ops(&json!([["read", 0, 4096]]))
        );
        alike(dir.path(), &src, &args, &cmd);
    }
}

#[test]
fn cacheextents_and_noparallel_serve_as_without_them() {
    let dir = workdir();
    let src = disk(dir.path());
    let ops_ = json!([
        ["status", 0, 1 << 20, "req_one"],
        ["status", 4096, 1 << 20, "req_one"],
        ["write", 600_000, 4096, 3],
        ["status", 0, 1 << 20],
        ["read", 0, 1 << 20],
    ]);
    for args in [
        &["--filter=cacheextents", "file", "FILE"][..],
        &["--filter=noparallel", "file", "FILE"],
        &[
            "--filter=noparallel",
            "file",
            "FILE",
            "serialize=all-requests",
        ],
        &[
            "--filter=noparallel",
            "file",
            "FILE",
            "serialize=connections",
        ],
    ] {
        let cmd = format!("{INFO} && {} && nbdcopy \"$uri\" /dev/null", ops(&ops_));
        alike(dir.path(), &src, args, &cmd);
    }
}

#[test]
fn ddrescue_fails_reads_of_bad_blocks_with_eio() {
    let dir = workdir();
    let src = disk(dir.path());
    let map = dir.path().join("disk.map");
    std::fs::write(
        &map,
        "# Mapfile. Created by GNU ddrescue version 1.27\n\
         # current_pos  current_status  current_pass\n\
         0x00010000     +               1\n\
         #      pos        size  status\n\
         0x00000000  0x00008000  +\n\
         0x00008000  0x00000200  -\n\
         0x00008200  0x00077E00  +\n\
         0x00080000  0x00001000  *\n\
         0x00081000  0x0007F000  +\n",
    )
    .unwrap();
    let param = format!("ddrescue-mapfile={}", s(&map));
    let args = ["--filter=ddrescue", "file", "FILE", &param];
    let ops_ = json!([
        ["read", 0, 32768],
        ["read", 32000, 1024],
        ["read", 0x8200, 4096],
        ["read", 0x80000, 512],
        ["read", 0x81000, 4096],
    ]);
    // The whole-disk digest at the end fails on both: only the requests.
    let cmd = format!(
        "nbdinfo --json \"$uri\" | jq -c '.exports[0] | [.is_read_only, .can_cache]'; {} ; true",
        ops(&ops_)
    );
    let out = alike(dir.path(), &src, &args, &cmd);
    assert!(out.contains("error EIO"), "{out}");
}

/// Python for nbdsh: holds one connection open, then tries a second.
const SECOND_CLIENT: &str = "nbdsh -u \"$uri\" -c '
h2 = nbd.NBD()
try:
    h2.connect_uri(h.get_uri())
    print(\"second connected\")
except nbd.Error:
    print(\"second refused\")
'";

#[test]
fn limit_refuses_clients_beyond_the_limit() {
    let dir = workdir();
    let src = disk(dir.path());
    let one = alike(
        dir.path(),
        &src,
        &["--filter=limit", "file", "FILE"],
        SECOND_CLIENT,
    );
    assert_eq!(one.trim(), "second refused");
    let two = ["--filter=limit", "file", "FILE", "limit=2"];
    assert_eq!(
        alike(dir.path(), &src, &two, SECOND_CLIENT).trim(),
        "second connected"
    );
    let none = ["--filter=limit", "file", "FILE", "limit=0"];
    assert_eq!(
        alike(dir.path(), &src, &none, SECOND_CLIENT).trim(),
        "second connected"
    );
}

#[test]
fn ip_allows_and_denies_unix_clients_by_credentials() {
    let dir = workdir();
    let src = disk(dir.path());
    let uid = format!("allow=uid:{}", unsafe_uid());
    let cmd = "nbdinfo --size \"$uri\" 2>/dev/null; echo $?";
    for (rules, allowed) in [
        (vec!["deny=all"], false),
        (vec![uid.as_str(), "deny=all"], true),
        (vec!["allow=uid:12345", "deny=anyunix"], false),
        (vec!["allow=gid:12345", "deny=pid:1"], true),
        (vec!["deny=anyipv4,pid:1", "allow=anyunix"], true),
        (vec!["allow=anyipv6,pid:1", "deny=allunix"], false),
    ] {
        let args: Vec<&str> = ["--filter=ip", "file", "FILE"]
            .into_iter()
            .chain(rules.iter().copied())
            .collect();
        let out = alike(dir.path(), &src, &args, cmd);
        assert_eq!(out.ends_with("0\n"), allowed, "{rules:?}: {out}");
    }
    // nbdkit 1.32 parses no address (its inet_pton calls are compiled
    // out: "don't know how to parse rule"); as its manual says, an
    // address rule does not match a Unix client, nor a wrong prefix.
    for (rules, allowed) in [
        (&["deny=127.0.0.1,::1"][..], true),
        (&["allow=10.0.0.0/8", "deny=all"], false),
        (&["deny=::1/128,192.168.0.0/16"], true),
    ] {
        let o = ok(serve_run(
            &["--filter=ip"],
            &[&["file", s(&src)], rules].concat(),
            cmd,
        ));
        assert_eq!(stdout(&o).ends_with("0\n"), allowed, "{rules:?}");
    }
    for bad in ["deny=10.0.0.0/33", "allow=::1/129", "deny=nowhere"] {
        let o = serve_run(&["--filter=ip"], &["file", s(&src), bad], cmd);
        assert_eq!(code(&o), 1, "{bad}");
    }
}

/// The user id of the tests.
fn unsafe_uid() -> String {
    stdout(&ok(std::process::Command::new("id")
        .arg("-u")
        .output()
        .unwrap()))
    .trim()
    .to_string()
}

/// Python for nbdsh: while it holds its connection, a second client
/// reads and leaves; the server still takes a third.
const HOLDER: &str = "
import subprocess
subprocess.run([\"nbdinfo\", \"--size\", h.get_uri()], check=True)
h3 = nbd.NBD()
h3.connect_uri(h.get_uri())
print(\"still serving\", h3.get_size())
h3.shutdown()
";

#[test]
fn exitlast_stops_the_server_when_its_last_client_leaves() {
    let dir = workdir();
    let src = disk(dir.path());
    for diskit in [false, true] {
        let sock = dir.path().join(format!("{diskit}.sock"));
        let mut c = server(diskit).command(60);
        let mut child = c
            .args(["-f", "-U", s(&sock), "--filter=exitlast", "file", s(&src)])
            .spawn()
            .unwrap();
        wait_for_socket(&sock);
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        let o = timed("nbdsh", 60)
            .args(["-u", &uri, "-c", HOLDER])
            .output()
            .unwrap();
        if !o.status.success() {
            let _ = child.kill();
        }
        let o = ok(o);
        assert_eq!(
            stdout(&o),
            "1048576\nstill serving 1048576\n",
            "diskit={diskit}"
        );
        let status = child.wait().unwrap();
        assert!(status.success(), "diskit={diskit}: {status}");
    }
}

/// diskit's server when `diskit`, else nbdkit.
fn server(diskit: bool) -> Server {
    if diskit {
        Server::Diskit
    } else {
        Server::Nbdkit
    }
}

/// Waits (20 s at most) until a server listens on `sock`.
fn wait_for_socket(sock: &Path) {
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(sock).is_err() && t.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn readonly_count_and_time_limit_do_what_their_manuals_say() {
    let dir = workdir();
    let src = disk(dir.path());
    let file = dir.path().join("rw.raw");
    std::fs::copy(&src, &file).unwrap();
    let flag = dir.path().join("ro");
    let write = ops(&json!([["write", 0, 512, 3], ["trim", 4096, 4096]]));
    // Always read-only.
    let o = ok(serve_run(
        &["--filter=readonly"],
        &["file", s(&file)],
        "nbdinfo --is read-only \"$uri\" && echo ro",
    ));
    assert_eq!(stdout(&o).trim(), "ro");
    // Read-only while the file exists.
    let param = format!("readonly-file={}", s(&flag));
    let plugin = ["file", s(&file), &param];
    let o = ok(serve_run(&["--filter=readonly"], &plugin, &write));
    assert!(!stdout(&o).contains("error"), "{}", stdout(&o));
    std::fs::write(&flag, "").unwrap();
    let o = ok(serve_run(&["--filter=readonly"], &plugin, &write));
    assert_eq!(
        stdout(&o).matches("error EPERM").count(),
        2,
        "{}",
        stdout(&o)
    );

    // count: the totals at the end.
    let o = ok(serve_run(
        &["--filter=count"],
        &["file", s(&file)],
        &ops(&json!([["read", 0, 4096], ["zero", 0, 512]])),
    ));
    assert_stderr_has(
        &o,
        "count bytes: read 1052672, written 0, zeroed 512, trimmed 0",
    );

    // time-limit: requests after the limit fail, and the client is cut off.
    let late = "nbdsh -u \"$uri\" -c '
import time
h.pread(512, 0)
time.sleep(2.5)
for i in range(2):
    try:
        h.pread(512, 0)
        print(\"served\")
    except nbd.Error:
        print(\"refused\")
'";
    let o = ok(serve_run(
        &["--filter=time-limit"],
        &["file", s(&file), "time-limit=1"],
        late,
    ));
    assert_eq!(stdout(&o), "refused\nrefused\n");
    let o = ok(serve_run(
        &["--filter=time-limit"],
        &["file", s(&file), "time-limit=0"],
        late,
    ));
    assert_eq!(stdout(&o), "served\nserved\n");
}

/// `diskit serve` or `nbdkit` (`diskit` false) in the foreground on the
/// socket `sock` with `--filter=exitwhen file FILE ARGS`, once it listens.
fn exitwhen_server(diskit: bool, sock: &Path, file: &Path, args: &[&str]) -> std::process::Child {
    let mut c = server(diskit).command(60);
    let child = c
        .args(["-f", "-U", s(sock), "--filter=exitwhen", "file", s(file)])
        .args(args)
        .spawn()
        .unwrap();
    wait_for_socket(sock);
    child
}

#[test]
fn exitwhen_refuses_new_clients_after_an_event_and_stops_after_the_last() {
    let dir = workdir();
    let src = disk(dir.path());
    for diskit in [false, true] {
        let flag = dir.path().join(format!("stop-{diskit}"));
        let sock = dir.path().join(format!("{diskit}.sock"));
        let created = format!("exit-when-file-created={}", s(&flag));
        let mut child = exitwhen_server(diskit, &sock, &src, &[&created, "exit-when-poll=1"]);
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        let script = format!(
            "
h1 = nbd.NBD()
h1.connect_uri(h.get_uri())
print(\"before: connected\")
h1.shutdown()
open(\"{}\", \"w\").close()
h2 = nbd.NBD()
try:
    h2.connect_uri(h.get_uri())
    print(\"second connected\")
except nbd.Error:
    print(\"second refused\")
print(h.get_size())
",
            s(&flag)
        );
        let o = timed("nbdsh", 60)
            .args(["-u", &uri, "-c", &script])
            .output()
            .unwrap();
        if !o.status.success() {
            let _ = child.kill();
        }
        assert_eq!(
            stdout(&ok(o)),
            "before: connected\nsecond refused\n1048576\n",
            "diskit={diskit}"
        );
        let status = child.wait().unwrap();
        assert!(status.success(), "diskit={diskit}: {status}");
        // The event there already: the server stops at once.
        let sock = dir.path().join(format!("again-{diskit}.sock"));
        let mut c = server(diskit).command(60);
        let o = c
            .args([
                "-f",
                "-U",
                s(&sock),
                "--filter=exitwhen",
                "file",
                s(&src),
                &created,
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "diskit={diskit}: {}", stderr(&o));
    }
}

#[test]
fn exitwhen_events_stop_an_idle_server() {
    let dir = workdir();
    let src = disk(dir.path());
    let flag = dir.path().join("flag");
    for diskit in [false, true] {
        // A file deleted; a script that sees a file (88).
        std::fs::write(&flag, "").unwrap();
        let deleted = format!("exit-when-file-deleted={}", s(&flag));
        let sock = dir.path().join(format!("del-{diskit}.sock"));
        let mut child = exitwhen_server(diskit, &sock, &src, &[&deleted, "exit-when-poll=1"]);
        std::fs::remove_file(&flag).unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "deleted, diskit={diskit}: {status}");
        let script = format!(
            "exit-when-script=test -e {} && exit 88; echo not yet >/dev/null",
            s(&flag)
        );
        let sock = dir.path().join(format!("script-{diskit}.sock"));
        let mut child = exitwhen_server(diskit, &sock, &src, &[&script, "exit-when-poll=1"]);
        std::fs::write(&flag, "").unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "script, diskit={diskit}: {status}");
        // A process that exits (reaped here).
        let mut sleeper = std::process::Command::new("sleep")
            .arg("1")
            .spawn()
            .unwrap();
        let pid = format!("exit-when-process-exits={}", sleeper.id());
        let sock = dir.path().join(format!("pid-{diskit}.sock"));
        let mut child = exitwhen_server(diskit, &sock, &src, &[&pid, "exit-when-poll=1"]);
        sleeper.wait().unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "process, diskit={diskit}: {status}");
        // A pipe closed at the other end.
        let prog = if diskit {
            format!("{} serve", s(&diskit_bin()))
        } else {
            "nbdkit".into()
        };
        let sock = dir.path().join(format!("pipe-{diskit}.sock"));
        let o = timed("bash", 60)
            .arg("-c")
            .arg(format!(
                "{prog} -f -U {} --filter=exitwhen file {} exit-when-pipe-closed=3 exit-when-poll=1 3< <(sleep 1)",
                s(&sock),
                s(&src)
            ))
            .output()
            .unwrap();
        assert!(o.status.success(), "pipe, diskit={diskit}: {}", stderr(&o));
    }
}

/// An nbdsh client that waits (20 s at most) until the log `log` shows
/// `n` cache requests answered.
fn until_cached(log: &Path, n: usize) -> String {
    format!(
        "nbdsh -u \"$uri\" -c '
import time
for _ in range(2000):
    if open(\"{}\").read().count(\"Cache id=\") >= {}:
        break
    time.sleep(0.01)
'",
        s(log),
        2 * n
    )
}

#[test]
fn scan_caches_the_disk_below_while_a_client_is_connected() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len((5 << 20) + 512).unwrap();
    let log = dir.path().join("log");
    let logfile = format!("logfile={}", s(&log));
    let args = [
        "--filter=scan",
        "--filter=log",
        "file",
        "FILE",
        &logfile,
        "scan-size=1M",
        "scan-ahead=false",
    ];
    // One client: the disk in pieces; the next goes on where the clock
    // stopped (the last piece again).
    let cmd = format!(
        "{} && {} && grep -o \"Cache id=[0-9]* offset=[^ ]* count=[^ ]*\" {}",
        until_cached(&log, 6),
        until_cached(&log, 7),
        s(&log)
    );
    let out = alike(dir.path(), &src, &args, &cmd);
    assert_eq!(out.lines().count(), 7, "{out}");
    assert!(out.ends_with("offset=0x500000 count=0x200\n"), "{out}");
    // Nothing to scan with: a warning, and the disk served.
    let args = ["--filter=scan", "--filter=nocache", "file", "FILE"];
    for diskit in [false, true] {
        let o = ok(served(diskit, &args, &src, "nbdinfo --size \"$uri\""));
        assert_eq!(stdout(&o), "5243392\n");
        assert_stderr_has(
            &o,
            "scan: warning: underlying plugin does not support NBD_CMD_CACHE",
        );
    }
    let o = serve_run(
        &["--filter=scan"],
        &["file", s(&src), "scan-size=1000"],
        "true",
    );
    assert_eq!(code(&o), 1);
}
