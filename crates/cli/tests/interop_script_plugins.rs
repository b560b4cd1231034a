//! nbdkit's script plugins, `sh` and `eval`, under nbdkit 1.32 and under
//! `diskit serve` on the same command lines: nbdkit's own example.sh
//! (vendored unmodified in tests/scripts) and a RAM-disk script with every
//! method (tests/scripts/ram.sh), compared by flags, bytes, maps and the
//! answers to the same requests (errors by errno name), and the same
//! refusals of bad command lines.
//!
//! diskit's server takes FLUSH on every writable export, so `can_flush`
//! is compared only where the script flushes too.

mod common;

use std::path::PathBuf;
use std::process::Stdio;

use common::*;

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scripts")
        .join(name)
}

#[test]
fn nbdkit_s_example_sh_serves_a_file_as_nbdkit_does() {
    let dir = workdir();
    let ex = script("example.sh");
    let file = dir.path().join("pristine.img");
    data_then_hole(&file, 65536, 1 << 20);
    let args = ["sh", s(&ex), "file=disk.img"];
    std::fs::copy(&file, dir.path().join("disk.img")).unwrap();
    // The example lists the directory's files as exports; the default
    // export's name is not compared.
    same_flags(dir.path(), &args, &["can_flush"]);
    // The same requests, each server from the same file, which ends equal.
    let disk = dir.path().join("disk.img");
    same_answers_and_file(dir.path(), &args, &file, &disk, 0, 65536);
    both_refuse(dir.path(), &["sh", s(&ex)], "file parameter missing");
}

#[test]
fn a_ram_script_answers_every_method_as_under_nbdkit() {
    let dir = workdir();
    let ram = script("ram.sh");
    let args = ["sh", s(&ram), "size=2M"];
    let dk = same_flags(dir.path(), &args, &[]);
    assert_eq!(dk["export-size"], 2 << 20);
    assert_eq!(dk["can_fua"], true);
    assert_eq!(dk["can_multi_conn"], false);
    // Writes, zeroes and trims land; a write past the first megabyte is
    // ENOSPC, as the script says.
    let a = same_answers(dir.path(), &args, 4096, 8192);
    assert!(
        a.contains("write-changed ok") && a.contains("trim ok"),
        "{a}"
    );
    let a = same_answers(dir.path(), &args, 1 << 20, 4096);
    assert!(a.contains("write-same ENOSPC"), "{a}");
    // The map is the script's: data written, holes elsewhere.
    let cmd = "nbdsh -u \"$uri\" -c 'h.pwrite(b\"x\" * 65536, 131072)' && nbdinfo --map \"$uri\"";
    let [nb, dk] = both_ok(dir.path(), &args, cmd);
    assert_eq!(nb, dk);
    assert!(dk.contains("131072       65536    0  data"), "{dk}");
    both_refuse(dir.path(), &["sh", s(&ram)], "size parameter missing");
    both_refuse(
        dir.path(),
        &["sh", s(&ram), "size=1M", "colour=blue"],
        "unknown parameter colour",
    );
}

#[test]
fn eval_snippets_answer_as_under_nbdkit() {
    let dir = workdir();
    let args = [
        "eval",
        "config_complete=dd if=/dev/zero bs=64K count=1 status=none | tr '\\0' e >$tmpdir/d; \
         truncate -s 128K $tmpdir/d",
        "get_size=echo 128K",
        "pread=dd if=$tmpdir/d iflag=skip_bytes,count_bytes skip=$4 count=$3 status=none",
        "pwrite=cat >/dev/null; echo 'EROFS not today' >&2; exit 1",
        "extents=echo 0 64K; echo 64K 64K hole,zero",
    ];
    let dk = same_flags(dir.path(), &args, &["can_flush"]);
    assert_eq!(dk["is_read_only"], false);
    same_bytes_and_map(dir.path(), &args);
    // EROFS reaches the client as EPERM, under both.
    let a = same_answers(dir.path(), &args, 0, 4096);
    assert!(a.contains("write-same EPERM"), "{a}");
    // A can_* snippet overrides the one nbdkit makes up: read-only.
    let mut ro = args.to_vec();
    ro.push("can_write=exit 3");
    let dk = same_flags(dir.path(), &ro, &[]);
    assert_eq!(dk["is_read_only"], true);
    both_refuse(
        dir.path(),
        &["eval", "get_size=echo 1M", "get_size=echo 2M"],
        "method get_size defined more than once on the command line",
    );
    both_refuse(
        dir.path(),
        &["eval", "get_size=echo 1M", "colour=blue"],
        "callback 'colour' is unknown, and there is no 'config' callback to handle it",
    );
}

#[test]
fn an_inline_script_is_read_from_standard_input() {
    let dir = workdir();
    let body = "case \"$1\" in\n  get_size) echo 1M ;;\n  \
                pread) dd if=/dev/zero count=$3 iflag=count_bytes status=none | tr '\\0' 'i' ;;\n  \
                *) exit 2 ;;\nesac\n";
    let outs = SERVERS.map(|server| {
        let mut c = server.command(60);
        c.current_dir(dir.path())
            .args(["-U", "-", "sh", "-", "--run"])
            .arg(format!("{PYTHON} -c \"import nbd,sys; h=nbd.NBD(); h.connect_uri(sys.argv[1]); print(h.get_size(), h.pread(3, 5))\" \"$uri\""))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
        stdout(&ok(child.wait_with_output().unwrap()))
    });
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[1].trim(), "1048576 bytearray(b'iii')");
}

#[test]
fn every_connection_opens_and_closes_its_own_handle() {
    let dir = workdir();
    let ram = script("ram.sh");
    // Two clients, one after the other, each with its own handle; the
    // script refuses a handle that is not one it opened.
    let cmd = "nbdinfo --size \"$uri\" && nbdinfo --size \"$uri\"";
    let outs = both_ok(dir.path(), &["sh", s(&ram), "size=64K"], cmd);
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[1].trim(), "65536\n65536");
}

#[test]
fn any_export_name_reaches_the_plugin_as_under_nbdkit() {
    let dir = workdir();
    // The handle is the export name the client asked for; the size
    // depends on it. nbdkit serves a plugin under any name.
    let args = [
        "-e",
        "disk",
        "eval",
        "open=echo \"$3\"",
        "get_size=case \"$2\" in big) echo 2M;; *) echo 1M;; esac",
        "pread=dd if=/dev/zero count=$3 iflag=count_bytes status=none",
    ];
    let cmd = "nbdinfo --size \"nbd+unix:///big?socket=$unixsocket\" && \
               nbdinfo --size \"nbd+unix:///other?socket=$unixsocket\" && \
               nbdinfo --size \"$uri\"";
    let [nb, dk] = both_ok(dir.path(), &args, cmd);
    assert_eq!(nb, dk);
    assert_eq!(
        dk.split_whitespace().collect::<Vec<_>>(),
        ["2097152", "1048576", "1048576"]
    );
}

#[test]
fn preconnect_runs_before_each_handshake_and_may_refuse_the_client() {
    let dir = workdir();
    // The script counts its calls in $tmpdir and refuses the second
    // client: the first connects, the second is closed before its
    // handshake, the third connects again.
    let args = [
        "eval",
        "preconnect=n=$(cat $tmpdir/n 2>/dev/null || echo 0); n=$((n+1)); echo $n > $tmpdir/n; \
         [ $n -ne 2 ] || { echo refused >&2; exit 1; }",
        "get_size=echo 1M",
        "pread=dd if=/dev/zero count=$3 iflag=count_bytes status=none",
    ];
    let cmd = "nbdinfo --size \"$uri\"; echo \"first $?\"; \
               nbdinfo --size \"$uri\" 2>/dev/null; echo \"second $?\"; \
               nbdinfo --size \"$uri\"; echo \"third $?\"";
    let [nb, dk] = both_ok(dir.path(), &args, cmd);
    assert_eq!(nb, dk);
    assert_eq!(
        dk.lines().collect::<Vec<_>>(),
        ["1048576", "first 0", "second 1", "1048576", "third 0"]
    );
}

/// nbdkit 1.34's exit statuses 4-8 (nbdkit 1.32, the peer here, treats
/// them as errors): checked against nbdkit-sh-plugin(3).
fn eval_pread_exiting(status: u8) -> Vec<String> {
    vec![
        "eval".into(),
        "get_size=echo 1M".into(),
        format!("pread=dd if=/dev/zero count=$3 iflag=count_bytes status=none; exit {status}"),
    ]
}

#[test]
fn status_7_closes_the_connection_after_the_reply_and_8_fails_it_too() {
    let dir = workdir();
    // Each of two reads: "ok", or the errno's name; "closed" once the
    // connection is gone.
    let py = "import errno, nbd, sys\n\
              h = nbd.NBD()\n\
              h.connect_uri(sys.argv[1])\n\
              for _ in range(2):\n    \
              try:\n        h.pread(512, 0)\n        print('ok')\n    \
              except nbd.Error as e:\n        \
              print(errno.errorcode.get(e.errnum, 'closed'))\n";
    std::fs::write(dir.path().join("two.py"), py).unwrap();
    for (status, want) in [(7, ["ok", "closed"]), (8, ["ESHUTDOWN", "closed"])] {
        let args = eval_pread_exiting(status);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run(
            Server::Diskit,
            dir.path(),
            &args,
            &format!("{PYTHON} two.py \"$uri\""),
        );
        let out = stdout(&ok(o));
        let got: Vec<&str> = out.lines().collect();
        // The second read finds the connection closed (libnbd's errno
        // for a dead connection varies: any but success).
        assert_eq!(got[0], want[0], "status {status}: {out}");
        assert_ne!(got[1], "ok", "status {status}: {out}");
    }
}

#[test]
fn status_4_shuts_the_server_down_after_the_reply() {
    let dir = workdir();
    let sock = dir.path().join("s.sock");
    let args = eval_pread_exiting(4);
    let mut server = std::process::Command::new(diskit_bin())
        .args(["serve", "-f", "-U"])
        .arg(&sock)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(appears(&sock, 10), "the server did not start");
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    assert_eq!(one_read(&uri), "512");
    // Once its last client has gone, the server exits by itself.
    let st = exits_within(&mut server, 20).expect("the server did not shut down");
    assert!(st.success(), "the server failed: {st}");
}
