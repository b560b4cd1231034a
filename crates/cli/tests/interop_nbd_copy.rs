//! `diskit copy` against nbdcopy: the same command lines give the same
//! bytes and the same allocation, through nbdkit and qemu-nbd, with
//! files, pipes, `[ CMD ]` servers and `null:`; bad input gets nbdcopy's
//! errors and exit codes.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::*;

/// Runs `script` under `nbdkit -U - ARGS --run`, where `$uri` is the export.
fn under_nbdkit(args: &[&str], script: &str) -> std::process::Output {
    timed("nbdkit", 120)
        .args(["-U", "-"])
        .args(args)
        .args(["--run", script])
        .output()
        .expect("nbdkit is installed")
}

#[test]
fn copies_into_and_out_of_an_export_as_nbdcopy_does() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    // Data, a written zero block inside data, and holes.
    sparse_file(
        &src,
        6 << 20,
        &[
            (0, 70_000, 0x11),
            (1 << 20, 300_000, 0x22),
            (5 << 20, 4096, 0x33),
        ],
    );
    let mine = dir.path().join("mine.raw");
    let theirs = dir.path().join("theirs.raw");
    let script = format!(
        "set -e; {d} copy {src} \"$uri\"; {d} copy \"$uri\" {mine}; nbdcopy \"$uri\" {theirs}",
        d = s(&diskit_bin()),
        src = s(&src),
        mine = s(&mine),
        theirs = s(&theirs),
    );
    let o = under_nbdkit(&["memory", "6M"], &script);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&src, &mine));
    assert!(same_bytes(&src, &theirs));
    assert_eq!(allocated(&mine), allocated(&theirs));

    // And the other way round: nbdcopy writes, diskit reads.
    let back = dir.path().join("back.raw");
    let script = format!(
        "set -e; nbdcopy {src} \"$uri\"; {d} copy -C 1 --request-size=64K \"$uri\" {back}",
        d = s(&diskit_bin()),
        src = s(&src),
        back = s(&back),
    );
    let o = under_nbdkit(&["memory", "6M"], &script);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&src, &back));
    assert_eq!(allocated(&back), allocated(&theirs));
}

#[test]
fn pipes_commands_and_null_work_as_in_nbdcopy() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(
        &src,
        3 << 20,
        &[(4096, 50_000, 0x44), (2 << 20, 8192, 0x55)],
    );
    let d = diskit_bin();

    // A pipe out: every byte, in order.
    let o = Command::new(&d)
        .args(["copy", s(&src), "-"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.stdout, std::fs::read(&src).unwrap());

    // A pipe in, to a file (holes kept) and to an export.
    let piped = dir.path().join("piped.raw");
    let mut child = Command::new(&d)
        .args(["copy", "-", s(&piped)])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&std::fs::read(&src).unwrap())
        .unwrap();
    assert!(child.wait().unwrap().success());
    assert!(same_bytes(&src, &piped));
    assert!(allocated(&piped) < 1 << 20, "zeros from a pipe stay holes");

    // A server run for the copy, both as source and as destination.
    let out = dir.path().join("out.raw");
    ok(diskit(&[
        "copy",
        "[",
        "nbdkit",
        "-r",
        "file",
        s(&src),
        "]",
        s(&out),
    ]));
    assert!(same_bytes(&src, &out));
    let q = dir.path().join("q.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&q), "3M"]));
    ok(diskit(&argv(
        "copy --",
        &[s(&src), "[", "qemu-nbd", "-f", "qcow2", s(&q), "]"],
    )));
    ok(same_as_qemu_img(
        &["compare", "-f", "raw", "-F", "qcow2", s(&src), s(&q)],
        "compare",
    ));

    // null: reads everything and keeps nothing.
    ok(diskit(&["copy", s(&src), "null:"]));
    ok(diskit(&argv(
        "copy --synchronous",
        &["[", "nbdkit", "-r", "file", s(&src), "]", "null:"],
    )));
}

#[test]
fn multi_conn_and_options_are_reported_with_verbose() {
    let script = format!(
        "set -e; {d} copy -v -T 4 \"$uri\" null: 2>&1 | grep -q 'connections=4 requests=64'; \
         {d} copy -v --synchronous \"$uri\" null: 2>&1 | grep -q 'connections=1 requests=1'",
        d = s(&diskit_bin()),
    );
    let o = under_nbdkit(&["memory", "1M"], &script);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
}

#[test]
fn progress_to_a_descriptor_counts_to_100() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 8 << 20, &[(0, 1 << 20, 0x66)]);
    let o = Command::new(diskit_bin())
        .args(["copy", "--progress=1", s(&src), "null:"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.first(), Some(&"0/100"), "{text}");
    assert_eq!(lines.last(), Some(&"100/100"), "{text}");
    assert!(lines.iter().all(|l| l.ends_with("/100")));
}

#[test]
fn bad_input_gets_clear_errors() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 2 << 20, &[(0, 4096, 1)]);
    let d = diskit_bin();
    let cases: &[(&[&str], &str)] = &[
        (&["copy", s(&src)], "required"),
        (
            &["copy", "[", "nbdkit", "memory", "1M", s(&src)],
            "without a matching",
        ),
        (
            &["copy", "--request-size=1000", s(&src), "null:"],
            "power of 2",
        ),
        (&["copy", "--sparse=100", s(&src), "null:"], "power of 2"),
        (&["copy", s(&src), "null:", "extra"], "extra"),
        (&["copy", "/nonexistent/file", "null:"], "/nonexistent/file"),
    ];
    for (args, needle) in cases {
        let o = Command::new(&d).args(*args).output().unwrap();
        assert_eq!(code(&o), 1, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
    // A destination smaller than the source, a read-only destination.
    let script = format!(
        "{d} copy {src} \"$uri\"; test $? = 1",
        d = s(&d),
        src = s(&src)
    );
    let o = under_nbdkit(&["memory", "1M"], &script);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = under_nbdkit(
        &["-r", "memory", "4M"],
        &format!(
            "{d} copy {src} \"$uri\" 2>&1 | grep -q read-only",
            d = s(&d),
            src = s(&src)
        ),
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn read_errors_stop_the_copy_with_how_far_it_got() {
    let dir = workdir();
    let out = dir.path().join("out.raw");
    let script = format!(
        "{d} copy \"$uri\" {out} 2>err.txt; rc=$?; cat err.txt >&2; test $rc = 1 && grep -q 'copied' err.txt",
        d = s(&diskit_bin()),
        out = s(&out)
    );
    let o = timed("nbdkit", 60)
        .current_dir(dir.path())
        .args([
            "-U",
            "-",
            "--filter=error",
            "pattern",
            "8M",
            "error-pread=EIO",
            "error-pread-rate=100%",
            "--run",
            &script,
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("Input/output error") || stderr(&o).contains("server error"));
}

#[test]
fn oldstyle_and_simple_reply_servers_are_read_as_libnbd_reads_them() {
    let dir = workdir();
    for args in [&["-o"][..], &["--no-sr"][..]] {
        let script = format!(
            "set -e; nbdinfo --no-content \"$uri\" > a.txt; {d} nbdinfo --no-content \"$uri\" > b.txt; \
             cmp a.txt b.txt; nbdinfo --json --no-content \"$uri\" > a.txt; \
             {d} nbdinfo --json --no-content \"$uri\" > b.txt; cmp a.txt b.txt; \
             {d} copy \"$uri\" mine.raw; nbdcopy \"$uri\" theirs.raw; cmp mine.raw theirs.raw",
            d = s(&diskit_bin()),
        );
        let o = timed("nbdkit", 60)
            .current_dir(dir.path())
            .args(["-U", "-"])
            .args(args)
            .args(["pattern", "1M", "--run", &script])
            .output()
            .unwrap();
        assert!(o.status.success(), "{args:?}: {}{}", stdout(&o), stderr(&o));
    }
}

#[test]
fn nbdinfo_runs_servers_and_answers_can_and_is_as_libnbd() {
    let d = diskit_bin();
    for word in [
        "write",
        "WRITE",
        "read",
        "connect",
        "sr",
        "tls",
        "readonly",
        "read-only",
        "fastzero",
        "multiconn",
        "rotational",
        "zero",
        "trim",
        "flush",
    ] {
        for ro in [true, false] {
            let mut server = vec!["[", "nbdkit"];
            if ro {
                server.push("-r");
            }
            server.extend(["memory", "1M", "]"]);
            let mut ours = Command::new(&d);
            ours.args(["nbdinfo", "--can", word, "--"]).args(&server);
            let mut theirs = Command::new("nbdinfo");
            theirs.args(["--can", word, "--"]).args(&server);
            let (a, b) = (ours.output().unwrap(), theirs.output().unwrap());
            assert_eq!(
                code(&a),
                code(&b),
                "--can {word} (read-only {ro}): {}",
                stderr(&a)
            );
        }
    }
    let o = Command::new(&d)
        .args([
            "nbdinfo",
            "--can",
            "bogus",
            "nbd+unix:///?socket=/nonexistent",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).contains("bogus"));
    // Everything but the URI (each names its own socket) as nbdinfo shows it.
    let server = ["--", "[", "nbdkit", "pattern", "2M", "]"];
    let strip = |o: std::process::Output| -> String {
        stdout(&o)
            .lines()
            .filter(|l| !l.contains("uri"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let a = Command::new(&d)
        .args(["nbdinfo", "--no-content"])
        .args(server)
        .output()
        .unwrap();
    let b = Command::new("nbdinfo")
        .args(["--no-content"])
        .args(server)
        .output()
        .unwrap();
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(strip(a), strip(b));
}

#[test]
fn a_server_that_dies_mid_copy_fails_the_copy_with_how_far_it_got() {
    let dir = workdir();
    let sock = dir.path().join("s.sock");
    let args = ["-f", "-U", s(&sock), "--filter=delay", "pattern", "256M"];
    let server = start_server(
        "nbdkit",
        &[&args[..], &["delay-read=50ms"]].concat(),
        || sock.exists(),
    );
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let out = dir.path().join("out.raw");
    let copy = Command::new(diskit_bin())
        .args(["copy", "-C", "1", &uri, s(&out)])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    drop(server);
    let o = copy.wait_with_output().unwrap();
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_stderr_has(&o, "copied");
}
