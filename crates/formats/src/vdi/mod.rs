//! VDI, VirtualBox's format (`-f vdi`): a header, a block map of 1 MiB
//! blocks, and the blocks in the order they were first written (dynamic)
//! or all of them (static).
//!
//! [`header`] parses and validates; [`device`] answers where a guest
//! range lives (the generic mapped layer reads) and allocates blocks on
//! writes; creation and `check` are here, with qemu-img's options,
//! messages and exit codes.

pub mod device;
pub mod header;

use std::sync::Arc;

use diskit_backends::Preallocation;
use diskit_core::{Error, Result, StorageRef};

use crate::check::{CheckReport, Repair};
use crate::creation::{Basics, FormatOptions, NewFiles, Offered, Planned, given_summary};
use crate::driver::{FormatDriver, Opened, Opening};
use crate::image_ops::{Capability, FormatImage};
use crate::info::FormatInfo;
use crate::{Format, OptionList};

use device::Vdi;
use header::{BLOCK_SIZE, DISCARDED, Header, MAX_SIZE, UNALLOCATED};

/// The creation options vdi offers.
const OFFERED: Offered = Offered(&[
    "size=<size>            - Virtual disk size",
    "static=<bool (on/off)> - VDI static (pre-allocated) image",
]);

/// Validated creation options.
#[derive(Debug, Clone, Default)]
pub struct VdiCreateOptions {
    /// Every block allocated at creation.
    pub static_image: bool,
    /// `preallocation=` as given.
    pub preallocation: Option<String>,
    /// Protocol options as given, for the "Formatting" line.
    given: Vec<(String, String)>,
}

impl VdiCreateOptions {
    /// Parses `-o`: unknown keys and malformed values are errors.
    pub fn parse(options: &OptionList) -> Result<VdiCreateOptions> {
        OFFERED.check(options)?;
        Ok(VdiCreateOptions {
            static_image: options.flag("static")?.unwrap_or(false),
            preallocation: options.text("preallocation"),
            given: options.given(&["preallocation", "nocow", "extent_size_hint"]),
        })
    }
}

/// A random version 4 UUID in the byte order VDI stores (Microsoft's: the
/// first three fields little-endian).
fn new_uuid() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    crate::luks::keys::random(&mut b)?;
    b[7] = (b[7] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    Ok(b)
}

/// Makes a VDI image of `size` bytes at `path`, as `qemu-img create -f
/// vdi` does (a failed creation removes the file it made).
pub fn create(
    target: &mut dyn crate::creation::NewFiles,
    size: u64,
    o: &VdiCreateOptions,
) -> Result<()> {
    let size = size.div_ceil(512) * 512;
    if size > MAX_SIZE {
        return Err(Error::invalid(format!(
            "Unsupported VDI image size (size is {size:#x}, max supported is {MAX_SIZE:#x})"
        )));
    }
    let prealloc = match o.preallocation.as_deref() {
        None => Preallocation::Off,
        Some("metadata") => {
            return Err(Error::unsupported(
                "Unsupported preallocation mode: metadata",
            ));
        }
        Some(p) => Preallocation::parse(p)
            .map_err(|_| Error::invalid(format!("invalid parameter value: {p}")))?,
    };
    crate::creation::make_image(target, |dev| {
        let h = Header::new(size, o.static_image, [new_uuid()?, new_uuid()?]);
        let mut bmap = vec![0u8; h.bmap_len() as usize];
        for i in 0..h.blocks_in_image {
            let e = if o.static_image { i } else { UNALLOCATED };
            bmap[i as usize * 4..i as usize * 4 + 4].copy_from_slice(&e.to_le_bytes());
        }
        dev.write_extend(&h.to_bytes(), 0)?;
        if !bmap.is_empty() {
            dev.write_extend(&bmap, h.offset_bmap as u64)?;
        }
        if o.static_image {
            let end = h.offset_data as u64 + h.blocks_in_image as u64 * BLOCK_SIZE;
            dev.resize(end, prealloc)?;
        }
        Ok(())
    })
}

impl FormatOptions for VdiCreateOptions {
    fn summary(&self, _: &Basics) -> String {
        let on = if self.static_image { "on" } else { "off" };
        format!(" static={on}{}", given_summary(&self.given))
    }

    fn make(&self, target: &mut dyn NewFiles, size: u64, _: &Basics) -> Result<()> {
        create(target, size, self)
    }
}

/// Checks the block map as qemu-img does: every allocated entry below the
/// block count and used once, and as many as the header says.
pub fn check(storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
    if repair != Repair::None {
        return Err(Error::unsupported(
            "This image format does not support checks",
        ));
    }
    let vdi = Vdi::open(storage.clone(), false)?;
    let h = vdi.header();
    let map = vdi.block_map();
    let mut r = CheckReport::default();
    let mut used = vec![false; h.blocks_in_image as usize];
    let mut allocated = 0u32;
    for (i, &e) in map.iter().enumerate() {
        if e >= DISCARDED {
            continue;
        }
        if e >= h.blocks_in_image {
            r.messages
                .push(format!("ERROR: block index {i} too large, is {e}"));
            r.corruptions += 1;
            continue;
        }
        if used[e as usize] {
            r.messages
                .push(format!("ERROR: block index {e} also used by {e}"));
            r.corruptions += 1;
        } else {
            used[e as usize] = true;
        }
        allocated += 1;
    }
    if allocated != h.blocks_allocated {
        r.messages.push(format!(
            "ERROR: allocated blocks mismatch, is {allocated}, should be {}",
            h.blocks_allocated
        ));
        r.corruptions += 1;
    }
    Ok(r)
}

/// vdi's probe: the signature after the 64-byte text.
pub fn probe(h: &[u8], _: &str) -> u32 {
    crate::probe::magic_at(h, 0x40, &0xbeda_107fu32.to_le_bytes())
}

/// The vdi driver.
pub struct VdiDriver;

impl FormatDriver for VdiDriver {
    fn name(&self) -> &'static str {
        "vdi"
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let Opening { storage, opts, .. } = at;
        let vdi = Arc::new(
            Vdi::open(storage.clone(), opts.writable)?.keeping_allocations(opts.keep_allocations),
        );
        Ok(Opened {
            device: vdi.clone(),
            image: Arc::new(VdiImage),
        })
    }

    fn supports(&self, what: Capability) -> bool {
        matches!(what, Capability::Check)
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        Planned::boxed(options, VdiCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("vdi", with_file)
    }

    fn check(&self, storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
        check(storage, repair)
    }
}

/// An open VDI image (its device answers everything but the format's
/// fixed facts).
pub struct VdiImage;

impl FormatImage for VdiImage {
    fn format(&self) -> Format {
        Format::VDI
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        Ok(Some(FormatInfo::plain(Some(BLOCK_SIZE))))
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(BLOCK_SIZE)
    }
}
