//! S3 objects wherever an image goes, against Ceph's radosgw on a
//! one-node cluster (tests/ceph: the test run's, or the test's own), in
//! a bucket of the test's own, with the AWS CLI and boto3 as peers: what diskit writes into a bucket they read back byte for byte
//! (and `qemu-img check` passes on a qcow2 kept there), what they wrote
//! diskit reads back, and a failed copy leaves neither an object nor a
//! multipart upload behind. `diskit serve s3` and nbdkit's S3 plugin
//! serve the same buckets: what one writes the other reads.

mod ceph;
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ceph::Ceph;
use common::*;

/// radosgw, the environment that reaches it (no profile files: the
/// user's own ~/.aws is no part of a test) and the test's own bucket.
struct Store {
    /// Held for the test's pool (or cluster), dropped after the bucket.
    _ceph: Ceph,
    env: Vec<(String, String)>,
    bucket: String,
}

impl Store {
    fn start(dir: &Path) -> Store {
        let ceph = Ceph::start_with_s3();
        let mut env = ceph.s3_env();
        for var in ["AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"] {
            env.push((var.into(), s(&dir.join("no-such-aws-file")).into()));
        }
        let bucket = ceph.unique("diskit-tests");
        let store = Store {
            _ceph: ceph,
            env,
            bucket,
        };
        store.python(&format!(
            "boto3.client('s3', endpoint_url=E).create_bucket(Bucket='{}')",
            store.bucket
        ));
        store
    }

    fn var(&self, name: &str) -> &str {
        &self.env.iter().find(|(k, _)| k == name).unwrap().1
    }

    fn with_env(&self, mut c: Command) -> Command {
        c.env_remove("AWS_PROFILE")
            .env_remove("AWS_SESSION_TOKEN")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    /// Runs diskit with the store's environment.
    fn diskit(&self, args: &[&str]) -> Output {
        let mut c = self.with_env(Command::new(diskit_bin()));
        c.args(args).output().expect("run diskit")
    }

    /// Runs the AWS CLI against the store.
    fn aws(&self, args: &[&str]) -> Output {
        let aws = if Path::new("/usr/bin/aws").exists() {
            "/usr/bin/aws"
        } else {
            "aws"
        };
        let mut c = self.with_env(Command::new(aws));
        c.args(["--endpoint-url", self.var("AWS_ENDPOINT_URL")])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run aws ({e}): scripts/test installs awscli"))
    }

    /// Runs s3cmd against the store (path-style, plain HTTP, no config
    /// file).
    fn s3cmd(&self, args: &[&str]) -> Output {
        let endpoint = self.var("AWS_ENDPOINT_URL");
        let host = endpoint.trim_start_matches("http://");
        let mut c = self.with_env(Command::new("s3cmd"));
        c.args(["--config=/dev/null", "--no-ssl"])
            .arg(format!("--host={host}"))
            .arg(format!("--host-bucket={host}"))
            .arg(format!("--access_key={}", self.var("AWS_ACCESS_KEY_ID")))
            .arg(format!(
                "--secret_key={}",
                self.var("AWS_SECRET_ACCESS_KEY")
            ))
            .arg(format!("--region={}", self.var("AWS_REGION")))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run s3cmd ({e}): scripts/test installs it"))
    }

    /// Runs rclone against the store, as the remote `store:` (configured
    /// by the environment).
    fn rclone(&self, args: &[&str]) -> Output {
        let mut c = self.with_env(Command::new("rclone"));
        c.env("RCLONE_CONFIG", "/dev/null")
            .env("RCLONE_CONFIG_STORE_TYPE", "s3")
            .env("RCLONE_CONFIG_STORE_PROVIDER", "Ceph")
            .env_remove("AWS_CA_BUNDLE")
            .env(
                "RCLONE_CONFIG_STORE_ACCESS_KEY_ID",
                self.var("AWS_ACCESS_KEY_ID"),
            )
            .env(
                "RCLONE_CONFIG_STORE_SECRET_ACCESS_KEY",
                self.var("AWS_SECRET_ACCESS_KEY"),
            )
            .env("RCLONE_CONFIG_STORE_ENDPOINT", self.var("AWS_ENDPOINT_URL"))
            .env("RCLONE_CONFIG_STORE_REGION", self.var("AWS_REGION"))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run rclone ({e}): scripts/test installs it"))
    }

    /// Runs Python `code` with boto3 imported and the endpoint as `E`.
    fn python(&self, code: &str) -> Output {
        let mut c = self.with_env(Command::new("/usr/bin/python3"));
        let program = format!("import boto3, os\nE = os.environ['AWS_ENDPOINT_URL']\n{code}\n");
        ok(c.args(["-c", &program])
            .output()
            .expect("scripts/test installs python3-boto3"))
    }

    /// The keys in the bucket.
    fn keys(&self) -> Vec<String> {
        let o = ok(self.aws(&["s3", "ls", &format!("s3://{}/", self.bucket)]));
        stdout(&o)
            .lines()
            .filter_map(|l| l.split_whitespace().nth(3).map(str::to_string))
            .collect()
    }

    /// Asserts that no multipart upload is left in the bucket.
    fn no_uploads_left(&self) {
        let o = ok(self.aws(&[
            "s3api",
            "list-multipart-uploads",
            "--bucket",
            &self.bucket,
            "--output",
            "json",
        ]));
        let text = stdout(&o);
        assert!(!text.contains("UploadId"), "uploads left behind: {text}");
    }

    /// Runs `cmd` against an S3 plugin with `args` (the store's endpoint
    /// and bucket given) served by `server` on a private socket.
    fn serve(&self, server: Server, args: &[&str], cmd: &str) -> Output {
        let mut c = match server {
            Server::Diskit => {
                let mut c = timed(diskit_bin(), 120);
                c.args(["serve", "-U", "-", "s3"]);
                c
            }
            Server::Nbdkit => {
                let mut c = timed("nbdkit", 120);
                c.args(["-U", "-", "S3"]);
                c
            }
        };
        c.arg(format!("endpoint-url={}", self.var("AWS_ENDPOINT_URL")))
            .arg(format!("bucket={}", self.bucket))
            .args(args)
            .args(["--run", cmd]);
        self.with_env(c)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {server:?} ({e}): scripts/test installs it"))
    }

    /// The keys under `prefix/` and their sizes, the prefix cut.
    fn objects(&self, prefix: &str) -> Vec<(String, u64)> {
        let o = ok(self.aws(&["s3", "ls", &format!("s3://{}/{prefix}/", self.bucket)]));
        stdout(&o)
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                Some((w.get(3)?.to_string(), w.get(2)?.parse().ok()?))
            })
            .collect()
    }

    /// The URL of `key` in the test's bucket.
    fn url(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }

    /// Downloads `key` with the AWS CLI.
    fn download(&self, key: &str, to: &Path) {
        ok(self.aws(&["s3", "cp", &self.url(key), s(to)]));
    }
}

impl Drop for Store {
    /// Removes the test's bucket and what it holds (the cluster may be
    /// the whole test run's).
    fn drop(&mut self) {
        let _ = self.aws(&["s3", "rb", "--force", &format!("s3://{}", self.bucket)]);
    }
}

/// A server of S3 objects over NBD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    /// `diskit serve s3`.
    Diskit,
    /// nbdkit's S3 plugin (Python, boto3).
    Nbdkit,
}

impl Server {
    fn other(self) -> Server {
        match self {
            Server::Diskit => Server::Nbdkit,
            Server::Nbdkit => Server::Diskit,
        }
    }
}

/// `len` bytes that differ everywhere and do not compress (a xorshift
/// stream from `seed`).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x: u64 = seed | 1;
    let mut data = Vec::with_capacity(len + 8);
    while data.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    data.truncate(len);
    data
}

/// `len` bytes that differ everywhere (a xorshift stream), with a hole of
/// zeros in the middle.
fn random_file(path: &Path, len: usize) -> PathBuf {
    let mut data = random_bytes(len, 0x9e37_79b9_7f4a_7c15);
    let hole = (len / 4).min(3 << 20);
    data[len / 3..len / 3 + hole].fill(0);
    std::fs::write(path, &data).unwrap();
    path.to_path_buf()
}

#[test]
fn objects_written_by_s3cmd_and_rclone_are_read_by_diskit_and_back() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    let url = |key: &str| store.url(key);
    // More than one part for each tool (s3cmd's 15 MiB, rclone's 5 MiB).
    let src = random_file(&d.join("src.raw"), 17 << 20);
    // diskit writes; each reads the same bytes back.
    ok(store.diskit(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        s(&src),
        &url("by-diskit"),
    ]));
    let by_s3cmd = d.join("s3cmd.raw");
    ok(store.s3cmd(&["get", &url("by-diskit"), s(&by_s3cmd)]));
    assert!(same_bytes(&src, &by_s3cmd), "s3cmd read other bytes");
    let by_rclone = d.join("rclone.raw");
    let remote = format!("store:{}/by-diskit", store.bucket);
    ok(store.rclone(&["copyto", &remote, s(&by_rclone)]));
    assert!(same_bytes(&src, &by_rclone), "rclone read other bytes");
    // Each writes (multipart); diskit reads the same bytes, as an image.
    ok(store.s3cmd(&["put", s(&src), &url("by-s3cmd")]));
    let remote = format!("store:{}/by-rclone", store.bucket);
    ok(store.rclone(&[
        "copyto",
        "--s3-chunk-size=5M",
        "--s3-upload-cutoff=5M",
        s(&src),
        &remote,
    ]));
    for key in ["by-s3cmd", "by-rclone"] {
        let o = ok(store.diskit(&["compare", "-f", "raw", "-F", "raw", &url(key), s(&src)]));
        assert!(
            stdout(&o).contains("Images are identical"),
            "{key}: {}",
            stdout(&o)
        );
    }
}

#[test]
fn objects_written_and_read_by_diskit_aws_and_boto3_are_the_same_bytes() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    let url = |key: &str| store.url(key);
    // 20 MiB: three parts of 8 MiB, uploaded while the copy runs.
    let src = random_file(&d.join("src.raw"), 20 << 20);

    // diskit writes raw; the AWS CLI reads the same bytes.
    ok(store.diskit(&["convert", "-f", "raw", "-O", "raw", s(&src), &url("raw")]));
    let back = d.join("back.raw");
    store.download("raw", &back);
    assert!(same_bytes(&src, &back), "aws s3 cp read other bytes");
    // Many parts (more than the upload keeps open) from a convert with
    // many workers: the object is written front to back all the same.
    let big = random_file(&d.join("big.raw"), 72 << 20);
    ok(store.diskit(&[
        "convert",
        "-m",
        "8",
        "-W",
        "-f",
        "raw",
        "-O",
        "raw",
        s(&big),
        &url("big"),
    ]));
    let big_back = d.join("big-back.raw");
    store.download("big", &big_back);
    assert!(same_bytes(&big, &big_back), "aws s3 cp read other bytes");

    // diskit writes qcow2: qemu-img checks and compares the download.
    ok(store.diskit(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        s(&src),
        &url("img.qcow2"),
    ]));
    let q = d.join("back.qcow2");
    store.download("img.qcow2", &q);
    ok(qemu_img(&["check", s(&q)]));
    let compare = ["compare", "-f", "qcow2", "-F", "raw"];
    ok(qemu_img(&[&compare[..], &[s(&q), s(&src)]].concat()));
    // And diskit reads it back from the bucket through the format.
    let info = stdout(&ok(store.diskit(&[
        "info",
        "--output=json",
        &url("img.qcow2"),
    ])));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["format"], "qcow2", "{info}");
    assert_eq!(v["virtual-size"], 20 << 20, "{info}");
    ok(store.diskit(&["compare", &url("img.qcow2"), s(&src)]));
    let map = stdout(&ok(store.diskit(&[
        "map",
        "--output=json",
        &url("img.qcow2"),
    ])));
    assert!(map.contains("\"data\": true"), "{map}");
    let out = d.join("out.raw");
    ok(store.diskit(&[
        "convert",
        "-f",
        "qcow2",
        "-O",
        "raw",
        &url("img.qcow2"),
        s(&out),
    ]));
    assert!(same_bytes(&src, &out), "qcow2 read from S3 differs");

    // boto3's transfer manager writes (a multipart upload of its own);
    // diskit reads the same bytes.
    store.python(&format!(
        "boto3.client('s3', endpoint_url=E).upload_file('{}', '{}', 'boto')",
        s(&src),
        store.bucket
    ));
    ok(store.diskit(&["compare", "-f", "raw", "-F", "raw", &url("boto"), s(&src)]));
    let out2 = d.join("out2.raw");
    ok(store.diskit(&["convert", "-f", "raw", "-O", "raw", &url("boto"), s(&out2)]));
    assert!(
        same_bytes(&src, &out2),
        "diskit read other bytes of boto3's object"
    );

    // diskit copy into a new object and out of it; boto3 reads it.
    ok(store.diskit(&["copy", s(&src), &url("copied")]));
    let got = d.join("boto.raw");
    store.python(&format!(
        "boto3.client('s3', endpoint_url=E).download_file('{}', 'copied', '{}')",
        store.bucket,
        s(&got)
    ));
    assert!(
        same_bytes(&src, &got),
        "boto3 read other bytes of diskit copy's object"
    );
    let out3 = d.join("out3.raw");
    ok(store.diskit(&["copy", &url("copied"), s(&out3)]));
    assert!(same_bytes(&src, &out3), "diskit copy from S3 differs");

    // `create` alone leaves an object qemu-img reads.
    ok(store.diskit(&["create", "-f", "qcow2", &url("new.qcow2"), "64M"]));
    let new = d.join("new.qcow2");
    store.download("new.qcow2", &new);
    ok(qemu_img(&["check", s(&new)]));

    let mut keys = store.keys();
    keys.sort();
    assert_eq!(
        keys,
        ["big", "boto", "copied", "img.qcow2", "new.qcow2", "raw"]
    );
    store.no_uploads_left();
    drop(store);
}

/// A sparse image of 1 GiB: 64 KiB of data every 32 MiB (a pattern that
/// compresses), 12 MiB of random bytes at 64 MiB and 40 MiB of them at
/// 520 MiB: a qcow2's (or QED's) second L2 table lands past the first
/// part of the object, and the data written after it goes well past the
/// parts an upload keeps open (until tables were placed after the data,
/// the table's update at the end failed, "S3 objects are written front
/// to back").
fn large_sparse_source(path: &Path) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let runs: Vec<(u64, usize, u8)> = (0..32).map(|i| (i << 25, 64 << 10, 0xff)).collect();
    sparse_file(path, 1 << 30, &runs);
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    for (at, len, seed) in [(64u64 << 20, 12 << 20, 1), (520 << 20, 40 << 20, 2)] {
        f.write_all_at(&random_bytes(len, seed), at).unwrap();
    }
    path.to_path_buf()
}

#[test]
fn large_images_are_written_into_s3_front_to_back() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    let url = |key: &str| store.url(key);
    let src = large_sparse_source(&d.join("src.raw"));
    let src = s(&src);
    // Each target written once, front to back (its tables after the data
    // where the format changes them as it writes), read back by the AWS
    // CLI: qemu-img finds it sound and equal to the source.
    for (key, format, opts) in [
        ("plain.qcow2", "qcow2", &[][..]),
        ("compressed.qcow2", "qcow2", &["-c"][..]),
        (
            "stream.vmdk",
            "vmdk",
            &["-o", "subformat=streamOptimized"][..],
        ),
        // 16 KiB clusters: an L2 table for each 128 MiB.
        ("image.qed", "qed", &["-o", "cluster_size=16384"][..]),
    ] {
        let args = [&["convert", "-f", "raw", "-O", format][..], opts].concat();
        ok(store.diskit(&[&args[..], &[src, &url(key)]].concat()));
        let back = d.join(key);
        store.download(key, &back);
        ok(qemu_img(&["check", "-f", format, s(&back)]));
        ok(qemu_img(&[
            "compare",
            "-f",
            format,
            "-F",
            "raw",
            s(&back),
            src,
        ]));
        std::fs::remove_file(&back).unwrap();
    }

    // `diskit copy` of a sparse raw image into a new object: its workers
    // take ranges of 32 MiB in turn (one runs through the holes far ahead
    // of one copying data), and the object is written front to back all
    // the same (the copy failed before, "S3 objects are written front to
    // back").
    let sparse = d.join("sparse.raw");
    sparse_file(&sparse, 256 << 20, &[(200 << 20, 1 << 20, 7)]);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&sparse)
            .unwrap();
        f.write_all_at(&random_bytes(10 << 20, 3), 0).unwrap();
    }
    ok(store.diskit(&["copy", s(&sparse), &url("copied.raw")]));
    let back = d.join("copied-back.raw");
    store.download("copied.raw", &back);
    assert!(same_bytes(&sparse, &back), "aws s3 cp read other bytes");
    std::fs::remove_file(&back).unwrap();

    // A qcow2 whose L1 table (small clusters, a large disk) reaches past
    // the object's first part cannot be written so: it is refused before
    // any data is, in one line, and nothing is left.
    let huge = d.join("huge.raw");
    sparse_file(&huge, 40 << 30, &[(0, 4096, 1)]);
    let o = store.diskit(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=512",
        s(&huge),
        &url("huge.qcow2"),
    ]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot write this qcow2 image front to back"),
        "{}",
        stderr(&o)
    );
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    let mut keys = store.keys();
    keys.sort();
    assert_eq!(
        keys,
        [
            "compressed.qcow2",
            "copied.raw",
            "image.qed",
            "plain.qcow2",
            "stream.vmdk"
        ]
    );
    store.no_uploads_left();
}

#[test]
fn s3_errors_are_named_and_a_failed_copy_leaves_nothing() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    let url = |key: &str| store.url(key);
    let src = random_file(&d.join("src.raw"), 1 << 20);
    ok(store.aws(&["s3", "cp", s(&src), &url("there")]));

    let with = |var: &str, value: &str, args: &[&str]| {
        let mut c = store.with_env(Command::new(diskit_bin()));
        c.env(var, value).args(args).output().unwrap()
    };
    for (var, value, says) in [
        ("AWS_SECRET_ACCESS_KEY", "wrong", "SignatureDoesNotMatch"),
        ("AWS_ACCESS_KEY_ID", "NOSUCHKEY", "InvalidAccessKeyId"),
    ] {
        let o = with(var, value, &["info", &url("there")]);
        assert_eq!(code(&o), 1, "{}", stderr(&o));
        assert!(stderr(&o).contains(says), "{var}: {}", stderr(&o));
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    }
    for (name, says) in [
        ("s3://no-such-bucket/x".to_string(), "NoSuchBucket"),
        (url("no-such-key"), "NoSuchKey"),
    ] {
        let o = store.diskit(&["info", &name]);
        assert_eq!(code(&o), 1, "{}", stderr(&o));
        assert!(stderr(&o).contains(says), "{}", stderr(&o));
    }
    // Writing with wrong keys fails, and leaves nothing.
    let o = with(
        "AWS_SECRET_ACCESS_KEY",
        "wrong",
        &["convert", "-O", "raw", s(&src), &url("denied")],
    );
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("SignatureDoesNotMatch"),
        "{}",
        stderr(&o)
    );

    // A source whose reads fail part way (nbdkit's error filter): the
    // copy fails, and the upload (with whatever parts went up) is aborted.
    // A quarter of the reads fail: at 10%, a convert's 40 reads of 1 MiB
    // all succeeded once in 70 runs, and the test with it.
    let (uri, _err) = failing_source(d, "40M", "0.25");
    for format in ["raw", "qcow2"] {
        let o = store.diskit(&["convert", "-f", "raw", "-O", format, &uri, &url("failed")]);
        assert_eq!(code(&o), 1, "{}", stderr(&o));
        assert!(stderr(&o).contains("Input/output error"), "{}", stderr(&o));
    }
    let o = store.diskit(&["copy", &uri, &url("failed-copy")]);
    assert_ne!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(store.keys(), ["there"], "only the object that was there");
    store.no_uploads_left();

    // An object that is there is never written in place (S3 replaces it
    // whole): a writable server, a resize, convert -n and a copy onto it
    // are refused, and its bytes stay.
    let other = random_file(&d.join("other.raw"), 1 << 20);
    for args in [
        vec!["serve", "-U", "-", "image", &url("there"), "--run", "true"],
        vec!["resize", "-f", "raw", &url("there"), "2M"],
        vec!["convert", "-n", "-O", "raw", s(&other), &url("there")],
        vec!["copy", s(&other), &url("there")],
    ] {
        let o = store.diskit(&args);
        assert_ne!(code(&o), 0, "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("cannot be changed in place"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let back = d.join("there.raw");
    store.download("there", &back);
    assert!(same_bytes(&src, &back), "the object is as it was");
    store.no_uploads_left();
}

/// The object size of the sharded tests: nbdkit's plugin advertises it as
/// its minimum block size, which nbdkit takes up to 64 KiB only.
const OBJ: u64 = 64 << 10;

/// The plugin arguments of a disk of `size` bytes over objects `key/%016x`.
fn sharded(key: &str, size: u64) -> Vec<String> {
    vec![
        format!("key={key}"),
        format!("size={size}"),
        format!("object-size={OBJ}"),
    ]
}

/// The command that runs `ops` (see tests/nbd/filter_ops.py) and prints
/// what came back and the whole disk's digest.
fn ops(ops: &serde_json::Value) -> String {
    format!(
        "{PYTHON} {} \"$uri\" '{ops}'",
        s(&nbd_script("filter_ops.py"))
    )
}

#[test]
fn serve_s3_and_nbdkits_s3_plugin_lay_out_objects_alike() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    const SIZE: u64 = 4 << 20;
    // 64 objects; the zeros in the middle cover blocks 22 to 36 whole.
    let src = random_file(&d.join("src.raw"), SIZE as usize);
    let every_block_but_zeros: Vec<(String, u64)> = (0..SIZE / OBJ)
        .filter(|b| !(22..37).contains(b))
        .map(|b| (format!("{b:016x}"), OBJ))
        .collect();

    for writer in [Server::Diskit, Server::Nbdkit] {
        let key = format!("{writer:?}");
        let args = sharded(&key, SIZE);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // One writes with nbdcopy (which zeroes the zeros: no objects).
        ok(store.serve(writer, &args, &format!("nbdcopy {} \"$uri\"", s(&src))));
        assert_eq!(
            store.objects(&key),
            every_block_but_zeros,
            "{writer:?}'s objects"
        );
        // The other reads the same bytes.
        let back = d.join(format!("{key}.back"));
        ok(store.serve(
            writer.other(),
            &args,
            &format!("nbdcopy \"$uri\" {}", s(&back)),
        ));
        assert!(
            same_bytes(&src, &back),
            "{:?} read other bytes",
            writer.other()
        );
    }

    // Whole objects written, zeroed (with and without leave to punch
    // holes) and trimmed, each server on its own objects (requests of
    // whole objects: libnbd keeps to nbdkit's minimum block size): the
    // same answers, and the same objects left (zeroes and trims delete
    // the objects they cover).
    let k = OBJ;
    let aligned = serde_json::json!([
        ["write", 0, k, 3],
        ["write", 40 * k, 3 * k, 5],
        ["zero", 2 * k, 2 * k, "nohole"],
        ["zero", 8 * k, 3 * k],
        ["zero", 12 * k, 3 * k, "nohole", "fua"],
        ["trim", 44 * k, 4 * k],
        ["trim", 50 * k, 2 * k],
        ["read", 0, 16 * k],
        ["read", 38 * k, 12 * k],
        ["flush"]
    ]);
    let mut outputs = Vec::new();
    for server in [Server::Diskit, Server::Nbdkit] {
        let key = format!("{server:?}");
        let args = sharded(&key, SIZE);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = ok(store.serve(server, &args, &ops(&aligned)));
        assert!(!stdout(&o).contains("error"), "{server:?}: {}", stdout(&o));
        outputs.push(stdout(&o));
    }
    assert_eq!(outputs[0], outputs[1], "the servers answered differently");
    let (by_diskit, by_nbdkit) = (store.objects("Diskit"), store.objects("Nbdkit"));
    assert_eq!(by_diskit, by_nbdkit, "other objects left");
    let gone = |b: u64| !by_diskit.iter().any(|(k, _)| *k == format!("{b:016x}"));
    for b in [2, 3, 8, 9, 10, 12, 13, 14, 44, 45, 46, 47, 50, 51] {
        assert!(
            gone(b),
            "block {b} was zeroed or trimmed whole: {by_diskit:?}"
        );
    }
    for b in [0, 1, 4, 11, 15, 40, 42, 48, 52] {
        assert!(!gone(b), "block {b} keeps data: {by_diskit:?}");
    }
    // And each reads what the other left.
    let disk_line = |out: &str| out.lines().last().unwrap().to_string();
    for server in [Server::Diskit, Server::Nbdkit] {
        let args = sharded(&format!("{:?}", server.other()), SIZE);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = ok(store.serve(server, &args, &ops(&serde_json::json!([]))));
        assert_eq!(disk_line(&stdout(&o)), disk_line(&outputs[0]), "{server:?}");
    }

    // Writes and zeroes of parts of objects (read-modify-write, across
    // objects, within one, at the very end; zeroes that delete the
    // objects between their ends) on a new disk give what they give on
    // nbdkit's memory plugin; nbdkit's S3 plugin reads it back.
    let unaligned = serde_json::json!([
        ["write", k - 5, 10, 7],
        ["write", 5 * k + 1, 3 * k, 9],
        ["write", 6 * k + 7, 100, 11, "fua"],
        ["zero", 9 * k - 50, 2 * k + 100],
        ["write", 30 * k, 5 * k, 15],
        ["zero", 30 * k + 1, 3 * k, "nohole"],
        ["zero", 20 * k + 3, 10, "nohole"],
        ["write", SIZE - 3, 3, 13],
        ["zero", 5 * k + 10, 10, "fast"],
        ["read", k - 10, 30],
        ["read", 5 * k, 4 * k],
        ["read", SIZE - 100, 100]
    ]);
    let mem = timed("nbdkit", 60)
        .args([
            "-U",
            "-",
            "memory",
            &SIZE.to_string(),
            "--run",
            &ops(&unaligned),
        ])
        .output()
        .unwrap();
    let mem = stdout(&ok(mem));
    let args = sharded("rmw", SIZE);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = ok(store.serve(Server::Diskit, &args, &ops(&unaligned)));
    assert_eq!(stdout(&o), mem, "diskit serve s3 differs from memory");
    let o = ok(store.serve(Server::Nbdkit, &args, &ops(&serde_json::json!([]))));
    assert_eq!(
        disk_line(&stdout(&o)),
        disk_line(&mem),
        "nbdkit read other bytes"
    );
    assert!(
        store.objects("rmw").iter().all(|(_, size)| *size == OBJ),
        "objects are whole"
    );

    // Served read-only, the disk is read-only.
    let o = ok(store.serve(Server::Diskit, &args, "nbdinfo \"$uri\""));
    assert!(stdout(&o).contains("is_read_only: false"), "{}", stdout(&o));
    // (The endpoint from AWS_ENDPOINT_URL, as the AWS tools find it.)
    let o = timed(diskit_bin(), 60);
    let o = store
        .with_env(o)
        .args(["serve", "-U", "-"])
        .args(["-r", "s3", &format!("bucket={}", store.bucket)])
        .args(&args)
        .args(["--run", "nbdinfo \"$uri\""])
        .output()
        .unwrap();
    assert!(stdout(&ok(o)).contains("is_read_only: true"));
}

#[test]
fn serve_s3_serves_one_object_read_only_and_names_its_errors() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    let url = |key: &str| store.url(key);
    // Not a multiple of anything.
    let src = random_file(&d.join("src.raw"), 3_000_001);
    ok(store.aws(&["s3", "cp", s(&src), &url("vm/disk.img")]));
    let got = d.join("aws.raw");
    store.download("vm/disk.img", &got);
    for server in [Server::Diskit, Server::Nbdkit] {
        let out = d.join(format!("{server:?}.raw"));
        let o = ok(store.serve(
            server,
            &["key=vm/disk.img"],
            &format!("nbdinfo \"$uri\" && nbdcopy \"$uri\" {}", s(&out)),
        ));
        assert!(stdout(&o).contains("is_read_only: true"), "{}", stdout(&o));
        assert!(stdout(&o).contains("3000001"), "{}", stdout(&o));
        assert!(same_bytes(&got, &out), "{server:?} read other bytes");
        // nbdkit's plugin also spells its keys with underscores: they are
        // the same keys (a wrong key given so is used, and refused).
        let id = format!("access_key={}", store.var("AWS_ACCESS_KEY_ID"));
        let secret = format!("secret_key={}", store.var("AWS_SECRET_ACCESS_KEY"));
        let o = ok(store.serve(
            server,
            &["key=vm/disk.img", &id, &secret],
            &format!("nbdcopy \"$uri\" {}", s(&out)),
        ));
        assert!(same_bytes(&got, &out), "{server:?}: {}", stderr(&o));
        let o = store.serve(
            server,
            &["key=vm/disk.img", "access_key=NOSUCHKEY", &secret],
            "nbdinfo \"$uri\"",
        );
        assert_ne!(code(&o), 0, "{server:?} took a wrong access_key");
    }

    let fails = |args: &[&str], says: &str| {
        let o = store.serve(Server::Diskit, args, "true");
        assert_ne!(code(&o), 0, "{args:?}");
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
    };
    fails(&["key=k", "size=1M"], "must always be specified together");
    fails(
        &["key=k", "object-size=64k"],
        "must always be specified together",
    );
    fails(
        &["key=k", "size=100k", "object-size=64k"],
        "multiple of `object-size`",
    );
    fails(&["size=1M"], "missing parameter 'key'");
    fails(&["key=no-such-object"], "NoSuchKey");
    let o = store
        .with_env(timed(diskit_bin(), 60))
        .args(["serve", "-U", "-", "s3", "bucket=no-such-bucket", "key=k"])
        .args(["size=1M", "object-size=64k", "--run", "true"])
        .output()
        .unwrap();
    assert_ne!(code(&o), 0);
    assert!(stderr(&o).contains("NoSuchBucket"), "{}", stderr(&o));
}

/// Checks every read an nbdsh client makes against the file `src`: two
/// streams of 256 KiB reads taking turns, 64 reads in flight at once in
/// order, random reads of 1 byte to 5 MiB (across the 4 MiB chunks a
/// stream is read in, up to the end), and reads backwards from the end.
const CHECK_READS: &str = r#"
import random
data = open(SRC, 'rb').read()
size = len(data)
assert h.get_size() == size, (h.get_size(), size)
checked = 0
def check(off, n):
    global checked
    got = h.pread(n, off)
    assert got == data[off:off + n], ('other bytes', off, n)
    checked += 1
step = 256 << 10
a, b = 0, (13 << 20) + 512
while a < size or b < size:
    for at in (a, b):
        if at < size:
            check(at, min(step, size - at))
    a, b = a + step, b + step
pending = []
for off in range(0, size, step):
    n = min(step, size - off)
    buf = nbd.Buffer(n)
    pending.append((off, n, buf, h.aio_pread(buf, off)))
    while h.aio_in_flight() >= 64:
        h.poll(-1)
while h.aio_in_flight() > 0:
    h.poll(-1)
for off, n, buf, cookie in pending:
    assert h.aio_command_completed(cookie)
    assert bytes(buf.to_bytearray()) == data[off:off + n], ('other bytes in flight', off, n)
    checked += 1
rng = random.Random(29)
for _ in range(300):
    n = min(size, rng.choice([1, 511, 4096, 65536, 262144, 1 << 20, 3 << 20, (5 << 20) + 7]))
    check(rng.randrange(0, size - n + 1), n)
off = size
while off > 0:
    n = min(100000, off)
    off -= n
    check(off, n)
print('checked', checked)
"#;

#[test]
fn serve_s3_gives_the_objects_bytes_to_streams_and_random_reads() {
    let dir = workdir();
    let d = dir.path();
    let store = Store::start(d);
    // Six chunks and some, with a hole of zeros: the object is read in
    // whole chunks for streams, as asked for other reads.
    let src = random_file(&d.join("src.raw"), (25 << 20) + 12345);
    ok(store.aws(&["s3", "cp", s(&src), &store.url("big.img")]));
    let script = d.join("check.py");
    std::fs::write(&script, format!("SRC = {:?}\n{CHECK_READS}", s(&src))).unwrap();
    let (many, one) = (d.join("many.raw"), d.join("one.raw"));
    let o = ok(store.serve(
        Server::Diskit,
        &["key=big.img"],
        &format!(
            "nbdcopy \"$uri\" {} && nbdcopy --connections=1 --request-size=65536 \"$uri\" {} \
             && nbdsh -u \"$uri\" -c \"exec(open('{}').read())\"",
            s(&many),
            s(&one),
            s(&script)
        ),
    ));
    assert!(stdout(&o).contains("checked "), "{}", stdout(&o));
    assert!(same_bytes(&src, &many), "nbdcopy read other bytes");
    assert!(
        same_bytes(&src, &one),
        "nbdcopy on one connection read other bytes"
    );
    // diskit's own readers (1 MiB requests, many in flight) read the same.
    let copied = d.join("copied.raw");
    ok(store.diskit(&["copy", &store.url("big.img"), s(&copied)]));
    assert!(same_bytes(&src, &copied), "diskit copy read other bytes");
}
