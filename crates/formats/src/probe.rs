//! Format probing from the first bytes of an image, by table.
//!
//! Every format QEMU recognises has a row here with its probe, scored as
//! QEMU scores it (the highest score wins; raw scores 1). A format diskit
//! recognises but does not read yet is refused by name: a container is
//! never read as raw because its driver is missing.

use diskit_core::{BlockDevice, Error, ErrorKind, Result};

use crate::Format;

/// How many bytes of the image probing looks at (QEMU's
/// BLOCK_PROBE_BUF_SIZE).
pub const PROBE_BYTES: usize = 512;

/// A format known to probing.
pub struct ProbeRow {
    /// The format's name, as qemu-img spells it.
    pub name: &'static str,
    /// The driver that reads it, when diskit has one.
    pub format: Option<Format>,
    /// Scores the first bytes (at most [`PROBE_BYTES`]) and the file name:
    /// 0 is "not this format", 100 is certain.
    pub probe: fn(head: &[u8], filename: &str) -> u32,
}

/// Every format QEMU probes, in QEMU's order of registration where scores tie.
pub const PROBES: &[ProbeRow] = &[
    ProbeRow {
        name: "qcow2",
        format: Some(Format::Qcow2),
        probe: |h, _| u32::from(qcow_version(h).is_some_and(|v| v >= 2)) * 100,
    },
    ProbeRow {
        name: "qcow",
        format: None,
        probe: |h, _| u32::from(qcow_version(h) == Some(1)) * 100,
    },
    ProbeRow {
        name: "qed",
        format: None,
        probe: |h, _| magic_at(h, 0, b"QED\0"),
    },
    ProbeRow {
        name: "vmdk",
        format: None,
        probe: |h, _| {
            if h.starts_with(b"KDMV") || h.starts_with(b"COWD") {
                100
            } else {
                vmdk_descriptor_score(h)
            }
        },
    },
    ProbeRow {
        name: "vhdx",
        format: None,
        probe: |h, _| magic_at(h, 0, b"vhdxfile"),
    },
    ProbeRow {
        name: "vpc",
        format: None,
        probe: |h, _| magic_at(h, 0, b"conectix"),
    },
    ProbeRow {
        name: "vdi",
        format: None,
        probe: |h, _| magic_at(h, 0x40, &0xbeda_107fu32.to_le_bytes()),
    },
    ProbeRow {
        name: "luks",
        format: None,
        probe: |h, _| {
            let version = h.get(6..8).map(|v| u16::from_be_bytes([v[0], v[1]]));
            u32::from(h.starts_with(b"LUKS\xba\xbe") && matches!(version, Some(1 | 2))) * 100
        },
    },
    ProbeRow {
        name: "parallels",
        format: None,
        probe: |h, _| magic_at(h, 0, b"WithoutFreeSpace").max(magic_at(h, 0, b"WithouFreSpacExt")),
    },
    ProbeRow {
        name: "bochs",
        format: None,
        probe: |h, _| magic_at(h, 0, b"Bochs Virtual HD Image\0"),
    },
    ProbeRow {
        name: "cloop",
        format: None,
        probe: |h, _| {
            const MAGIC: &[u8] = b"#!/bin/sh\n#V2.0 Format\n\
                modprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";
            u32::from(h.starts_with(MAGIC)) * 2
        },
    },
    ProbeRow {
        name: "dmg",
        format: None,
        // QEMU knows dmg by its name alone.
        probe: |_, name| u32::from(name.len() > 4 && name.ends_with(".dmg")) * 2,
    },
    ProbeRow {
        name: "raw",
        format: Some(Format::Raw),
        probe: |_, _| 1,
    },
];

fn magic_at(h: &[u8], at: usize, magic: &[u8]) -> u32 {
    u32::from(h.get(at..at + magic.len()) == Some(magic)) * 100
}

/// The version field of a qcow or qcow2 header, when the magic matches.
fn qcow_version(h: &[u8]) -> Option<u32> {
    (h.len() >= 8 && h[..4] == *b"QFI\xfb").then(|| u32::from_be_bytes([h[4], h[5], h[6], h[7]]))
}

/// QEMU's test for a vmdk text descriptor: a line `version=1`, `2` or `3`
/// (ending the line) among the first bytes.
fn vmdk_descriptor_score(h: &[u8]) -> u32 {
    let found = h
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .map(|line| {
            let start = line.iter().position(|b| !b.is_ascii_whitespace());
            &line[start.unwrap_or(line.len())..]
        })
        .any(|line| matches!(line, b"version=1" | b"version=2" | b"version=3"));
    u32::from(found) * 100
}

/// The row of the format the first bytes of `filename` belong to.
pub fn probe_bytes(head: &[u8], filename: &str) -> &'static ProbeRow {
    let head = &head[..head.len().min(PROBE_BYTES)];
    let mut best = &PROBES[PROBES.len() - 1];
    let mut best_score = 0;
    for row in PROBES {
        let score = (row.probe)(head, filename);
        if score > best_score {
            best = row;
            best_score = score;
        }
    }
    best
}

/// The row of a format given by name (`-f`, `-O`, a backing format).
pub fn by_name(name: &str) -> Option<&'static ProbeRow> {
    PROBES.iter().find(|r| r.name == name)
}

/// Probes the image on `dev` (named `filename`) and returns the format
/// that reads it; a recognised format without a driver is an error that
/// names it.
pub fn probe(dev: &dyn BlockDevice, filename: &str) -> Result<Format> {
    let mut head = vec![0u8; PROBE_BYTES.min(dev.size() as usize)];
    dev.read_at(&mut head, 0)?;
    let row = probe_bytes(&head, filename);
    row.format.ok_or_else(|| unsupported(row.name))
}

/// The error for a format diskit recognises but does not read.
pub fn unsupported(name: &str) -> Error {
    Error::new(
        ErrorKind::NotSupported,
        format!(
            "image format '{name}' is recognised but not supported by diskit yet \
             (it is not read as raw; give -f raw to read the container's bytes)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(head: &[u8]) -> &'static str {
        probe_bytes(head, "x.img").name
    }

    #[test]
    fn qcow_versions() {
        assert_eq!(name(b"QFI\xfb\0\0\0\x03"), "qcow2");
        assert_eq!(name(b"QFI\xfb\0\0\0\x02"), "qcow2");
        assert_eq!(name(b"QFI\xfb\0\0\0\x01"), "qcow");
        assert_eq!(name(b"QFI"), "raw");
        assert_eq!(name(b""), "raw");
    }

    #[test]
    fn every_container_magic() {
        assert_eq!(name(b"QED\0rest"), "qed");
        assert_eq!(name(b"KDMV\x01\0\0\0"), "vmdk");
        assert_eq!(name(b"COWD\x01\0\0\0"), "vmdk");
        assert_eq!(
            name(b"# Disk DescriptorFile\n  version=1\nCID=fffffffe\n"),
            "vmdk"
        );
        assert_eq!(name(b"# Disk DescriptorFile\nversion=10\n"), "raw");
        assert_eq!(name(b"vhdxfile"), "vhdx");
        assert_eq!(name(b"conectix"), "vpc");
        let mut vdi = vec![0u8; 0x48];
        vdi[0x40..0x44].copy_from_slice(&[0x7f, 0x10, 0xda, 0xbe]);
        assert_eq!(name(&vdi), "vdi");
        assert_eq!(name(b"LUKS\xba\xbe\0\x01"), "luks");
        assert_eq!(name(b"LUKS\xba\xbe\0\x03"), "raw");
        assert_eq!(name(b"WithoutFreeSpace"), "parallels");
        assert_eq!(name(b"Bochs Virtual HD Image\0"), "bochs");
        assert_eq!(probe_bytes(b"anything", "disk.dmg").name, "dmg");
    }

    #[test]
    fn containers_are_refused_by_name() {
        let dev = diskit_backends::MemoryDevice::new(4096);
        dev.write_at(b"vhdxfile", 0, diskit_core::WriteFlags::NONE)
            .unwrap();
        let e = probe(&dev, "a.vhdx").unwrap_err();
        assert!(e.to_string().contains("'vhdx'"), "{e}");
        assert_eq!(by_name("qcow2").unwrap().format, Some(Format::Qcow2));
        assert!(by_name("vmdk").unwrap().format.is_none());
    }
}
