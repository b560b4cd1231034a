//! convert's `--salvage`, `-r` and `-C` against qemu-img's: the same
//! images, warnings, errors and exit codes.

mod common;

use common::*;

/// The lines of standard error that the tool wrote (not the server's),
/// without its name.
fn own_lines(o: &std::process::Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| !l.starts_with("nbdkit"))
        .map(|l| l.replace("qemu-img: ", "").replace("diskit: ", ""))
        .collect()
}

#[test]
fn salvage_reads_errors_as_zeros_with_qemu_img_warnings() {
    let dir = workdir();
    let d = dir.path();
    let tools = [
        (diskit_bin().display().to_string(), d.join("ours.raw")),
        ("qemu-img".to_string(), d.join("theirs.raw")),
    ];
    let mut runs = Vec::new();
    for salvage in [true, false] {
        for (tool, out) in &tools {
            let flag = if salvage { "--salvage" } else { "" };
            let cmd = format!("{tool} convert {flag} -f raw -O raw \"$uri\" {}", s(out));
            let o = timed("nbdkit", 60)
                .args(["-U", "-", "--filter=error", "pattern", "64k"])
                .args(["error-pread=EIO", "error-pread-rate=100%", "--run", &cmd])
                .output()
                .unwrap();
            runs.push((salvage, o));
        }
    }
    for pair in runs.chunks(2) {
        let ((salvage, ours), (_, theirs)) = (&pair[0], &pair[1]);
        assert_eq!(
            code(ours),
            code(theirs),
            "salvage={salvage}: {}",
            stderr(ours)
        );
        if *salvage {
            assert_eq!(code(ours), 0);
            assert_eq!(own_lines(ours), own_lines(theirs));
            assert_eq!(own_lines(ours).len(), 128, "a warning per sector");
            assert!(same_bytes(&tools[0].1, &tools[1].1));
        } else {
            assert_eq!(code(ours), 1);
        }
    }
}

#[test]
fn copy_offloading_and_rate_limits_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let src = d.join("src.raw");
    sparse_file(
        &src,
        4 << 20,
        &[
            (0, 100_000, 0x11),
            (2 << 20, 65536, 0x22),
            ((4 << 20) - 10, 10, 0x33),
        ],
    );
    for args in [
        &["-C", "-O", "raw"][..],
        &["-C", "-O", "qcow2"],
        &["-r", "100M", "-O", "raw"],
        &["-r", "0", "-O", "raw"],
    ] {
        let (ours, theirs) = (d.join("o.img"), d.join("t.img"));
        let _ = std::fs::remove_file(&ours);
        let _ = std::fs::remove_file(&theirs);
        ok(diskit(&[&["convert"], args, &[s(&src), s(&ours)]].concat()));
        ok(qemu_img(
            &[&["convert"], args, &[s(&src), s(&theirs)]].concat(),
        ));
        ok(qemu_img(&["compare", s(&ours), s(&src)]));
        if args.contains(&"raw") {
            assert!(same_bytes(&ours, &theirs), "{args:?}");
            // Holes stay holes.
            assert!(allocated(&ours) < 1 << 20, "{args:?}: {}", allocated(&ours));
        }
    }
    for args in [
        &["-C", "-c", "-O", "qcow2"][..],
        &["-C", "-S", "4k", "-O", "raw"],
        &["-r", "foo", "-O", "raw"],
    ] {
        let out = d.join("bad.img");
        let o = diskit(&[&["convert"], args, &[s(&src), s(&out)]].concat());
        let t = qemu_img(&[&["convert"], args, &[s(&src), s(&out)]].concat());
        assert_eq!(
            (code(&o), own_lines(&o)),
            (code(&t), own_lines(&t)),
            "{args:?}"
        );
    }
}

#[test]
fn qcow2_written_by_several_workers_keeps_source_order_as_qemu_img() {
    let dir = workdir();
    let d = dir.path();
    let src = d.join("src.raw");
    // 24 MiB of data in runs of different bytes, no zeros.
    let runs: Vec<(u64, usize, u8)> = (0..24u64)
        .map(|i| (i << 20, 1 << 20, i as u8 + 1))
        .collect();
    sparse_file(&src, 24 << 20, &runs);
    for tool in ["diskit", "qemu-img"] {
        let out = d.join(format!("{tool}.qcow2"));
        let args = ["convert", "-m", "8", "-O", "qcow2", s(&src), s(&out)];
        ok(if tool == "diskit" {
            diskit(&args)
        } else {
            qemu_img(&args)
        });
        ok(qemu_img(&["compare", s(&src), s(&out)]));
        // Without -W the clusters lie in the file in guest order, written
        // by every worker: each run of the map starts past the one before.
        let map = stdout(&ok(qemu_img(&["map", "--output=json", s(&out)])));
        let map: serde_json::Value = serde_json::from_str(&map).unwrap();
        let mut end = 0;
        for e in map.as_array().unwrap() {
            let at = e["offset"]
                .as_u64()
                .unwrap_or_else(|| panic!("{tool}: {e}"));
            assert!(at >= end, "{tool}: {e} lies before {end}");
            end = at + e["length"].as_u64().unwrap();
        }
    }
}
