//! New VMDK disks, laid out as qemu-img lays them out: every subformat,
//! the options and their refusals, the descriptor text.

use std::path::{Path, PathBuf};

use diskit_core::{Error, Result};

use super::descriptor::NewDescriptor;
use super::header::{
    COMPRESS_DEFLATE, DESC_SECTORS, FLAG_COMPRESSED, FLAG_MARKERS, FLAG_NL_DETECT, FLAG_RGD,
    FLAG_ZEROED_GRAIN, GRAIN_SECTORS, GTES_PER_GT, SECTOR, SparseHeader,
};
use crate::OptionList;
use crate::creation::{Basics, FormatOptions, NewFiles, Offered, given_summary};

/// Sparse extents hold less than this (a grain count in 32 bits).
const MAX_SPARSE: u64 = 256 << 40;

/// The most a twoGbMaxExtent extent holds.
const MAX_EXTENT: u64 = 2 << 30;

/// The subformats qemu-img creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subformat {
    /// One sparse file, descriptor embedded.
    MonolithicSparse,
    /// A descriptor file and one raw file.
    MonolithicFlat,
    /// A descriptor file and sparse files of 2 GiB at most.
    TwoGbSparse,
    /// A descriptor file and raw files of 2 GiB at most.
    TwoGbFlat,
    /// One sparse file of compressed grains.
    StreamOptimized,
}

impl Subformat {
    /// The subformat `createType` names.
    pub fn parse(s: &str) -> Option<Subformat> {
        Some(match s {
            "monolithicSparse" => Subformat::MonolithicSparse,
            "monolithicFlat" => Subformat::MonolithicFlat,
            "twoGbMaxExtentSparse" => Subformat::TwoGbSparse,
            "twoGbMaxExtentFlat" => Subformat::TwoGbFlat,
            "streamOptimized" => Subformat::StreamOptimized,
            _ => return None,
        })
    }

    /// Its `createType`.
    pub fn name(self) -> &'static str {
        match self {
            Subformat::MonolithicSparse => "monolithicSparse",
            Subformat::MonolithicFlat => "monolithicFlat",
            Subformat::TwoGbSparse => "twoGbMaxExtentSparse",
            Subformat::TwoGbFlat => "twoGbMaxExtentFlat",
            Subformat::StreamOptimized => "streamOptimized",
        }
    }

    fn flat(self) -> bool {
        matches!(self, Subformat::MonolithicFlat | Subformat::TwoGbFlat)
    }
}

/// The creation options vmdk offers.
pub(crate) const OFFERED: Offered = Offered(&[
    "adapter_type=<str>     - Virtual adapter type, can be one of ide (default), lsilogic, buslogic or legacyESX",
    "backing_file=<str>     - File name of a base image",
    "backing_fmt=<str>      - Must be 'vmdk' if present",
    "compat6=<bool (on/off)> - VMDK version 6 image",
    "hwversion=<str>        - VMDK hardware version",
    "size=<size>            - Virtual disk size",
    "subformat=<str>        - VMDK flat extent format, can be one of {monolithicSparse (default) | monolithicFlat | twoGbMaxExtentSparse | twoGbMaxExtentFlat | streamOptimized} ",
    "toolsversion=<str>     - VMware guest tools version",
    "zeroed_grain=<bool (on/off)> - Enable efficient zero writes using the zeroed-grain GTE feature",
]);

/// Creation options as given.
#[derive(Debug, Clone, Default)]
pub struct VmdkCreateOptions {
    adapter_type: Option<String>,
    compat6: bool,
    hwversion: Option<String>,
    toolsversion: Option<String>,
    subformat: Option<String>,
    zeroed_grain: bool,
    /// The rest as given, for the "Formatting" line.
    given: Vec<(String, String)>,
}

impl VmdkCreateOptions {
    /// Parses `-o`: unknown keys and malformed values are errors.
    pub fn parse(options: &OptionList) -> Result<VmdkCreateOptions> {
        OFFERED.check(options)?;
        Ok(VmdkCreateOptions {
            adapter_type: options.text("adapter_type"),
            compat6: options.flag("compat6")?.unwrap_or(false),
            hwversion: options.text("hwversion"),
            toolsversion: options.text("toolsversion"),
            subformat: options.text("subformat"),
            zeroed_grain: options.flag("zeroed_grain")?.unwrap_or(false),
            given: options.given(&["preallocation", "nocow", "extent_size_hint"]),
        })
    }
}

impl FormatOptions for VmdkCreateOptions {
    /// qemu-img's order: compat6 and hwversion always, with their defaults.
    fn summary(&self, basics: &Basics) -> String {
        let mut out = String::new();
        if let Some(a) = &self.adapter_type {
            out += &format!(" adapter_type={a}");
        }
        out += &basics.backing_summary();
        out += &format!(
            " compat6={} hwversion={}",
            if self.compat6 { "on" } else { "off" },
            self.hwversion.as_deref().unwrap_or("undefined")
        );
        if let Some(t) = &self.toolsversion {
            out += &format!(" toolsversion={t}");
        }
        if let Some(s) = &self.subformat {
            out += &format!(" subformat={s}");
        }
        if self.zeroed_grain {
            out += " zeroed_grain=on";
        }
        out + &given_summary(&self.given)
    }

    /// Makes a VMDK disk of `size` bytes where `target` says, as `qemu-img
    /// create -f vmdk` does (its extents beside it).
    fn make(&self, target: &mut dyn NewFiles, size: u64, basics: &Basics) -> Result<()> {
        let path = &PathBuf::from(target.name());
        let sub = match self.subformat.as_deref() {
            None => Subformat::MonolithicSparse,
            Some(s) => Subformat::parse(s)
                .ok_or_else(|| Error::invalid(format!("invalid parameter value: {s}")))?,
        };
        let adapter = self.adapter_type.as_deref().unwrap_or("ide");
        if !["ide", "lsilogic", "buslogic", "legacyESX"].contains(&adapter) {
            return Err(Error::invalid(format!(
                "invalid parameter value: {adapter}"
            )));
        }
        let hw = self.hwversion.as_deref().filter(|h| *h != "undefined");
        if self.compat6 && hw.is_some() {
            return Err(Error::invalid(
                "compat6 cannot be enabled with hwversion set",
            ));
        }
        if self.zeroed_grain && sub.flat() {
            return Err(Error::invalid("Flat image can't enable zeroed grain"));
        }
        let mut parent_cid = 0xffff_ffff;
        if let Some(b) = &basics.backing_file {
            if sub.flat() {
                return Err(Error::invalid("Flat image can't have backing file"));
            }
            if basics.backing_fmt.as_deref().is_some_and(|f| f != "vmdk") {
                return Err(Error::invalid("backing_file must be a vmdk image"));
            }
            let full = if Path::new(b).is_absolute() {
                PathBuf::from(b)
            } else {
                path.parent().unwrap_or(Path::new("")).join(b)
            };
            parent_cid = cid_of(&full)?;
        }
        let mut r = [0u8; 4];
        crate::luks::keys::random(&mut r)?;
        let cid = u32::from_le_bytes(r);
        let size = size.div_ceil(SECTOR) * SECTOR;
        let hw_version = if self.compat6 { "6" } else { hw.unwrap_or("4") };
        let tools = self.toolsversion.as_deref().unwrap_or("2147483647");
        // The extents: (file path, name in the descriptor, bytes).
        let mut parts: Vec<(PathBuf, String, u64)> = Vec::new();
        let own_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match sub {
            Subformat::MonolithicSparse | Subformat::StreamOptimized => {
                parts.push((path.to_path_buf(), own_name, size));
            }
            // An empty flat disk has no extent at all, as qemu-img makes it.
            Subformat::MonolithicFlat if size > 0 => {
                let (p, n) = extent_path(path, "-flat");
                parts.push((p, n, size));
            }
            Subformat::MonolithicFlat => {}
            Subformat::TwoGbSparse | Subformat::TwoGbFlat => {
                let letter = if sub == Subformat::TwoGbFlat {
                    'f'
                } else {
                    's'
                };
                let mut left = size;
                let mut i = 1;
                while left > 0 {
                    let n = left.min(MAX_EXTENT);
                    let (p, name) = extent_path(path, &format!("-{letter}{i:03}"));
                    parts.push((p, name, n));
                    left -= n;
                    i += 1;
                }
            }
        }
        let lines = parts
            .iter()
            .map(|(_, name, bytes)| {
                let sectors = bytes.div_ceil(SECTOR);
                if sub.flat() {
                    format!("RW {sectors} FLAT \"{name}\" 0")
                } else {
                    format!("RW {sectors} SPARSE \"{name}\"")
                }
            })
            .collect();
        let text = NewDescriptor {
            cid,
            parent_cid,
            create_type: sub.name(),
            parent: basics.backing_file.as_deref(),
            extents: lines,
            hw_version,
            size,
            adapter,
            tools_version: tools,
        }
        .text();
        let stream = sub == Subformat::StreamOptimized;
        if matches!(
            sub,
            Subformat::MonolithicSparse | Subformat::StreamOptimized
        ) {
            // qemu-img counts grains in 32 bits and writes a broken layout
            // from 256 TiB on; its embedded descriptor area is 10 KiB, and a
            // longer text would overwrite the directory behind it.
            if size >= MAX_SPARSE {
                return Err(Error::invalid(
                    "The image size is too large for a VMDK sparse extent (at most 256 TiB)",
                ));
            }
            if text.len() as u64 > DESC_SECTORS * SECTOR {
                return Err(Error::invalid(
                    "The VMDK descriptor does not fit in its 10 KiB (a backing file name or \
                     version string too long)",
                ));
            }
            let h = sparse_header(size / SECTOR, stream, self.zeroed_grain);
            return crate::creation::make_image(target, |dev| write_sparse(dev, &h, Some(&text)));
        }
        // The descriptor file first, then its extents, then its text.
        let descriptor = target.make_image()?;
        for (p, _, bytes) in &parts {
            let dev = target.make(&p.display().to_string())?;
            if sub.flat() {
                dev.resize(*bytes, diskit_core::Preallocation::Off)?;
                // QEMU's file driver writes the first block of a new file (so
                // that its allocation is probed cheaply).
                let first = (*bytes).min(4096) as usize;
                if first > 0 {
                    dev.write_extend(&vec![0u8; first], 0)?;
                }
            } else {
                let h = sparse_header(bytes / SECTOR, false, self.zeroed_grain);
                write_sparse(&*dev, &h, None)?;
            }
            dev.flush()?;
        }
        descriptor.write_extend(text.as_bytes(), 0)?;
        descriptor.flush()
    }
}

/// The layout of one new sparse extent of `capacity` sectors, as
/// qemu-img computes it (its u32 arithmetic included).
pub fn sparse_header(capacity: u64, stream: bool, zeroed: bool) -> SparseHeader {
    let grains = capacity.div_ceil(GRAIN_SECTORS) as u32 as u64;
    let gt_count = grains.div_ceil(u64::from(GTES_PER_GT));
    let gt_sectors = u64::from(GTES_PER_GT) * 4 / SECTOR;
    let gd_sectors = (gt_count * 4).div_ceil(SECTOR);
    let rgd = 1 + DESC_SECTORS;
    let gd = rgd + gd_sectors + gt_sectors * gt_count;
    let overhead =
        (gd + gd_sectors + gt_sectors * gt_count).div_ceil(GRAIN_SECTORS) * GRAIN_SECTORS;
    let mut flags = FLAG_NL_DETECT | FLAG_RGD;
    let mut version = 1;
    if zeroed {
        flags |= FLAG_ZEROED_GRAIN;
        version = 2;
    }
    if stream {
        flags |= FLAG_COMPRESSED | FLAG_MARKERS;
        version = 3;
    }
    SparseHeader {
        version,
        flags,
        capacity,
        grain_sectors: GRAIN_SECTORS,
        desc_offset: 1,
        desc_sectors: DESC_SECTORS,
        gtes_per_gt: GTES_PER_GT,
        rgd_offset: rgd,
        gd_offset: gd,
        overhead,
        unclean_shutdown: 0,
        compress: if stream { COMPRESS_DEFLATE } else { 0 },
    }
}

/// Writes a new sparse extent's metadata into `dev` (empty): the header,
/// the file grown to its overhead (the grain tables are holes), both
/// directories pointing at their tables, and the embedded descriptor.
fn write_sparse(
    dev: &dyn diskit_core::Storage,
    h: &SparseHeader,
    descriptor: Option<&str>,
) -> Result<()> {
    let gt_count = h.l1_entries();
    let gd_sectors = (gt_count * 4).div_ceil(SECTOR);
    let gt_sectors = u64::from(h.gtes_per_gt) * 4 / SECTOR;
    dev.write_extend(&h.to_bytes()[..0x4F], 0)?;
    dev.resize(h.overhead * SECTOR, diskit_backends::Preallocation::Off)?;
    for dir in [h.rgd_offset, h.gd_offset] {
        if gt_count == 0 {
            continue;
        }
        let mut b = vec![0u8; (gd_sectors * SECTOR) as usize];
        for i in 0..gt_count {
            let gt = (dir + gd_sectors + i * gt_sectors) as u32;
            b[(i * 4) as usize..(i * 4 + 4) as usize].copy_from_slice(&gt.to_le_bytes());
        }
        dev.write_extend(&b, dir * SECTOR)?;
    }
    if let Some(d) = descriptor {
        dev.write_extend(d.as_bytes(), h.desc_offset * SECTOR)?;
    }
    Ok(())
}

/// The file next to `path` for extent `suffix` (`-flat`, `-s001`...):
/// the name's extension kept after the suffix, as qemu-img names them.
fn extent_path(path: &Path, suffix: &str) -> (PathBuf, String) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let file = match name.rfind('.') {
        Some(dot) => format!("{}{suffix}{}", &name[..dot], &name[dot..]),
        None => format!("{name}{suffix}"),
    };
    (path.with_file_name(&file), file)
}

/// The content ID of an existing vmdk (a new overlay's parentCID).
fn cid_of(path: &Path) -> Result<u32> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)
        .map_err(|e| Error::from(e).context(format!("Could not open '{}'", path.display())))?;
    // The IDs are in the first 10 KiB of the descriptor: at sector 1 of a
    // sparse file, at the start of a descriptor file.
    let mut head = vec![0u8; 0x200 + 10240];
    let mut got = 0;
    while got < head.len() {
        match f.read_at(&mut head[got..], got as u64)? {
            0 => break,
            n => got += n,
        }
    }
    head.truncate(got);
    let text = if head.starts_with(super::header::KDMV) {
        super::descriptor::text_of(head.get(0x200..).unwrap_or(&[]))
    } else {
        super::descriptor::text_of(&head)
    };
    super::descriptor::content_ids(&text)
        .map(|(cid, _)| cid)
        .map_err(|_| Error::invalid("Failed to read parent CID"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_as_qemu_img_makes_them() {
        // (sectors, gd, overhead) from qemu-img 10.
        for (cap, gd, overhead) in [
            (2048, 26, 128),
            (204800, 38, 128),
            (10485760, 663, 1408),
            (4194304, 278, 640),
            (2097152, 150, 384),
        ] {
            let h = sparse_header(cap, false, false);
            assert_eq!((h.gd_offset, h.overhead), (gd, overhead), "{cap}");
            assert_eq!(h.rgd_offset, 21);
        }
        let s = sparse_header(2048, true, true);
        assert_eq!((s.version, s.flags, s.compress), (3, 0x30007, 1));
        assert_eq!(
            extent_path(Path::new("/d/a.b.img"), "-flat").1,
            "a.b-flat.img"
        );
        assert_eq!(extent_path(Path::new("disk"), "-s001").1, "disk-s001");
    }
}
