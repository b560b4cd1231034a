//! Formats QEMU knows that diskit only recognises: each has a row in
//! [`FORMATS`](crate::table::FORMATS) with its probe here, so that an
//! image of it is refused by name and never read as raw.

use crate::driver::FormatDriver;
use crate::probe::magic_at;

/// A format QEMU knows that diskit only recognises, by its name.
pub struct Recognised(pub &'static str);

impl FormatDriver for Recognised {
    fn name(&self) -> &'static str {
        self.0
    }
    fn supported(&self) -> bool {
        false
    }
}

/// qcow (version 1).
pub fn qcow1(h: &[u8], _: &str) -> u32 {
    u32::from(crate::qcow2::driver::qcow_version(h) == Some(1)) * 100
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
