//! The opener: names (json:, --image-opts, protocols), probing of every
//! format qemu-img creates, and the trust gate, with qemu-img as the oracle.

mod common;

use common::*;

/// A qcow2 with data in two places, made by qemu-io.
fn qcow2_with_data(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("q.qcow2");
    ok(qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "4M"]));
    ok(peer(
        "qemu-io",
        &argv(
            "-f qcow2 -c",
            &["write -P 7 64k 128k", "-c", "write -z 1M 64k", s(&p)],
        ),
    ));
    p
}

#[test]
fn map_through_image_opts_and_json_equals_qemu_img() {
    let dir = workdir();
    let p = qcow2_with_data(dir.path());
    let opts = format!("driver=qcow2,file.driver=file,file.filename={}", s(&p));
    same_as_qemu_img(
        &["map", "--output=json", "--image-opts", &opts],
        "image-opts",
    );
    let opts = format!("driver=qcow2,file.filename={},l2-cache-size=1M", s(&p));
    same_as_qemu_img(&["map", "--output=json", "--image-opts", &opts], "l2-cache");
    let json = format!(
        r#"json:{{"driver":"qcow2","file":{{"driver":"file","filename":"{}"}}}}"#,
        s(&p)
    );
    same_as_qemu_img(&["map", "--output=json", &json], "json:");
    let json = format!(r#"json:{{"file":{{"filename":"{}"}}}}"#, s(&p));
    same_as_qemu_img(&["map", "--output=json", &json], "json: probed");
    // A string child names a node, which neither has.
    let json = format!(r#"json:{{"file":"{}"}}"#, s(&p));
    assert_eq!(code(&qemu_img(&["map", &json])), 1);
    assert_eq!(code(&diskit(&["map", &json])), 1);
    // The backing file replaced, or removed, by the description.
    let base = dir.path().join("base.raw");
    sparse_file(&base, 4 << 20, &[(0, 1 << 20, 0x11)]);
    let top = dir.path().join("top.qcow2");
    ok(qemu_img(&argv(
        "create -q -f qcow2 -b",
        &[s(&p), "-F", "qcow2", s(&top)],
    )));
    let opts = format!(
        "driver=qcow2,file.filename={},backing.driver=raw,backing.file.filename={}",
        s(&top),
        s(&base)
    );
    same_as_qemu_img(
        &["map", "--output=json", "--image-opts", &opts],
        "backing.*",
    );
    let json = format!(
        r#"json:{{"driver":"qcow2","backing":null,"file":{{"filename":"{}"}}}}"#,
        s(&top)
    );
    same_as_qemu_img(&["map", "--output=json", &json], "backing null");
    same_as_qemu_img(&["map", "--output=json", s(&top)], "chain");
    // A raw view of the same file through either spelling.
    let opts = format!("driver=raw,file.filename={}", s(&p));
    same_as_qemu_img(&["map", "--output=json", "--image-opts", &opts], "raw");
}

#[test]
fn null_co_maps_as_qemu_img() {
    for args in [
        vec!["map", "--output=json", "null-co://"],
        vec![
            "map",
            "--output=json",
            "--image-opts",
            "driver=raw,file.driver=null-co,file.size=1M",
        ],
        vec![
            "map",
            "--output=json",
            "--image-opts",
            "driver=null-co,size=3M,read-zeroes=on",
        ],
    ] {
        same_as_qemu_img(&args, "null-co");
    }
    same_as_qemu_img(&["info", "null-co://"], "null-co info");
    same_as_qemu_img(&["info", "--output=json", "null-co://"], "null-co info");
}

#[test]
fn qcow2_over_null_co_reads_as_qemu_sees_it() {
    // null-co reads zeros: there is no qcow2 header, and both refuse.
    let ours = diskit(&words(
        "info --image-opts driver=qcow2,file.driver=null-co,file.size=1M",
    ));
    assert_ne!(code(&ours), 0);
    assert_stderr_has(&ours, "qcow2");
    assert_ne!(
        code(&qemu_img(&words(
            "info --image-opts driver=qcow2,file.driver=null-co,file.size=1M"
        ))),
        0
    );
}

#[test]
fn bad_descriptions_are_named() {
    let dir = workdir();
    let p = qcow2_with_data(dir.path());
    let cases = [
        (
            format!("driver=qcow2,file.filename={},bogus=1", s(&p)),
            "'bogus'",
        ),
        (
            format!(
                "driver=qcow2,file.driver=file,file.filename={},file.nope=1",
                s(&p)
            ),
            "'nope'",
        ),
        ("driver=nosuch,file.filename=x".to_string(), "'nosuch'"),
        (
            "driver=qcow2,file.driver=gopher,file.filename=x".to_string(),
            "'gopher'",
        ),
        ("driver".to_string(), "key=value"),
    ];
    for (opts, want) in cases {
        let o = diskit(&["map", "--image-opts", &opts]);
        assert_eq!(code(&o), 1, "{opts}");
        assert!(stderr(&o).contains(want), "{opts}: {}", stderr(&o));
    }
    for bad in [
        "json:{",
        "json:[]",
        r#"json:{"driver":"qcow2","file":{"a":{"b":{"c":{"d":{"e":{"f":{"g":{"h":{}}}}}}}}}}"#,
    ] {
        let o = diskit(&["info", bad]);
        assert_eq!(code(&o), 1, "{bad}");
        assert!(stderr(&o).contains("json:"), "{bad}: {}", stderr(&o));
    }
    let o = diskit(&["info", "gopher://x/y"]);
    assert_stderr_has(&o, "Unknown protocol 'gopher'");
}

#[test]
fn every_format_qemu_img_creates_is_probed_and_refused_by_name() {
    let dir = workdir();
    // The formats diskit does not read yet (raw, qcow2, luks, vdi, vpc,
    // qed, vmdk and vhdx it reads).
    for fmt in ["qcow"] {
        let p = dir.path().join(format!("disk.{fmt}"));
        let mut args = vec!["create", "-q", "-f", fmt];
        args.extend([s(&p), "4M"]);
        let made = qemu_img(&args);
        if code(&made) != 0 {
            // qemu-img builds without a format (qcow is often read-only).
            eprintln!("skipping {fmt}: {}", stderr(&made));
            continue;
        }
        // qemu-img probes it as `fmt`...
        let info = ok(qemu_img(&["info", "--output=json", s(&p)]));
        let probed: serde_json::Value = serde_json::from_str(&stdout(&info)).unwrap();
        assert_eq!(probed["format"], fmt, "qemu-img probes {fmt}");
        // ...and diskit names it and refuses, for every way of reading it.
        let out = dir.path().join("out.raw");
        for args in [
            vec!["info", s(&p)],
            vec!["map", s(&p)],
            vec!["convert", "-O", "raw", s(&p), s(&out)],
        ] {
            let o = diskit(&args);
            assert_eq!(code(&o), 1, "{fmt} {args:?}");
            assert!(
                stderr(&o).contains(&format!("'{fmt}'")),
                "{fmt}: {}",
                stderr(&o)
            );
            assert!(!out.exists(), "{fmt}: convert wrote a file");
        }
        // Asked for by name with -f, it is refused by name too.
        let o = diskit(&["info", "-f", fmt, s(&p)]);
        assert_stderr_has(&o, &format!("'{fmt}'"));
        // -f raw reads the container's bytes, as qemu-img does.
        same_as_qemu_img(&["map", "--output=json", "-f", "raw", s(&p)], fmt);
    }
}

#[test]
fn short_and_garbage_headers_get_clear_errors() {
    let dir = workdir();
    let short = dir.path().join("short");
    std::fs::write(&short, b"QFI").unwrap();
    // Too short for any magic: raw, as qemu-img says.
    same_as_qemu_img(&["map", "--output=json", s(&short)], "short");
    let garbage = dir.path().join("garbage");
    let mut bytes = b"QFI\xfb\0\0\0\x03".to_vec();
    bytes.extend(std::iter::repeat_n(0xffu8, 600));
    std::fs::write(&garbage, &bytes).unwrap();
    let o = diskit(&["info", s(&garbage)]);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).starts_with("diskit: Could not open"),
        "{}",
        stderr(&o)
    );
}

/// Makes `dir/top.qcow2` over the backing file `backing` (as stored).
fn top_over(dir: &std::path::Path, backing: &str) -> std::path::PathBuf {
    let top = dir.join("top.qcow2");
    let _ = std::fs::remove_file(&top);
    ok(qemu_img(&argv(
        "create -q -f qcow2 -u -b",
        &[backing, "-F", "raw", s(&top), "1M"],
    )));
    top
}

#[test]
fn untrusted_images_name_only_files_beside_them() {
    let dir = workdir();
    let d = dir.path().join("img");
    std::fs::create_dir(&d).unwrap();
    sparse_file(&d.join("base.raw"), 1 << 20, &[(0, 4096, 0x5a)]);
    sparse_file(&dir.path().join("secret.raw"), 1 << 20, &[(0, 4096, 0x77)]);
    std::os::unix::fs::symlink(dir.path().join("secret.raw"), d.join("link.raw")).unwrap();
    std::os::unix::fs::symlink("base.raw", d.join("inside.raw")).unwrap();
    let out = dir.path().join("out.raw");
    let secret = s(&dir.path().join("secret.raw")).to_string();
    for (backing, rule) in [
        (secret.as_str(), "absolute"),
        ("../secret.raw", "leaves the image's directory"),
        ("link.raw", "symbolic link"),
        ("/dev/null", "absolute"),
        ("nbd://localhost/x", "protocol"),
    ] {
        let top = top_over(&d, backing);
        // Trusted (the default, as qemu-img): the named file is read.
        if !backing.starts_with("nbd") && !backing.starts_with("/dev") {
            ok(diskit(&["convert", "-O", "raw", s(&top), s(&out)]));
        }
        let o = diskit(&["convert", "--untrusted", "-O", "raw", s(&top), s(&out)]);
        assert_eq!(code(&o), 1, "{backing}");
        let e = stderr(&o);
        assert!(e.contains(backing) && e.contains(rule), "{backing}: {e}");
        // info lists it without opening it, and says why it is refused.
        let o = ok(diskit(&["info", "--untrusted", "--output=json", s(&top)]));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let f = &v["implied-files"][0];
        assert_eq!(f["name"], backing);
        assert_eq!(f["allowed"], false);
        assert!(f["refusal"].as_str().unwrap().contains(rule), "{f}");
        let o = diskit(&["info", "--untrusted", "--backing-chain", s(&top)]);
        assert_eq!(code(&o), 1, "{backing}");
        // serve image goes through the same gate.
        let o = diskit(&argv("serve --untrusted -U - --run true image", &[s(&top)]));
        assert_eq!(code(&o), 1, "{backing}");
        assert_stderr_has(&o, rule);
    }
    // A device reached through a name inside the directory.
    std::os::unix::fs::symlink("/dev/zero", d.join("dev.raw")).unwrap();
    let top = top_over(&d, "dev.raw");
    let o = diskit(&["map", "--untrusted", s(&top)]);
    assert_eq!(code(&o), 1);
    // Files beside the image are fine, through links inside too.
    for backing in ["base.raw", "inside.raw", "./base.raw"] {
        let top = top_over(&d, backing);
        ok(diskit(&argv(
            "convert --untrusted -O raw",
            &[s(&top), s(&out)],
        )));
        let o = ok(diskit(&["info", "--untrusted", "--output=json", s(&top)]));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["implied-files"][0]["allowed"], true);
        let o = ok(diskit(&argv(
            "compare -f qcow2 -F raw",
            &[s(&top), s(&d.join("base.raw"))],
        )));
        assert_eq!(code(&o), 0);
    }
}

#[test]
fn untrusted_data_files_too() {
    let dir = workdir();
    let d = dir.path();
    sparse_file(&d.join("secret.raw"), 1 << 20, &[(0, 4096, 0x77)]);
    let top = d.join("top.qcow2");
    let secret = d.join("secret.raw");
    // An image whose raw external data file is a host file: amend points
    // an image at it, as an attacker would.
    ok(qemu_img(&argv(
        "create -q -f qcow2 -o",
        &[
            &format!("data_file={},data_file_raw=on", s(&d.join("own.raw"))),
            s(&top),
            "1M",
        ],
    )));
    ok(qemu_img(&argv(
        "amend -f qcow2 -o",
        &[&format!("data_file={}", s(&secret)), s(&top)],
    )));
    let out = d.join("out.raw");
    ok(diskit(&["convert", "-O", "raw", s(&top), s(&out)]));
    assert!(same_bytes(&out, &secret), "trusted: the data file is read");
    let o = diskit(&["convert", "--untrusted", "-O", "raw", s(&top), s(&out)]);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).contains("data file") && stderr(&o).contains("absolute"),
        "{}",
        stderr(&o)
    );
    // Beside the image, by a relative name: allowed.
    ok(qemu_img(&argv(
        "amend -f qcow2 -o data_file=secret.raw",
        &[s(&top)],
    )));
    ok(diskit(&argv(
        "convert --untrusted -O raw",
        &[s(&top), s(&out)],
    )));
    assert!(same_bytes(&out, &secret));
}

#[test]
fn convert_takes_descriptions_for_source_and_target() {
    let dir = workdir();
    let p = qcow2_with_data(dir.path());
    let src = format!("driver=qcow2,file.filename={}", s(&p));
    let ours = dir.path().join("ours.raw");
    let theirs = dir.path().join("theirs.raw");
    // --image-opts is for the source; the target stays a plain name.
    ok(diskit(&argv(
        "convert --image-opts",
        &[&src, "-O", "raw", s(&ours)],
    )));
    ok(qemu_img(&argv(
        "convert --image-opts",
        &[&src, "-O", "raw", s(&theirs)],
    )));
    assert!(same_bytes(&ours, &theirs));
    // --target-image-opts names an existing target, with -n only.
    let o = diskit(&argv(
        "convert --target-image-opts",
        &[s(&p), "driver=raw,file.filename=x"],
    ));
    assert_fails_with(&o, 1, "requires use of -n");
    sparse_file(&ours, 4 << 20, &[(0, 4 << 20, 0x33)]);
    let dst = format!("driver=raw,file.driver=file,file.filename={}", s(&ours));
    ok(diskit(&argv(
        "convert -n --target-image-opts",
        &[s(&p), &dst],
    )));
    assert!(same_bytes(&ours, &theirs));
}
