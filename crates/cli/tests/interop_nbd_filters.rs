//! `diskit serve --filter=...` against nbdkit 1.32 with the same filters
//! over the same data: nbdinfo's view (size, flags, block sizes), the
//! allocation map, the answers to the same requests (tests/nbd/filter_ops.py
//! through libnbd, bounds unchecked so the servers' own checks answer), and
//! the bytes each server leaves in its copy of the file. Every server runs
//! under `timeout` on a private socket (`-U -`) and stops with its `--run`
//! command.
//!
//! The plugins themselves differ a little between the two servers (nbdkit's
//! memory plugin advertises flush and cache, its file plugin no fast zero;
//! diskit's file device may report a rotational disk): a flag is compared
//! under a filter only where the two servers agree on it without the
//! filter, and each test checks that the flags its filter changes were
//! among those compared.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;
use serde_json::{Value, json};

/// nbdinfo's block size fields (nbdkit 1.32 sends them only when a layer sets them).
const BLOCK_SIZES: &[&str] = &[
    "block_size_minimum",
    "block_size_preferred",
    "block_size_maximum",
];

/// Runs `SERVER -U - ARGS --run CMD`; every "FILE" in ARGS becomes `file`.
fn run(server: Server, args: &[&str], file: Option<&Path>, cmd: &str) -> Output {
    let mut c = server.command(120);
    c.args(["-U", "-"]);
    for a in args {
        match (*a, file) {
            ("FILE", Some(f)) => c.arg(f),
            _ => c.arg(a),
        };
    }
    c.args(["--run", cmd]);
    c.output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e})", server.name()))
}

/// A copy of `src` for `server` to change (each server writes its own).
fn copy_for(dir: &Path, src: &Path, server: Server) -> PathBuf {
    sparse_copy(src, &dir.join(format!("{}.raw", server.name())))
}

/// A copy of `src` at `p` with the same holes: only the 4 KiB blocks that
/// hold data are written.
fn sparse_copy(src: &Path, p: &Path) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let data = std::fs::read(src).unwrap();
    let f = std::fs::File::create(p).unwrap();
    f.set_len(data.len() as u64).unwrap();
    for (i, block) in data.chunks(4096).enumerate() {
        if block.iter().any(|&b| b != 0) {
            f.write_all_at(block, i as u64 * 4096).unwrap();
        }
    }
    f.sync_all().unwrap();
    p.to_path_buf()
}

/// One server's run over its own copy of the disk.
struct Run {
    out: Output,
    file: Option<PathBuf>,
}

/// Runs both servers with `args` and `cmd`, each on a fresh copy of `src`.
fn both(dir: &Path, src: Option<&Path>, args: &[&str], cmd: &str) -> [Run; 2] {
    SERVERS.map(|server| {
        let file = src.map(|s| copy_for(dir, s, server));
        let out = run(server, args, file.as_deref(), cmd);
        Run { out, file }
    })
}

/// Runs both servers; both must succeed and print the same thing.
fn same_output(dir: &Path, src: Option<&Path>, args: &[&str], cmd: &str) -> [Run; 2] {
    let runs = both(dir, src, args, cmd);
    for (r, server) in runs.iter().zip(SERVERS) {
        assert!(
            r.out.status.success(),
            "{} {args:?} failed ({}): {}{}",
            server.name(),
            code(&r.out),
            stdout(&r.out),
            stderr(&r.out)
        );
    }
    assert_eq!(
        stdout(&runs[0].out),
        stdout(&runs[1].out),
        "nbdkit (left) and diskit (right) differ with {args:?}"
    );
    runs
}

/// What nbdinfo says of the export each server makes of `args`.
fn infos(dir: &Path, src: Option<&Path>, args: &[&str]) -> [Value; 2] {
    both(dir, src, args, "nbdinfo --json \"$uri\"").map(|r| {
        let o = ok(r.out);
        let v: Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", stdout(&o)));
        v["exports"][0].clone()
    })
}

/// Compares nbdinfo's view of `filtered` between the servers, flag by flag,
/// wherever they agree on `base` (the same plugin without the filters),
/// and the block sizes wherever nbdkit reports them. Returns nbdkit's view
/// of `filtered` and the fields compared.
fn same_info(
    dir: &Path,
    src: Option<&Path>,
    base: &[&str],
    filtered: &[&str],
) -> (Value, Vec<&'static str>) {
    let [nb_base, dk_base] = infos(dir, src, base);
    let [nb, dk] = infos(dir, src, filtered);
    let mut compared = Vec::new();
    for &k in NBDINFO_FLAGS {
        if nb_base[k] == dk_base[k] {
            assert_eq!(
                nb[k], dk[k],
                "{k} with {filtered:?}: nbdkit {nb}, diskit {dk}"
            );
            compared.push(k);
        }
    }
    for &k in BLOCK_SIZES {
        if nb.get(k).is_some() {
            assert_eq!(nb[k], dk[k], "{k} with {filtered:?}");
            compared.push(k);
        }
    }
    (nb, compared)
}

fn assert_compared(compared: &[&str], needed: &[&str], what: &[&str]) {
    for k in needed {
        assert!(
            compared.contains(k),
            "{k} not comparable for {what:?} (compared {compared:?})"
        );
    }
}

/// The command that runs `ops` (see filter_ops.py).
fn ops_only(ops: &Value) -> String {
    let script = nbd_script("filter_ops.py");
    format!("{PYTHON} {} \"$uri\" '{ops}'", s(&script))
}

/// The command that runs `ops`, then prints the allocation map.
fn ops_then_map(ops: &Value) -> String {
    ops_only(ops) + " && nbdinfo --map \"$uri\""
}

/// `args` with the plugin's arguments after the filters'.
fn cat<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    a.iter().chain(b).copied().collect()
}

/// A 3,000,000-byte sparse file (not a multiple of 4 KiB or 64 KiB):
/// data at the start, a 4 KiB run at 1 MiB, 100 KB around 2 MB, and the
/// last 10 bytes; holes between.
fn test_disk(dir: &Path) -> PathBuf {
    let p = dir.join("src.raw");
    sparse_file(
        &p,
        REAL,
        &[
            (0, 70_000, 0xff),
            (1 << 20, 4096, 0x5a),
            (2_000_000, 100_000, 0xff),
            (REAL - 10, 10, 0x33),
        ],
    );
    p
}

const REAL: u64 = 3_000_000;

const FILE: [&str; 2] = ["file", "FILE"];

/// The byte ranges where `a` and `b` differ.
fn changed_ranges(a: &Path, b: &Path) -> Vec<(usize, usize)> {
    let (a, b) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(a.len(), b.len(), "size changed");
    let mut out: Vec<(usize, usize)> = Vec::new();
    for i in (0..a.len()).filter(|&i| a[i] != b[i]) {
        match out.last_mut() {
            Some(last) if last.1 == i => last.1 = i + 1,
            _ => out.push((i, i + 1)),
        }
    }
    out
}

/// Both servers left the same bytes in their copies.
fn same_files(runs: &[Run; 2]) {
    let (a, b) = (
        runs[0].file.as_ref().unwrap(),
        runs[1].file.as_ref().unwrap(),
    );
    assert!(same_bytes(a, b), "nbdkit's and diskit's copies differ");
}

#[test]
fn offset_serves_a_window_with_shifted_extents_and_writes() {
    let dir = workdir();
    let src = test_disk(dir.path());
    for (params, offset) in [
        (&["offset=1M"][..], 1 << 20),
        (&["offset=1000000", "range=1500000"], 1_000_000),
        (&["range=2M"], 0),
        (&["offset=2999990"], 2_999_990),
    ] {
        let args = cat(&cat(&["--filter=offset"], &FILE), params);
        let (nb, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
        assert_compared(&compared, &["export-size", "can_zero", "can_trim"], &args);
        let size = nb["export-size"].as_u64().unwrap();
        let ops = json!([
            ["size"],
            ["read", 0, 4096],
            ["read", 100, 70000],
            ["write", 10, 100, 7],
            ["write", 5000, 3000, 9, "fua"],
            ["zero", 20000, 5000],
            ["trim", 300_000, 200_000],
            ["status", 0, size],
            ["status", 0, size, "req_one"],
            ["write", size.saturating_sub(5), 10, 3],
            ["read", size.saturating_sub(5), 10],
            ["cache", 0, size],
            ["flush"],
        ]);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
        same_files(&runs);
        // Nothing outside the window changed, and the first write landed
        // `offset` bytes into the file.
        let changes = changed_ranges(&src, runs[1].file.as_ref().unwrap());
        for &(a, b) in &changes {
            assert!(
                a as u64 >= offset && b as u64 <= offset + size,
                "{params:?}: {a}..{b} changed, outside the window"
            );
        }
        if size > 110 {
            let first = offset + 10..offset + 110;
            assert!(
                changes
                    .iter()
                    .any(|&(a, b)| first.contains(&(a as u64)) || first.contains(&(b as u64 - 1))),
                "{params:?}: the write at 10 is not at {first:?}: {changes:?}"
            );
        }
    }
}

#[test]
fn truncate_cuts_extends_and_rounds() {
    let dir = workdir();
    let src = test_disk(dir.path());
    for params in [
        &["truncate=5M"][..],
        &["truncate=1500000"],
        &["round-up=1M"],
        &["round-down=64k"],
        &["truncate=3500000", "round-down=1M"],
    ] {
        let args = cat(&cat(&["--filter=truncate"], &FILE), params);
        let (nb, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
        assert_compared(&compared, &["export-size", "can_zero", "can_trim"], &args);
        let size = nb["export-size"].as_u64().unwrap();
        let end = REAL.min(size);
        let ops = json!([
            ["size"],
            ["read", end - 100, size - end + 100],
            ["status", 0, size],
            ["status", end - 10, size - end + 10, "req_one"],
            // Zeros past the end of the file are fine; data is not.
            ["write", REAL, 4096, 0],
            ["write", REAL, 16, 5],
            ["write", REAL - 8, 16, 0],
            ["write", REAL - 8, 16, 5],
            ["write", 1000, 50, 6],
            ["zero", REAL - 4096, 8192],
            ["zero", REAL + 100, 1000, "fast"],
            ["trim", REAL - 4096, 8192],
            ["cache", 0, size],
            ["read", 0, size],
        ]);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
        same_files(&runs);
        for r in &runs {
            let len = std::fs::metadata(r.file.as_ref().unwrap()).unwrap().len();
            assert_eq!(len, REAL, "{params:?}: the file keeps its size");
        }
    }

    // nbdkit 1.32 aborts on block status past truncate= when round-up=
    // made the disk larger still (it reports the tail up to truncate=, not
    // to the rounded size). diskit serves it as nbdkit serves the same
    // size given directly.
    let rounded = cat(
        &cat(&["--filter=truncate"], &FILE),
        &["truncate=3500000", "round-up=1M"],
    );
    let direct = cat(&cat(&["--filter=truncate"], &FILE), &["truncate=4M"]);
    let cmd = "nbdinfo --size \"$uri\" && nbdinfo --map \"$uri\"";
    let f = copy_for(dir.path(), &src, Server::Diskit);
    let ours = ok(run(Server::Diskit, &rounded, Some(&f), cmd));
    let f = copy_for(dir.path(), &src, Server::Nbdkit);
    let theirs = ok(run(Server::Nbdkit, &direct, Some(&f), cmd));
    assert_eq!(stdout(&ours), stdout(&theirs));
}

#[test]
fn nozero_modes_advertise_and_zero_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let mem = ["memory", "4M"];
    let mut maps = Vec::new();
    // (parameters, whether the fast-zero answer is the filter's own: with
    // `plugin`/`notrim` by default it is the plugin's, and the two servers'
    // file plugins differ there).
    for (params, fast_by_filter) in [
        (&[][..], true),
        (&["zeromode=none"], true),
        (&["zeromode=emulate"], true),
        (&["zeromode=emulate", "fastzeromode=none"], true),
        (&["zeromode=emulate", "fastzeromode=ignore"], true),
        (&["zeromode=notrim"], false),
        (&["zeromode=notrim", "fastzeromode=slow"], true),
        (&["zeromode=plugin"], false),
        (&["zeromode=plugin", "fastzeromode=none"], true),
        (&["zeromode=plugin", "fastzeromode=slow"], true),
        (&["zeromode=plugin", "fastzeromode=ignore"], true),
    ] {
        let args = cat(&cat(&["--filter=nozero"], &mem), params);
        let (_, compared) = same_info(dir.path(), None, &mem, &args);
        assert_compared(&compared, &["can_zero", "can_fast_zero"], &args);

        let args = cat(&cat(&["--filter=nozero"], &FILE), params);
        let mut ops = vec![
            json!(["zero", 0, 65536]),
            json!(["zero", 2_000_000, 50_000, "fua"]),
            json!(["read", 0, 131072]),
        ];
        if fast_by_filter {
            ops.push(json!(["zero", 2_050_000, 8192, "fast"]));
            ops.push(json!(["read", 2_050_000, 8192]));
        }
        let ops = Value::Array(ops);
        // Zeroing without may-trim (notrim) is up to each file plugin:
        // nbdkit's leaves data, diskit's unwritten extents that SEEK_DATA
        // calls holes; both keep the blocks, compared below.
        let notrim = params.contains(&"zeromode=notrim");
        let cmd = if notrim {
            ops_only(&ops)
        } else {
            ops_then_map(&ops)
        };
        let runs = same_output(dir.path(), Some(&src), &args, &cmd);
        same_files(&runs);
        // Whether the zeroing freed blocks (punched) is the same on both:
        // the 64 KiB zeroed at 0 hold data, so punching frees at least
        // that much (st_blocks also counts extent tree blocks, which vary
        // by a block or two with fragmentation).
        let before = allocated(&sparse_copy(&src, &dir.path().join("before.raw")));
        let freed = runs
            .each_ref()
            .map(|r| allocated(r.file.as_ref().unwrap()) + 32768 <= before);
        assert_eq!(
            freed[0], freed[1],
            "{params:?}: nbdkit freed {}, diskit {}",
            freed[0], freed[1]
        );
        if notrim {
            assert!(!freed[1], "notrim punched a hole");
        }
        maps.push((params, stdout(&runs[1].out), freed[1]));
    }
    // The test tells the modes apart: emulate leaves written zeros (data),
    // plugin punches holes.
    let find = |p: &[&str]| maps.iter().find(|(q, _, _)| *q == p).unwrap().clone();
    let (emulate, plugin) = (find(&["zeromode=emulate"]), find(&["zeromode=plugin"]));
    assert_ne!(emulate.1, plugin.1);
    assert!(
        !emulate.2 && plugin.2,
        "emulate writes zeros, plugin punches"
    );
}

#[test]
fn noextents_reports_everything_as_data() {
    let dir = workdir();
    let src = test_disk(dir.path());
    for filters in [
        &["--filter=noextents"][..],
        &["--filter=truncate", "--filter=noextents"],
    ] {
        let args = cat(&cat(filters, &FILE), &["round-up=1M"][..filters.len() - 1]);
        let (nb, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
        assert_compared(&compared, &["export-size", "can_zero"], &args);
        let size = nb["export-size"].as_u64().unwrap();
        let ops = json!([
            ["status", 0, size],
            ["status", 1 << 20, 4096, "req_one"],
            ["read", 0, size],
            ["write", 1_500_000, 3000, 4],
            ["status", 0, size],
        ]);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
        same_files(&runs);
    }
    // Without the filter the map has holes; with it, none.
    let [plain, _] = same_output(dir.path(), Some(&src), &FILE, "nbdinfo --map \"$uri\"");
    assert!(stdout(&plain.out).contains("hole"));
    let args = cat(&["--filter=noextents"], &FILE);
    let [filtered, _] = same_output(dir.path(), Some(&src), &args, "nbdinfo --map \"$uri\"");
    assert!(!stdout(&filtered.out).contains("hole"));
}

#[test]
fn fua_modes_advertise_and_pass_fua_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let ops = json!([
        ["write", 0, 4096, 3, "fua"],
        ["write", 8192, 4096, 4],
        ["zero", 65536, 4096, "fua"],
        ["trim", 1 << 20, 4096, "fua"],
        ["flush"],
        ["read", 0, 1 << 20],
    ]);
    for params in [
        &[][..],
        &["fuamode=emulate"],
        &["fuamode=native"],
        &["fuamode=force"],
        &["fuamode=pass"],
        &["fuamode=discard"],
    ] {
        let args = cat(&cat(&["--filter=fua"], &FILE), params);
        let (_, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
        assert_compared(&compared, &["can_fua", "can_flush"], &args);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
        same_files(&runs);
    }
    // nbdkit 1.32 refuses fuamode=none by mistake; diskit takes it as the
    // default it is documented to be.
    let none = cat(&cat(&["--filter=fua"], &FILE), &["fuamode=none"]);
    let default = cat(&["--filter=fua"], &FILE);
    let f = copy_for(dir.path(), &src, Server::Diskit);
    let [nb, _] = infos(dir.path(), Some(&src), &default);
    let o = ok(run(
        Server::Diskit,
        &none,
        Some(&f),
        "nbdinfo --json \"$uri\"",
    ));
    let dk: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(dk["exports"][0]["can_fua"], nb["can_fua"]);
    assert_eq!(dk["exports"][0]["can_fua"], false);

    // Modes that need what the plugin lacks fail on both servers (nbdkit
    // when the client connects, diskit before serving), but not read-only.
    for (mode, missing) in [("emulate", "flush"), ("native", "fua"), ("force", "fua")] {
        let param = format!("fuamode={mode}");
        let args = ["--filter=fua", "pattern", "1M", param.as_str()];
        for r in both(dir.path(), None, &args, "nbdinfo --size \"$uri\"") {
            assert!(!r.out.status.success(), "{args:?} served");
        }
        let o = run(Server::Diskit, &args, None, "true");
        assert_stderr_has(&o, &format!("requires plugin {missing} support"));
        let ro = cat(&["-r"], &args);
        same_output(dir.path(), None, &ro, "nbdinfo --size \"$uri\"");
    }
}

#[test]
fn delay_delays_and_keeps_the_data() {
    let dir = workdir();
    let src = test_disk(dir.path());
    // Fast zero offered by the filter itself when it fails fast zeros at
    // once, even over a plugin that offers none.
    let base = [
        "--filter=nozero",
        "memory",
        "1M",
        "zeromode=plugin",
        "fastzeromode=none",
    ];
    for extra in [&[][..], &["delay-zero=1ms", "delay-fast-zero=false"]] {
        let args = cat(&cat(&["--filter=delay"], &base), extra);
        let (_, compared) = same_info(dir.path(), None, &base, &args);
        assert_compared(&compared, &["can_fast_zero", "can_zero"], &args);
    }
    let params = [
        "rdelay=1ms",
        "wdelay=2ms",
        "delay-zero=1ms",
        "delay-extents=1ms",
        "delay-cache=1ms",
        "delay-fast-zero=false",
    ];
    let args = cat(&cat(&["--filter=delay"], &FILE), &params);
    let ops = json!([
        ["read", 0, 70000],
        ["write", 100, 5000, 8],
        ["zero", 65536, 4096],
        ["zero", 1 << 20, 4096, "fast"],
        ["trim", 2_000_000, 65536],
        ["cache", 0, 4096],
        ["status", 0, REAL],
        ["read", 0, REAL],
    ]);
    let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
    same_files(&runs);
    assert!(stdout(&runs[1].out).contains(r#"["zero", 1048576, 4096, "fast"] -> error"#));

    // The delay syntax of nbdkit 1.40 (fractions, units): diskit only.
    let f = copy_for(dir.path(), &src, Server::Diskit);
    let args = cat(
        &cat(&["--filter=delay"], &FILE),
        &["rdelay=0.5ms", "delay-write=250us", "delay-trim=1s"],
    );
    let o = ok(run(
        Server::Diskit,
        &args,
        Some(&f),
        "nbdinfo --size \"$uri\"",
    ));
    assert_eq!(stdout(&o).trim(), REAL.to_string());
}

#[test]
fn error_injects_the_errno_asked_for_each_kind_of_request() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let ops = json!([
        ["read", 0, 70000],
        ["write", 100, 5000, 8],
        ["zero", 65536, 4096],
        ["trim", 2_000_000, 65536],
        ["cache", 0, 4096],
        ["status", 0, REAL],
        ["flush"],
        ["read", 0, REAL],
    ]);
    // Writes and zeroes fail with ENOSPC, the rest goes through; then
    // every kind fails with EPERM but reads (a later specific key wins),
    // then nothing fails while the error file is missing.
    let flag = dir.path().join("inject");
    let flag_param = format!("error-file={}", s(&flag));
    for params in [
        vec![
            "error=ENOSPC",
            "error-pwrite-rate=100%",
            "error-zero-rate=1",
        ],
        vec!["error=EPERM", "error-rate=1", "error-pread-rate=0"],
        vec!["error=ESHUTDOWN", "error-rate=100%", &flag_param],
    ] {
        let args = cat(&cat(&["--filter=error"], &FILE), &params);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_only(&ops));
        same_files(&runs);
        let out = stdout(&runs[1].out);
        match params[0] {
            "error=ENOSPC" => {
                assert_contains(&out, r#"["write", 100, 5000, 8] -> error ENOSPC"#);
                assert_contains(&out, r#"["zero", 65536, 4096] -> error ENOSPC"#);
                assert_contains(&out, r#"["read", 0, 70000] -> ok"#);
            }
            "error=EPERM" => {
                assert_contains(&out, r#"["trim", 2000000, 65536] -> error EPERM"#);
                assert_contains(&out, r#"["read", 0, 70000] -> ok"#);
            }
            _ => assert!(!out.contains("error"), "{out}"),
        }
    }
    // With the error file there, everything but flush fails (the script's
    // last read of the whole disk too, so it exits 1 on both servers).
    std::fs::write(&flag, b"").unwrap();
    let args = cat(
        &cat(&["--filter=error"], &FILE),
        &["error=ESHUTDOWN", "error-rate=100%", &flag_param],
    );
    let runs = both(dir.path(), Some(&src), &args, &ops_only(&ops));
    assert_eq!(code(&runs[0].out), 1, "{}", stderr(&runs[0].out));
    assert_eq!(code(&runs[1].out), 1, "{}", stderr(&runs[1].out));
    assert_eq!(stdout(&runs[0].out), stdout(&runs[1].out));
    same_files(&runs);
    let out = stdout(&runs[1].out);
    assert_contains(&out, r#"["read", 0, 70000] -> error ESHUTDOWN"#);
    assert_contains(&out, r#"["flush"] -> ok"#);
}

#[test]
fn cow_keeps_writes_in_the_overlay_as_nbdkit() {
    use std::os::unix::fs::PermissionsExt;
    let dir = workdir();
    let src = test_disk(dir.path());
    let ops = json!([
        ["write", 100, 5000, 8],
        ["write", 131072, 131072, 9],
        ["trim", 65536, 65536],
        ["trim", 2_000_100, 70000],
        ["cache", 0, 4096],
        ["read", 0, 300_000],
        ["status", 0, REAL],
        ["flush"],
        ["read", 0, REAL],
    ]);
    for params in [
        &[][..],
        &["cow-block-size=4096"],
        &["cow-on-read=true", "cow-on-cache=true"],
    ] {
        let args = cat(&cat(&["--filter=cow"], &FILE), params);
        // The file below is read-only: both servers open it so.
        let runs = SERVERS.map(|server| {
            let file = copy_for(dir.path(), &src, server);
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444)).unwrap();
            let out = run(server, &args, Some(&file), &ops_then_map(&ops));
            Run {
                out,
                file: Some(file),
            }
        });
        for r in &runs {
            assert!(r.out.status.success(), "{args:?}: {}", stderr(&r.out));
            assert!(
                same_bytes(r.file.as_ref().unwrap(), &src),
                "the file below changed"
            );
        }
        let [nb, dk] = [stdout(&runs[0].out), stdout(&runs[1].out)];
        if params.is_empty() || params[0].starts_with("cow-block-size") {
            assert_eq!(nb, dk, "{args:?}");
        } else {
            // cow-on-read: nbdkit copies the holes it reads into its
            // overlay (they turn into data); diskit marks them zero and
            // keeps them holes. The same bytes either way.
            let lines = |o: &str| -> Vec<String> {
                o.lines()
                    .filter(|l| l.starts_with('[') && !l.starts_with("[\"status\""))
                    .map(str::to_string)
                    .collect()
            };
            assert_eq!(lines(&nb), lines(&dk), "{args:?}");
            assert_contains(&dk, "hole,zero");
        }
    }
    // What clients are offered: writable over a read-only plugin, trim,
    // flush, FUA, cache, multi-conn and nbdkit's block sizes. (nbdkit
    // 1.32 offers no write-zeroes over a read-only plugin; diskit does,
    // fast on whole blocks: not compared.)
    let [nb, dk] = infos(dir.path(), Some(&src), &cat(&["--filter=cow"], &FILE));
    for k in [
        "is_read_only",
        "can_flush",
        "can_fua",
        "can_trim",
        "can_cache",
        "can_multi_conn",
        "block_size_minimum",
        "block_size_preferred",
        "block_size_maximum",
    ] {
        assert_eq!(nb[k], dk[k], "{k}: nbdkit {nb}, diskit {dk}");
    }
    assert_eq!(dk["is_read_only"], json!(false));
    assert_eq!(dk["can_zero"], json!(true));
}

#[test]
fn readahead_passes_everything_through_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let (_, compared) = same_info(
        dir.path(),
        Some(&src),
        &FILE,
        &cat(&["--filter=readahead"], &FILE),
    );
    assert_compared(
        &compared,
        &["can_cache", "can_trim", "export-size"],
        &["readahead"],
    );
    // Over cow with cow-on-cache, reads sequential and scattered, writes
    // between them: the same answers and the same bytes below.
    let args = cat(
        &cat(&["--filter=readahead", "--filter=cow"], &FILE),
        &["cow-on-cache=true"],
    );
    let mut ops = vec![json!(["write", 5000, 3000, 4])];
    for i in 0..20u64 {
        ops.push(json!(["read", i * 65536, 65536]));
    }
    for off in [2_500_000u64, 1_000_000, 2_990_000, 7] {
        ops.push(json!(["read", off, 4096]));
        ops.push(json!(["write", off + 1, 100, 6]));
    }
    ops.push(json!(["read", 0, REAL]));
    let runs = same_output(dir.path(), Some(&src), &args, &ops_only(&json!(ops)));
    same_files(&runs);
}

#[test]
fn prefetching_over_a_slow_source_gives_what_nbdkit_gives() {
    // 12 MiB with different data every 256 KiB, behind 5 ms a read: slow
    // enough that the cache and cow filters prefetch around each read.
    let dir = workdir();
    let src = dir.path().join("src.raw");
    let size = 12u64 << 20;
    let runs: Vec<(u64, usize, u8)> = (0..48u64)
        .map(|i| (i << 18, 65536 + i as usize * 1000, i as u8 + 1))
        .collect();
    sparse_file(&src, size, &runs);
    // Scattered reads, each followed at once by writes near it (racing
    // the prefetch the read starts), a flush, a sequential stretch, and
    // everything.
    let mut ops = Vec::new();
    for (i, off) in [7u64, 5_000_000, 2_500_000, 9_990_000, 300_000]
        .into_iter()
        .enumerate()
    {
        ops.push(json!(["read", off, 4096]));
        ops.push(json!(["write", off + 70_000, 5000, 0xa0 + i]));
        ops.push(json!([
            "write",
            (off + 600_000) / 65536 * 65536,
            65536,
            0xb0 + i
        ]));
    }
    ops.push(json!(["flush"]));
    for i in 0..24u64 {
        ops.push(json!(["read", (6 << 20) + i * 65536, 65536]));
    }
    ops.push(json!(["read", 0, size]));
    let ops = ops_only(&json!(ops));
    let slow = ["--filter=delay"];
    let delay = ["delay-read=5ms"];
    for (filters, params) in [
        // virt-v2v's order, readahead at either end or none.
        (
            &["--filter=cow", "--filter=cache"][..],
            &["cache-on-read=true"][..],
        ),
        (
            &["--filter=readahead", "--filter=cow", "--filter=cache"],
            &["cache-on-read=true"],
        ),
        (
            &["--filter=cow", "--filter=cache", "--filter=readahead"],
            &["cache-on-read=true"],
        ),
        // Writes that reach the file, at the flush.
        (&["--filter=cache"], &["cache-on-read=true"]),
        (&["--filter=cow"], &["cow-on-read=true"]),
        (
            &["--filter=cow", "--filter=readahead"],
            &["cow-on-read=true", "cow-block-size=4K"],
        ),
    ] {
        let args = cat(&cat(&cat(&cat(filters, &slow), &FILE), params), &delay);
        let runs = same_output(dir.path(), Some(&src), &args, &ops);
        same_files(&runs);
        if filters == ["--filter=cache"] {
            assert!(!same_bytes(runs[1].file.as_ref().unwrap(), &src));
        } else {
            assert!(same_bytes(runs[1].file.as_ref().unwrap(), &src));
        }
    }
}

/// Runs requests (filter_ops.py's list) and nothing else.
const STATS_CLIENT: &str = r#"
import json, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
for op in json.loads(sys.argv[2]):
    if op[0] == "read":
        h.pread(op[2], op[1])
    elif op[0] == "write":
        h.pwrite(bytes([op[3]]) * op[2], op[1])
    elif op[0] == "trim":
        h.trim(op[2], op[1])
    elif op[0] == "zero":
        h.zero(op[2], op[1])
    elif op[0] == "flush":
        h.flush()
h.shutdown()
"#;

#[test]
fn stats_counts_as_nbdkit_and_writes_its_format() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let mut ops = vec![json!(["flush"])];
    for i in 0..30u64 {
        ops.push(json!(["read", i * 65536, 65536]));
        ops.push(json!(["write", i * 4096 + 512, 4096, 3]));
    }
    ops.push(json!(["trim", 1_048_576, 65536]));
    ops.push(json!(["zero", 2_097_152, 8192]));
    ops.push(json!(["read", 7, 1000]));
    ops.push(json!(["flush"]));
    // The time fields differ; counts, bytes and breakdowns must not, but
    // for the bytes of "other sizes", where nbdkit 1.32 prints every byte
    // of the operation (it never counts what it printed before).
    let masked = |text: &str| -> String {
        text.lines()
            .map(|l| match l.split_once(" reqs, ") {
                Some((head, _)) if l.trim_start().starts_with("other sizes") => {
                    format!("{head} reqs, B total)")
                }
                _ => l.to_string(),
            })
            .map(|l| {
                let mut words: Vec<String> = Vec::new();
                let toks: Vec<&str> = l.split(' ').collect();
                let mut i = 0;
                while i < toks.len() {
                    let t = toks[i];
                    let next = toks.get(i + 1).copied().unwrap_or("");
                    if next.starts_with("s,") && t.contains('.') {
                        words.push("T".into());
                    } else if next.ends_with("/s") || t.ends_with("/s") {
                        // A rate: "1.23 MiB/s", "(n/a)/s", "0 bytes/s".
                        if next.ends_with("/s") {
                            i += 1;
                        }
                        words.push("R/s".into());
                    } else {
                        words.push(t.to_string());
                    }
                    i += 1;
                }
                words.join(" ")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let outs = SERVERS.map(|server| {
        let file = copy_for(dir.path(), &src, server);
        let stats = dir.path().join(format!("stats-{}.txt", server.name()));
        let param = format!("statsfile={}", s(&stats));
        let args = cat(&cat(&["--filter=stats"], &FILE), &[&param]);
        // Only these requests: filter_ops.py would read the whole disk too.
        let cmd = format!("{PYTHON} -c '{STATS_CLIENT}' \"$uri\" '{}'", json!(ops));
        let o = run(server, &args, Some(&file), &cmd);
        assert!(o.status.success(), "{}: {}", server.name(), stderr(&o));
        std::fs::read_to_string(&stats).unwrap()
    });
    assert_eq!(
        masked(&outs[0]),
        masked(&outs[1]),
        "nbdkit:\n{}\ndiskit:\n{}",
        outs[0],
        outs[1]
    );
    assert!(outs[1].starts_with("total: "), "{}", outs[1]);
    assert!(
        outs[1].contains("Request size and alignment breakdown"),
        "{}",
        outs[1]
    );
}

#[test]
fn cache_modes_give_what_nbdkit_gives() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let ops = json!([
        ["read", 0, 70000],
        ["write", 100, 5000, 8],
        ["write", 131072, 131072, 9, "fua"],
        ["zero", 65536, 4096],
        ["trim", 2_000_100, 70000],
        ["cache", 0, 262144],
        ["read", 0, 300_000],
        ["write", 2_999_000, 1000, 5],
        ["flush"],
        ["read", 0, REAL],
    ]);
    for params in [
        &["cache=writeback"][..],
        &["cache=writethrough", "cache-on-read=true"],
        &["cache=unsafe", "cache-min-block-size=4096"],
        &[
            "cache-on-read=true",
            "cache-max-size=1M",
            "cache-min-block-size=4K",
        ],
    ] {
        let args = cat(&cat(&["--filter=cache"], &FILE), params);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_only(&ops));
        if params[0] == "cache=unsafe" {
            // nbdkit drops dirty blocks when it stops; diskit writes them
            // back when it closes: its file has every write, as after the
            // writeback run.
            let written = dir.path().join("writeback.raw");
            assert!(same_bytes(runs[1].file.as_ref().unwrap(), &written));
            continue;
        }
        same_files(&runs);
        if params[0] == "cache=writeback" {
            std::fs::copy(
                runs[1].file.as_ref().unwrap(),
                dir.path().join("writeback.raw"),
            )
            .unwrap();
        }
        {
            let (_, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
            assert_compared(
                &compared,
                &["can_cache", "can_flush", "can_fua", "block_size_preferred"],
                &args,
            );
        }
    }
}

/// A 64 MiB disk partitioned by sfdisk with `script`, each partition
/// holding its own bytes.
fn partitioned_disk(dir: &Path, name: &str, script: &str) -> PathBuf {
    let p = dir.join(name);
    // Data at the start of every 1 MiB, different in each.
    let ranges: Vec<(u64, usize, u8)> = (1..64u64).map(|i| (i << 20, 4096, i as u8)).collect();
    sparse_file(&p, 64 << 20, &ranges);
    // In /usr/sbin, which a user's PATH may leave out.
    let sfdisk = ["/usr/sbin/sfdisk", "/sbin/sfdisk"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("sfdisk");
    let mut c = std::process::Command::new(sfdisk);
    c.args(["-q", s(&p)]).stdin(std::process::Stdio::piped());
    let mut child = c
        .spawn()
        .expect("sfdisk is installed (Debian package fdisk)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "sfdisk failed on {script}");
    p
}

#[test]
fn partition_serves_mbr_and_gpt_partitions_as_nbdkit() {
    let dir = workdir();
    let mbr = partitioned_disk(
        dir.path(),
        "mbr.raw",
        "label: dos\nunit: sectors\n\
         p1 : start=2048, size=20480, type=83\n\
         p2 : start=22528, size=61440, type=5\n\
         p5 : start=24576, size=10240, type=83\n\
         p6 : start=36864, size=10240, type=7\n\
         p3 : start=86016, size=4096, type=c\n",
    );
    let gpt = partitioned_disk(dir.path(), "gpt.raw", "label: gpt\n,10M,L\n,7M,L\n,3M,S\n");
    let ops = json!([["size"], ["read", 0, 8192], ["status", 0, 4096]]);
    for (disk, good, bad) in [
        (&mbr, &[1, 3, 5, 6][..], &[2, 4, 7][..]),
        (&gpt, &[1, 2, 3], &[4, 200]),
    ] {
        for n in good {
            let param = format!("partition={n}");
            let args = cat(&cat(&["--filter=partition"], &FILE), &[&param]);
            let runs = same_output(dir.path(), Some(disk), &args, &ops_only(&ops));
            same_files(&runs);
            if n == &good[0] {
                let (_, compared) = same_info(dir.path(), Some(disk), &FILE, &args);
                assert_compared(&compared, &["export-size"], &args);
            }
        }
        for n in bad {
            let param = format!("partition={n}");
            let args = cat(&cat(&["--filter=partition"], &FILE), &[&param]);
            for r in both(dir.path(), Some(disk), &args, "nbdinfo --size \"$uri\"") {
                assert_ne!(code(&r.out), 0, "{args:?}: {}", stdout(&r.out));
            }
        }
    }
    // diskit names what is wrong before serving.
    let f = copy_for(dir.path(), &mbr, Server::Diskit);
    let o = run(
        Server::Diskit,
        &cat(&["--filter=partition"], &FILE),
        Some(&f),
        "true",
    );
    assert_stderr_has(&o, "must supply the partition parameter");
    let o = run(
        Server::Diskit,
        &cat(&cat(&["--filter=partition"], &FILE), &["partition=2"]),
        Some(&f),
        "true",
    );
    assert_stderr_has(&o, "is an extended partition");
}

#[test]
fn blocksize_aligns_splits_and_advertises_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    for (filters, params) in [
        (&["--filter=blocksize"][..], &["minblock=64k"][..]),
        (&["--filter=blocksize"], &["minblock=4k", "maxdata=8k"]),
        (&["--filter=blocksize"], &["maxdata=5000"]),
        (&["--filter=blocksize"], &["minblock=512", "maxlen=1M"]),
        (&["--filter=blocksize"], &["minblock=16k", "maxlen=32k"]),
        // nbdkit's manual: reach the unaligned tail through truncate.
        (
            &["--filter=truncate", "--filter=blocksize"],
            &["minblock=64k", "round-up=64k"],
        ),
    ] {
        let args = cat(&cat(filters, &FILE), params);
        let (nb, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
        assert_compared(
            &compared,
            &[
                "export-size",
                "block_size_minimum",
                "block_size_preferred",
                "block_size_maximum",
            ],
            &args,
        );
        let size = nb["export-size"].as_u64().unwrap();
        let ops = json!([
            ["read", 1, 100_000],
            ["read", 65_000, 1_000_000],
            ["write", 3, 10, 2],
            ["write", 4095, 70_000, 3],
            ["write", 500_001, 1_500_000, 4, "fua"],
            ["zero", 100_001, 200_000],
            ["trim", 1_000_003, 300_000],
            ["cache", 7, 500_000],
            ["write", size - 7, 7, 5],
            ["read", size - 70_000, 70_000],
            ["status", 0, size],
            ["status", 5, 70_000, "req_one"],
            ["read", 0, size],
        ]);
        let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
        same_files(&runs);
    }
    // Fast zero is the filter's answer only when one request below would
    // not do: compared over memory, which both servers zero fast (its
    // allocation map differs between them: only the answers are compared).
    let ops = json!([
        ["zero", 131_072, 65_536, "fast"],
        ["zero", 131_073, 65_536, "fast"],
        ["zero", 0, 4096 * 3, "fast"],
        ["write", 5, 300_000, 6],
        ["zero", 70_000, 100_000],
        ["read", 0, 1 << 20],
    ]);
    let args = [
        "--filter=blocksize",
        "memory",
        "4M",
        "minblock=4k",
        "maxlen=8k",
    ];
    same_output(dir.path(), None, &args, &ops_only(&ops));
}

#[test]
fn filter_order_first_is_outermost() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let params = ["offset=1M", "truncate=5M"];
    let mut sizes = Vec::new();
    for filters in [
        &["--filter=offset", "--filter=truncate"],
        &["--filter=truncate", "--filter=offset"],
    ] {
        let args = cat(&cat(filters, &FILE), &params);
        let (nb, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
        assert_compared(&compared, &["export-size"], &args);
        let size = nb["export-size"].as_u64().unwrap();
        let ops = json!([
            ["status", 0, size],
            ["read", 0, size],
            ["write", size - 4, 4, 0]
        ]);
        same_files(&same_output(
            dir.path(),
            Some(&src),
            &args,
            &ops_then_map(&ops),
        ));
        sizes.push(size);
    }
    // offset over truncate: 5M - 1M; truncate over offset: 5M.
    assert_ne!(sizes[0], sizes[1]);
    // Keys go to the filters whatever their place among the plugin's.
    let args = [
        "--filter=offset",
        "--filter=truncate",
        "file",
        "truncate=5M",
        "FILE",
        "offset=1M",
    ];
    let [r, _] = same_output(dir.path(), Some(&src), &args, "nbdinfo --size \"$uri\"");
    assert_eq!(stdout(&r.out).trim(), sizes[0].to_string());
}

#[test]
fn bad_filters_and_parameters_fail_on_both_servers() {
    let dir = workdir();
    let src = test_disk(dir.path());
    // Each case: the server's words (split at spaces), and what the
    // message must say.
    for (words, says) in [
        ("--filter=nosuch file FILE", "unknown filter 'nosuch'"),
        (
            "--filter=offset file FILE bogus=1",
            "unknown parameter 'bogus'",
        ),
        ("--filter=offset file FILE offset=foo", "'foo'"),
        ("--filter=offset file FILE offset=-1", "'-1'"),
        (
            "--filter=offset file FILE offset=2M range=2M",
            "larger than the real size",
        ),
        (
            "--filter=offset file FILE offset=4M",
            "larger than the real size",
        ),
        ("--filter=truncate file FILE round-up=3", "power of 2"),
        ("--filter=truncate file FILE round-down=0", "must be > 0"),
        ("--filter=blocksize file FILE minblock=3k", "power of 2"),
        (
            "--filter=blocksize file FILE minblock=128k",
            "must not exceed",
        ),
        (
            "--filter=blocksize file FILE minblock=4k maxdata=6k",
            "multiple of 4096",
        ),
        ("--filter=blocksize file FILE maxlen=8G", "too large"),
        (
            "--filter=fua file FILE fuamode=sometimes",
            "unknown fuamode 'sometimes'",
        ),
        (
            "--filter=nozero file FILE zeromode=fast",
            "unknown zeromode 'fast'",
        ),
        (
            "--filter=nozero file FILE fastzeromode=quick",
            "unknown fastzeromode",
        ),
        (
            "--filter=nozero pattern 1M zeromode=plugin",
            "requires plugin zero support",
        ),
        ("--filter=delay file FILE rdelay=-1", "rdelay"),
        ("--filter=delay file FILE wdelay=ten", "wdelay"),
        ("--filter=delay file FILE delay-fast-zero=maybe", "maybe"),
        ("--filter=rate file FILE rate=0", "rate cannot be set to 0"),
        (
            "--filter=rate file FILE connection-rate=fast",
            "connection-rate",
        ),
        (
            "--filter=log file FILE logfile=/nonexistent/dir/log",
            "/nonexistent/dir/log",
        ),
    ] {
        let args: &[&str] = &words.split(' ').collect::<Vec<_>>();
        for (r, server) in both(dir.path(), Some(&src), args, "nbdinfo --size \"$uri\"")
            .iter()
            .zip(SERVERS)
        {
            assert!(
                !r.out.status.success(),
                "{} accepted {args:?}",
                server.name()
            );
        }
        let f = copy_for(dir.path(), &src, Server::Diskit);
        let o = run(Server::Diskit, args, Some(&f), "true");
        assert_eq!(code(&o), 1, "{args:?}");
        let err = stderr(&o);
        assert!(
            err.starts_with("diskit: ") && err.contains(says),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
    }
}

#[test]
fn help_lists_every_filter() {
    let o = ok(diskit(&["serve", "--help"]));
    let help = stdout(&o);
    for f in diskit_filters::FILTERS {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{} ", f.name)))
            .unwrap_or_else(|| panic!("{} missing from --help:\n{help}", f.name));
        assert_contains(line, f.help);
    }
}

#[test]
fn blocksize_read_modify_write_keeps_concurrent_unaligned_writes() {
    // qemu-io sends 32 unaligned writes at once, several into each 4 KiB
    // block (disjoint bytes), then checks every one reads back. Reads
    // below the blocksize filter are slowed down (delay) so that a
    // read-modify-write left unprotected would be overtaken.
    let mut cmd = String::from("qemu-io -f raw");
    for i in 0..32u64 {
        cmd += &format!(" -c 'aio_write -P {} {} 700'", i + 1, i * 700 + 3);
    }
    cmd += " -c aio_flush";
    for i in 0..32u64 {
        cmd += &format!(" -c 'read -P {} {} 700'", i + 1, i * 700 + 3);
    }
    cmd += " \"$uri\"";
    let dir = workdir();
    for minblock in ["minblock=4k", "minblock=64k"] {
        let args = [
            "--filter=blocksize",
            "--filter=delay",
            "memory",
            "1M",
            minblock,
            "rdelay=2ms",
        ];
        for (r, server) in both(dir.path(), None, &args, &cmd).iter().zip(SERVERS) {
            let out = stdout(&r.out);
            assert!(
                r.out.status.success() && !out.contains("verification failed"),
                "{} {args:?}: {out}{}",
                server.name(),
                stderr(&r.out)
            );
            assert_eq!(out.matches("read 700/700").count(), 32, "{out}");
        }
    }
}

/// A client whose requests carry flags: (op, offset, length, flag names).
const FLAGGED_CLIENT: &str = r#"
import json, sys, nbd
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(sys.argv[1])
names = {"fua": nbd.CMD_FLAG_FUA, "fast": nbd.CMD_FLAG_FAST_ZERO,
         "nohole": nbd.CMD_FLAG_NO_HOLE, "reqone": nbd.CMD_FLAG_REQ_ONE}
for op in json.loads(sys.argv[2]):
    flags = 0
    for f in op[3:]:
        flags |= names[f]
    try:
        if op[0] == "read":
            h.pread(op[2], op[1])
        elif op[0] == "write":
            h.pwrite(b"\x07" * op[2], op[1], flags)
        elif op[0] == "trim":
            h.trim(op[2], op[1], flags)
        elif op[0] == "zero":
            h.zero(op[2], op[1], flags)
        elif op[0] == "cache":
            h.cache(op[2], op[1])
        elif op[0] == "extents":
            h.block_status(op[2], op[1], lambda *a: 0, flags)
        elif op[0] == "flush":
            h.flush()
    except nbd.Error as e:
        print(op, e, file=sys.stderr)
h.shutdown()
"#;

#[test]
fn log_writes_what_nbdkit_writes() {
    let dir = workdir();
    let ops = json!([
        ["read", 0, 4096],
        ["read", 65536, 1_048_576],
        ["write", 512, 4096],
        ["write", 8192, 65536, "fua"],
        ["zero", 1_048_576, 65536],
        ["zero", 2_097_152, 131_072, "fast", "fua"],
        ["zero", 3_145_728, 4096, "nohole"],
        ["trim", 0, 4096, "fua"],
        ["cache", 0, 65536],
        ["extents", 0, 4_194_304],
        ["flush"],
    ]);
    // Timestamps, and what the plugins themselves answer differently
    // (block sizes, flush, the extents' lengths) are masked; nbdkit logs
    // "Fork" as its server forks away from the --run command, which
    // diskit's does not.
    let masked = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.ends_with(" Fork"))
            .map(|l| {
                let l = &l[27..];
                let l = match l.find("extents=(") {
                    Some(i) => format!("{}extents=(...) return=0", &l[..i]),
                    None => l.to_string(),
                };
                l.split(' ')
                    .filter(|w| {
                        !["minsize=", "prefsize=", "maxsize=", "flush="]
                            .iter()
                            .any(|k| w.starts_with(k))
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    };
    let logs = SERVERS.map(|server| {
        let log = dir.path().join(format!("log-{}.txt", server.name()));
        let param = format!("logfile={}", s(&log));
        // Zeroes fail below the log in the second connection.
        let args = [
            "--filter=log",
            "--filter=error",
            "memory",
            "4M",
            &param,
            "error-zero=ENOSPC",
            "error-zero-rate=100%",
            "error-zero-file=ERRORS",
        ];
        let errors = dir.path().join(format!("errors-{}", server.name()));
        let args = args.map(|a| {
            if a == "error-zero-file=ERRORS" {
                format!("error-zero-file={}", s(&errors))
            } else {
                a.to_string()
            }
        });
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let cmd = format!(
            "{PYTHON} -c '{FLAGGED_CLIENT}' \"$uri\" '{ops}' && touch {} && \
             {PYTHON} -c '{FLAGGED_CLIENT}' \"$uri\" '[[\"zero\", 4096, 4096]]'",
            s(&errors)
        );
        let o = run(server, &args, None, &cmd);
        assert!(o.status.success(), "{}: {}", server.name(), stderr(&o));
        std::fs::read_to_string(&log).unwrap()
    });
    let (nbdkit, diskit) = (masked(&logs[0]), masked(&logs[1]));
    assert_eq!(nbdkit, diskit, "nbdkit:\n{}\ndiskit:\n{}", logs[0], logs[1]);
    // The lines the masks keep say what matters.
    let text = diskit.join("\n");
    for want in [
        "connection=1 Connect export=\"\" tls=0 size=0x400000 write=1",
        "connection=1 Read id=2 offset=0x10000 count=0x100000 ...",
        "connection=1 Zero id=6 offset=0x200000 count=0x20000 trim=1 fua=1 fast=1 ...",
        "connection=1 Zero id=7 offset=0x300000 count=0x1000 trim=0 fua=0 fast=0 ...",
        "connection=1 Disconnect transactions=11",
        "connection=2 ...Zero id=1 return=-1 error=ENOSPC",
    ] {
        assert!(text.contains(want), "{want} not in\n{text}");
    }
}

#[test]
fn rate_passes_requests_and_capabilities_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let rate_file = dir.path().join("rate");
    std::fs::write(&rate_file, "10G\n").unwrap();
    let rate_param = format!("rate-file={}", s(&rate_file));
    let missing = format!("connection-rate-file={}", s(&dir.path().join("none")));
    let params = [
        "rate=1G",
        "connection-rate=512M",
        "burstiness=0.5",
        &rate_param,
        &missing,
    ];
    let args = cat(&cat(&["--filter=rate"], &FILE), &params);
    let (_, compared) = same_info(dir.path(), Some(&src), &FILE, &args);
    assert_compared(
        &compared,
        &["can_trim", "can_cache", "export-size", "is_read_only"],
        &args,
    );
    let ops = json!([
        ["read", 0, 70000],
        ["write", 100, 5000, 8],
        ["zero", 65536, 4096],
        ["trim", 1_000_000, 65536],
        ["write", 2_000_000, 300_000, 3],
        ["flush"],
        ["read", 0, REAL],
    ]);
    let runs = same_output(dir.path(), Some(&src), &args, &ops_then_map(&ops));
    same_files(&runs);
}

/// Two connections at once, taking turns (so that the log's order is
/// the requests' order).
const TWO_CONNECTIONS: &str = r#"
import sys, nbd
a = nbd.NBD(); a.connect_uri(sys.argv[1])
b = nbd.NBD(); b.connect_uri(sys.argv[1])
print(a.can_multi_conn(), a.can_fua(), a.can_flush())
a.pwrite(b"x" * 4096, 0)
b.pread(4096, 8192)
b.flush()
a.flush()
b.flush()
b.pwrite(b"y" * 512, 4096, nbd.CMD_FLAG_FUA)
a.zero(4096, 65536)
b.pread(512, 0)
a.flush()
a.trim(4096, 131072, nbd.CMD_FLAG_FUA)
print(a.pread(8, 0), b.pread(8, 4096))
a.shutdown(); b.shutdown()
"#;

#[test]
fn multi_conn_flushes_what_nbdkit_flushes() {
    let dir = workdir();
    let src = test_disk(dir.path());
    for params in [
        &["multi-conn-mode=emulate"][..],
        &["multi-conn-mode=emulate", "multi-conn-track-dirty=fast"],
        &["multi-conn-mode=emulate", "multi-conn-track-dirty=off"],
        &["multi-conn-mode=plugin"],
        &["multi-conn-mode=plugin", "multi-conn-track-dirty=fast"],
        &["multi-conn-mode=disable", "multi-conn-track-dirty=off"],
        &["multi-conn-mode=unsafe"],
        &[],
    ] {
        let (logs, outs): (Vec<String>, Vec<String>) = SERVERS
            .map(|server| {
                let file = copy_for(dir.path(), &src, server);
                let log = dir.path().join(format!("mc-{}.txt", server.name()));
                let param = format!("logfile={}", s(&log));
                let args = cat(
                    &cat(&["--filter=multi-conn", "--filter=log"], &FILE),
                    &cat(params, &[&param]),
                );
                let cmd = format!("{PYTHON} -c '{TWO_CONNECTIONS}' \"$uri\"");
                let o = run(server, &args, Some(&file), &cmd);
                assert!(
                    o.status.success(),
                    "{} {args:?}: {}",
                    server.name(),
                    stderr(&o)
                );
                // The requests that reached the device below, in order.
                let text = std::fs::read_to_string(&log).unwrap();
                let requests: Vec<&str> = text
                    .lines()
                    .map(|l| &l[27..])
                    .filter(|l| {
                        l.starts_with("connection=")
                            && !l.contains(" Connect ")
                            && !l.contains(" Disconnect ")
                    })
                    .collect();
                (requests.join("\n"), stdout(&o).to_string())
            })
            .into_iter()
            .unzip();
        assert_eq!(outs[0], outs[1], "{params:?}");
        assert_eq!(
            logs[0], logs[1],
            "{params:?}: nbdkit (left) and diskit (right) pass different requests"
        );
        assert!(logs[1].contains("Flush"), "{params:?}: {}", logs[1]);
    }
}

#[test]
fn retry_recovers_from_injected_errors_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    // Every request fails while the flag file exists; it goes away half a
    // second after the client starts, and retries (1 s apart) recover.
    for server in SERVERS {
        let flag = dir.path().join(format!("fail-{}", server.name()));
        std::fs::write(&flag, "").unwrap();
        let file = copy_for(dir.path(), &src, server);
        let flag_param = format!("error-file={}", s(&flag));
        let args = [
            "--filter=retry",
            "--filter=error",
            "file",
            "FILE",
            "retry-delay=1",
            "error-rate=100%",
            &flag_param,
        ];
        let cmd = format!(
            "(sleep 0.5; rm {}) & nbdsh -u \"$uri\" -c 'print(list(h.pread(8, 1000)))'",
            s(&flag)
        );
        let o = run(server, &args, Some(&file), &cmd);
        assert!(o.status.success(), "{}: {}", server.name(), stderr(&o));
        let want = format!("{:?}\n", &std::fs::read(&src).unwrap()[1000..1008]);
        assert_eq!(stdout(&o), want, "{}", server.name());
    }
    // With retry-readonly, a connection that saw a failure writes no more
    // (EPERM), on both servers; one that saw none writes.
    let client = r#"
import sys, nbd, os
h = nbd.NBD(); h.connect_uri(sys.argv[1])
h.pread(8, 0)
try:
    h.pwrite(b"x" * 512, 0)
    print("written")
except nbd.Error as e:
    print("refused", e.errno)
"#;
    let outs = SERVERS.map(|server| {
        let flag = dir.path().join(format!("ro-{}", server.name()));
        std::fs::write(&flag, "").unwrap();
        let file = copy_for(dir.path(), &src, server);
        let flag_param = format!("error-file={}", s(&flag));
        let args = [
            "--filter=retry",
            "--filter=error",
            "file",
            "FILE",
            "retry-delay=1",
            "retry-readonly=true",
            "error-rate=100%",
            &flag_param,
        ];
        let cmd = format!(
            "(sleep 0.5; rm {}) & {PYTHON} -c '{client}' \"$uri\" && {PYTHON} -c '{client}' \"$uri\"",
            s(&flag)
        );
        let o = run(server, &args, Some(&file), &cmd);
        assert!(o.status.success(), "{}: {}", server.name(), stderr(&o));
        stdout(&o).to_string()
    });
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[1], "refused EPERM\nwritten\n");
}

/// A script that stops the server whose pid is in `pidfile`, waits until
/// it is gone, and starts `diskit serve` again on `socket` over `file`.
fn restart_backend(pidfile: &Path, socket: &Path, file: &Path) -> PathBuf {
    let script = pidfile.with_extension("restart.sh");
    std::fs::write(
        &script,
        format!(
            "pid=$(cat {p}); kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.05; done\n\
             exec {b} serve -U {sock} -P {p} file {f}\n",
            p = s(pidfile),
            b = diskit_bin().display(),
            sock = s(socket),
            f = s(file)
        ),
    )
    .unwrap();
    script
}

#[test]
fn retry_reconnects_the_nbd_plugin_to_a_restarted_server_as_nbdkit() {
    let dir = workdir();
    let src = test_disk(dir.path());
    let client = r#"
import sys, subprocess, nbd
h = nbd.NBD(); h.connect_uri(sys.argv[1])
before = h.pread(4096, 8192)
subprocess.run(sys.argv[2], shell=True, check=True)
after = h.pread(4096, 8192)
h.pwrite(b"z" * 512, 0)
h.flush()
print(before == after, h.pread(4, 0))
"#;
    let outs = SERVERS.map(|server| {
        let file = copy_for(dir.path(), &src, server);
        let socket = dir.path().join(format!("backend-{}.sock", server.name()));
        let pidfile = dir.path().join(format!("backend-{}.pid", server.name()));
        ok(timed(diskit_bin(), 60)
            .args([
                "serve",
                "-U",
                s(&socket),
                "-P",
                s(&pidfile),
                "file",
                s(&file),
            ])
            .output()
            .unwrap());
        let restart = restart_backend(&pidfile, &socket, &file);
        let sock_param = format!("socket={}", s(&socket));
        let cmd = format!("{PYTHON} -c '{client}' \"$uri\" 'sh {}'", s(&restart));
        let o = run(
            server,
            &["--filter=retry", "nbd", &sock_param, "retry-delay=1"],
            None,
            &cmd,
        );
        // The backend goes, whatever happened.
        if let Ok(pid) = std::fs::read_to_string(&pidfile) {
            let _ = std::process::Command::new("kill").arg(pid.trim()).status();
        }
        assert!(o.status.success(), "{}: {}", server.name(), stderr(&o));
        let written = std::fs::read(&file).unwrap();
        assert_eq!(&written[..512], &[b'z'; 512][..], "{}", server.name());
        stdout(&o).to_string()
    });
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[1], "True bytearray(b'zzzz')\n");
}

#[test]
fn cow_file_keeps_the_overlay_as_a_qcow2_backed_by_the_source() {
    use std::os::unix::fs::PermissionsExt;
    let dir = workdir();
    let src = test_disk(dir.path());
    let ops = json!([
        ["write", 100, 5000, 8],
        ["write", 131072, 131072, 9],
        ["trim", 1_048_576, 65536],
        ["trim", 2_000_100, 70000],
        ["write", 2_999_000, 1000, 5],
        ["flush"],
        ["read", 0, REAL],
    ]);
    // The same answers as nbdkit's cow with a temporary overlay (nbdkit
    // 1.32 offers no write-zeroes over a read-only plugin: trims only).
    let nbdkit_file = copy_for(dir.path(), &src, Server::Nbdkit);
    let nb = run(
        Server::Nbdkit,
        &cat(&["--filter=cow"], &FILE),
        Some(&nbdkit_file),
        &ops_only(&ops),
    );
    let file = copy_for(dir.path(), &src, Server::Diskit);
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444)).unwrap();
    let overlay = dir.path().join("overlay.qcow2");
    let cow_file = format!("cow-file={}", s(&overlay));
    let seen = dir.path().join("seen.raw");
    let args = cat(&cat(&["--filter=cow"], &FILE), &[&cow_file]);
    let cmd = format!("{} && nbdcopy \"$uri\" {}", ops_only(&ops), s(&seen));
    let dk = run(Server::Diskit, &args, Some(&file), &cmd);
    assert!(dk.status.success(), "{}", stderr(&dk));
    assert_eq!(stdout(&nb), stdout(&dk));
    assert!(same_bytes(&file, &src), "the source changed");
    // A qcow2 that qemu-img checks clean, backed by the source, and that
    // reads what the clients saw.
    ok(qemu_img(&["check", s(&overlay)]));
    let info = ok(qemu_img(&["info", "--output=json", s(&overlay)]));
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    let abs = std::fs::canonicalize(&file).unwrap();
    assert_eq!(info["backing-filename"], json!(abs.display().to_string()));
    assert_eq!(info["backing-filename-format"], json!("raw"));
    let merged = dir.path().join("merged.raw");
    ok(qemu_img(&["convert", "-O", "raw", s(&overlay), s(&merged)]));
    let seen_bytes = std::fs::read(&seen).unwrap();
    assert_eq!(
        &std::fs::read(&merged).unwrap()[..REAL as usize],
        &seen_bytes[..]
    );
    // A second server goes on from the overlay.
    let again = dir.path().join("again.raw");
    let o = run(
        Server::Diskit,
        &args,
        Some(&file),
        &format!("nbdcopy \"$uri\" {}", s(&again)),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same_bytes(&again, &seen));
    // cow-on-read copies what it reads into the overlay: afterwards the
    // overlay holds every cluster of data itself (the source's holes,
    // which nbdcopy skips, need no copy).
    let on_read = dir.path().join("on-read.qcow2");
    let on_read_param = format!("cow-file={}", s(&on_read));
    let o = run(
        Server::Diskit,
        &cat(
            &cat(&["--filter=cow"], &FILE),
            &[&on_read_param, "cow-on-read=true"],
        ),
        Some(&file),
        "nbdcopy \"$uri\" null:",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    ok(qemu_img(&["check", s(&on_read)]));
    let map = ok(qemu_img(&["map", "--output=json", s(&on_read)]));
    let map: Value = serde_json::from_slice(&map.stdout).unwrap();
    let entries = map.as_array().unwrap();
    assert!(entries.iter().any(|e| e["data"] == json!(true)));
    for e in entries.iter().filter(|e| e["data"] == json!(true)) {
        assert_eq!(e["depth"], json!(0), "{e}");
    }
    // An overlay of another source is refused, naming both.
    let other = sparse_copy(&src, &dir.path().join("other.raw"));
    let o = run(Server::Diskit, &args, Some(&other), "true");
    assert_fails_with(&o, 1, "backing file");
    // Committed with qemu-img, the source holds what clients saw.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    ok(qemu_img(&["commit", s(&overlay)]));
    // (qemu-img grows the source to the overlay's size: whole sectors.)
    let committed = std::fs::read(&file).unwrap();
    assert_eq!(&committed[..REAL as usize], &seen_bytes[..]);
    assert!(committed[REAL as usize..].iter().all(|&b| b == 0));
}

/// How `unshare` makes a mount namespace here: as root directly, else
/// inside a user namespace; `None` when neither is allowed.
fn mount_namespace_flags() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let flags = if root { "-m" } else { "-rm" };
    let works = std::process::Command::new("unshare")
        .args([flags, "true"])
        .status()
        .is_ok_and(|st| st.success());
    works.then_some(flags)
}

/// Runs `SERVER -U - ARGS --run CMD` with TMPDIR on a 1 MiB tmpfs of its
/// own (a mount namespace: nothing outside sees it).
fn run_with_small_tmpdir(server: Server, args: &[&str], cmd: &str) -> Output {
    let dir = workdir();
    let mnt = dir.path().join("tmp");
    std::fs::create_dir(&mnt).unwrap();
    let program = match server {
        Server::Nbdkit => "nbdkit".to_string(),
        Server::Diskit => format!("{} serve", diskit_bin().display()),
    };
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        "mount -t tmpfs -o size=1M tmpfs {m} && TMPDIR={m} exec {program} -U - {} --run '{cmd}'",
        quoted.join(" "),
        m = s(&mnt)
    );
    let flags = mount_namespace_flags().expect("checked by the caller");
    timed("unshare", 120)
        .args([flags, "sh", "-c", &script])
        .output()
        .unwrap()
}

#[test]
fn a_full_overlay_fails_writes_with_enospc_and_the_server_goes_on() {
    let client = r#"
import nbd, sys
h = nbd.NBD(); h.connect_uri(sys.argv[1])
try:
    h.pwrite(b"x" * (4 << 20), 0)
    print("written")
except nbd.Error as e:
    print("error", e.errno)
print(len(h.pread(4096, 8 << 20)), h.pread(4, 1 << 20) in (b"xxxx", bytes(4)))
"#;
    if mount_namespace_flags().is_none() {
        eprintln!("skipped: unshare cannot make a mount namespace here");
        return;
    }
    for filter in ["--filter=cache", "--filter=cow"] {
        let outs = SERVERS.map(|server| {
            let cmd = format!("{PYTHON} -c \"{}\" \"$uri\"", client.replace('"', "\\\""));
            let o = run_with_small_tmpdir(server, &[filter, "memory", "64M"], &cmd);
            assert!(
                o.status.success(),
                "{} {filter}: {}",
                server.name(),
                stderr(&o)
            );
            stdout(&o).to_string()
        });
        assert_eq!(outs[0], outs[1], "{filter}");
        assert_eq!(outs[1], "error ENOSPC\n4096 True\n", "{filter}");
    }
}

#[test]
fn an_overlay_that_cannot_be_created_is_a_clear_error() {
    let dir = workdir();
    let sock = dir.path().join("s");
    for filter in ["--filter=cache", "--filter=cow"] {
        let o = timed(diskit_bin(), 60)
            .env("TMPDIR", dir.path().join("no-such-dir"))
            .args([
                "serve",
                "-U",
                s(&sock),
                filter,
                "memory",
                "1M",
                "--run",
                "true",
            ])
            .output()
            .unwrap();
        assert_eq!(code(&o), 1, "{filter}");
        let err = stderr(&o);
        assert!(
            err.contains("no-such-dir") && err.contains("TMPDIR"),
            "{filter}: {err}"
        );
    }
}

/// The most requests of `op` (`Read`, `Write`...) the log filter's lines
/// show in flight at once: started and not yet returned.
fn most_in_flight(log: &str, op: &str) -> usize {
    let (start, end) = (format!(" {op} id="), format!(" ...{op} id="));
    let (mut now, mut most) = (0usize, 0usize);
    for line in log.lines() {
        if line.contains(&end) {
            now = now.saturating_sub(1);
        } else if line.contains(&start) {
            now += 1;
            most = most.max(now);
        }
    }
    most
}

#[test]
fn copies_through_a_filter_keep_requests_in_flight() {
    // The source goes through a filter in the client (copy --no-extents:
    // the noextents filter; convert -r: the rate filter) over an NBD
    // connection; one worker each (-T 1, -m 1), so that only submitted
    // requests can overlap. The server logs each request as it starts and
    // ends, and delays reads so that requests in flight overlap there.
    let dir = workdir();
    let d = dir.path();
    let src = d.join("src.raw");
    sparse_file(&src, 8 << 20, &[(0, 8 << 20, 0xff)]);
    let diskit = diskit_bin();
    let clients = [
        (
            "copy --no-extents",
            format!(
                "{} copy --no-extents -C 1 -T 1 \"$uri\" {}",
                diskit.display(),
                s(&d.join("copy.raw"))
            ),
            d.join("copy.raw"),
        ),
        (
            "convert -r",
            format!(
                "{} convert -r 1G -m 1 -f raw -O raw \"$uri\" {}",
                diskit.display(),
                s(&d.join("convert.raw"))
            ),
            d.join("convert.raw"),
        ),
    ];
    for (what, cmd, out) in clients {
        let log = d.join(format!("{}.log", what.replace(' ', "_")));
        let logfile = format!("logfile={}", s(&log));
        let o = run(
            Server::Diskit,
            &argv(
                "--filter=log --filter=delay file FILE",
                &[&logfile, "rdelay=10ms"],
            ),
            Some(&src),
            &cmd,
        );
        assert!(o.status.success(), "{what}: {}", stderr(&o));
        assert!(same_bytes(&out, &src), "{what}: the copy differs");
        let text = std::fs::read_to_string(&log).unwrap();
        let most = most_in_flight(&text, "Read");
        assert!(most > 1, "{what}: at most {most} read in flight:\n{text}");
    }
}
