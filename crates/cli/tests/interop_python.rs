//! The python plugin: nbdkit's own example and test scripts
//! (tests/python, vendored unmodified from nbdkit 1.32.5) run under
//! `nbdkit python SCRIPT` (the real one, nbdkit-plugin-python), `diskit
//! serve python SCRIPT` and diskit under nbdkit's name; the clients
//! (nbdinfo, qemu-io, qemu-img, nbdsh) must see the same size, flags,
//! bytes, extents and errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

/// A script of tests/python.
fn script(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// The servers compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    /// nbdkit's python plugin.
    Nbdkit,
    /// `diskit serve python`.
    Diskit,
    /// diskit run as `nbdkit python` (a link named nbdkit).
    DiskitAsNbdkit,
}

const ALL: [Server; 3] = [Server::Nbdkit, Server::Diskit, Server::DiskitAsNbdkit];

/// Runs `server -U - python ARGS --run CMD` in `dir` (made if missing).
fn run_in(server: Server, dir: &Path, args: &[&str], cmd: &str) -> Output {
    run_with(server, dir, &[], args, cmd)
}

/// The command of `server` (a link named nbdkit in `dir` for
/// [`Server::DiskitAsNbdkit`]), with the test PATH.
fn server_command(server: Server, dir: &Path) -> std::process::Command {
    match server {
        Server::Nbdkit => timed("nbdkit", 60),
        Server::Diskit => {
            let mut c = timed(diskit_bin(), 60);
            c.arg("serve");
            c
        }
        Server::DiskitAsNbdkit => {
            let link = dir.join("nbdkit");
            if !link.exists() {
                std::os::unix::fs::symlink(diskit_bin(), &link).unwrap();
            }
            timed(link, 60)
        }
    }
}

/// Runs `server OPTS -U - python ARGS --run CMD` in `dir` (made if
/// missing).
fn run_with(server: Server, dir: &Path, opts: &[&str], args: &[&str], cmd: &str) -> Output {
    std::fs::create_dir_all(dir).unwrap();
    server_command(server, dir)
        .args(opts)
        .args(["-U", "-", "python"])
        .args(args)
        .args(["--run", cmd])
        .current_dir(dir)
        .output()
        .unwrap()
}

/// Runs it under every server, each in its own directory under `root`
/// (named after the server); the outputs in [`ALL`]'s order.
fn under_all(root: &Path, args: &[&str], cmd: &str) -> Vec<(Output, PathBuf)> {
    ALL.iter()
        .map(|&server| {
            let dir = root.join(format!("{server:?}"));
            let o = run_in(server, &dir, args, cmd);
            (o, dir)
        })
        .collect()
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

/// The flags nbdinfo reports that both servers decide alike: every one
/// but can_flush (diskit takes FLUSH on every writable export, a no-op
/// where the script has none) and the block sizes (diskit always sends
/// them).
const FLAGS: &[&str] = &[
    "is_read_only",
    "can_fua",
    "can_trim",
    "can_zero",
    "can_fast_zero",
    "can_multi_conn",
    "can_cache",
    "can_df",
    "is_rotational",
];

/// The export of an `nbdinfo --json` file.
fn export(info: &Path) -> serde_json::Value {
    json(info)["exports"][0].clone()
}

/// The servers' `nbdinfo --json` (in `info.json`) agree on size and
/// flags; nbdkit's export is returned.
fn same_info(runs: &[(Output, PathBuf)]) -> serde_json::Value {
    let theirs = export(&runs[0].1.join("info.json"));
    for (_, dir) in &runs[1..] {
        let ours = export(&dir.join("info.json"));
        assert_eq!(
            ours["export-size"],
            theirs["export-size"],
            "{}",
            dir.display()
        );
        for f in FLAGS {
            assert_eq!(ours[f], theirs[f], "{f}: {}", dir.display());
        }
        if theirs["can_flush"] == true {
            assert_eq!(ours["can_flush"], true, "{}", dir.display());
        }
    }
    theirs
}

/// Every run succeeded, and qemu-io's output in `qemu_io` (when given)
/// names no failed request.
fn all_ok(runs: &[(Output, PathBuf)], qemu_io: Option<&str>) {
    for (o, d) in runs {
        assert!(o.status.success(), "{}: {}", d.display(), stderr(o));
        if let Some(f) = qemu_io {
            let text = std::fs::read_to_string(d.join(f)).unwrap();
            assert!(!text.contains("fail"), "{}: {text}", d.display());
        }
    }
}

/// Each range of `bytes` holds only its byte.
fn holds(bytes: &[u8], runs: &[(std::ops::Range<usize>, u8)]) {
    for (r, b) in runs {
        assert!(
            bytes[r.clone()].iter().all(|x| x == b),
            "{r:?} is not {b:#x}"
        );
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn ramdisk_example_bytes_flags_and_map() {
    let dir = workdir();
    // Writes, a zero without may-trim (the script refuses it with
    // EOPNOTSUPP: zeros are written instead) and one with it, then the
    // whole disk read back, in one server's life (the disk is its memory).
    let cmd = "nbdinfo --json \"$uri\" > info.json && \
               qemu-io -f raw -c 'write -P 0x5a 4096 8192' -c 'write -z 8192 512' \
               -c 'write -P 0x33 1040384 8192' -c 'write -P 0x77 131072 4096' \
               -c 'write -z -u 131072 1024' \"$uri\" > /dev/null && \
               qemu-img convert -f raw -O raw \"$uri\" out.raw && \
               nbdinfo --map \"$uri\" > map.txt";
    let runs = under_all(dir.path(), &[&script("ramdisk.py"), "test1=foo"], cmd);
    all_ok(&runs, None);
    let e = same_info(&runs);
    assert_eq!(e["export-size"], 1 << 20);
    assert_eq!(e["can_zero"], true);
    let want = read(&runs[0].1.join("out.raw"));
    assert_eq!(want.len(), 1 << 20);
    holds(
        &want,
        &[
            (4096..8192, 0x5a),
            (8192..8704, 0),
            (8704..12288, 0x5a),
            (131072..132096, 0),
            (132096..135168, 0x77),
        ],
    );
    for (_, d) in &runs[1..] {
        assert!(read(&d.join("out.raw")) == want, "{}", d.display());
        assert_eq!(
            read(&d.join("map.txt")),
            read(&runs[0].1.join("map.txt")),
            "{}",
            d.display()
        );
    }
}

#[test]
fn file_example_writes_the_file_as_nbdkit_does() {
    let dir = workdir();
    let cmd = "nbdinfo --json \"$uri\" > info.json && \
               qemu-io -f raw -c 'write -P 0x61 65536 131072' -c 'write -z 1048576 4096' \
               -c 'flush' \"$uri\" > /dev/null && \
               qemu-io -f raw -c 'read -P 0x61 65536 131072' \"$uri\" > read.txt";
    let runs: Vec<_> = ALL
        .iter()
        .map(|&server| {
            let d = dir.path().join(format!("{server:?}"));
            std::fs::create_dir_all(&d).unwrap();
            served_file(&d, 65536);
            (
                run_in(server, &d, &[&script("file.py"), "file=t.raw"], cmd),
                d,
            )
        })
        .collect();
    all_ok(&runs, Some("read.txt"));
    same_info(&runs);
    let want = read(&runs[0].1.join("t.raw"));
    holds(
        &want,
        &[(65536..196608, 0x61), (1 << 20..(1 << 20) + 4096, 0)],
    );
    for (_, d) in &runs[1..] {
        assert!(read(&d.join("t.raw")) == want, "{}", d.display());
    }
    // Read-only: the script opens the file so, and writes are refused.
    let ro = "nbdinfo --json \"$uri\" > info.json; \
              qemu-io -f raw -c 'write 0 512' \"$uri\" > write.txt 2>&1; true";
    for (server, d) in ALL.iter().zip(&runs) {
        let o = run_in(*server, &d.1, &["-r", &script("file.py"), "file=t.raw"], ro);
        assert!(o.status.success(), "{server:?}: {}", stderr(&o));
        assert_eq!(export(&d.1.join("info.json"))["is_read_only"], true);
    }
}

/// nbdkit's test plugin configured by a pickled dictionary (`cfg=`), as
/// nbdkit's test_python.py configures it.
fn test_plugin_cfg(dict: &str) -> String {
    let o = ok(peer(
        PYTHON,
        &[
            "-c",
            "import base64, pickle, sys; \
             print(base64.b64encode(pickle.dumps(eval(sys.argv[1]))).decode())",
            dict,
        ],
    ));
    format!("cfg={}", stdout(&o).trim())
}

#[test]
fn test_plugin_flags_extents_fua_and_cache() {
    let dir = workdir();
    let cfg = test_plugin_cfg(
        "{'size': 1048576, 'can_flush': True, 'can_trim': True, 'can_zero': True, \
          'can_fast_zero': True, 'can_fua': 'native', 'can_cache': 'native', \
          'can_multi_conn': True, 'is_rotational': True, 'can_extents': True, \
          'pwrite_expect_fua': True, \
          'extents': [(0, 65536, 0), (65536, 131072, 3), (196608, 655360, 0), \
                      (851968, 196608, 1)]}",
    );
    // pwrite asserts that FUA came (native FUA passes it on).
    let cmd = "nbdinfo --json \"$uri\" > info.json && nbdinfo --map \"$uri\" > map.txt && \
               qemu-io -f raw -c 'write -f -P 0x44 0 4096' \"$uri\" > write.txt && \
               nbdsh -u \"$uri\" -c 'h.cache(4096, 0)' -c 'h.flush()' && \
               qemu-img convert -f raw -O raw \"$uri\" out.raw";
    let runs = under_all(dir.path(), &[&script("test-python-plugin.py"), &cfg], cmd);
    all_ok(&runs, Some("write.txt"));
    let e = same_info(&runs);
    for flag in [
        "can_fua",
        "can_trim",
        "can_fast_zero",
        "can_multi_conn",
        "can_cache",
        "is_rotational",
        "can_flush",
    ] {
        assert_eq!(e[flag], true, "{flag}");
    }
    let map = read(&runs[0].1.join("map.txt"));
    let text = String::from_utf8_lossy(&map);
    assert!(text.contains("hole,zero"), "{text}");
    for (_, d) in &runs[1..] {
        assert_eq!(
            String::from_utf8_lossy(&read(&d.join("map.txt"))),
            text,
            "{}",
            d.display()
        );
        assert!(read(&d.join("out.raw")) == read(&runs[0].1.join("out.raw")));
    }
}

/// What nbdsh saw of each of `calls` (Python expressions on `h`): `ok` or
/// the errno's name, one per line in `seen.txt`.
fn nbdsh_calls(calls: &[&str]) -> String {
    let mut py = String::from("import errno\nfor c in [");
    for c in calls {
        py.push_str(&format!("{c:?}, "));
    }
    py.push_str(
        "]:\n    try:\n        eval(c)\n        print('ok')\n    \
         except nbd.Error as e:\n        print(errno.errorcode.get(e.errno, e.errno))\n",
    );
    format!(
        "nbdsh --base-allocation -u \"$uri\" -c {} > seen.txt",
        shell_quote(&py)
    )
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[test]
fn exceptions_are_eio_and_set_error_gives_the_errno() {
    let dir = workdir();
    let writes = nbdsh_calls(&["h.pwrite(b'x' * 512, 0)", "h.pread(512, 512)"]);
    for (args, want) in [
        (vec![script("enospc.py")], "ENOSPC\nok\n"),
        (
            vec![script("enospc.py"), "fail=EPERM".into()],
            "EPERM\nok\n",
        ),
        (vec![script("enospc.py"), "plain=1".into()], "EIO\nok\n"),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for (o, d) in under_all(dir.path(), &args, &writes) {
            assert!(o.status.success(), "{}: {}", d.display(), stderr(&o));
            let seen = std::fs::read_to_string(d.join("seen.txt")).unwrap();
            assert_eq!(seen, want, "{args:?} {}", d.display());
            // The server's log has the script, the callback and the
            // traceback.
            assert_contains(&stderr(&o), "enospc.py: pwrite: error: Traceback");
            assert_contains(&stderr(&o), "RuntimeError: write refused at 0");
            assert_contains(&stderr(&o), "cleanup called");
        }
    }
    // nbdkit's error.py fails every other call with an exception: EIO.
    let d = dir.path().join("error");
    std::fs::create_dir_all(&d).unwrap();
    sparse_file(&d.join("disk.raw"), 1 << 20, &[(0, 4096, 0x42)]);
    let reads = nbdsh_calls(&[
        "h.pread(512, 0)",
        "h.pread(512, 0)",
        "h.pwrite(b'y' * 512, 0)",
        "h.pwrite(b'y' * 512, 0)",
        "h.block_status(65536, 0, lambda *a: 0)",
        "h.block_status(65536, 0, lambda *a: 0)",
    ]);
    for server in ALL {
        let o = run_in(
            server,
            &d,
            &[
                &script("error.py"),
                &format!("file={}", s(&d.join("disk.raw"))),
            ],
            &reads,
        );
        assert!(o.status.success(), "{server:?}: {}", stderr(&o));
        let seen = std::fs::read_to_string(d.join("seen.txt")).unwrap();
        assert_eq!(seen, "EIO\nok\nEIO\nok\nEIO\nok\n", "{server:?}");
    }
}

#[test]
fn start_up_errors_are_nbdkits() {
    let dir = workdir();
    let bad = dir.path().join("bad.py");
    std::fs::write(
        &bad,
        "API_VERSION = 2\ndef open(r):\n  return 1\ndef get_size(h) return 1\n",
    )
    .unwrap();
    let missing = dir.path().join("none.py");
    std::fs::write(&missing, "API_VERSION = 2\n").unwrap();
    let cases: [(Vec<String>, &[&str]); 4] = [
        (
            vec![s(&bad).into()],
            &["bad.py: error running this script", "SyntaxError"],
        ),
        (
            vec![s(&missing).into()],
            &["one of the required callbacks 'open', 'get_size' or 'pread' is not defined"],
        ),
        (
            vec![script("python-exception.py"), "test=simple".into()],
            &[
                "config_complete: error: Traceback",
                "this is the test string",
            ],
        ),
        (
            vec![script("file.py"), "colour=red".into()],
            &[
                "config: error: Traceback",
                "RuntimeError: unknown parameter: colour",
            ],
        ),
    ];
    for (args, msgs) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for server in ALL {
            let o = run_in(server, dir.path(), &args, "true");
            assert!(!o.status.success(), "{server:?} {args:?}");
            for msg in *msgs {
                assert_contains(&stderr(&o), msg);
            }
        }
    }
    // A syntax error is one line from diskit.
    let o = run_in(Server::Diskit, dir.path(), &[s(&bad)], "true");
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    assert_contains(&stderr(&o), "line 4");
}

#[test]
fn the_scripts_thread_model_is_kept() {
    let dir = workdir();
    // Eight reads in flight on one connection, then the most that ran at
    // once.
    let cmd = "nbdsh -u \"$uri\" -c '\
bufs = [nbd.Buffer(512) for _ in range(8)]
for i, b in enumerate(bufs):
    h.aio_pread(b, i * 512)
while h.aio_in_flight() > 0:
    h.poll(-1)
print(h.pread(512, 0)[0])' > most.txt";
    for model in ["serialize_all_requests", "serialize_requests", "parallel"] {
        for (o, d) in under_all(
            &dir.path().join(model),
            &[&script("threads.py"), &format!("model={model}")],
            cmd,
        ) {
            assert!(o.status.success(), "{}: {}", d.display(), stderr(&o));
            let most: u32 = std::fs::read_to_string(d.join("most.txt"))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            if model == "parallel" {
                assert!(most > 1, "{model} {}: {most}", d.display());
            } else {
                assert_eq!(most, 1, "{model} {}", d.display());
            }
        }
    }
}

#[test]
fn api_version_1_scripts_run_too() {
    let dir = workdir();
    let cmd = "nbdinfo --json \"$uri\" > info.json && \
               qemu-io -f raw -c 'write -P 0x21 512 4096' -c 'write -z 1024 512' \
               -c 'write -f -P 0x22 8192 512' -c 'discard 8192 512' -c 'flush' \
               \"$uri\" > /dev/null && qemu-img convert -f raw -O raw \"$uri\" out.raw";
    let runs = under_all(dir.path(), &[&script("api1.py")], cmd);
    all_ok(&runs, None);
    let e = same_info(&runs);
    assert_eq!(e["can_fua"], true, "emulated by flush");
    let want = read(&runs[0].1.join("out.raw"));
    holds(
        &want,
        &[
            (512..1024, 0x21),
            (1024..1536, 0),
            (1536..4608, 0x21),
            (8192..8704, 0x22),
        ],
    );
    for (_, d) in &runs[1..] {
        assert!(read(&d.join("out.raw")) == want, "{}", d.display());
    }
}

/// A script whose `pread` fills zeros, then runs `then` (a statement).
fn reading_script(dir: &Path, then: &str) -> String {
    let path = dir.join("then.py");
    std::fs::write(
        &path,
        format!(
            "import nbdkit\nAPI_VERSION = 2\ndef open(readonly):\n    return 1\n\
             def get_size(h):\n    return 1048576\n\
             def pread(h, buf, offset, flags):\n    buf[:] = bytes(len(buf))\n    {then}\n"
        ),
    )
    .unwrap();
    s(&path).to_string()
}

#[test]
fn nbdkit_debug_is_shown_with_v_only() {
    let dir = workdir();
    for server in ALL {
        let d = dir.path().join(format!("{server:?}"));
        for (opts, shown) in [(&["-v"][..], true), (&[][..], false)] {
            let o = run_with(
                server,
                &d,
                opts,
                &[&script("ramdisk.py")],
                "nbdinfo --size \"$uri\"",
            );
            assert!(o.status.success(), "{server:?}: {}", stderr(&o));
            assert_eq!(
                stderr(&o).contains("debug: open: readonly=0"),
                shown,
                "{server:?} {opts:?}: {}",
                stderr(&o)
            );
        }
    }
}

#[test]
fn nbdkit_shutdown_stops_the_server_after_its_last_client() {
    let dir = workdir();
    let script = reading_script(dir.path(), "nbdkit.shutdown()");
    for server in [Server::Nbdkit, Server::Diskit] {
        let sock = dir.path().join(format!("{server:?}.sock"));
        let mut child = server_command(server, dir.path())
            .args(["-f", "-U", s(&sock), "python", &script])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        assert!(appears(&sock, 20), "{server:?} did not start");
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        assert_eq!(one_read(&uri), "512", "{server:?}");
        // Once its last client has gone, the server exits by itself.
        let st =
            exits_within(&mut child, 30).unwrap_or_else(|| panic!("{server:?} did not shut down"));
        assert!(st.success(), "{server:?} failed: {st}");
    }
}

#[test]
fn nbdkit_disconnect_closes_the_connection_after_the_reply() {
    // nbdkit 1.34's nbdkit.disconnect (nbdkit 1.32, the peer here, has
    // none): the read that asks for it is answered, the next finds the
    // connection closed.
    let dir = workdir();
    let script = reading_script(dir.path(), "nbdkit.disconnect()");
    let py = "import nbd, sys\n\
              h = nbd.NBD()\n\
              h.connect_uri(sys.argv[1])\n\
              for _ in range(2):\n    \
              try:\n        h.pread(512, 0)\n        print('ok')\n    \
              except nbd.Error:\n        print('closed')\n";
    std::fs::write(dir.path().join("two.py"), py).unwrap();
    let o = ok(run_in(
        Server::Diskit,
        dir.path(),
        &[&script],
        &format!("{PYTHON} two.py \"$uri\""),
    ));
    assert_eq!(stdout(&o), "ok\nclosed\n");
}

#[test]
fn diskit_does_not_link_libpython_and_loads_the_plugin_only_for_python() {
    let dir = workdir();
    let ldd = ok(peer("ldd", &[s(&diskit_bin())]));
    assert!(!stdout(&ldd).contains("libpython"), "{}", stdout(&ldd));
    // With the plugin's library out of reach, diskit runs (as qemu-img
    // too), and serving a script is one line of error.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let qemu_img = dir.path().join("qemu-img");
    std::os::unix::fs::symlink(diskit_bin(), &qemu_img).unwrap();
    let o = ok(std::process::Command::new(&qemu_img)
        .arg("--version")
        .env("DISKIT_PLUGIN_DIR", &empty)
        .output()
        .unwrap());
    assert_contains(&stdout(&o), "qemu-img version");
    for server in [Server::Diskit, Server::DiskitAsNbdkit] {
        for args in [
            &["-U", "-", "python", &script("ramdisk.py"), "--run", "true"][..],
            &["python", "--dump-plugin"][..],
        ] {
            let o = server_command(server, dir.path())
                .args(args)
                .env("DISKIT_PLUGIN_DIR", &empty)
                .output()
                .unwrap();
            assert!(!o.status.success(), "{server:?} {args:?}");
            let e = stderr(&o);
            assert_eq!(e.lines().count(), 1, "{server:?} {args:?}: {e}");
            assert_contains(
                &e,
                "cannot load the python plugin: libdiskit_python.so is not in",
            );
        }
    }
    // Found, it tells the Python it runs, as nbdkit's plugin does (nbdkit
    // names the version it was built with: the same minor version).
    let minor = |o: &Output| {
        let out = stdout(o);
        let v = out
            .lines()
            .find_map(|l| l.strip_prefix("python_version="))
            .unwrap_or_else(|| panic!("no python_version: {out}"))
            .to_string();
        v.rsplit_once('.').map(|(m, _)| m.to_string()).unwrap()
    };
    let theirs = ok(peer("nbdkit", &["python", "--dump-plugin"]));
    for server in [Server::Diskit, Server::DiskitAsNbdkit] {
        let ours = ok(server_command(server, dir.path())
            .args(["python", "--dump-plugin"])
            .output()
            .unwrap());
        assert_eq!(minor(&ours), minor(&theirs), "{server:?}");
        for key in [
            "python_pep_384_abi_version",
            "nbdkit_python_maximum_api_version",
        ] {
            let line = |o: &Output| {
                stdout(o)
                    .lines()
                    .find(|l| l.starts_with(&format!("{key}=")))
                    .map(String::from)
            };
            assert_eq!(line(&ours), line(&theirs), "{server:?} {key}");
        }
    }
}

#[test]
fn export_lists_default_export_and_descriptions_are_the_scripts() {
    let dir = workdir();
    let path = dir.path().join("exports.py");
    std::fs::write(
        &path,
        "import nbdkit\nAPI_VERSION = 2\n\
         def list_exports(readonly, is_tls):\n    return ['a', ('b', 'the b export')]\n\
         def default_export(readonly, is_tls):\n    return 'a'\n\
         def open(readonly):\n    return nbdkit.export_name()\n\
         def export_description(h):\n    return 'desc of ' + h\n\
         def get_size(h):\n    return 1048576 if h == 'a' else 2097152\n\
         def pread(h, buf, offset, flags):\n    buf[:] = bytes(len(buf))\n",
    )
    .unwrap();
    let cmd = "nbdinfo --list --json \"$uri\" > list.json && nbdinfo --json \"$uri\" > info.json";
    let runs = under_all(dir.path(), &[s(&path)], cmd);
    all_ok(&runs, None);
    let seen = |d: &Path, file: &str| -> Vec<(String, String, u64)> {
        json(&d.join(file))["exports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["export-name"].as_str().unwrap().to_string(),
                    e["description"].as_str().unwrap_or("-").to_string(),
                    e["export-size"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let list = seen(&runs[0].1, "list.json");
    assert_eq!(list.len(), 2, "{list:?}");
    let info = seen(&runs[0].1, "info.json");
    assert_eq!(info, [("a".into(), "desc of a".into(), 1 << 20)]);
    for (_, d) in &runs[1..] {
        assert_eq!(seen(d, "list.json"), list, "{}", d.display());
        assert_eq!(seen(d, "info.json"), info, "{}", d.display());
    }
}

#[test]
fn preconnect_runs_before_each_handshake_and_may_refuse_the_client() {
    let dir = workdir();
    // The script refuses the second client (an exception), before its
    // handshake; the first and the third connect.
    let path = dir.path().join("gate.py");
    std::fs::write(
        &path,
        "import nbdkit\nAPI_VERSION = 2\nseen = 0\n\
         def preconnect(readonly):\n    global seen\n    seen += 1\n    \
         if seen == 2:\n        raise RuntimeError('not this one')\n\
         def open(readonly):\n    return 1\n\
         def get_size(h):\n    return 1048576\n\
         def pread(h, buf, offset, flags):\n    buf[:] = bytes(len(buf))\n",
    )
    .unwrap();
    let cmd = "nbdinfo --size \"$uri\"; echo \"first $?\"; \
               nbdinfo --size \"$uri\" 2>/dev/null; echo \"second $?\"; \
               nbdinfo --size \"$uri\"; echo \"third $?\"";
    for (o, d) in under_all(dir.path(), &[s(&path)], cmd) {
        assert!(o.status.success(), "{}: {}", d.display(), stderr(&o));
        assert_eq!(
            stdout(&o).lines().collect::<Vec<_>>(),
            ["1048576", "first 0", "second 1", "1048576", "third 0"],
            "{}: {}",
            d.display(),
            stderr(&o)
        );
    }
}
