//! Images made on NBD exports, as qemu-img 10 makes them (and where it
//! cannot: vmdk, vhdx and qed, whose new space it takes past the export's
//! end): `create -f FMT URI SIZE` and `convert -O FMT SRC URI` take over
//! an existing export, zeroed first,
//! (nbdkit's memory plugin, qemu-nbd over a file, diskit serve), and
//! what lands there reads back equal through qemu-img and passes
//! `qemu-img check`. A name no image can be made on is refused in QEMU's
//! words.

mod common;

use std::path::Path;

use common::*;

/// Runs `case(server, uri)` against each server in turn.
fn on_each_server(case: impl Fn(&str, &str)) {
    for name in ["nbdkit", "qemu-nbd", "diskit"] {
        let dir = workdir();
        let sock = dir.path().join("sock");
        let disk = dir.path().join("disk");
        // A disk with old contents, so that nothing reads as zeros by luck.
        std::fs::write(&disk, vec![0xeeu8; 64 << 20]).unwrap();
        let ready = || sock.exists();
        let _guard = match name {
            "nbdkit" => start_server("nbdkit", &["-f", "-U", s(&sock), "memory", "64M"], ready),
            "qemu-nbd" => start_server(
                "qemu-nbd",
                &["-k", s(&sock), "-f", "raw", "-t", s(&disk)],
                ready,
            ),
            _ => start_server(
                s(&diskit_bin()),
                &["serve", "-f", "-U", s(&sock), "file", s(&disk)],
                ready,
            ),
        };
        let uri = format!("nbd+unix:///?socket={}", s(&sock));
        case(name, &uri);
    }
}

/// A 4 MiB raw source: 1 MiB of 0x33 at 0, 64 KiB of 0x44 at 2 MiB, 1000
/// bytes of 0x55 inside a cluster, the rest zeros.
fn source(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("src.raw");
    sparse_file(
        &p,
        4 << 20,
        &[
            (0, 1 << 20, 0x33),
            (2 << 20, 65536, 0x44),
            (3_000_000, 1000, 0x55),
        ],
    );
    p
}

#[test]
fn convert_and_create_make_images_on_nbd_exports() {
    let dir = workdir();
    let src = source(dir.path());
    on_each_server(|server, uri| {
        for fmt in ["raw", "qcow2", "vdi", "vpc", "vmdk", "vhdx", "qed"] {
            let what = format!("{fmt} on {server}");
            let o = diskit(&["create", "-q", "-f", fmt, uri, "4M"]);
            assert!(o.status.success(), "create {what}: {}", stderr(&o));
            let info = ok(qemu_img(&["info", "--output=json", "-f", fmt, uri]));
            let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
            // (vpc rounds the size to its disk geometry.)
            if fmt != "raw" && fmt != "vpc" {
                assert_eq!(v["virtual-size"], 4 << 20, "{what}: {v}");
            }
            let o = diskit(&["convert", "-O", fmt, s(&src), uri]);
            assert!(o.status.success(), "convert {what}: {}", stderr(&o));
            // (A raw image is the export: its first 4 MiB are compared.)
            let sock = uri.split_once("socket=").unwrap().1;
            let raw4m = format!("driver=raw,size=4194304,file.driver=nbd,file.path={sock}");
            let cmp = if fmt == "raw" {
                let src = format!("driver=file,filename={}", s(&src));
                qemu_img(&["compare", "--image-opts", &src, &raw4m])
            } else {
                qemu_img(&["compare", "-f", "raw", s(&src), "-F", fmt, uri])
            };
            assert!(
                stdout(&cmp).contains("Images are identical"),
                "{what}: {}{}",
                stdout(&cmp),
                stderr(&cmp)
            );
            if fmt == "qed" {
                // qemu-img counts every unused cluster of the export after
                // the image as leaked: leaks, nothing else.
                let o = qemu_img(&["check", "-f", fmt, uri]);
                assert!(matches!(code(&o), 0 | 3), "{what}: {}", stdout(&o));
                assert!(!stdout(&o).contains("ERROR"), "{what}: {}", stdout(&o));
            } else if fmt != "raw" && fmt != "vpc" {
                ok(qemu_img(&["check", "-f", fmt, uri]));
            }
        }
    });
}

#[test]
fn names_no_image_can_be_made_on_are_refused_as_qemu_img_refuses_them() {
    let dir = workdir();
    for args in [
        &["create", "-f", "qcow2", "null-co://", "1M"][..],
        &[
            "create",
            "-f",
            "raw",
            "nbd+unix:///?socket=/nonexistent/s",
            "1M",
        ][..],
    ] {
        alike_in(dir.path(), args);
    }
}
