//! The command lines real callers of qemu-img run (Ironic, Cinder,
//! libvirt, image builders, CDI), each through qemu-img and through diskit
//! against the same inputs: the same output, messages, exit codes and
//! bytes.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// A loop device over a file, detached when dropped.
struct Loop(String);

impl Loop {
    /// Attaches `file`; `None` (with the reason) where losetup cannot.
    fn attach(file: &Path) -> Result<Loop, String> {
        let o = Command::new("losetup")
            .args(["-f", "--show", s(file)])
            .output()
            .map_err(|e| format!("cannot run losetup: {e}"))?;
        if !o.status.success() {
            return Err(format!("losetup failed: {}", stderr(&o).trim()));
        }
        Ok(Loop(stdout(&o).trim().to_string()))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// Fills the file (and so the device over it) with 0xaa.
fn fill(path: &Path, size: usize) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![0xaa; size], 0).unwrap();
    f.sync_all().unwrap();
}

/// A qcow2 with data at odd places, made by qemu-img and qemu-io.
fn qcow2_with_data(dir: &Path, name: &str, size: &str) -> PathBuf {
    let img = dir.join(name);
    ok(qemu_img(&["create", "-f", "qcow2", s(&img), size]));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &[
                "write -P 0x5a 1000 70000",
                "-c",
                "write -P 0x33 1M 100k",
                "-c",
                "write -z 2M 64k",
                s(&img),
            ],
        ),
    ));
    img
}

/// Ironic: `qemu-img convert -t directsync -S 0 -O host_device -W IMG
/// /dev/loopN` and `qemu-img info -f host_device /dev/loopN`.
#[test]
fn ironic_writes_an_image_to_a_block_device_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let img = qcow2_with_data(d, "img.qcow2", "6M");
    let backing = d.join("disk.img");
    std::fs::write(&backing, vec![0u8; 8 << 20]).unwrap();
    let small = d.join("small.img");
    std::fs::write(&small, vec![0u8; 4 << 20]).unwrap();
    let (dev, small_dev) = match (Loop::attach(&backing), Loop::attach(&small)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("skipping the host_device test: {e}");
            return;
        }
    };
    let convert = [
        "convert",
        "-t",
        "directsync",
        "-S",
        "0",
        "-O",
        "host_device",
        "-W",
        s(&img),
        &dev.0,
    ];
    // The device holds something else first: -S 0 writes the zeros too.
    let mut results = Vec::new();
    for tool in ["qemu-img", "diskit"] {
        // Through the device, so that its page cache holds no stale bytes.
        fill(Path::new(&dev.0), 8 << 20);
        good_in(d, tool, &convert);
        results.push(std::fs::read(&dev.0).unwrap());
    }
    assert!(results[0] == results[1], "the devices differ");
    let raw = d.join("img.raw");
    ok(qemu_img(&["convert", "-O", "raw", s(&img), s(&raw)]));
    let want = std::fs::read(&raw).unwrap();
    assert!(results[1][..want.len()] == want[..]);
    // What lies past the image is left alone.
    assert!(results[1][want.len()..].iter().all(|&b| b == 0xaa));
    let desc = format!("driver=host_device,filename={}", dev.0);
    for args in [
        vec!["info", "-f", "host_device", &dev.0],
        vec!["info", "--output=json", "--image-opts", &desc],
        vec!["info", "--output=json", "-f", "host_device", &dev.0],
        vec!["info", "--output=json", &dev.0],
        vec![
            "compare",
            "-f",
            "qcow2",
            "-F",
            "host_device",
            s(&img),
            &dev.0,
        ],
        vec!["map", "--output=json", "-f", "host_device", &dev.0],
        // Refusals, in qemu-img's words.
        vec!["info", "-f", "host_device", s(&raw)],
        vec!["convert", "-O", "host_device", s(&img), s(&raw)],
        vec!["convert", "-O", "host_device", s(&img), "missing.img"],
        vec!["convert", "-O", "host_device", s(&img), &small_dev.0],
        vec!["create", "-f", "host_device", &dev.0, "4M"],
        vec!["create", "-f", "host_device", &dev.0, "16M"],
        vec![
            "create",
            "-f",
            "host_device",
            &dev.0,
            "-o",
            "preallocation=full",
            "1M",
        ],
    ] {
        alike_in(d, &args);
    }
}

/// The secrets Cinder defines (`format=raw,file=`), files in `dir`.
fn secrets(dir: &Path) -> Vec<String> {
    std::fs::write(dir.join("p1"), "old passphrase").unwrap();
    std::fs::write(dir.join("p2"), "new passphrase").unwrap();
    vec![
        "--object".into(),
        "secret,id=sec1,format=raw,file=p1".into(),
        "--object".into(),
        "secret,id=sec2,format=raw,file=p2".into(),
    ]
}

/// `SUB OBJECTS REST...`: the secrets after the subcommand.
fn with_objects(sub: &str, objects: &[String], rest: &[&str]) -> Vec<String> {
    let mut v = vec![sub.to_string()];
    v.extend(objects.iter().cloned());
    v.extend(rest.iter().map(|r| r.to_string()));
    v
}

/// Decrypts a LUKS image with qemu-img into raw bytes.
fn decrypted(dir: &Path, objects: &[String], desc: &str) -> Vec<u8> {
    let out = dir.join("decrypted.raw");
    let _ = std::fs::remove_file(&out);
    let args = with_objects(
        "convert",
        objects,
        &["-O", "raw", "--image-opts", desc, s(&out)],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    good_in(dir, "qemu-img", &args);
    std::fs::read(&out).unwrap()
}

/// Cinder: `convert --object secret,id=sec1,... --object secret,id=sec2,...
/// --image-opts encrypt.format=luks,encrypt.key-secret=sec1,file.filename=SRC
/// -O luks -o key-secret=sec2 DEST` (re-keying an encrypted volume).
#[test]
fn cinder_rekeys_a_luks_volume_described_by_image_opts() {
    let dir = workdir();
    let d = dir.path();
    let objects = secrets(d);
    let objs: Vec<&str> = objects.iter().map(String::as_str).collect();
    // A qcow2 volume encrypted with LUKS, as Cinder's NFS driver makes it,
    // and a plain LUKS volume.
    let mut create = vec!["create"];
    create.extend(&objs);
    create.extend([
        "-f",
        "qcow2",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec1,encrypt.iter-time=10",
        "vol.qcow2",
        "4M",
    ]);
    good_in(d, "qemu-img", &create);
    let mut create = vec!["create"];
    create.extend(&objs);
    create.extend([
        "-f",
        "luks",
        "-o",
        "key-secret=sec1,iter-time=10",
        "vol.luks",
        "4M",
    ]);
    good_in(d, "qemu-img", &create);
    for desc in [
        "driver=qcow2,encrypt.key-secret=sec1,file.filename=vol.qcow2",
        "driver=luks,key-secret=sec1,file.filename=vol.luks",
    ] {
        let mut io = vec!["--image-opts"];
        io.extend(&objs);
        io.extend([
            "-c",
            "write -P 0x5a 4096 70000",
            "-c",
            "write -P 0x17 3M 8192",
            desc,
        ]);
        good_in(d, "qemu-io", &io);
    }
    let plain_qcow2 = decrypted(
        d,
        &objects,
        "driver=qcow2,encrypt.key-secret=sec1,file.filename=vol.qcow2",
    );
    let plain_luks = decrypted(
        d,
        &objects,
        "driver=luks,key-secret=sec1,file.filename=vol.luks",
    );
    assert!(plain_qcow2.contains(&0x5a));
    for (source, plain) in [
        // Cinder's own line: no driver, the format probed.
        (
            "encrypt.format=luks,encrypt.key-secret=sec1,file.filename=vol.qcow2",
            &plain_qcow2,
        ),
        (
            "driver=qcow2,encrypt.format=luks,encrypt.key-secret=sec1,file.filename=vol.qcow2",
            &plain_qcow2,
        ),
        (
            "driver=luks,key-secret=sec1,file.filename=vol.luks",
            &plain_luks,
        ),
        ("key-secret=sec1,file.filename=vol.luks", &plain_luks),
    ] {
        for tool in ["qemu-img", "diskit"] {
            let dest = format!("new-{tool}.luks");
            let _ = std::fs::remove_file(d.join(&dest));
            let args = with_objects(
                "convert",
                &objects,
                &[
                    "--image-opts",
                    source,
                    "-O",
                    "luks",
                    "-o",
                    "key-secret=sec2,iter-time=10",
                    &dest,
                ],
            );
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            good_in(d, tool, &args);
            let got = decrypted(
                d,
                &objects,
                &format!("driver=luks,key-secret=sec2,file.filename={dest}"),
            );
            assert!(
                got == *plain,
                "{tool} {source}: the re-keyed volume reads otherwise"
            );
        }
    }
    // What QEMU refuses, refused alike.
    ok(qemu_img(&argv(
        "create -f qcow2",
        &[s(&d.join("clear.qcow2")), "1M"],
    )));
    for desc in [
        "encrypt.format=aes,encrypt.key-secret=sec1,file.filename=vol.qcow2",
        "encrypt.format=bogus,encrypt.key-secret=sec1,file.filename=vol.qcow2",
        "encrypt.format=luks,file.filename=vol.qcow2",
        "encrypt.format=luks,encrypt.key-secret=sec2,file.filename=vol.qcow2",
        "encrypt.format=luks,encrypt.key-secret=sec1,file.filename=clear.qcow2",
        "key-secret=sec1,encrypt.format=luks,file.filename=vol.luks",
        "driver=raw,encrypt.key-secret=sec1,file.filename=vol.qcow2",
    ] {
        let args = with_objects(
            "convert",
            &objects,
            &["-O", "raw", "--image-opts", desc, "out.raw"],
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        alike_in(d, &args);
    }
}

/// A qcow2 with a persistent bitmap and writes after it, as libvirt's
/// backups see one.
fn image_with_bitmap(dir: &Path) -> PathBuf {
    let img = dir.join("b.qcow2");
    ok(qemu_img(&["create", "-f", "qcow2", s(&img), "4M"]));
    ok(peer("qemu-io", &["-c", "write -P 1 0 64k", s(&img)]));
    ok(qemu_img(&["bitmap", "--add", s(&img), "bm0"]));
    ok(peer(
        "qemu-io",
        &[
            "-c",
            "write -P 2 1M 128k",
            "-c",
            "write -z 2M 64k",
            "-c",
            "write -P 3 3M 4k",
            s(&img),
        ],
    ));
    img
}

/// libvirt: NBD described by structure (`server.type=unix|inet`, the
/// `json:` form), and `x-dirty-bitmap`, with which `map` shows a dirty
/// bitmap (pull-mode backups read it so), against qemu-nbd's exports.
#[test]
fn libvirt_reads_nbd_by_structure_and_dirty_bitmaps_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let img = image_with_bitmap(d);
    let sock = d.join("nbd.sock");
    let port = free_port();
    let port_s = port.to_string();
    let _unix = start_server(
        "qemu-nbd",
        &[
            "-r",
            "-t",
            "-f",
            "qcow2",
            "-B",
            "bm0",
            "-x",
            "exp",
            "-k",
            s(&sock),
            s(&img),
        ],
        || sock.exists(),
    );
    let _tcp = start_server(
        "qemu-nbd",
        &[
            "-r",
            "-t",
            "-f",
            "qcow2",
            "-B",
            "bm0",
            "-x",
            "exp",
            "-b",
            "127.0.0.1",
            "-p",
            &port_s,
            s(&img),
        ],
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
    );
    let sp = s(&sock);
    let bitmap = "x-dirty-bitmap=qemu:dirty-bitmap:bm0";
    let unix = format!("driver=nbd,server.type=unix,server.path={sp},export=exp");
    let inet =
        format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=exp");
    let json = format!(
        r#"json:{{"driver":"nbd","server":{{"type":"unix","path":"{sp}"}},"export":"exp","x-dirty-bitmap":"qemu:dirty-bitmap:bm0"}}"#
    );
    let mut seen_dirty = false;
    for desc in [
        unix.clone(),
        format!("{unix},{bitmap}"),
        inet.clone(),
        format!("{inet},{bitmap}"),
        format!("driver=nbd,path={sp},export=exp,{bitmap}"),
        format!(
            "driver=raw,file.driver=nbd,file.server.type=unix,file.server.path={sp},file.export=exp,file.{bitmap}"
        ),
    ] {
        for out in ["--output=json", "--output=human"] {
            let o = same_as_qemu_img(&["map", out, "--image-opts", &desc], "map");
            seen_dirty |= stdout(&o).contains(r#""present": false, "zero": false, "data": false"#);
        }
    }
    for out in ["--output=json", "--output=human"] {
        same_as_qemu_img(&["map", out, &json], "map of a json: description");
    }
    // The bitmap's dirty ranges were shown as such (neither data nor zero).
    assert!(seen_dirty);
    // Descriptions QEMU refuses, refused alike.
    for desc in [
        "driver=nbd,server.path=/nowhere,export=exp".to_string(),
        "driver=nbd,server.type=unix,export=exp".to_string(),
        "driver=nbd,server.type=inet,server.host=127.0.0.1,export=exp".to_string(),
        "driver=nbd,server.type=bogus,server.path=x".to_string(),
        format!("{unix},path={sp}"),
        format!("driver=nbd,server.type=unix,server.path={sp},server.host=h,export=exp"),
        "driver=nbd,export=exp".to_string(),
    ] {
        alike_in(d, &["map", "--image-opts", &desc]);
    }
}

/// `compare -s`: the block status must match too, as qemu-img checks it.
#[test]
fn strict_compare_checks_block_status_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let run = |args: &[&str]| ok(tool_in(d, "qemu-img", args));
    run(&["create", "-f", "qcow2", "a.qcow2", "4M"]);
    ok(peer(
        "qemu-io",
        &["-c", "write -P 7 1M 64k", s(&d.join("a.qcow2"))],
    ));
    sparse_file(&d.join("a.raw"), 4 << 20, &[(1 << 20, 64 << 10, 7)]);
    run(&["convert", "-O", "qcow2", "a.raw", "b.qcow2"]);
    run(&["convert", "-c", "-O", "qcow2", "a.raw", "c.qcow2"]);
    run(&["convert", "-S", "0", "-O", "raw", "a.qcow2", "full.raw"]);
    run(&words("create -f qcow2 -b a.qcow2 -F qcow2 over.qcow2"));
    run(&words(
        "convert -O qcow2 -o preallocation=metadata a.raw meta.qcow2",
    ));
    for (a, b) in [
        // Same content: unallocated clusters against a file's holes.
        ("a.qcow2", "a.raw"),
        ("a.raw", "a.qcow2"),
        ("a.raw", "full.raw"),
        ("a.qcow2", "b.qcow2"),
        ("b.qcow2", "c.qcow2"),
        ("a.qcow2", "over.qcow2"),
        ("over.qcow2", "a.raw"),
        ("meta.qcow2", "a.qcow2"),
        ("a.raw", "a.raw"),
    ] {
        alike_in(d, &["compare", "-s", a, b]);
        alike_in(d, &["compare", a, b]);
    }
}

/// The host offsets of a qcow2's compressed clusters, in guest order.
fn compressed_offsets(path: &Path) -> Vec<u64> {
    let f = std::fs::read(path).unwrap();
    let be = |at: usize| u64::from_be_bytes(f[at..at + 8].try_into().unwrap());
    let bits = u32::from_be_bytes(f[20..24].try_into().unwrap());
    let l1_size = u32::from_be_bytes(f[36..40].try_into().unwrap()) as usize;
    let l1 = be(40) as usize;
    let cs = 1usize << bits;
    let mask = (1u64 << (62 - (bits - 8))) - 1;
    let mut out = Vec::new();
    for i in 0..l1_size {
        let l2 = (be(l1 + 8 * i) & 0x00ff_ffff_ffff_fe00) as usize;
        if l2 == 0 {
            continue;
        }
        for j in 0..cs / 8 {
            let e = be(l2 + 8 * j);
            if e & (1 << 62) != 0 {
                out.push(e & mask);
            }
        }
    }
    out
}

/// Image builders: `convert -c` gives the same bytes on every run,
/// whatever `-m`, with the compressed clusters laid out in guest order as
/// qemu-img lays them out.
#[test]
fn compressed_convert_is_reproducible() {
    let dir = workdir();
    let d = dir.path();
    // 32 MiB of data (several copy workers' worth), each cluster
    // compressing to its own size.
    let src = d.join("src.raw");
    let mut data = Vec::with_capacity(32 << 20);
    let mut x = 0x9e37_79b9u32;
    for i in 0..512u32 {
        let tail = 200 + (i as usize * 37) % 900;
        data.extend(std::iter::repeat_n((i % 250 + 1) as u8, 65536 - tail));
        data.extend((0..tail).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        }));
    }
    std::fs::write(&src, &data).unwrap();
    let mut first: Option<Vec<u8>> = None;
    for m in ["1", "4", "8", "8", "4"] {
        let out = d.join(format!("out-{m}.qcow2"));
        let _ = std::fs::remove_file(&out);
        ok(diskit(&argv(
            "convert -c -m",
            &[m, "-O", "qcow2", s(&src), s(&out)],
        )));
        let bytes = std::fs::read(&out).unwrap();
        match &first {
            None => first = Some(bytes),
            Some(f) => assert!(*f == bytes, "-m {m} gave other bytes"),
        }
    }
    let ours = d.join("out-8.qcow2");
    let theirs = d.join("qemu.qcow2");
    ok(qemu_img(&argv(
        "convert -c -m 8 -O qcow2",
        &[s(&src), s(&theirs)],
    )));
    for img in [&ours, &theirs] {
        let offsets = compressed_offsets(img);
        assert_eq!(offsets.len(), 512, "{img:?}");
        assert!(
            offsets.windows(2).all(|w| w[0] < w[1]),
            "{img:?}: not in guest order"
        );
    }
    // qemu-img's compressed streams are zlib's own, not byte-equal to
    // zlib-rs's: the layout is compared, and the content.
    ok(qemu_img(&["check", s(&ours)]));
    alike_in(d, &["compare", s(&src), s(&ours)]);
    alike_in(d, &["map", "--output=json", s(&ours)]);
}

/// QEMU 10's long options, each against qemu-img's short one: the same
/// output, exit status and files. (qemu-img 10.0.2 lacks some of the long
/// spellings its --help lists: it runs the short ones.)
#[test]
fn long_options_of_qemu_10_mean_their_short_ones() {
    let dir = workdir();
    let d = dir.path();
    sparse_file(&d.join("a.raw"), 2 << 20, &[(65536, 70000, 0xff)]);
    qemu_img_in(d, "create -f qcow2 -b a.raw -F raw top.qcow2");
    // An internal snapshot holding less than the image now does.
    qemu_img_in(d, "create -f qcow2 snap.qcow2 8M");
    good_in(d, "qemu-io", &["-c", "write 0 1M", "snap.qcow2"]);
    qemu_img_in(d, "snapshot -c s1 snap.qcow2");
    good_in(d, "qemu-io", &["-c", "write 2M 3M", "snap.qcow2"]);
    // Each case: qemu-img's short spelling, diskit's long one.
    let cases = [
        (
            "measure -O qcow2 -l s1 snap.qcow2",
            "measure --target-format qcow2 --snapshot s1 snap.qcow2",
        ),
        (
            "measure -O qcow2 -l nope snap.qcow2",
            "measure --target-format qcow2 -l nope snap.qcow2",
        ),
        ("info -b top.qcow2", "info --backing-chain top.qcow2"),
        ("info -b top.qcow2", "info -b top.qcow2"),
        ("info -f qcow2 top.qcow2", "info --format qcow2 top.qcow2"),
        ("map -f raw a.raw", "map --format=raw a.raw"),
        (
            "create -f qcow2 -o cluster_size=4k -b a.raw -F raw NEW",
            "create --format qcow2 --options cluster_size=4k --backing a.raw --backing-format raw NEW",
        ),
        (
            "convert -f raw -O qcow2 -o cluster_size=16k -m 2 -S 8k -r 1G -c a.raw NEW",
            "convert --source-format raw --target-format qcow2 --target-options cluster_size=16k --parallel 2 --sparse-size 8k --rate 1G --compress a.raw NEW",
        ),
        (
            "convert -O qcow2 -o cluster_size=16k -q a.raw NEW",
            "convert --output-format qcow2 --options cluster_size=16k --quiet a.raw NEW",
        ),
        (
            "compare -f raw -F qcow2 -s a.raw top.qcow2",
            "compare --a-format raw --b-format qcow2 --strict a.raw top.qcow2",
        ),
        (
            "compare -T none a.raw top.qcow2",
            "compare --cache none a.raw top.qcow2",
        ),
        (
            "measure -O qcow2 -o cluster_size=4k a.raw",
            "measure --target-format qcow2 --options cluster_size=4k a.raw",
        ),
        (
            "measure -O qcow2 --size 1G",
            "measure --target-format qcow2 -s 1G",
        ),
        (
            "check -f qcow2 -r leaks COPYQ",
            "check --format qcow2 --repair leaks COPYQ",
        ),
        (
            "resize -f raw -q COPY 3M",
            "resize --format raw --quiet COPY 3M",
        ),
        (
            "dd -f raw -O qcow2 bs=64k if=a.raw of=NEW",
            "dd --format raw --output-format qcow2 bs=64k if=a.raw of=NEW",
        ),
        (
            "bench -c 4 -d 2 -s 4k -S 8k -o 4k -t none -i native a.raw",
            "bench --count 4 --depth 2 --buffer-size 4k --step-size 8k --offset 4k --cache none --aio native a.raw",
        ),
        (
            "rebase -u -b a.raw -F raw -q COPYQ",
            "rebase --backing-unsafe --backing a.raw --backing-format raw --quiet COPYQ",
        ),
        (
            "commit -f qcow2 -d -q COPYQ",
            "commit --format qcow2 --drop --quiet COPYQ",
        ),
        (
            "amend -f qcow2 -o lazy_refcounts=on -q COPYQ",
            "amend --format qcow2 --options lazy_refcounts=on --quiet COPYQ",
        ),
        (
            "bitmap --add -g 128k -f qcow2 COPYQ bm",
            "bitmap --add --granularity 128k --format qcow2 COPYQ bm",
        ),
    ];
    for (i, (short, long)) in cases.into_iter().enumerate() {
        let (short, long) = (words(short), words(long));
        let mut outs = Vec::new();
        for (tool, args) in [("qemu-img", &short), ("diskit", &long)] {
            // Each run gets fresh copies of what it changes.
            let new = format!("new-{i}-{tool}");
            let copy = format!("copy-{i}-{tool}.raw");
            let copyq = format!("copy-{i}-{tool}.qcow2");
            std::fs::copy(d.join("a.raw"), d.join(&copy)).unwrap();
            std::fs::copy(d.join("top.qcow2"), d.join(&copyq)).unwrap();
            let args: Vec<&str> = args
                .iter()
                .map(|a| match *a {
                    "NEW" => new.as_str(),
                    "COPY" => copy.as_str(),
                    "COPYQ" => copyq.as_str(),
                    a => a,
                })
                .collect();
            let o = tool_in(d, tool, &args);
            let text = stdout(&o)
                .replace(&new, "NEW")
                .replace(&copyq, "COPYQ")
                .replace(&copy, "COPY");
            let made = std::fs::read(d.join(&new)).ok();
            let changed = (
                std::fs::read(d.join(&copy)).unwrap(),
                std::fs::read(d.join(&copyq)).unwrap(),
            );
            outs.push((
                code(&o),
                text,
                stderr(&o).replace("diskit:", "qemu-img:"),
                made,
                changed,
            ));
        }
        let (q, ours) = (&outs[0], &outs[1]);
        assert_eq!(q.0, ours.0, "{:?}: exit status ({})", long, ours.2);
        // bench prints timings, which differ run to run.
        if long[0] != "bench" {
            assert_eq!(q.1, ours.1, "{:?}", long);
        }
        assert_eq!(q.2, ours.2, "{:?}", long);
        // Images diskit writes byte for byte as qemu-img (compressed
        // streams aside) are compared whole; the rest by content.
        match (&q.3, &ours.3) {
            (Some(_), Some(_)) => {
                let (a, b) = (format!("new-{i}-qemu-img"), format!("new-{i}-diskit"));
                alike_in(d, &["compare", &a, &b]);
            }
            (a, b) => assert_eq!(a.is_some(), b.is_some(), "{:?}", long),
        }
        if ["amend", "bitmap", "rebase", "commit"].contains(&long[0]) {
            // The qcow2 both changed reads and describes itself alike.
            let info = |tool: &str| {
                let name = format!("copy-{i}-{tool}.qcow2");
                let o = ok(qemu_img(&["info", "-U", s(&d.join(&name))]));
                stdout(&o)
                    .replace(&name, "COPYQ")
                    .lines()
                    .filter(|l| !l.contains("disk size") && !l.contains("file length"))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            assert_eq!(info("qemu-img"), info("diskit"), "{:?}", long);
            assert!(
                q.4.0 == ours.4.0,
                "{:?}: the raw file changed otherwise",
                long
            );
        } else {
            assert!(q.4 == ours.4, "{:?}: the inputs changed otherwise", long);
        }
    }
}

/// `-o help` and `-o ?` list the options of the format named by `-f`/`-O`,
/// as qemu-img lists them, for every format diskit writes.
#[test]
fn option_help_lists_the_named_formats_options() {
    let dir = workdir();
    let d = dir.path();
    sparse_file(&d.join("a.raw"), 1 << 20, &[]);
    for f in [
        "raw",
        "qcow2",
        "luks",
        "vdi",
        "vpc",
        "qed",
        "vmdk",
        "vhdx",
        "host_device",
    ] {
        for h in ["help", "?"] {
            // A file, and a device (QEMU's host_device protocol, with
            // fewer options of its own).
            for target in ["out.img", "/dev/null"] {
                alike_in(d, &["convert", "-O", f, "-o", h, "a.raw", target]);
                alike_in(d, &["create", "-f", f, "-o", h, target, "1M"]);
            }
            alike_in(d, &["create", "-f", f, "-o", h]);
        }
    }
}

/// CDI: nbdkit's retry filter with `retry-exponential=no` waits the same
/// delay between tries; with yes (the default) the delay doubles. Timed
/// against nbdkit on a request that always fails.
#[test]
fn retry_exponential_no_waits_evenly_as_nbdkit() {
    let script = "import sys, nbd, time\n\
                  h = nbd.NBD(); h.connect_uri(sys.argv[1])\n\
                  t = time.monotonic()\n\
                  try:\n    h.pread(512, 0); print('read')\n\
                  except nbd.Error as e:\n    print(e.errno, round(time.monotonic() - t))\n";
    let run = |server: &str, exponential: &str| {
        let (program, first): (PathBuf, &[&str]) = if server == "nbdkit" {
            ("nbdkit".into(), &[])
        } else {
            (diskit_bin(), &["serve"])
        };
        let o = timed(program, 60)
            .args(first)
            .args([
                "-U",
                "-",
                "--filter=retry",
                "--filter=error",
                "memory",
                "1M",
                "retries=2",
                "retry-delay=1",
                &format!("retry-exponential={exponential}"),
                "error-rate=100%",
                "error=EIO",
                "--run",
                &format!("{PYTHON} -c \"$SCRIPT\" \"$uri\""),
            ])
            .env("SCRIPT", script)
            .output()
            .unwrap();
        stdout(&o)
    };
    std::thread::scope(|sc| {
        let runs: Vec<_> = [
            ("nbdkit", "no"),
            ("diskit", "no"),
            ("nbdkit", "yes"),
            ("diskit", "yes"),
        ]
        .into_iter()
        .map(|(server, e)| (server, e, sc.spawn(move || run(server, e))))
        .collect();
        for (server, e, h) in runs {
            let got = h.join().unwrap();
            // Two retries: 1 s + 1 s evenly, 1 s + 2 s doubling.
            let want = if e == "no" { "EIO 2\n" } else { "EIO 3\n" };
            assert_eq!(got, want, "{server} retry-exponential={e}");
        }
    });
}
