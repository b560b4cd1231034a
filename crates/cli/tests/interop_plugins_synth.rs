//! nbdkit's synthetic-disk plugins under `diskit serve` and under nbdkit
//! 1.32 on the same command lines: the bytes (nbdcopy), the allocation
//! map (nbdinfo --map), the flags and size (nbdinfo --json), the answers
//! to the same requests (tests/nbd/synth_ops.py through libnbd), and the
//! refusal of bad parameters (one line, non-zero exit). Every server runs
//! under `timeout` on a private socket (`-U -`) and stops with its `--run`
//! command.
//!
//! diskit's server takes FLUSH on every writable export, so `can_flush`
//! is compared only where nbdkit's plugin flushes too; nbdkit 1.32 has no
//! ones plugin, which is compared with the data plugin's same bytes.

mod common;

use std::path::Path;

use common::*;
use serde_json::Value;

#[test]
fn zero_is_an_empty_read_only_disk() {
    let dir = workdir();
    let dk = same_flags(dir.path(), &["zero"], &[]);
    assert_eq!(dk["export-size"], 0);
    assert_eq!(dk["is_read_only"], true);
    both_refuse(
        dir.path(),
        &["zero", "size=1M"],
        "this plugin does not need command line configuration",
    );
}

#[test]
fn full_reads_zeros_and_takes_nothing() {
    let dir = workdir();
    let args = ["full", "4M"];
    same_flags(dir.path(), &args, &["can_flush"]);
    same_bytes_and_map(dir.path(), &args);
    let answers = same_answers(dir.path(), &args, 4096, 8192);
    assert_contains(&answers, "write-same ENOSPC");
    assert_contains(&answers, "zero-fast ENOTSUP");
    both_refuse(dir.path(), &["full"], "size");
}

#[test]
fn ones_reads_its_byte_as_nbdkit_s_data_plugin_would() {
    let dir = workdir();
    for (ones, data) in [
        (&["ones", "3M"][..], "0xff*3145728"),
        (&["ones", "size=1000000", "byte=0x5a"], "0x5a*1000000"),
    ] {
        let nb = run(
            Server::Nbdkit,
            dir.path(),
            &["data", data],
            "nbdcopy \"$uri\" out.nbdkit",
        );
        ok(nb);
        let dk = run(
            Server::Diskit,
            dir.path(),
            ones,
            "nbdcopy \"$uri\" out.diskit && nbdinfo --map \"$uri\"",
        );
        let map = stdout(&ok(dk));
        assert!(
            same_bytes(
                &dir.path().join("out.nbdkit"),
                &dir.path().join("out.diskit")
            ),
            "{ones:?}"
        );
        assert_eq!(map.lines().count(), 1, "{map}");
        assert_contains(&map, "data");
    }
    let script = nbd_script("synth_ops.py");
    let o = run(
        Server::Diskit,
        dir.path(),
        &["ones", "1M"],
        &format!("{PYTHON} {} \"$uri\" 0 4096", s(&script)),
    );
    let answers = stdout(&ok(o));
    assert_contains(&answers, "write-changed ok");
    assert_contains(&answers, "after True");
    let o = run(
        Server::Diskit,
        dir.path(),
        &["ones", "1M", "byte=256"],
        "true",
    );
    assert_fails_with(&o, 1, "byte: could not parse number: \"256\"");
}

#[test]
fn random_gives_nbdkit_s_bytes_for_a_seed() {
    let dir = workdir();
    for args in [
        &["random", "1M", "seed=1"][..],
        &["random", "size=3000000", "seed=0x12345678"],
        &["random", "65537", "seed=4294967295"],
    ] {
        same_flags(dir.path(), args, &["can_flush"]);
        same_bytes_and_map(dir.path(), args);
    }
    let answers = same_answers(dir.path(), &["random", "1M", "seed=9"], 1000, 5000);
    assert_contains(&answers, "write-same ok");
    assert_contains(&answers, "write-changed EIO");
    both_refuse(
        dir.path(),
        &["random", "1M", "seed=-1"],
        "seed: negative numbers are not allowed",
    );
    both_refuse(
        dir.path(),
        &["random", "1M", "seed=x"],
        "seed: empty string where we expected a number",
    );
}

#[test]
fn sparse_random_gives_nbdkit_s_layout_and_bytes() {
    let dir = workdir();
    for args in [
        &[
            "sparse-random",
            "64M",
            "seed=1",
            "percent=30",
            "runlength=1048576",
        ][..],
        &[
            "sparse-random",
            "size=32M",
            "seed=7",
            "percent=50",
            "runlength=100000",
            "random-content=true",
        ],
        &["sparse-random", "16M", "seed=3", "percent=100"],
        &["sparse-random", "16M", "seed=3", "percent=0"],
        &[
            "sparse-random",
            "10000000",
            "seed=42",
            "percent=12.5",
            "runlength=0x10000",
        ],
    ] {
        same_flags(dir.path(), args, &[]);
        same_bytes_and_map(dir.path(), args);
    }
    // Whole blocks: nbdkit draws a partial block's bytes from the read's
    // offset.
    let args = [
        "sparse-random",
        "16M",
        "seed=5",
        "percent=50",
        "runlength=65536",
    ];
    let answers = same_answers(dir.path(), &args, 0, 1 << 20);
    assert_contains(&answers, "write-same ok");
    assert_contains(&answers, "write-changed EIO");
    assert_contains(&answers, "trim EIO");
    both_refuse(
        dir.path(),
        &["sparse-random", "1M", "percent=101"],
        "cannot parse percent parameter: 101",
    );
    both_refuse(
        dir.path(),
        &["sparse-random", "1M", "runlength=0"],
        "runlength parameter must be > 0",
    );
    both_refuse(
        dir.path(),
        &["sparse-random", "1M", "runlength=1M"],
        "runlength: could not parse number: \"1M\": trailing garbage",
    );
}

/// Expressions from nbdkit's own tests (test-data-format.sh and the
/// plugin's manual): each read and mapped alike under both servers.
const DATA_CASES: &[&str] = &[
    "",
    "0",
    "0 0",
    "1 2 3 @0x1fe 0x55 0xaa",
    "0 1 2 3 @^0x200 @-2 le16:0xaa55",
    "le64:0xffffffffffffffff be16:1 be32:0x12345678 le32:017",
    r#" "hello" ( "\"" "\\" )*2 "\x01\x02\x03" "\n" "#,
    r#"@4 "\x00""#,
    r#"@+4 @-1 "\x00""#,
    "( @4 ( 0x21 )*4 )*4",
    r#"( "Hello" @^8 )*2"#,
    "( @7 )*4 1",
    "1 (@2 2) (@3 3)",
    "# comment\n 1 2 3",
    "() ()*2 ( () ) ( ()*2 ) ( () () )*2 ()*0 ( 1 2 3 )*0 ()*1*2*3",
    "1*2*3*4",
    r#""foo"*2*50"#,
    "1*100000",
    r#""1"*100000"#,
    "1*1000 @100 0*100",
    "1*1000 @100 0*1000",
    r#"1 2 "3"*3 4"#,
    "(0x31 0x32) -> \\a (0x35 0x36) -> \\b ( (0x33 0x34) -> \\a (0x37 0x38) -> \\c \\a \\a \\b \\c ) \\a \\b",
    "1 -> \\1 ( \\1 ) -> \\test \\test ( 2 -> \\1 ) \\test ( 3 -> \\1 \\test ) 4 -> \\1 \\test",
    r#""Hello"[:]"#,
    r#"( "Hello" )[3:5]"#,
    r#""Hello"[99:99]"#,
    "<file.bin",
    "<file.bin[100:5000] @^4096 <file.bin[:10]",
    "<( for i in `seq 0 7`; do printf \"%04d\" $i; done )",
    "<( i=0; while :; do printf \"%04d\" $i; i=$((i+1)); done )[:65]",
    "@32766 1*5 @65534 2*5 @32768 0*32768",
    "@0x100000 \"x\" @0x10000 0*4 @0x30000 0 0 0 1",
    "( 0 0 0 0 )*50000 @+65536 1",
];

#[test]
fn data_reads_and_maps_as_nbdkit_s() {
    let dir = workdir();
    let bytes: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.path().join("file.bin"), bytes).unwrap();
    for expr in DATA_CASES {
        same_bytes_and_map(dir.path(), &["data", expr]);
        same_bytes_and_map(dir.path(), &["data", expr, "size=2M"]);
    }
    same_flags(dir.path(), &["data", "1 2 3", "size=1M"], &[]);
    let answers = same_answers(dir.path(), &["data", "1*70000", "size=1M"], 65536, 8192);
    assert_contains(&answers, "zero ok");
    // Writes and zeroes change the map as nbdkit's pages change.
    let ops = "nbdsh -u \"$uri\" -c 'h.pwrite(b\"\\0\" * 100, 40000); h.zero(32768, 0); \
               h.trim(1000, 70000)' && nbdinfo --map \"$uri\"";
    let [nb, dk] = both_ok(dir.path(), &["data", "1*100000", "size=1M"], ops);
    assert_eq!(nb, dk);
}

#[test]
fn data_takes_raw_base64_and_variables() {
    let dir = workdir();
    same_bytes_and_map(dir.path(), &["data", "raw=hello\u{1}x", "size=100000"]);
    same_bytes_and_map(dir.path(), &["data", "base64=aGVsbG8gbmJka2l0IHVzZXI="]);
    same_bytes_and_map(
        dir.path(),
        &[
            "data",
            " $a $b $c ",
            "a= 1 2 ",
            "b= 3 4 ",
            "c= $d*5 ",
            "d= 5 ",
        ],
    );
    // From the environment when no parameter has the name.
    let cmd = "nbdcopy \"$uri\" out.$S";
    for server in SERVERS {
        let mut c = server.command(60);
        let o = c
            .current_dir(dir.path())
            .env("pattern", "0x55 0xAA")
            .args(["-U", "-", "data", "$pattern*16", "--run"])
            .arg(cmd.replace("$S", server.name()))
            .output()
            .unwrap();
        ok(o);
    }
    assert!(same_bytes(
        &dir.path().join("out.nbdkit"),
        &dir.path().join("out.diskit")
    ));
    for (args, msg) in [
        (
            &["data", "256"][..],
            "data parameter BYTE must be in the range 0..255",
        ),
        (&["data", "( 1"], "unmatched '(' in data string"),
        (&["data", "1 )"], "unmatched ')' in data string"),
        (
            &["data", "@0*2"],
            "*N cannot be applied to this type of expression",
        ),
        (&["data", "$nope"], "$nope: variable not found"),
        (
            &["data", "1 x"],
            "data parameter: parsing error at offset 2",
        ),
        (&["data", "\"abc"], "data parameter: unterminated string"),
        (&["data", "le16:0x10000"], "Numerical result out of range"),
        (&["data", "@^3"], "data parameter @^3 must be a power of 2"),
        (
            &["data", "@-4"],
            "must not be larger than the current offset 0",
        ),
        (
            &["data", "\"Hello\"[2:9]"],
            "[N:M] does not describe a valid slice",
        ),
        (
            &["data", "<no-such-file"],
            "no-such-file: No such file or directory",
        ),
        (
            &["data", "raw=a", "base64=YQ=="],
            "raw|base64|data parameter must be specified exactly once",
        ),
        (
            &["data", "size=1M"],
            "raw|base64|data parameter was not specified",
        ),
        (
            &["data", "raw=a", "x=1"],
            "extra parameters passed and not using data='...'",
        ),
    ] {
        both_refuse(dir.path(), args, msg);
    }
}

/// A file of `size` bytes with `runs` of data (offset, length, byte).
fn file_with(dir: &Path, name: &str, size: u64, runs: &[(u64, usize, u8)]) -> String {
    sparse_file(&dir.join(name), size, runs);
    name.to_string()
}

#[test]
fn split_joins_files_and_their_holes() {
    let dir = workdir();
    let a = file_with(dir.path(), "a.img", 3 << 20, &[(1 << 20, 4096, 0x41)]);
    let b = file_with(dir.path(), "b.img", 5000, &[(0, 5000, 0x42)]);
    let c = file_with(dir.path(), "c.img", 2 << 20, &[(100_000, 10, 0x43)]);
    let file_c = format!("file={c}");
    let args = ["split", &a, &b, &file_c];
    same_flags(dir.path(), &args, &["can_flush"]);
    same_bytes_and_map(dir.path(), &args);
    let ro = ["-r", "split", &a, &b];
    same_flags(dir.path(), &ro, &[]);
    both_refuse(
        dir.path(),
        &["split", "no-such.img"],
        "realpath: no-such.img: No such file or directory",
    );
    // Writes land in the file holding the bytes (nbdkit 1.32 writes at the
    // whole disk's offset).
    let o = run(
        Server::Diskit,
        dir.path(),
        &args,
        "nbdsh -u \"$uri\" -c 'h.pwrite(b\"Z\" * 10, (3 << 20) + 100)'",
    );
    ok(o);
    assert_eq!(
        read_bytes(&dir.path().join("b.img"), 100, 10),
        b"ZZZZZZZZZZ"
    );
}

/// `out.nbdkit` and `out.diskit` with GPT's unique partition GUIDs and
/// the CRCs over them blanked (they are drawn from the time in seconds,
/// which two runs need not share).
fn same_disks(dir: &Path) {
    let blank = |name: &str| {
        let mut d = std::fs::read(dir.join(name)).unwrap();
        if d.len() > 1024 && &d[512..520] == b"EFI PART" {
            let backup_entries = d.len() - 512 - 128 * 128;
            for header in [512, d.len() - 512] {
                d[header + 16..header + 20].fill(0);
                d[header + 88..header + 92].fill(0);
            }
            for base in [1024, backup_entries] {
                for i in 0..128 {
                    d[base + i * 128 + 16..base + i * 128 + 32].fill(0);
                }
            }
        }
        d
    };
    assert!(blank("out.nbdkit") == blank("out.diskit"), "disks differ");
}

#[test]
fn partitioning_lays_out_nbdkit_s_tables() {
    let dir = workdir();
    let a = file_with(dir.path(), "a.img", 3 << 20, &[(1 << 20, 4, 0x41)]);
    let b = file_with(dir.path(), "b.img", 5000, &[(0, 5000, 0x42)]);
    let c = file_with(dir.path(), "c.img", 1 << 20, &[]);
    for args in [
        vec!["partitioning", &a, &b],
        vec!["partitioning", &a, &b, &c, &a, &b, &c, &b],
        vec!["partitioning", "partition-type=gpt", &a, &b],
        vec![
            "partitioning",
            "alignment=4096",
            "mbr-id=7",
            &a,
            "alignment=512",
            &b,
            "mbr-id=default",
            &c,
        ],
        vec![
            "partitioning",
            "partition-type=gpt",
            "type-guid=21686148-6449-6E6F-744E-656564454649",
            &a,
            "type-guid=default",
            &b,
            "alignment=64K",
            &c,
        ],
        vec!["partitioning", &a, &b, &c, &a, &b],
    ] {
        same_flags(dir.path(), &args, &[]);
        let cmd = "nbdcopy \"$uri\" \"out.$S\"";
        for server in SERVERS {
            ok(run(
                server,
                dir.path(),
                &args,
                &cmd.replace("$S", server.name()),
            ));
        }
        same_disks(dir.path());
    }
    // The table cannot change; the partitions are the files.
    let args = ["partitioning", &a, &b];
    let answers = same_answers(dir.path(), &args, 0, 512);
    assert_contains(&answers, "write-changed EIO");
    let answers = same_answers(dir.path(), &args, 1 << 20, 4096);
    assert_contains(&answers, "write-changed ok");
    for (args, msg) in [
        (
            &["partitioning", "no-such.img"][..],
            "no-such.img: No such file or directory",
        ),
        (
            &["partitioning", "alignment=100", "a.img"],
            "partition alignment 100 should be >= sector size 512",
        ),
        (
            &["partitioning", "partition-type=xyz", "a.img"],
            "unknown partition-type: xyz",
        ),
        (
            &["partitioning", "type-guid=zz", "a.img"],
            "could not validate GUID: zz",
        ),
        (
            &["partitioning", "mbr-id=300", "a.img"],
            "mbr-id: could not parse number: \"300\"",
        ),
    ] {
        both_refuse(dir.path(), args, msg);
    }
    std::fs::write(dir.path().join("empty.img"), b"").unwrap();
    both_refuse(
        dir.path(),
        &["partitioning", "empty.img"],
        "empty.img: zero length partitions are not allowed",
    );
}

#[test]
fn tmpdisk_makes_a_new_disk_for_each_client() {
    let dir = workdir();
    let tmp = dir.path().to_str().unwrap();
    // nbdkit's default command: an ext4 filesystem with the label.
    let args = ["tmpdisk", "16M", "label=synth"];
    let superblock = format!(
        "{PYTHON} -c 'import nbd,sys; h=nbd.NBD(); h.connect_uri(sys.argv[1]); \
         b=h.pread(1024, 1024); print(b[56:58].hex(), bytes(b[120:125]))' \"$uri\""
    );
    let mut infos = Vec::new();
    for server in SERVERS {
        let mut c = server.command(60);
        let o = c
            .env("TMPDIR", tmp)
            .args(["-U", "-"])
            .args(args)
            .args(["--run", &format!("{superblock} && nbdinfo --json \"$uri\"")])
            .output()
            .unwrap();
        let out = stdout(&ok(o));
        assert!(out.starts_with("53ef b'synth'"), "{}: {out}", server.name());
        let json: Value = serde_json::from_str(out.split_once('\n').unwrap().1).unwrap();
        infos.push(json["exports"][0].clone());
    }
    for k in NBDINFO_FLAGS {
        assert_eq!(infos[0][k], infos[1][k], "{k}");
    }
    // command= and the parameters as shell variables: the same bytes; each
    // client its own disk.
    let cmd = "command=truncate -s $size \"$disk\"; printf %s \"$greeting\" | \
               dd of=\"$disk\" conv=notrunc 2>/dev/null";
    let args = ["tmpdisk", "1M", cmd, "greeting=hi \"there\" $x"];
    let run_cmd = "nbdsh -u \"$uri\" -c 'h.pwrite(b\"x\" * 512, 0)' && nbdcopy \"$uri\" out.$S";
    for server in SERVERS {
        ok(run(
            server,
            dir.path(),
            &args,
            &run_cmd.replace("$S", server.name()),
        ));
    }
    assert!(same_bytes(
        &dir.path().join("out.nbdkit"),
        &dir.path().join("out.diskit")
    ));
    assert_eq!(
        read_bytes(&dir.path().join("out.diskit"), 0, 14),
        b"hi \"there\" $x\0"
    );
    both_refuse(
        dir.path(),
        &["tmpdisk", "1M", "disk=x"],
        "'disk' parameter cannot be set on the command line",
    );
    // diskit makes the first disk at start-up: a failing command is
    // reported then (nbdkit tells the first client).
    let o = run(
        Server::Diskit,
        dir.path(),
        &["tmpdisk", "1M", "command=exit 3"],
        "true",
    );
    assert_fails_with(&o, 1, "command exited with code 3");
}
