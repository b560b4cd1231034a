//! Format probing from the first bytes of an image, by table.
//!
//! Every format QEMU recognises has a probe here, scored as QEMU scores it
//! (the highest score wins; raw scores 1), and a row in
//! [`FORMATS`](crate::table::FORMATS). A format diskit recognises but does
//! not read yet is refused by name: a container is never read as raw
//! because its driver is missing.

use diskit_core::{BlockDevice, Result};

use crate::driver::{Format, unsupported};

/// How many bytes of the image probing looks at (QEMU's
/// BLOCK_PROBE_BUF_SIZE).
pub const PROBE_BYTES: usize = 512;

/// qcow2: the qcow magic with version 2 or more.
pub fn qcow2(h: &[u8], _: &str) -> u32 {
    u32::from(qcow_version(h).is_some_and(|v| v >= 2)) * 100
}

/// qcow (version 1).
pub fn qcow1(h: &[u8], _: &str) -> u32 {
    u32::from(qcow_version(h) == Some(1)) * 100
}

/// qed.
pub fn qed(h: &[u8], _: &str) -> u32 {
    magic_at(h, 0, b"QED\0")
}

/// vmdk: a sparse extent header (VMDK4 or VMDK3) or a text descriptor.
pub fn vmdk(h: &[u8], _: &str) -> u32 {
    if h.starts_with(b"KDMV") || h.starts_with(b"COWD") {
        100
    } else {
        vmdk_descriptor_score(h)
    }
}

/// vhdx.
pub fn vhdx(h: &[u8], _: &str) -> u32 {
    magic_at(h, 0, b"vhdxfile")
}

/// vpc (VHD): the footer copy at the start of a dynamic image. A fixed VHD
/// has its footer only at the end, and QEMU probes it as raw.
pub fn vpc(h: &[u8], _: &str) -> u32 {
    magic_at(h, 0, b"conectix")
}

/// vdi: the signature after the 64-byte text.
pub fn vdi(h: &[u8], _: &str) -> u32 {
    magic_at(h, 0x40, &0xbeda_107fu32.to_le_bytes())
}

/// LUKS versions 1 and 2.
pub fn luks(h: &[u8], _: &str) -> u32 {
    let version = h.get(6..8).map(|v| u16::from_be_bytes([v[0], v[1]]));
    u32::from(h.starts_with(b"LUKS\xba\xbe") && matches!(version, Some(1 | 2))) * 100
}

/// Parallels.
pub fn parallels(h: &[u8], _: &str) -> u32 {
    magic_at(h, 0, b"WithoutFreeSpace").max(magic_at(h, 0, b"WithouFreSpacExt"))
}

/// Bochs.
pub fn bochs(h: &[u8], _: &str) -> u32 {
    magic_at(h, 0, b"Bochs Virtual HD Image\0")
}

/// cloop: its shell-script header (QEMU scores it 2).
pub fn cloop(h: &[u8], _: &str) -> u32 {
    const MAGIC: &[u8] = b"#!/bin/sh\n#V2.0 Format\n\
        modprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";
    u32::from(h.starts_with(MAGIC)) * 2
}

/// dmg: QEMU knows it by its name alone.
pub fn dmg(_: &[u8], name: &str) -> u32 {
    u32::from(name.len() > 4 && name.ends_with(".dmg")) * 2
}

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
    // QEMU looks at the first sector only: comment lines and lines of
    // spaces are skipped; the first other line must be the version.
    let h = &h[..h.len().min(512)];
    let mut p = 0;
    while p < h.len() {
        match h[p] {
            b'#' => match h[p..].iter().position(|&b| b == b'\n') {
                Some(n) => p += n + 1,
                None => return 0,
            },
            b' ' => {
                while p < h.len() && h[p] == b' ' {
                    p += 1;
                }
                if h.get(p) == Some(&b'\r') {
                    p += 1;
                }
                if h.get(p) != Some(&b'\n') {
                    return 0;
                }
                p += 1;
            }
            _ => {
                let rest = &h[p..];
                let version = rest.starts_with(b"version=")
                    && matches!(rest.get(8), Some(b'1'..=b'3'))
                    && (rest[9..].starts_with(b"\n") || rest[9..].starts_with(b"\r\n"));
                return u32::from(version) * 100;
            }
        }
    }
    0
}

/// The format the first bytes of `filename` belong to, supported or not.
pub fn probe_bytes(head: &[u8], filename: &str) -> Format {
    let head = &head[..head.len().min(PROBE_BYTES)];
    let mut best = Format::RAW;
    let mut best_score = 0;
    for f in Format::all() {
        let score = f.driver().probe(head, filename);
        if score > best_score {
            best = f;
            best_score = score;
        }
    }
    best
}

/// Probes the image on `dev` (named `filename`) and returns its format; a
/// recognised format without a driver is an error that names it.
pub fn probe(dev: &dyn BlockDevice, filename: &str) -> Result<Format> {
    let mut head = vec![0u8; PROBE_BYTES.min(dev.size() as usize)];
    dev.read_at(&mut head, 0)?;
    let f = probe_bytes(&head, filename);
    if f.driver().supported() {
        Ok(f)
    } else {
        Err(unsupported(f.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(head: &[u8]) -> &'static str {
        probe_bytes(head, "x.img").name()
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
            name(b"# Disk DescriptorFile\n   \r\nversion=1\nCID=fffffffe\n"),
            "vmdk"
        );
        // qemu-img 10 probes these as raw.
        assert_eq!(name(b"# Disk DescriptorFile\n  version=1\n"), "raw");
        assert_eq!(name(b"\nversion=1\n"), "raw");
        assert_eq!(name(b"version=1 \n"), "raw");
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
        assert_eq!(probe_bytes(b"anything", "disk.dmg").name(), "dmg");
    }

    #[test]
    fn containers_are_refused_by_name() {
        let dev = diskit_backends::MemoryDevice::new(4096);
        dev.write_at(b"WithoutFreeSpace", 0, diskit_core::WriteFlags::NONE)
            .unwrap();
        let e = probe(&dev, "a.hds").unwrap_err();
        assert!(e.to_string().contains("'parallels'"), "{e}");
        assert_eq!(Format::from_name("qcow2").unwrap(), Format::QCOW2);
        let e = Format::from_name("parallels").unwrap_err();
        assert!(e.to_string().contains("'parallels'"), "{e}");
        assert!(Format::from_name("nosuch").is_err());
    }
}
