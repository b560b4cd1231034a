//! `diskit bench` against `qemu-img bench`: the same lines (the time
//! masked), messages and exit codes, and for write tests the same bytes
//! left in the image.

mod common;

use common::*;

/// Output and errors without the program's name, the time masked.
fn shown(o: &std::process::Output, img: &std::path::Path) -> (i32, String, String) {
    let out = stdout(o)
        .lines()
        .map(|l| match l.strip_prefix("Run completed in ") {
            Some(_) => "Run completed in T seconds.".to_string(),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let err = stderr(o)
        .lines()
        .filter(|l| !l.starts_with("WARNING") && !l.starts_with("         "))
        .map(|l| {
            l.replace("qemu-img: ", "")
                .replace("diskit: ", "")
                .replace(s(img), "IMG")
        })
        .collect::<Vec<_>>()
        .join("\n");
    (code(o), out, err)
}

#[test]
fn bench_runs_and_reports_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let cases: &[&[&str]] = &[
        &["-c", "100"],
        &["-c", "50", "-d", "4", "-s", "8k", "-S", "16k", "-o", "4k"],
        &[
            "-c",
            "100",
            "-w",
            "-d",
            "4",
            "-s",
            "4k",
            "-S",
            "64k",
            "--pattern=7",
        ],
        &["-c", "100", "-w", "-d", "4", "--flush-interval=10"],
        &[
            "-c",
            "100",
            "-w",
            "-d",
            "4",
            "--flush-interval=10",
            "--no-drain",
        ],
        &[
            "-c",
            "20",
            "-w",
            "-s",
            "64k",
            "-S",
            "1M",
            "--pattern=200",
            "-t",
            "none",
        ],
        &["-c", "10", "-n"],
        &["-c", "10", "-n", "-t", "none"],
        &["-c", "5", "-S", "0"],
        &["-c", "0"],
        &["-c", "x"],
        &["-d", "0"],
        &["-s", "0"],
        &["-S", "x"],
        &["-o", "x"],
        &["--pattern=300", "-w"],
        &["--flush-interval=10"],
        &["-w", "--flush-interval=10"],
        &["-t", "bogus"],
        &["-c", "10", "-o", "16M"],
    ];
    for case in cases {
        let imgs = [d.join("ours.raw"), d.join("theirs.raw")];
        for img in &imgs {
            sparse_file(img, 16 << 20, &[(0, 4096, 1)]);
        }
        let ours = diskit(&[&["bench", "-f", "raw"], *case, &[s(&imgs[0])]].concat());
        let theirs = qemu_img(&[&["bench", "-f", "raw"], *case, &[s(&imgs[1])]].concat());
        assert_eq!(shown(&ours, &imgs[0]), shown(&theirs, &imgs[1]), "{case:?}");
        assert!(
            same_bytes(&imgs[0], &imgs[1]),
            "{case:?}: other bytes written"
        );
    }
}
