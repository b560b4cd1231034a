//! Ceph RBD images wherever an image goes, against a one-node Ceph
//! cluster (tests/ceph: the test run's, or the test's own), with Ceph's own `rbd` tool as the oracle:
//! what diskit writes into RBD `rbd export` reads back byte for byte (and
//! `qemu-img check` passes on a qcow2 kept in RBD), what `rbd import`
//! wrote diskit reads back, snapshots read as they were, and `serve rbd`
//! serves an image to nbdinfo and nbdcopy.

mod ceph;
mod common;

use std::path::{Path, PathBuf};

use ceph::Ceph;
use common::*;

/// A 64 MiB raw source: 1 MiB of 0x33 at 0, 64 KiB of 0x44 at 40 MiB,
/// the rest holes.
fn source(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("src.raw");
    sparse_file(&p, 64 << 20, &[(0, 1 << 20, 0x33), (40 << 20, 65536, 0x44)]);
    p
}

#[test]
fn convert_create_info_map_and_snapshots_through_rbd() {
    let ceph = Ceph::start();
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    // Into RBD, raw: `rbd export` reads the same bytes; only data is
    // stored (2 objects of 4 MiB, not 16).
    ok(diskit(&[
        "convert",
        "-O",
        "raw",
        s(&src),
        &ceph.name("raw1"),
    ]));
    let out = d.join("export.raw");
    ok(ceph.rbd(&["export", &ceph.at("raw1"), s(&out)]));
    assert!(same_bytes(&src, &out), "rbd export read other bytes");
    let du = stdout(&ok(ceph.rbd(&["du", "--format", "json", &ceph.at("raw1")])));
    let v: serde_json::Value = serde_json::from_str(&du).unwrap();
    let used = v["images"][0]["used_size"].as_u64().unwrap();
    assert!(
        used <= 8 << 20,
        "thin stays thin: {used} bytes used of 64 MiB ({du})"
    );
    // info and map see the image as qemu-img would.
    let info = stdout(&ok(diskit(&["info", "--output=json", &ceph.name("raw1")])));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["virtual-size"], 64 << 20, "{info}");
    assert_eq!(v["format"], "raw", "{info}");
    // As QEMU's rbd driver tells it: the object size as the cluster size
    // (raw asks its file), a dirty flag, an rbd block, no disk size.
    assert_eq!(v["cluster-size"], 4 << 20, "{info}");
    assert_eq!(v["dirty-flag"], false, "{info}");
    let file = &v["children"][0]["info"];
    assert_eq!(file["format"], "rbd", "{info}");
    assert_eq!(file["cluster-size"], 4 << 20, "{info}");
    assert_eq!(file["format-specific"]["type"], "rbd", "{info}");
    assert!(file.get("actual-size").is_none(), "{info}");
    let map = stdout(&ok(diskit(&["map", "--output=json", &ceph.name("raw1")])));
    let data: Vec<serde_json::Value> = serde_json::from_str::<Vec<serde_json::Value>>(&map)
        .unwrap()
        .into_iter()
        .filter(|e| e["data"] == true)
        .collect();
    // Exact as `rbd diff` (not whole objects): the object map says which
    // objects exist, their sizes how far their data reaches.
    let ours: Vec<(u64, u64)> = data
        .iter()
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(ours, [(0, 1 << 20), (40 << 20, 65536)], "{map}");
    let diff = stdout(&ok(ceph.rbd(&[
        "diff",
        "--format",
        "json",
        &ceph.at("raw1"),
    ])));
    let theirs: Vec<(u64, u64)> = serde_json::from_str::<Vec<serde_json::Value>>(&diff)
        .unwrap()
        .iter()
        .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(ours, theirs, "{map} {diff}");
    // Out of RBD: the same bytes, holes kept.
    let back = d.join("back.raw");
    ok(diskit(&[
        "convert",
        "-O",
        "raw",
        &ceph.name("raw1"),
        s(&back),
    ]));
    assert!(same_bytes(&src, &back));
    assert!(allocated(&back) <= 4 << 20, "exported sparse");
    // A qcow2 kept in RBD: exported, qemu-img checks it and reads it.
    ok(diskit(&[
        "convert",
        "-O",
        "qcow2",
        s(&src),
        &ceph.name("q1"),
    ]));
    let q = d.join("export.qcow2");
    ok(ceph.rbd(&["export", &ceph.at("q1"), s(&q)]));
    ok(qemu_img(&["check", s(&q)]));
    let cmp = ok(qemu_img(&["compare", s(&src), s(&q)]));
    assert!(stdout(&cmp).contains("Images are identical"));
    ok(diskit(&["compare", s(&src), &ceph.name("q1")]));
    // create: an empty image of the size asked; an existing name refused.
    ok(diskit(&[
        "create",
        "-q",
        "-f",
        "raw",
        &ceph.name("new1"),
        "16M",
    ]));
    let info = stdout(&ok(ceph.rbd(&[
        "info",
        "--format",
        "json",
        &ceph.at("new1"),
    ])));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["size"], 16 << 20, "{info}");
    let o = diskit(&["create", "-q", "-f", "raw", &ceph.name("new1"), "16M"]);
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).contains("File exists"), "{}", stderr(&o));
    // What `rbd import` wrote, diskit reads; a snapshot reads as it was.
    ok(ceph.rbd(&["import", s(&src), &ceph.at("imp")]));
    ok(ceph.rbd(&["snap", "create", &format!("{}@s1", ceph.at("imp"))]));
    // The head changes (written through diskit, -n: the image exists).
    let other = d.join("other.raw");
    sparse_file(&other, 64 << 20, &[(0, 1 << 20, 0x55)]);
    ok(diskit(&[
        "convert",
        "-n",
        "-O",
        "raw",
        s(&other),
        &ceph.name("imp"),
    ]));
    let head = d.join("head.raw");
    ok(ceph.rbd(&["export", &ceph.at("imp"), s(&head)]));
    assert!(same_bytes(&other, &head), "the head holds the new bytes");
    let snap = d.join("snap.raw");
    ok(diskit(&[
        "convert",
        "-O",
        "raw",
        &ceph.name("imp@s1"),
        s(&snap),
    ]));
    assert!(same_bytes(&src, &snap), "the snapshot reads as it was");
    let o = diskit(&["resize", &ceph.name("imp@s1"), "128M"]);
    assert_ne!(code(&o), 0, "a snapshot is read-only");
    // QEMU's keys: --image-opts and json: name the same image.
    let conf = ceph.conf();
    let opts = format!(
        "driver=raw,file.driver=rbd,file.pool={},file.image=raw1,file.conf={}",
        ceph.pool(),
        conf.display()
    );
    let json = format!(
        r#"json:{{"driver":"raw","file":{{"driver":"rbd","pool":"{}","image":"raw1","conf":"{}"}}}}"#,
        ceph.pool(),
        conf.display()
    );
    for args in [
        vec!["compare", "--image-opts", &opts, "driver=file,filename=SRC"],
        vec!["compare", &json, "SRC"],
    ] {
        let src_opt = format!("driver=file,filename={}", s(&src));
        let args: Vec<&str> = args
            .into_iter()
            .map(|a| match a {
                "driver=file,filename=SRC" => src_opt.as_str(),
                "SRC" => s(&src),
                a => a,
            })
            .collect();
        let o = ok(diskit(&args));
        assert!(stdout(&o).contains("Images are identical"), "{args:?}");
    }
    // Growing an image in RBD, and names that lead nowhere.
    ok(diskit(&["resize", &ceph.name("new1"), "32M"]));
    let info = stdout(&ok(ceph.rbd(&[
        "info",
        "--format",
        "json",
        &ceph.at("new1"),
    ])));
    assert!(info.contains(&format!("\"size\":{}", 32 << 20)), "{info}");
    for (name, why) in [
        (
            ceph.name("missing"),
            "error reading header from missing: No such file or directory",
        ),
        (
            format!("rbd:nopool/x:conf={}", conf.display()),
            "error opening pool nopool: No such file or directory",
        ),
    ] {
        let o = diskit(&["info", &name]);
        assert_eq!(code(&o), 1, "{name}");
        assert!(stderr(&o).contains(why), "{}", stderr(&o));
    }
    // qemu-img's snapshot command on an RBD image: its RBD snapshots
    // (raw keeps none and hands them to its storage, as QEMU does).
    let n = ceph.name("raw1");
    ok(diskit(&["snapshot", "-f", "raw", "-c", "before", &n]));
    let o = diskit(&["snapshot", "-f", "raw", "-c", "before", &n]);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).contains("Could not create snapshot 'before': File exists"),
        "{}",
        stderr(&o)
    );
    let ls = stdout(&ok(ceph.rbd(&[
        "snap",
        "ls",
        "--format",
        "json",
        &ceph.at("raw1"),
    ])));
    assert!(ls.contains("\"name\":\"before\""), "{ls}");
    let list = stdout(&ok(diskit(&["snapshot", "-f", "raw", "-l", &n])));
    let row = list
        .lines()
        .find(|l| l.starts_with("before "))
        .expect(&list);
    assert!(row.contains(" 64 MiB "), "{list}");
    let info = stdout(&ok(diskit(&["info", "-f", "raw", "--output=json", &n])));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["snapshots"][0]["name"], "before", "{info}");
    // Overwritten, then rolled back: rbd export reads the old bytes.
    ok(diskit(&[
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        s(&other),
        &n,
    ]));
    ok(diskit(&["snapshot", "-f", "raw", "-a", "before", &n]));
    let rolled = d.join("rolled.raw");
    ok(ceph.rbd(&["export", &ceph.at("raw1"), s(&rolled)]));
    assert!(same_bytes(&src, &rolled), "rolled back to the snapshot");
    ok(diskit(&["snapshot", "-f", "raw", "-d", "before", &n]));
    let o = diskit(&["snapshot", "-f", "raw", "-d", "before", &n]);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).contains(
            "Could not delete snapshot 'before': Failed to remove the snapshot: No such file or directory"
        ),
        "{}",
        stderr(&o)
    );
    let ls = stdout(&ok(ceph.rbd(&[
        "snap",
        "ls",
        "--format",
        "json",
        &ceph.at("raw1"),
    ])));
    assert_eq!(ls.trim(), "[]");
}

/// A cluster that does not answer is an error after the timeout, never a
/// hang (librados waits forever by default; diskit sets 30 s, and the
/// name may say less).
#[test]
fn an_unreachable_cluster_is_a_clear_error() {
    let port = free_port();
    let name =
        format!("rbd:rbd/x:mon_host=127.0.0.1\\:{port}:auth_supported=none:client_mount_timeout=2");
    let o = diskit(&["info", &name]);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).contains("error connecting: Connection timed out"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn serve_rbd_serves_an_image_to_nbd_clients() {
    let ceph = Ceph::start();
    let dir = workdir();
    let d = dir.path();
    let src = source(d);
    ok(ceph.rbd(&["import", s(&src), &ceph.at("img")]));
    let copy = d.join("copy.raw");
    let conf = format!("conf={}", ceph.conf().display());
    let o = ok(serve(&[
        "-U",
        "-",
        "-r",
        "rbd",
        &ceph.at("img"),
        &conf,
        "--run",
        &format!("nbdinfo --size \"$uri\" && nbdcopy \"$uri\" {}", s(&copy)),
    ]));
    assert_eq!(stdout(&o).trim(), (64u64 << 20).to_string());
    assert!(same_bytes(&src, &copy));
    // An image whose size is no multiple of the object size (4 MiB) nor
    // of 4 KiB, with data and holes in one object, a run across an object
    // boundary and data up to its last byte: what nbdcopy reads whole and
    // what random reads of all sizes read (the big ones read without
    // asking for extents first) are `rbd export`'s bytes.
    let size = (9u64 << 20) + 12_800;
    let odd = d.join("odd.raw");
    sparse_file(
        &odd,
        size,
        &[
            (0, 300 << 10, 0xff),
            ((1 << 20) + 4096, 65536, 0x5a),
            ((8 << 20) - 100_000, 200_000, 0xff),
            (size - 5000, 5000, 0xff),
        ],
    );
    let exported = imported(&ceph, d, &odd, "odd", &[]);
    read_served(
        &ceph,
        d,
        "odd",
        &exported,
        "r = random.Random(28)\n\
         for _ in range(200):\n\
         \x20   n = r.choice([512, 4096, 65536, 262144, 1 << 20])\n\
         \x20   off = r.randrange(0, size - n + 1)\n\
         \x20   assert h.pread(n, off) == exp[off:off + n], (off, n)\n\
         tail = size - (8 << 20)\n\
         assert h.pread(size - tail, tail) == exp[tail:]\n\
         assert h.pread(5000, size - 5000) == exp[-5000:]\n",
        "",
    );
}

/// `src` imported into RBD as `image` by `rbd import` (with `opts`), and
/// exported back into a file by `rbd export`, which holds `src`'s bytes.
fn imported(ceph: &Ceph, d: &Path, src: &Path, image: &str, opts: &[&str]) -> PathBuf {
    let at = ceph.at(image);
    let mut args = vec!["import"];
    args.extend_from_slice(opts);
    args.extend([s(src), &at]);
    ok(ceph.rbd(&args));
    let exported = d.join(format!("{image}-export.raw"));
    ok(ceph.rbd(&["export", &at, s(&exported)]));
    assert!(same_bytes(src, &exported), "rbd export: the image as made");
    exported
}

/// `serve -r rbd IMAGE` read by an nbdsh script (`reads`, after `exp`
/// holds `exported`'s bytes and `size` the size served) and by nbdcopy
/// (with `nbdcopy_opts`), which copies `exported`'s bytes.
fn read_served(
    ceph: &Ceph,
    d: &Path,
    image: &str,
    exported: &Path,
    reads: &str,
    nbdcopy_opts: &str,
) {
    let script = d.join(format!("{image}-reads.py"));
    std::fs::write(
        &script,
        format!(
            "import os, random\n\
             exp = open(os.environ['EXPORTED'], 'rb').read()\n\
             size = h.get_size()\n\
             assert size == len(exp), (size, len(exp))\n\
             {reads}"
        ),
    )
    .unwrap();
    let copy = d.join(format!("{image}-copy.raw"));
    let conf = format!("conf={}", ceph.conf().display());
    let o = ok(serve(&[
        "-U",
        "-",
        "-r",
        "rbd",
        &ceph.at(image),
        &conf,
        "--run",
        &format!(
            "EXPORTED={} nbdsh -u \"$uri\" -c 'exec(open(\"{}\").read())' && nbdcopy {nbdcopy_opts} \"$uri\" {} && echo read",
            s(exported),
            s(&script),
            s(&copy),
        ),
    ]));
    assert_eq!(stdout(&o).trim(), "read", "{}", stderr(&o));
    assert!(same_bytes(exported, &copy), "nbdcopy read other bytes");
}

/// A copy whose source fails part way removes the RBD image it created;
/// an OSD that stops answering mid-copy fails the copy after the
/// name's `rados_osd_op_timeout`, with a message and exit code 1.
#[test]
fn failed_copies_into_rbd_say_so_and_leave_no_image_they_made() {
    // Its OSD is stopped: a cluster of its own.
    let ceph = Ceph::start_own(&[]);
    let dir = workdir();
    let d = dir.path();
    // A source whose reads fail (nbdkit's error filter, one read in
    // three): the image convert made is gone afterwards.
    let (uri, _err) = failing_source(d, "64M", "0.34");
    let o = diskit(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &uri,
        &ceph.name("failed"),
    ]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("Input/output error"), "{}", stderr(&o));
    assert!(
        !ceph.images().contains(&"failed".to_string()),
        "the image made is removed: {:?}",
        ceph.images()
    );
    // A slow source (each read waits) and an OSD that stops answering
    // while the copy runs: the copy fails within the timeouts the name
    // sets, and says why.
    let slow = d.join("slow.sock");
    let _slow = start_server(
        "nbdkit",
        &[
            "-f",
            "-U",
            s(&slow),
            "--filter=delay",
            "pattern",
            "64M",
            "delay-read=300ms",
        ],
        || slow.exists(),
    );
    let uri = format!("nbd+unix:///?socket={}", s(&slow));
    let name = format!(
        "{}:rados_osd_op_timeout=2:rados_mon_op_timeout=2",
        ceph.name("stalled")
    );
    let child = std::process::Command::new(diskit_bin())
        .args(["convert", "-f", "raw", "-O", "raw", &uri, &name])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The image is made and the copy under way before the OSD stops.
    let t = std::time::Instant::now();
    while !ceph.images().contains(&"stalled".to_string()) && t.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_millis(700));
    ceph.signal_osd(libc::SIGSTOP);
    let o = child.wait_with_output().unwrap();
    ceph.signal_osd(libc::SIGCONT);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    // Where librbd's cache took the writes, the flush at the close is
    // what fails: never an exit 0 with data short of the cluster.
    let said = stderr(&o);
    assert!(
        (said.starts_with("diskit: error while writing at byte ")
            || said.starts_with("diskit: error flushing rbd:rbd/stalled"))
            && said.trim_end().ends_with(": Connection timed out")
            && said.lines().count() == 1,
        "{said}"
    );
    assert!(
        t.elapsed().as_secs() < 60,
        "a stalled cluster fails the copy in bounded time"
    );
}

/// What an NBD client wrote and flushed through `serve rbd` is in the
/// cluster, even if the server dies right after the flush.
#[test]
fn a_flushed_write_through_serve_rbd_is_in_the_cluster() {
    let ceph = Ceph::start();
    let dir = workdir();
    let d = dir.path();
    ok(ceph.rbd(&["create", "--size", "16M", &ceph.at("w")]));
    let sock = d.join("w.sock");
    let conf = format!("conf={}", ceph.conf().display());
    let server = start_server(
        diskit_bin().to_str().unwrap(),
        &["serve", "-f", "-U", s(&sock), "rbd", &ceph.at("w"), &conf],
        || sock.exists(),
    );
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    ok(std::process::Command::new("nbdsh")
        .env("PATH", path_env())
        .args([
            "-u",
            &uri,
            "-c",
            "h.pwrite(b'\\x5a' * 65536, 1048576); h.flush(); \
             h.pwrite(b'\\x6b' * 4096, 4096, nbd.CMD_FLAG_FUA)",
        ])
        .output()
        .unwrap());
    // No orderly shutdown: the server is killed.
    drop(server);
    let out = d.join("w.raw");
    ok(ceph.rbd(&["export", &ceph.at("w"), s(&out)]));
    let data = std::fs::read(&out).unwrap();
    assert!(data[1 << 20..(1 << 20) + 65536].iter().all(|&b| b == 0x5a));
    assert!(data[4096..8192].iter().all(|&b| b == 0x6b));
    assert!(data[..4096].iter().all(|&b| b == 0));
}

/// A read-only image serves small reads that continue one another from
/// whole objects (read once each, the next one loaded ahead): streams of
/// reads that are not aligned to its objects (1 MiB here), nor to one
/// another's ends, read `rbd export`'s bytes, as do reads that jump about
/// between them and nbdcopy's whole copy.
#[test]
fn served_read_only_streams_read_what_rbd_export_reads() {
    let ceph = Ceph::start();
    let dir = workdir();
    let d = dir.path();
    // Bytes that differ from place to place: a read from the wrong
    // offset, or of the wrong object, shows.
    let size = (6u64 << 20) + 12_345;
    let src = d.join("src.raw");
    let bytes: Vec<u8> = (0..size)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&src, &bytes).unwrap();
    let exported = imported(&ceph, d, &src, "objects", &["--object-size", "1M"]);
    read_served(
        &ceph,
        d,
        "objects",
        &exported,
        "# Two streams, their reads interleaved, and random reads between.\n\
         streams = [[0, 300001], [7, 65539]]\n\
         r = random.Random(28)\n\
         while any(at < size for at, _ in streams):\n\
         \x20   for s in streams:\n\
         \x20       at, step = s\n\
         \x20       if at >= size:\n\
         \x20           continue\n\
         \x20       n = min(step, size - at)\n\
         \x20       assert h.pread(n, at) == exp[at:at + n], (at, n)\n\
         \x20       s[0] = at + n\n\
         \x20   n = r.choice([1, 4096, 100000])\n\
         \x20   off = r.randrange(0, size - n + 1)\n\
         \x20   assert h.pread(n, off) == exp[off:off + n], (off, n)\n\
         # A stream read again: from the objects still held.\n\
         at = 1000\n\
         while at < size:\n\
         \x20   n = min(123457, size - at)\n\
         \x20   assert h.pread(n, at) == exp[at:at + n], (at, n)\n\
         \x20   at += n\n",
        "--request-size=262144",
    );
}
