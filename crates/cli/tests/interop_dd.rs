//! `diskit dd` against `qemu-img dd`: the same operands give the same
//! image, byte for byte (raw and qcow2 outputs, qcow2 inputs), the same
//! warnings, errors and exit codes.

mod common;

use std::path::Path;

use common::*;

/// Runs `TOOL dd ARGS` in `dir` (the operands name files relatively).
fn dd(tool: &str, dir: &Path, args: &[&str]) -> std::process::Output {
    tool_in(dir, tool, &[&["dd"][..], args].concat())
}

/// The message without the program's name.
fn message(o: &std::process::Output) -> String {
    stderr(o).replace("qemu-img: ", "").replace("diskit: ", "")
}

#[test]
fn dd_writes_what_qemu_img_dd_writes() {
    let dir = workdir();
    let d = dir.path();
    // 1,000,000 bytes: not a whole number of sectors; data and zeros.
    let input = d.join("in.raw");
    sparse_file(
        &input,
        1_000_000,
        &[
            (0, 70_000, 0x11),
            (300_000, 4096, 0x22),
            (999_000, 1000, 0x33),
        ],
    );
    ok(qemu_img(&argv(
        "convert -O qcow2",
        &[s(&input), s(&d.join("in.qcow2"))],
    )));
    let cases: &[&[&str]] = &[
        &["if=in.raw", "of=OUT"],
        &["bs=4k", "count=10", "skip=3", "if=in.raw", "of=OUT"],
        &["bs=1M", "count=1", "if=in.raw", "of=OUT"],
        &["bs=3", "count=5", "skip=2", "if=in.raw", "of=OUT"],
        &["bs=64k", "skip=2", "if=in.qcow2", "of=OUT"],
        &["-f", "qcow2", "bs=1k", "count=500", "if=in.qcow2", "of=OUT"],
        &["-O", "qcow2", "bs=4k", "if=in.raw", "of=OUT"],
        &["-O", "qcow2", "bs=64k", "skip=1", "if=in.qcow2", "of=OUT"],
        &["skip=100000", "if=in.raw", "of=OUT"],
    ];
    for case in cases {
        let outs = ["diskit", "qemu-img"].map(|tool| {
            let name = format!("out-{tool}");
            let args: Vec<String> = case.iter().map(|a| a.replace("OUT", &name)).collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let o = dd(tool, d, &args);
            (o, d.join(name))
        });
        let [(ours, ours_file), (theirs, theirs_file)] = outs;
        assert_eq!(code(&ours), code(&theirs), "{case:?}: {}", stderr(&ours));
        assert_eq!(message(&ours), message(&theirs), "{case:?}");
        assert!(
            same_bytes(&ours_file, &theirs_file),
            "{case:?}: not qemu-img's image"
        );
        if case.contains(&"-O") {
            ok(qemu_img(&["check", s(&ours_file)]));
        }
    }
}

#[test]
fn bad_operands_fail_as_in_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    sparse_file(&d.join("in.raw"), 65536, &[(0, 100, 1)]);
    for case in [
        &["bs=0", "if=in.raw", "of=o"][..],
        &["bs=foo", "if=in.raw", "of=o"],
        &["count=-1", "if=in.raw", "of=o"],
        &["skip=x", "if=in.raw", "of=o"],
        &["if=in.raw"],
        &["foo=1", "if=in.raw", "of=o"],
        &["ifx"],
        &["if=missing.raw", "of=o"],
    ] {
        let (ours, theirs) = (dd("diskit", d, case), dd("qemu-img", d, case));
        assert_eq!(code(&ours), 1, "{case:?}");
        assert_eq!(code(&theirs), 1, "{case:?}");
        if case[0] != "if=missing.raw" {
            // diskit adds its "Try 'diskit dd --help'" hint to usage errors.
            assert_eq!(
                message(&ours).lines().next(),
                message(&theirs).lines().next(),
                "{case:?}"
            );
        } else {
            assert!(message(&ours).contains("missing.raw"), "{}", stderr(&ours));
        }
    }
}
