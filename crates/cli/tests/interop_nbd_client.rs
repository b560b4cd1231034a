//! diskit as an NBD client: an nbd+unix:// URI wherever an image name goes,
//! against qemu-nbd and nbdkit, with qemu-img as the oracle.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// qemu-nbd serving `file` as `format` until dropped.
fn qemu_nbd(dir: &Path, format: &str, file: &Path, read_only: bool) -> QemuNbd {
    let sock = dir.join(format!("qnbd-{}.sock", std::process::id()));
    let mut args = vec!["-f", format];
    if read_only {
        args.push("-r");
    }
    args.push(s(file));
    QemuNbd::start(&sock, &args)
}

/// A qcow2 with data, zeros and holes, written by qemu-io.
fn sample(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("sample.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "8M"]));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &[
                "write -P 5 1M 256k",
                "-c",
                "write -z 3M 64k",
                "-c",
                "write -P 9 7M 4k",
                s(&p),
            ],
        ),
    ));
    p
}

#[test]
fn map_info_and_convert_from_an_export_equal_qemu_img() {
    let dir = workdir();
    let img = sample(dir.path());
    let server = qemu_nbd(dir.path(), "qcow2", &img, true);
    let uri = server.uri.as_str();
    same_as_qemu_img(&["map", "--output=json", uri], "map");
    same_as_qemu_img(&["map", uri], "map human");
    same_as_qemu_img(&["info", uri], "info");
    same_as_qemu_img(&["info", "--output=json", uri], "info json");
    let (ours, theirs) = (dir.path().join("a.raw"), dir.path().join("b.raw"));
    ok(diskit(&["convert", "-O", "raw", uri, s(&ours)]));
    ok(qemu_img(&["convert", "-O", "raw", uri, s(&theirs)]));
    assert!(same_bytes(&ours, &theirs));
    assert_eq!(allocated(&ours), allocated(&theirs), "holes kept");
    let o = ok(diskit(&["compare", uri, s(&img)]));
    assert_eq!(code(&o), 0);
    // The same export in a json: description.
    let json = format!(r#"json:{{"driver":"raw","file":{{"driver":"nbd","filename":"{uri}"}}}}"#);
    ok(diskit(&["map", &json]));
}

#[test]
fn a_qcow2_on_an_export_reads_as_qemu_reads_it() {
    let dir = workdir();
    let img = sample(dir.path());
    // The export is the qcow2 file's bytes; the format sits on the client.
    let server = qemu_nbd(dir.path(), "raw", &img, true);
    let uri = server.uri.as_str();
    same_as_qemu_img(&["map", "--output=json", "-f", "qcow2", uri], "qcow2 map");
    let (ours, theirs) = (dir.path().join("a.raw"), dir.path().join("b.raw"));
    ok(diskit(&argv("convert -f qcow2 -O raw", &[uri, s(&ours)])));
    ok(qemu_img(&argv(
        "convert -f qcow2 -O raw",
        &[uri, s(&theirs)],
    )));
    assert!(same_bytes(&ours, &theirs));
    // Probing finds the qcow2 inside the export.
    same_as_qemu_img(&["map", "--output=json", uri], "qcow2 probed");
}

#[test]
fn convert_into_an_export_writes_what_qemu_img_reads_back() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(
        &src,
        8 << 20,
        &[
            (0, 65536, 0x11),
            (3 << 20, 1 << 20, 0x22),
            ((8 << 20) - 512, 512, 0x33),
        ],
    );
    for format in ["raw", "qcow2"] {
        let target = dir.path().join(format!("target.{format}"));
        ok(qemu_img(&["create", "-q", "-f", format, s(&target), "8M"]));
        // Dirty the target so that zeros must really be written.
        ok(peer(
            "qemu-io",
            &["-f", format, "-c", "write -P 0xee 0 8M", s(&target)],
        ));
        let server = qemu_nbd(dir.path(), format, &target, false);
        ok(diskit(&argv("convert -n -O raw", &[s(&src), &server.uri])));
        drop(server);
        let back = dir.path().join("back.raw");
        ok(qemu_img(&argv(
            "convert -f",
            &[format, "-O", "raw", s(&target), s(&back)],
        )));
        assert!(same_bytes(&back, &src), "{format}");
    }
}

#[test]
fn nbdkit_exports_work_too() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 4 << 20, &[(12345, 100_000, 0x5a)]);
    let out = dir.path().join("out.raw");
    let script = format!(
        "set -e; {d} convert -n -O raw {src} \"$uri\"; {d} convert -O raw \"$uri\" {out}; \
         {d} compare \"$uri\" {src}",
        d = s(&diskit_bin()),
        src = s(&src),
        out = s(&out),
    );
    let o = timed("nbdkit", 60)
        .args(["-U", "-", "memory", "4M", "--run", &script])
        .output()
        .expect("nbdkit is installed");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(same_bytes(&out, &src));
}

#[test]
fn bad_uris_and_missing_servers_get_clear_errors() {
    let dir = workdir();
    let sock = dir.path().join("nobody.sock");
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let o = diskit(&["info", &uri]);
    assert_fails_with(&o, 1, "nobody.sock");
    let o = diskit(&["info", "nbd+unix:///"]);
    assert_stderr_has(&o, "socket");
    let o = diskit(&["info", "nbd://localhost/?bogus=1"]);
    assert_stderr_has(&o, "'bogus'");
    // An export the server does not have.
    let img = sample(dir.path());
    let server = qemu_nbd(dir.path(), "qcow2", &img, true);
    let wrong = server.uri.replace(":///", ":///nosuch");
    let o = diskit(&["info", &wrong]);
    assert_fails_with(&o, 1, "nosuch");
}

#[test]
fn serve_proxies_another_server_as_nbdkit_nbd_plugin_does() {
    let dir = workdir();
    let img = sample(dir.path());
    let server = qemu_nbd(dir.path(), "qcow2", &img, true);
    let sock = server.uri.split("socket=").nth(1).unwrap().to_string();
    let direct = ok(qemu_img(&["map", "--output=json", &server.uri]));
    // The same export through diskit's proxy, by socket and by URI, and
    // with a filter over it.
    for plugin_args in [vec![format!("socket={sock}")], vec![server.uri.clone()]] {
        let mut args = vec![
            "-U",
            "-",
            "--run",
            "qemu-img map --output=json \"$uri\"",
            "nbd",
        ];
        args.extend(plugin_args.iter().map(String::as_str));
        let o = serve(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(stdout(&o), stdout(&direct));
    }
    let o = serve(&argv(
        "-U - --filter=offset --run",
        &[
            "nbdinfo --size \"$uri\"",
            "nbd",
            &format!("socket={sock}"),
            "offset=1M",
        ],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), (7u64 << 20).to_string());
    let o = serve(&["-U", "-", "--run", "true", "nbd", "export=x"]);
    assert_fails_with(&o, 1, "uri, socket, hostname");
}

/// In a child about to exec: makes `fd` its descriptor 3, kept across exec.
fn to_fd_3(fd: i32) -> std::io::Result<()> {
    // SAFETY: fcntl/dup2 on descriptors the child owns.
    let r = unsafe {
        if fd == 3 {
            libc::fcntl(3, libc::F_SETFD, 0)
        } else {
            libc::dup2(fd, 3)
        }
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `serve nbd` with each of nbdkit's ways to name the server below gives
/// clients what nbdkit's nbd plugin gives them from the same command line.
#[test]
fn nbd_plugin_forms_match_nbdkit() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dir = workdir();
    let img = sample(dir.path());
    let server = qemu_nbd(dir.path(), "qcow2", &img, true);
    let sock = server.uri.split("socket=").nth(1).unwrap().to_string();
    let direct = ok(qemu_img(&["map", "--output=json", &server.uri]));
    let map = "qemu-img map --output=json \"$uri\"";
    let forms: Vec<Vec<String>> = vec![
        vec![format!("socket={sock}")],
        vec![format!("uri={}", server.uri)],
        ["command=qemu-nbd", "arg=-r", "arg=-f", "arg=qcow2"]
            .iter()
            .map(|a| a.to_string())
            .chain([format!("arg={}", s(&img))])
            .collect(),
    ];
    for form in &forms {
        let mut args: Vec<&str> = vec!["-U", "-", "--run", map, "nbd"];
        args.extend(form.iter().map(String::as_str));
        let ours = serve(&args);
        assert!(ours.status.success(), "{form:?}: {}", stderr(&ours));
        assert_eq!(stdout(&ours), stdout(&direct), "{form:?}");
        let theirs = ok(peer("nbdkit", &args));
        assert_eq!(stdout(&ours), stdout(&theirs), "{form:?}");
    }
    // hostname= and port=: qemu-nbd on loopback TCP.
    let port = free_port();
    let qemu_args = ["-t", "-r", "-f", "qcow2", "-b", "127.0.0.1", "-p"];
    let tcp = start_server(
        "qemu-nbd",
        &[&qemu_args[..], &[&port.to_string(), s(&img)]].concat(),
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
    );
    let o = serve(&argv(
        "-U - --run",
        &[map, "nbd", "hostname=127.0.0.1", &format!("port={port}")],
    ));
    drop(tcp);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&direct));
    // socket-fd=3: a connection the parent opened.
    let conn = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let fd = conn.as_raw_fd();
    let mut c = Command::new(diskit_bin());
    c.args(["serve", "-U", "-", "--run", map, "nbd", "socket-fd=3"]);
    // SAFETY: to_fd_3 only calls async-signal-safe functions.
    unsafe {
        c.pre_exec(move || to_fd_3(fd));
    }
    let o = c.output().unwrap();
    drop(conn);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&direct));
    // Bad parameters name the plugin and what is wrong.
    let plain = std::fs::File::open(&img).unwrap();
    let bad: &[(&[&str], &str)] = &[
        (&["socket=/x", "uri=nbd://h"], "exactly one"),
        (&["port=1"], "port= goes with hostname="),
        (
            &["command=qemu-nbd", "tls=require"],
            "tls=require goes with",
        ),
        (&["socket=/x", "tls=on"], "tls=on"),
        (&["socket=/x", "tls=maybe"], "tls: expected"),
        (&["socket=/x", "tls-certificates=/d"], "need tls=require"),
        (&["hostname=h", "port=0"], "not a port number"),
        (&["socket-fd=x"], "not a file descriptor"),
        (&["uri=nbd://h", "export=x"], "uri= carries its own"),
        (&["arg=-r", "socket=/x"], "arg= goes with command="),
        (&["socket=/x", "retry=many"], "retry: not a number"),
    ];
    for (args, want) in bad {
        let mut all = vec!["-U", "-", "--run", "true", "nbd"];
        all.extend_from_slice(args);
        let o = serve(&all);
        assert_eq!(code(&o), 1, "{args:?}");
        assert!(stderr(&o).contains("nbd: "), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
    }
    // A descriptor that is not a socket.
    let fd = plain.as_raw_fd();
    let mut c = Command::new(diskit_bin());
    c.args(["serve", "-U", "-", "--run", "true", "nbd", "socket-fd=3"]);
    // SAFETY: to_fd_3 only calls async-signal-safe functions.
    unsafe {
        c.pre_exec(move || to_fd_3(fd));
    }
    let o = c.output().unwrap();
    assert_fails_with(&o, 1, "not a connected stream socket");
}

#[test]
fn server_takes_what_peers_ask_of_it() {
    let dir = workdir();
    let src = dir.path().join("src.raw");
    sparse_file(&src, 4 << 20, &[(0, 1 << 20, 0x42)]);
    // nbdcopy --flush against memory (it used to refuse: no flush).
    let o = serve(&argv(
        "-U - --run",
        &[
            &format!("nbdcopy --flush {} \"$uri\"", s(&src)),
            "memory",
            "4M",
        ],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    // null without a size is empty, as nbdkit's.
    let o = ok(serve(&argv(
        "-U - --run",
        &["nbdinfo --size \"$uri\"", "null"],
    )));
    assert_eq!(stdout(&o).trim(), "0");
    // -s with a socket passed by socket activation is refused.
    let o = timed("sh", 30)
        .args([
            "-c",
            &format!(
                "LISTEN_PID=$$ LISTEN_FDS=1 exec {} serve -s null 1M </dev/null",
                s(&diskit_bin())
            ),
        ])
        .output()
        .unwrap();
    assert_fails_with(&o, 1, "socket activation");
    // --exit-with-parent: the server goes when the shell that started it does.
    let sock = dir.path().join("orphan.sock");
    let o = timed("sh", 30)
        .args([
            "-c",
            &format!(
                "{} serve --exit-with-parent -U {s} null 1M & sleep 1; test -S {s}",
                s(&diskit_bin()),
                s = s(&sock)
            ),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "the server did not listen");
    let t = Instant::now();
    while sock.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!sock.exists(), "the server outlived its parent");
}

/// A 10 MiB qcow2 with every other MiB written (seed 001's layout, small).
fn every_other_mib(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("alt.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "10M"]));
    let cmds: Vec<String> = (0..5)
        .map(|i| format!("write -P {} {}M 1M", i + 1, 2 * i))
        .collect();
    let mut args = vec!["-f", "qcow2"];
    for c in &cmds {
        args.extend(["-c", c.as_str()]);
    }
    args.push(s(&p));
    ok(peer("qemu-io", &args));
    p
}

#[test]
fn convert_prezeroes_only_when_zeroing_is_fast() {
    let dir = workdir();
    let src = every_other_mib(dir.path());
    let want = dir.path().join("want.raw");
    ok(qemu_img(&["convert", "-O", "raw", s(&src), s(&want)]));
    let back = dir.path().join("back.raw");
    let log = dir.path().join("log.txt");
    // (nozero parameters, fast zero requests, zero requests, writes at most)
    for (params, fast, zeros, writes) in [
        // Fast zero works: the whole target in one request, then data
        // only (5 MiB in requests of 256 KiB).
        ("zeromode=plugin", 1, 1, 20),
        ("zeromode=plugin fastzeromode=ignore", 1, 1, 20),
        // Not offered: the holes are zeroed, one request each.
        ("zeromode=plugin fastzeromode=none", 0, 5, 20),
        // No zeroing at all: zeros are written.
        ("zeromode=none", 0, 0, 40),
    ] {
        let _ = std::fs::remove_file(&log);
        let script = format!(
            "set -e; {d} convert -n -f qcow2 -O raw {src} \"$uri\"; {d} convert -O raw \"$uri\" {back}",
            d = s(&diskit_bin()),
            src = s(&src),
            back = s(&back),
        );
        let mut args = vec![
            "-U".to_string(),
            "-".into(),
            "--filter=log".into(),
            "--filter=nozero".into(),
            "memory".into(),
            "10M".into(),
            format!("logfile={}", s(&log)),
        ];
        args.extend(params.split_whitespace().map(String::from));
        args.extend(["--run".into(), script]);
        let o = timed("nbdkit", 60).args(&args).output().unwrap();
        assert!(o.status.success(), "{params}: {}", stderr(&o));
        assert!(same_bytes(&back, &want), "{params}");
        let text = std::fs::read_to_string(&log).unwrap();
        // The convert into the export (over several connections: nbdkit's
        // memory allows multi-conn) is what writes; the one back only reads.
        let first: Vec<&str> = text.lines().collect();
        let count = |what: &str| first.iter().filter(|l| l.contains(what)).count();
        let fast_seen = first
            .iter()
            .filter(|l| l.contains(" Zero id=") && l.contains("fast=1"))
            .count();
        assert_eq!(fast_seen, fast, "{params}: fast zeros\n{text}");
        assert_eq!(count(" Zero id="), zeros, "{params}: zeros\n{text}");
        assert!(count(" Write id=") <= writes, "{params}: writes\n{text}");
    }
}

#[test]
fn nbdinfo_agrees_with_libnbd() {
    let dir = workdir();
    let img = every_other_mib(dir.path());
    let modes: [&[&str]; 10] = [
        &[],
        &["--json"],
        &["--size"],
        &["--map"],
        &["--map=qemu:allocation-depth"],
        &["--map", "--totals"],
        &["--map", "--json"],
        &["--map", "--totals", "--json"],
        &["--list"],
        &["--list", "--json"],
    ];
    // qemu-nbd with allocation depth, queried directly.
    let dir2 = workdir();
    let sock = dir2.path().join("a.sock");
    let mut child = Command::new("qemu-nbd")
        .args(["-t", "-r", "-A", "-f", "qcow2", "-k", s(&sock), s(&img)])
        .spawn()
        .expect("qemu-nbd is installed");
    let t = Instant::now();
    while !sock.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    for m in modes {
        let mut args = m.to_vec();
        args.push(&uri);
        let theirs = timed("nbdinfo", 30).args(&args).output().unwrap();
        let mut ours_args = vec!["nbdinfo"];
        ours_args.extend(&args);
        let ours = diskit(&ours_args);
        assert_eq!(code(&ours), code(&theirs), "{m:?}: {}", stderr(&ours));
        assert_eq!(stdout(&ours), stdout(&theirs), "{m:?}");
    }
    for (q, want) in [
        (["--can", "flush"], 0),
        (["--is", "read-only"], 0),
        (["--can", "trim"], 2),
    ] {
        let theirs = timed("nbdinfo", 30)
            .args([q[0], q[1], &uri])
            .output()
            .unwrap();
        let ours = diskit(&["nbdinfo", q[0], q[1], &uri]);
        assert_eq!(code(&theirs), want, "{q:?}");
        assert_eq!(code(&ours), want, "{q:?}");
    }
    let _ = child.kill();
    let _ = child.wait();
    // nbdkit and diskit's own server, both tools in one --run.
    let both = |m: &str| {
        format!(
            "a=$({} nbdinfo {m} \"$uri\"); b=$(nbdinfo {m} \"$uri\"); \
             test \"$a\" = \"$b\" || {{ echo \"$a\"; echo \"$b\"; exit 1; }}",
            s(&diskit_bin())
        )
    };
    for server in [
        vec!["nbdkit", "-U", "-", "memory", "1M"],
        vec!["nbdkit", "-U", "-", "null", "0"],
    ] {
        for m in ["", "--json", "--map", "--list --json"] {
            let o = timed(server[0], 30)
                .args(&server[1..])
                .args(["--run", &both(m)])
                .output()
                .unwrap();
            assert!(o.status.success(), "{server:?} {m}: {}", stdout(&o));
        }
    }
    let o = serve(&argv(
        "-U - -e disk --description",
        &["a test disk", "--run", &both("--json"), "memory", "8M"],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_minimum_block_size_is_obeyed() {
    // nbdkit refuses every request not aligned to 4 KiB; a qcow2 written
    // on the export reads and writes its small metadata all the same.
    let dir = workdir();
    let src = dir.path().join("q.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&src), "4M"]));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &["write -P 3 100k 300k", "-c", "write -P 4 3M 5k", s(&src)],
        ),
    ));
    let script = format!(
        "set -e; qemu-img create -q -f qcow2 \"$uri\" 4M; \
         {d} convert -n -O qcow2 {src} \"$uri\"; qemu-img check -f qcow2 \"$uri\"; \
         {d} compare -f qcow2 -F qcow2 {src} \"$uri\"; {d} map -f qcow2 \"$uri\" > /dev/null",
        d = s(&diskit_bin()),
        src = s(&src),
    );
    let o = timed("nbdkit", 60)
        .args([
            "-U",
            "-",
            "--filter=blocksize-policy",
            "memory",
            "8M",
            "blocksize-minimum=4096",
            "blocksize-preferred=4096",
            "blocksize-error-policy=error",
            "--run",
            &script,
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
}
