//! Format probing from the first bytes of an image, by table.
//!
//! Every format QEMU recognises has a probe in its own module, scored as
//! QEMU scores it (the highest score wins; raw scores 1), named by its row
//! in [`FORMATS`](crate::table::FORMATS). A format diskit recognises but does
//! not read yet is refused by name: a container is never read as raw
//! because its driver is missing.

use diskit_core::{BlockDevice, Result};

use crate::driver::{Format, unsupported};
use crate::table::FORMATS;

/// How many bytes of the image probing looks at (QEMU's
/// BLOCK_PROBE_BUF_SIZE).
pub const PROBE_BYTES: usize = 512;

/// 100 when `magic` stands at byte `at` of `h`, else 0: the probe of
/// most formats.
pub(crate) fn magic_at(h: &[u8], at: usize, magic: &[u8]) -> u32 {
    u32::from(h.get(at..at + magic.len()) == Some(magic)) * 100
}

/// The format the first bytes of `filename` belong to, supported or not.
pub fn probe_bytes(head: &[u8], filename: &str) -> Format {
    let head = &head[..head.len().min(PROBE_BYTES)];
    let mut best = Format::RAW;
    let mut best_score = 0;
    for row in FORMATS {
        let score = (row.probe)(head, filename);
        if score > best_score {
            best = Format(row.driver);
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
