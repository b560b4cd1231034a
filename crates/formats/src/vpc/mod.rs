//! VHD, Virtual PC's and Hyper-V's older format (QEMU's `vpc`): fixed
//! disks (the data, then a footer) and dynamic ones (a footer copy, a
//! dynamic header, a block allocation table, blocks of a sector bitmap
//! and data, the footer last).
//!
//! [`footer`] parses, checks and writes the structures and computes CHS
//! geometry as QEMU does; [`device`] maps and allocates. The virtual size
//! is read as QEMU 10 reads it (geometry for Virtual PC and QEMU images,
//! the current size for Hyper-V, Azure and the rest), and created as
//! qemu-img creates it: rounded up to a size the geometry can hold, or
//! exact with `force_size=on` (what Azure wants: a fixed VHD of a whole
//! number of MiB).

pub mod device;
pub mod footer;

use std::sync::Arc;

use diskit_backends::Preallocation;
use diskit_core::{Error, Result};

use crate::creation::{Basics, FormatOptions, NewFiles, Offered, Planned, given_summary};
use crate::driver::{FormatDriver, Opened, Opening};
use crate::image_ops::FormatImage;
use crate::info::FormatInfo;
use crate::mapped::Mapped;
use crate::{Format, OptionList};

use device::Vpc;
use footer::{BLOCK_SIZE, Chs, DynHeader, FOOTER_LEN, Footer, MAX_CHS_SECTORS, MAX_SECTORS};

/// The creation options vpc offers.
const OFFERED: Offered = Offered(&[
    "force_size=<bool (on/off)> - Force disk size calculation to use the actual size specified, rather than using the nearest CHS-based calculation",
    "size=<size>            - Virtual disk size",
    "subformat=<str>        - Type of virtual hard disk format. Supported formats are {dynamic (default) | fixed} ",
]);

/// Validated creation options.
#[derive(Debug, Clone, Default)]
pub struct VpcCreateOptions {
    /// `subformat=` as given (checked when the image is made, after
    /// qemu-img's "Formatting" line, as qemu-img checks it).
    subformat: Option<String>,
    force_size: bool,
    preallocation: Option<String>,
    /// Options as given after the size, for the "Formatting" line.
    given: Vec<(String, String)>,
}

impl VpcCreateOptions {
    /// Parses `-o`: unknown keys and malformed values are errors.
    pub fn parse(options: &OptionList) -> Result<VpcCreateOptions> {
        OFFERED.check(options)?;
        Ok(VpcCreateOptions {
            subformat: options.text("subformat"),
            force_size: options.flag("force_size")?.unwrap_or(false),
            preallocation: options.text("preallocation"),
            given: options.given(&[
                "subformat",
                "force_size",
                "preallocation",
                "nocow",
                "extent_size_hint",
            ]),
        })
    }
}

fn too_large() -> Error {
    Error::invalid("The image size is too large for file format 'vpc'")
}

/// The geometry and sectors of a new image of `size` bytes, as qemu-img
/// picks them.
pub fn plan_size(size: u64, force_size: bool) -> Result<(Chs, u64)> {
    if force_size {
        let sectors = size.div_ceil(512);
        if sectors > MAX_SECTORS {
            return Err(too_large());
        }
        return Ok((Chs::for_sectors(MAX_CHS_SECTORS), sectors));
    }
    let ts = (size / 512).min(MAX_CHS_SECTORS);
    let mut i = 0;
    // qemu-img starts from a geometry of zeros: an empty disk keeps it.
    let chs = loop {
        if ts == 0 {
            break Chs {
                cylinders: 0,
                heads: 0,
                sectors: 0,
            };
        }
        let g = Chs::for_sectors(ts + i);
        if g.total() >= ts {
            break g;
        }
        i += 1;
    };
    let sectors = if chs.total() == MAX_CHS_SECTORS {
        size / 512
    } else {
        chs.total()
    };
    if sectors > MAX_SECTORS {
        return Err(too_large());
    }
    Ok((chs, sectors))
}

/// Makes a VHD of `size` bytes at `path` as `qemu-img create -f vpc`
/// does (a failed creation removes the file it made).
pub fn create(
    target: &mut dyn crate::creation::NewFiles,
    size: u64,
    o: &VpcCreateOptions,
) -> Result<()> {
    let fixed = match o.subformat.as_deref() {
        None | Some("dynamic") => false,
        Some("fixed") => true,
        Some(other) => {
            return Err(Error::invalid(format!(
                "Parameter 'subformat' does not accept value '{other}'"
            )));
        }
    };
    let (chs, sectors) = plan_size(size, o.force_size)?;
    let prealloc = match o.preallocation.as_deref() {
        None => Preallocation::Off,
        Some(p) => Preallocation::parse(p)
            .map_err(|_| Error::invalid(format!("invalid parameter value: {p}")))?,
    };
    let bytes = sectors * 512;
    let mut uuid = [0u8; 16];
    crate::luks::keys::random(&mut uuid)?;
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let disk_type = if fixed {
        footer::TYPE_FIXED
    } else {
        footer::TYPE_DYNAMIC
    };
    let f = Footer::new(bytes, chs, disk_type, o.force_size, uuid, now);
    crate::creation::make_image(target, |dev| {
        if fixed {
            dev.resize(bytes, prealloc)?;
            dev.write_extend(f.to_bytes(), bytes)?;
        } else {
            let entries = sectors.div_ceil(BLOCK_SIZE as u64 / 512) as u32;
            let bat_len = (entries as u64 * 4).div_ceil(512) * 512;
            dev.write_extend(f.to_bytes(), 0)?;
            dev.write_extend(&DynHeader::bytes(entries), FOOTER_LEN as u64)?;
            let bat_at = (FOOTER_LEN + footer::DYN_LEN) as u64;
            if bat_len > 0 {
                dev.write_extend(&vec![0xFF; bat_len as usize], bat_at)?;
            }
            dev.write_extend(f.to_bytes(), bat_at + bat_len)?;
        }
        Ok(())
    })
}

impl FormatOptions for VpcCreateOptions {
    fn summary(&self, _: &Basics) -> String {
        given_summary(&self.given)
    }

    fn make(&self, target: &mut dyn NewFiles, size: u64, _: &Basics) -> Result<()> {
        create(target, size, self)
    }
}

/// vpc's (VHD's) probe: the footer copy at the start of a dynamic image.
/// A fixed VHD has its footer only at the end, and QEMU probes it as raw.
pub fn probe(h: &[u8], _: &str) -> u32 {
    crate::probe::magic_at(h, 0, b"conectix")
}

/// The vpc driver.
pub struct VpcDriver;

impl FormatDriver for VpcDriver {
    fn name(&self) -> &'static str {
        "vpc"
    }

    fn open_keys(&self) -> &'static [&'static str] {
        &["force_size_calc"]
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let Opening { storage, opts, .. } = at;
        let calc = match opts
            .node_options
            .iter()
            .find(|(k, _)| k == "force_size_calc")
        {
            Some((_, v)) => footer::SizeCalc::parse(v)?,
            None => footer::SizeCalc::Auto,
        };
        let vpc = Arc::new(
            Vpc::open(storage, opts.writable, calc, opts.host_zeros)?
                .keeping_allocations(opts.keep_allocations),
        );
        Ok(Opened {
            device: vpc.clone(),
            image: Arc::new(VpcImage { vpc }),
        })
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        Planned::boxed(options, VpcCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("vpc", with_file)
    }
}

/// An open VHD.
pub struct VpcImage {
    vpc: Arc<Mapped<Vpc>>,
}

impl FormatImage for VpcImage {
    fn format(&self) -> Format {
        Format::VPC
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        Ok(Some(FormatInfo::plain(self.vpc.dynamic_block_size())))
    }

    fn cluster_size(&self) -> Option<u64> {
        self.vpc.dynamic_block_size()
    }
}
