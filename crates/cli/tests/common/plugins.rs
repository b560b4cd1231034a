//! Plugins under nbdkit 1.32 and under `diskit serve` on the same
//! command line (each server under `timeout`, on a private socket `-U -`,
//! stopped by its `--run` command): outputs, flags, bytes, maps and
//! answers compared.

use std::path::Path;
use std::process::Output;

use serde_json::Value;

use super::*;

/// Runs `SERVER -U - ARGS --run CMD` in `dir`.
pub fn run(server: Server, dir: &Path, args: &[&str], cmd: &str) -> Output {
    let mut c = server.command(120);
    c.current_dir(dir)
        .args(["-U", "-"])
        .args(args)
        .args(["--run", cmd]);
    c.output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e})", server.name()))
}

/// Runs `cmd` under both servers with `args`; both must succeed. Their
/// outputs, nbdkit's first.
pub fn both_ok(dir: &Path, args: &[&str], cmd: &str) -> [String; 2] {
    SERVERS.map(|server| {
        let o = run(server, dir, args, cmd);
        assert!(
            o.status.success(),
            "{} {args:?} failed ({}): {}{}",
            server.name(),
            code(&o),
            stdout(&o),
            stderr(&o)
        );
        stdout(&o)
    })
}

/// nbdinfo's view of the export: both servers', nbdkit's first.
pub fn infos(dir: &Path, args: &[&str]) -> [Value; 2] {
    both_ok(dir, args, "nbdinfo --json \"$uri\"").map(|out| {
        let v: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("bad JSON ({e}): {out}"));
        v["exports"][0].clone()
    })
}

/// The servers agree on every flag but those in `skip`.
pub fn same_flags(dir: &Path, args: &[&str], skip: &[&str]) -> Value {
    let [nb, dk] = infos(dir, args);
    for k in NBDINFO_FLAGS.iter().filter(|k| !skip.contains(k)) {
        assert_eq!(nb[k], dk[k], "{k} with {args:?}: nbdkit {nb}, diskit {dk}");
    }
    dk
}

/// The servers serve the same bytes and the same allocation map.
pub fn same_bytes_and_map(dir: &Path, args: &[&str]) {
    let cmd = "nbdcopy \"$uri\" \"out.$S\" && nbdinfo --map \"$uri\"";
    let [nb_map, dk_map] = SERVERS.map(|server| {
        let o = run(server, dir, args, &cmd.replace("$S", server.name()));
        stdout(&ok(o))
    });
    assert!(
        same_bytes(&dir.join("out.nbdkit"), &dir.join("out.diskit")),
        "bytes differ with {args:?}"
    );
    assert_eq!(nb_map, dk_map, "maps differ with {args:?}");
}

/// The servers answer the requests of synth_ops.py alike.
pub fn same_answers(dir: &Path, args: &[&str], offset: u64, len: u64) -> String {
    let script = nbd_script("synth_ops.py");
    let cmd = format!("{PYTHON} {} \"$uri\" {offset} {len}", s(&script));
    let [nb, dk] = both_ok(dir, args, &cmd);
    assert_eq!(nb, dk, "answers differ with {args:?} at {offset}+{len}");
    dk
}

/// Both servers refuse `args`: non-zero exit, diskit's message one line
/// holding `msg` (nbdkit's, without its "nbdkit: error: ").
pub fn both_refuse(dir: &Path, args: &[&str], msg: &str) {
    for server in SERVERS {
        let o = run(server, dir, args, "true");
        assert_ne!(code(&o), 0, "{} accepted {args:?}", server.name());
        assert_stderr_has(&o, msg);
    }
    let o = run(Server::Diskit, dir, args, "true");
    assert_eq!(stderr(&o).trim_end().lines().count(), 1, "{}", stderr(&o));
}

/// The requests of synth_ops.py over `offset..offset+len`, under each
/// server with `args`, each starting from `pristine` copied to `served`
/// (the file the plugin serves): the same answers (a write among them),
/// and `served` ends with the same bytes. The answers.
pub fn same_answers_and_file(
    dir: &Path,
    args: &[&str],
    pristine: &Path,
    served: &Path,
    offset: u64,
    len: u64,
) -> String {
    let ops = nbd_script("synth_ops.py");
    let cmd = format!("{PYTHON} {} \"$uri\" {offset} {len}", s(&ops));
    let answers = SERVERS.map(|server| {
        std::fs::copy(pristine, served).unwrap();
        let o = ok(run(server, dir, args, &cmd));
        std::fs::copy(served, dir.join(format!("after.{}", server.name()))).unwrap();
        stdout(&o)
    });
    assert_eq!(answers[0], answers[1]);
    assert!(answers[1].contains("write-changed ok"), "{}", answers[1]);
    assert!(same_bytes(
        &dir.join("after.nbdkit"),
        &dir.join("after.diskit")
    ));
    answers[1].clone()
}
