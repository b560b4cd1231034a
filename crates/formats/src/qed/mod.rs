//! QED, QEMU's enhanced disk format (`-f qed`): a header cluster, an L1
//! table, L2 tables and data clusters allocated at the end of the file,
//! an optional backing file.
//!
//! [`header`] parses and validates; [`device`] maps (the generic mapped
//! layer reads, backing file included) and writes; creation, `check` (and
//! `-r`), `info` and growing are here, with qemu-img's options, messages
//! and exit codes.

pub mod device;
pub mod header;

use std::sync::Arc;

use diskit_core::{BlockDevice, Error, Result, Storage, StorageRef, WriteFlags};

use crate::check::{CheckReport, Repair};
use crate::creation::{Basics, FormatOptions, NewFiles, Offered, Planned, given_summary};
use crate::driver::{BackingName, FormatDriver, Opened, Opening};
use crate::image_ops::{Capability, FormatImage};
use crate::implied::Named;
use crate::info::FormatInfo;
use crate::mapped::Backing;
use crate::{Format, OptionList, Prealloc};

use device::{Qed, ZERO_CLUSTER};
use header::{
    F_BACKING_FILE, F_BACKING_FORMAT_NO_PROBE, F_NEED_CHECK, HEADER_LEN, Header, MAX_CLUSTER,
    MAX_TABLE, MIN_CLUSTER, max_image_size,
};

/// Reads and validates the header of the image in `file`.
pub fn read_header(file: &dyn Storage) -> Result<Header> {
    let mut b = [0u8; HEADER_LEN];
    file.read_padded(&mut b, 0)?;
    Header::parse(&b, file.file_len()?)
}

/// The backing file name stored in the header cluster, if any.
pub fn backing_name(file: &dyn Storage, h: &Header) -> Result<Option<String>> {
    if h.features & F_BACKING_FILE == 0 || h.backing_filename_size == 0 {
        return Ok(None);
    }
    let mut b = vec![0u8; h.backing_filename_size as usize];
    file.read_padded(&mut b, h.backing_filename_offset as u64)?;
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    Ok(Some(String::from_utf8_lossy(&b[..end]).into_owned()))
}

/// The creation options qed offers.
const OFFERED: Offered = Offered(&[
    "backing_file=<str>     - File name of a base image",
    "backing_fmt=<str>      - Image format of the base image",
    "cluster_size=<size>    - Cluster size (in bytes)",
    "size=<size>            - Virtual disk size",
    "table_size=<size>      - L1/L2 table size (in clusters)",
]);

/// Creation options.
#[derive(Debug, Clone, Default)]
pub struct QedCreateOptions {
    cluster_size: Option<u64>,
    table_size: Option<u64>,
    given: Vec<(String, String)>,
}

impl QedCreateOptions {
    /// Parses `-o`.
    pub fn parse(options: &OptionList) -> Result<QedCreateOptions> {
        OFFERED.check(options)?;
        Ok(QedCreateOptions {
            cluster_size: options.size("cluster_size")?,
            table_size: options.size("table_size")?,
            given: options.given(&["nocow", "preallocation", "extent_size_hint"]),
        })
    }
}

/// Records `name` (of format `format`) as the backing file of the closed
/// image on `storage`, or none, as QEMU does: the header is rewritten with
/// the name right after it (the raw-format bit set for a raw backing file),
/// all within the header clusters.
fn change_backing_file(storage: &dyn Storage, to: Option<BackingName<'_>>) -> Result<()> {
    let mut h = read_header(storage)?;
    // An unknown compatible feature may keep data after the header.
    if to.is_some() && h.compat_features != 0 {
        return Err(Error::from_kind(diskit_core::ErrorKind::NotSupported));
    }
    h.features &= !(F_BACKING_FILE | F_BACKING_FORMAT_NO_PROBE);
    let name = to.map_or("", |b| b.file);
    if !name.is_empty() {
        h.features |= F_BACKING_FILE;
        if to.is_some_and(|b| b.format == "raw") {
            h.features |= F_BACKING_FORMAT_NO_PROBE;
        }
    }
    h.backing_filename_offset = HEADER_LEN as u32;
    h.backing_filename_size = name.len() as u32;
    if HEADER_LEN as u64 + name.len() as u64 > u64::from(h.header_size) * u64::from(h.cluster_size)
    {
        return Err(Error::from_kind(diskit_core::ErrorKind::NoSpace));
    }
    let mut buf = h.to_bytes().to_vec();
    buf.extend_from_slice(name.as_bytes());
    storage.write_extend(&buf, 0)?;
    storage.flush()
}

impl FormatOptions for QedCreateOptions {
    fn summary(&self, basics: &Basics) -> String {
        let mut out = basics.backing_summary();
        out += &format!(" cluster_size={}", self.cluster_size.unwrap_or(65536));
        if let Some(t) = self.table_size {
            out += &format!(" table_size={t}");
        }
        out + &given_summary(&self.given)
    }

    /// Makes a QED image (with the backing file `basics` name) where
    /// `target` says, as `qemu-img create -f qed` does.
    fn make(&self, target: &mut dyn NewFiles, size: u64, basics: &Basics) -> Result<()> {
        let cs = self.cluster_size.unwrap_or(65536);
        let ts = self.table_size.unwrap_or(4);
        if !cs.is_power_of_two() || !(MIN_CLUSTER as u64..=MAX_CLUSTER as u64).contains(&cs) {
            return Err(Error::invalid(format!(
                "QED cluster size must be within range [{MIN_CLUSTER}, {MAX_CLUSTER}] and power of 2"
            )));
        }
        if !ts.is_power_of_two() || ts > MAX_TABLE as u64 {
            return Err(Error::invalid(format!(
                "QED table size must be within range [1, {MAX_TABLE}] and power of 2"
            )));
        }
        let max = max_image_size(cs as u32, ts as u32);
        let size = size.div_ceil(512) * 512;
        if size > max {
            return Err(Error::invalid(format!(
                "QED image size must be a non-zero multiple of cluster size and less than {max} bytes"
            )));
        }
        let mut h = Header {
            cluster_size: cs as u32,
            table_size: ts as u32,
            header_size: 1,
            features: 0,
            compat_features: 0,
            autoclear_features: 0,
            l1_table_offset: cs,
            image_size: size,
            backing_filename_offset: 0,
            backing_filename_size: 0,
        };
        if let Some(b) = &basics.backing_file {
            h.features |= F_BACKING_FILE;
            if basics.backing_fmt.as_deref() == Some("raw") {
                h.features |= F_BACKING_FORMAT_NO_PROBE;
            }
            h.backing_filename_offset = HEADER_LEN as u32;
            h.backing_filename_size = b.len() as u32;
            if HEADER_LEN as u64 + b.len() as u64 > cs {
                return Err(Error::invalid("No space left in the file header"));
            }
        }
        crate::creation::make_image(target, |dev| {
            dev.write_extend(&h.to_bytes(), 0)?;
            if let Some(b) = &basics.backing_file {
                dev.write_extend(b.as_bytes(), HEADER_LEN as u64)?;
            }
            dev.write_extend(&vec![0u8; (ts * cs) as usize], cs)?;
            Ok(())
        })
    }
}

/// Checks (and with `repair`, repairs) the tables as qemu-img does:
/// every table and cluster inside the file and referenced once; leaks
/// counted, never repaired; invalid entries dropped with `-r`.
pub fn check(storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
    let h = read_header(&**storage)?;
    let fix = repair != Repair::None;
    let mut r = walk(storage, &h, fix)?;
    if fix {
        let again = walk(storage, &h, false)?;
        let fixed = r.corruptions_fixed;
        r = again;
        r.corruptions_fixed = fixed;
        if r.corruptions == 0 && r.check_errors == 0 && h.features & F_NEED_CHECK != 0 {
            let mut clean = h.clone();
            clean.features &= !F_NEED_CHECK;
            storage.flush()?;
            storage.write_at(&clean.to_bytes(), 0, WriteFlags::NONE)?;
            storage.flush()?;
        }
    }
    Ok(r)
}

fn walk(storage: &StorageRef, h: &Header, fix: bool) -> Result<CheckReport> {
    let cs = h.cluster_size as u64;
    let file_size = storage.file_len()? / cs * cs;
    let nclusters = file_size / cs;
    let mut used = vec![false; nclusters as usize];
    let mut r = CheckReport {
        total_clusters: h.image_size.div_ceil(cs),
        ..Default::default()
    };
    let mark = |off: u64, n: u64, used: &mut Vec<bool>| -> u64 {
        let mut dups = 0;
        for c in off / cs..off / cs + n {
            match used.get_mut(c as usize) {
                Some(u) if *u => dups += 1,
                Some(u) => *u = true,
                None => {}
            }
        }
        dups
    };
    for c in 0..h.header_size as u64 {
        if let Some(u) = used.get_mut(c as usize) {
            *u = true;
        }
    }
    mark(h.l1_table_offset, h.table_size as u64, &mut used);
    let read = |off: u64| -> Result<Vec<u64>> {
        let mut raw = vec![0u8; h.table_bytes() as usize];
        storage.read_at(&mut raw, off)?;
        Ok(crate::bytes::le64s(&raw))
    };
    let write = |off: u64, t: &[u64]| -> Result<()> {
        let b: Vec<u8> = t.iter().flat_map(|e| e.to_le_bytes()).collect();
        storage.write_at(&b, off, WriteFlags::NONE)
    };
    let mut l1 = read(h.l1_table_offset)?;
    let mut l1_fixed = false;
    for slot in l1.iter_mut() {
        let l2_off = *slot;
        if l2_off == 0 {
            continue;
        }
        if !h.table_offset_ok(l2_off, file_size) {
            if fix {
                *slot = 0;
                l1_fixed = true;
                r.corruptions_fixed += 1;
            } else {
                r.corruptions += 1;
            }
            continue;
        }
        let dups = mark(l2_off, h.table_size as u64, &mut used);
        if dups > 0 {
            r.corruptions += dups;
            continue;
        }
        let mut l2 = match read(l2_off) {
            Ok(t) => t,
            Err(_) => {
                r.check_errors += 1;
                continue;
            }
        };
        let mut l2_fixed = false;
        let mut last: Option<u64> = None;
        for entry in l2.iter_mut() {
            let e = *entry;
            if e == 0 || e == ZERO_CLUSTER {
                continue;
            }
            r.allocated_clusters += 1;
            if last.is_some_and(|p| p.checked_add(cs) != Some(e)) {
                r.fragmented_clusters += 1;
            }
            last = Some(e);
            if !h.cluster_offset_ok(e, file_size) {
                if fix {
                    *entry = 0;
                    l2_fixed = true;
                    r.corruptions_fixed += 1;
                } else {
                    r.corruptions += 1;
                }
                continue;
            }
            if mark(e, 1, &mut used) > 0 {
                r.corruptions += 1;
            }
        }
        if l2_fixed {
            write(l2_off, &l2)?;
        }
    }
    if l1_fixed {
        write(h.l1_table_offset, &l1)?;
    }
    if r.check_errors == 0 {
        r.leaks = used
            .iter()
            .skip(h.header_size as usize)
            .filter(|u| !**u)
            .count() as u64;
    }
    if fix {
        storage.flush()?;
    }
    Ok(r)
}

/// qed's probe: its magic.
pub fn probe(h: &[u8], _: &str) -> u32 {
    crate::probe::magic_at(h, 0, b"QED\0")
}

/// The qed driver.
pub struct QedDriver;

impl FormatDriver for QedDriver {
    fn name(&self) -> &'static str {
        "qed"
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let (storage, opts, implied) = (at.storage, at.opts, at.implied);
        let mut h = read_header(&*storage)?;
        if opts.writable {
            if h.features & F_NEED_CHECK != 0 {
                let r = check(&storage, Repair::All)?;
                if r.corruptions > 0 || r.check_errors > 0 {
                    return Err(Error::invalid("Image corrupted"));
                }
                h = read_header(&*storage)?;
            }
            if h.autoclear_features != 0 {
                h.autoclear_features = 0;
                storage.write_at(&h.to_bytes(), 0, WriteFlags::NONE)?;
                storage.flush()?;
            }
        }
        let backing = match backing_name(&*storage, &h)? {
            None => None,
            Some(name) => {
                let fmt = (h.features & F_BACKING_FORMAT_NO_PROBE != 0).then_some("raw");
                let (device, size) = implied.backing(&name, fmt)?;
                Some(Backing { device, size })
            }
        };
        let qed = Arc::new(
            Qed::open(storage.clone(), h, backing, opts.writable)?
                .keeping_allocations(opts.keep_allocations),
        );
        Ok(Opened {
            device: qed.clone(),
            image: Arc::new(QedImage { qed, storage }),
        })
    }

    fn supports(&self, what: Capability) -> bool {
        matches!(what, Capability::Check | Capability::BackingFile)
    }

    fn change_backing_file(&self, file: &dyn Storage, to: Option<BackingName<'_>>) -> Result<()> {
        change_backing_file(file, to)
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        Planned::boxed(options, QedCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("qed", with_file)
    }

    fn check(&self, storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
        check(storage, repair)
    }
}

/// An open QED image.
pub struct QedImage {
    qed: Arc<crate::mapped::Mapped<Qed>>,
    storage: StorageRef,
}

impl FormatImage for QedImage {
    fn format(&self) -> Format {
        Format::QED
    }

    fn implied_names(&self) -> Vec<Named> {
        match backing_name(&*self.storage, &self.qed.header()) {
            Ok(Some(name)) => {
                let h = self.qed.header();
                vec![Named {
                    role: crate::implied::Role::Backing,
                    name,
                    format: (h.features & F_BACKING_FORMAT_NO_PROBE != 0).then(|| "raw".into()),
                }]
            }
            _ => Vec::new(),
        }
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        let h = self.qed.header();
        let backing = backing_name(&*self.storage, &h)?;
        Ok(Some(FormatInfo {
            backing_format: backing
                .as_ref()
                .filter(|_| h.features & F_BACKING_FORMAT_NO_PROBE != 0)
                .map(|_| "raw".to_string()),
            backing_filename: backing,
            ..FormatInfo::plain(Some(h.cluster_size as u64))
        }))
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.qed.header().cluster_size as u64)
    }

    fn check_resize(&self, _new_size: u64, _prealloc: Option<Prealloc>) -> Result<()> {
        // The driver's own rules come after qemu-img's shrink rule
        // (see `resize`).
        Ok(())
    }

    fn resize(&self, new_size: u64, _shrink: bool, prealloc: Prealloc) -> Result<()> {
        // Growing over a backing file longer than the image was must make
        // the grown range read zeros (QEMU's bdrv_co_truncate), which QED
        // cannot promise: refused as QEMU refuses it, before anything else.
        let old = self.qed.header().image_size;
        if new_size > old
            && crate::mapped::MappedFormat::backing(self.qed.format()).is_some_and(|b| b.size > old)
        {
            return Err(Error::unsupported(
                "Block driver does not support requested flags",
            ));
        }
        if prealloc != Prealloc::Off {
            return Err(Error::unsupported(format!(
                "Unsupported preallocation mode '{}'",
                prealloc.name()
            )));
        }
        let h = self.qed.header();
        if !new_size.is_multiple_of(512) || new_size > max_image_size(h.cluster_size, h.table_size)
        {
            return Err(Error::invalid("Invalid image size specified"));
        }
        if new_size < h.image_size {
            return Err(Error::unsupported(
                "Shrinking images is currently not supported",
            ));
        }
        self.qed.set_image_size(new_size)
    }
}
