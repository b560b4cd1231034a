//! VMDK, VMware's format (QEMU's `vmdk`): a descriptor naming the disk's
//! extents, each a flat file or a sparse file of grains mapped through a
//! grain directory and grain tables (hosted "KDMV" sparse, streamOptimized
//! with deflated grains, ESX "COWD" sparse), with an optional parent.
//!
//! [`descriptor`] reads and writes the text, [`header`] the binary
//! structures, [`sparse`] maps and allocates grains, [`device`] joins the
//! extents into the disk, [`create`] makes new disks as qemu-img makes
//! them. The files a descriptor names and the parent are opened through
//! the opener ([`ImpliedFiles`]), so that the trust gate covers them.

pub mod create;
pub mod descriptor;
pub mod device;
pub mod header;
pub mod sesparse;
pub mod sparse;

use std::sync::Arc;

use diskit_core::{Error, Result, StorageRef};

use crate::check::{CheckReport, Repair};
use crate::driver::{FormatDriver, Opened, Opening};
use crate::image_ops::{Capability, FormatImage};
use crate::implied::{ImpliedFiles, Named, Role};
use crate::info::{ChildFile, FormatInfo, InfoValue};
use crate::mapped::{Backing, Mapped, Place};
use crate::{Format, OpenOptions, OptionList};

use create::VmdkCreateOptions;
use descriptor::{Descriptor, ExtentKind};
use device::{DescriptorHome, ExtentData, Vmdk, VmdkExtent};
use header::{COWD, KDMV, SECTOR, SparseHeader};
use sparse::SparseExtent;

/// Bytes of a descriptor area QEMU reads the content IDs from.
const EMBEDDED_TEXT: u64 = 10240;

/// Reads up to `max` bytes at 0 of `file` (zero-padded to whole sectors).
fn read_head(file: &StorageRef, max: u64) -> Result<Vec<u8>> {
    let len = file.file_len()?;
    let n = len
        .div_ceil(SECTOR)
        .saturating_mul(SECTOR)
        .min(max)
        .max(SECTOR);
    let mut b = vec![0u8; n as usize];
    file.read_padded(&mut b, 0)?;
    Ok(b)
}

/// The bytes of a sparse file's embedded descriptor (QEMU reads it at
/// sector 1, whatever the header says), up to its first NUL.
fn embedded_text(file: &StorageRef, h: &SparseHeader) -> Result<Vec<u8>> {
    let len = if h.desc_offset == 1 {
        h.desc_sectors
            .saturating_mul(SECTOR)
            .clamp(EMBEDDED_TEXT, descriptor::MAX_TEXT as u64)
    } else {
        EMBEDDED_TEXT
    };
    let mut b = vec![0u8; len as usize];
    file.read_padded(&mut b, SECTOR)?;
    Ok(descriptor::bytes_of(&b))
}

/// The bytes of the descriptor area at sector 1 that a new content ID may
/// be written over: QEMU's 10 KiB, never reaching the directories.
fn embedded_area(h: &SparseHeader) -> u64 {
    let mut len = EMBEDDED_TEXT;
    for dir in [h.rgd_offset, h.gd_offset] {
        if dir > 1 {
            len = len.min((dir - 1).saturating_mul(SECTOR));
        }
    }
    len
}

/// What an opened disk's descriptor says of it.
pub struct Facts {
    /// `createType` (a sparse file's own type for a monolithic one).
    pub create_type: String,
    /// The content ID.
    pub cid: u32,
    /// The parent's content ID.
    pub parent_cid: u32,
    /// `parentFileNameHint`.
    pub parent: Option<String>,
    /// The file of a monolithic disk is its only extent.
    pub monolithic: bool,
}

/// Opens one extent a descriptor names.
fn open_extent(
    line: &descriptor::ExtentLine,
    start: u64,
    writable: bool,
    backing: Option<&Backing>,
    implied: &mut dyn ImpliedFiles,
) -> Result<VmdkExtent> {
    let file = implied.extent(&line.file, writable)?;
    let name = file.location().to_string();
    let too_big = || {
        Error::invalid(format!(
            "Invalid extent line: extent '{}' is too big",
            line.file
        ))
    };
    let bytes = |sectors: u64| sectors.checked_mul(SECTOR).ok_or_else(too_big);
    if let ExtentKind::Flat { offset } = line.kind {
        // The flat data must be addressable where it is.
        bytes(offset)?
            .checked_add(bytes(line.sectors)?)
            .ok_or_else(too_big)?;
    }
    let (size, data) = match line.kind {
        ExtentKind::Flat { offset } => (
            bytes(line.sectors)?,
            ExtentData::Flat {
                file,
                offset: bytes(offset)?,
            },
        ),
        ExtentKind::Vmfs => (bytes(line.sectors)?, ExtentData::Flat { file, offset: 0 }),
        ExtentKind::Sparse | ExtentKind::VmfsSparse => {
            let head = read_head(&file, SECTOR)?;
            if &head[..4] != KDMV && &head[..4] != COWD {
                return Err(Error::invalid("Image not in VMDK format"));
            }
            let below = backing.and_then(|b| sparse::shifted_backing(b, start));
            let s = SparseExtent::open(file, &head, writable, below)?;
            (s.capacity(), ExtentData::Sparse(Arc::new(Mapped::new(s))))
        }
        ExtentKind::SeSparse => {
            let below = backing.and_then(|b| sparse::shifted_backing(b, start));
            let s = sesparse::SeSparseExtent::open(file, writable, below)?;
            (s.capacity(), ExtentData::SeSparse(Arc::new(s)))
        }
    };
    Ok(VmdkExtent {
        start,
        size,
        name,
        kind: line.kind.name(),
        data,
    })
}

/// Opens a VMDK disk whose descriptor (or sparse file) is `file`.
pub fn open(
    file: StorageRef,
    opts: &OpenOptions,
    implied: &mut dyn ImpliedFiles,
) -> Result<(Arc<Vmdk>, Facts)> {
    if file.file_len()? == 0 {
        return Err(Error::invalid("File is too small, not a valid image"));
    }
    let head = read_head(&file, SECTOR)?;
    let writable = opts.writable;
    if &head[..4] == COWD {
        // A COWD file on its own has no descriptor to name its IDs.
        return Err(Error::invalid(
            "Invalid argument: a vmfsSparse extent needs its descriptor file",
        ));
    }
    let sparse = (&head[..4] == KDMV).then(|| SparseHeader::parse(&head));
    if let Some(h) = sparse
        .as_ref()
        .filter(|h| !(h.capacity == 0 && h.desc_offset != 0))
    {
        // A monolithic sparse or stream file: its own only extent.
        let raw = embedded_text(&file, h)?;
        let text = descriptor::text_of(&raw);
        let (cid, parent_cid) = descriptor::content_ids(&text)?;
        let parent = descriptor::parent_hint(&text);
        let backing = open_backing(parent.as_deref(), implied)?;
        let s = SparseExtent::open(file.clone(), &head, writable, backing.clone())?;
        let create_type = if s.geometry().compressed {
            "streamOptimized"
        } else {
            "monolithicSparse"
        };
        let extent = VmdkExtent {
            start: 0,
            size: s.capacity(),
            name: file.location().to_string(),
            kind: "",
            data: ExtentData::Sparse(Arc::new(Mapped::new(s))),
        };
        let home = DescriptorHome::Embedded {
            file: file.clone(),
            offset: SECTOR,
            len: embedded_area(h),
        };
        let vmdk = Vmdk::new(vec![extent], writable, raw, home, backing)?;
        return Ok((
            Arc::new(vmdk),
            Facts {
                create_type: create_type.into(),
                cid,
                parent_cid,
                parent,
                monolithic: true,
            },
        ));
    }
    // A descriptor: a file of its own, or embedded in an empty sparse file.
    let (bytes, home) = match &sparse {
        Some(h) => {
            let len = h
                .desc_sectors
                .saturating_mul(SECTOR)
                .min(descriptor::MAX_TEXT as u64);
            let mut b = vec![0u8; len as usize];
            file.read_padded(&mut b, h.desc_offset.saturating_mul(SECTOR))?;
            let home = DescriptorHome::Embedded {
                file: file.clone(),
                offset: h.desc_offset.saturating_mul(SECTOR),
                len,
            };
            (b, home)
        }
        None => (
            read_head(&file, descriptor::MAX_TEXT as u64)?,
            DescriptorHome::File(file.clone()),
        ),
    };
    let d = Descriptor::parse(&bytes)?;
    let backing = open_backing(d.parent.as_deref(), implied)?;
    let mut extents = Vec::with_capacity(d.extents.len());
    let mut start = 0u64;
    for line in &d.extents {
        let e = open_extent(line, start, writable, backing.as_ref(), implied)?;
        start = start
            .checked_add(e.size)
            .ok_or_else(|| Error::invalid("The VMDK extents add up to more than 16 EiB"))?;
        extents.push(e);
    }
    let vmdk = Vmdk::new(
        extents,
        writable,
        descriptor::bytes_of(&bytes),
        home,
        backing,
    )?;
    Ok((
        Arc::new(vmdk),
        Facts {
            create_type: d.create_type,
            cid: d.cid,
            parent_cid: d.parent_cid,
            parent: d.parent,
            monolithic: false,
        },
    ))
}

/// Opens the parent a descriptor names (always a vmdk).
fn open_backing(name: Option<&str>, implied: &mut dyn ImpliedFiles) -> Result<Option<Backing>> {
    let Some(name) = name else {
        return Ok(None);
    };
    let (device, size) = implied.backing(name, Some("vmdk"))?;
    Ok((size > 0 || device.size() > 0).then_some(Backing { device, size }))
}

/// vmdk's probe: a sparse extent header (VMDK4 or VMDK3) or a text
/// descriptor.
pub fn probe(h: &[u8], _: &str) -> u32 {
    if h.starts_with(b"KDMV") || h.starts_with(b"COWD") {
        100
    } else {
        descriptor::probe_score(h)
    }
}

/// The vmdk driver.
pub struct VmdkDriver;

impl FormatDriver for VmdkDriver {
    fn name(&self) -> &'static str {
        "vmdk"
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let (storage, opts, implied) = (at.storage, at.opts, at.implied);
        let (vmdk, facts) = open(storage, opts, implied)?;
        Ok(Opened {
            device: vmdk.clone(),
            image: Arc::new(VmdkImage { vmdk, facts }),
        })
    }

    fn supports(&self, what: Capability) -> bool {
        matches!(
            what,
            Capability::Check | Capability::BackingFile | Capability::Compression
        )
    }

    fn check_opens_image(&self) -> bool {
        true
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        crate::creation::Planned::boxed(options, VmdkCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        create::OFFERED.help("vmdk", with_file)
    }
}

/// An open VMDK disk.
pub struct VmdkImage {
    vmdk: Arc<Vmdk>,
    facts: Facts,
}

impl VmdkImage {
    /// The grain size when every extent is sparse with one grain size.
    fn common_grain(&self) -> Option<u64> {
        let mut grain = None;
        for e in self.vmdk.extents() {
            let g = e.grain()?;
            match grain {
                None => grain = Some(g),
                Some(c) if c != g => return None,
                Some(_) => {}
            }
        }
        grain
    }
}

impl FormatImage for VmdkImage {
    fn format(&self) -> Format {
        Format::VMDK
    }

    fn implied_names(&self) -> Vec<Named> {
        let mut v = Vec::new();
        if let Some(p) = &self.facts.parent {
            v.push(Named {
                role: Role::Backing,
                name: p.clone(),
                format: Some("vmdk".into()),
            });
        }
        if !self.facts.monolithic {
            for e in self.vmdk.extents() {
                v.push(Named {
                    role: Role::Extent,
                    name: e.name.clone(),
                    format: None,
                });
            }
        }
        v
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        let extents = self
            .vmdk
            .extents()
            .iter()
            .map(|e| {
                let mut d = InfoValue::dict();
                if e.compressed() {
                    d = d.with("compressed", InfoValue::Bool(true));
                }
                d = d
                    .with("virtual-size", InfoValue::UInt(e.size))
                    .with("filename", InfoValue::Str(e.name.clone()));
                if let Some(g) = e.grain() {
                    d = d.with("cluster-size", InfoValue::UInt(g));
                }
                d.with("format", InfoValue::Str(e.kind.into()))
            })
            .collect();
        let mut info = FormatInfo::plain(self.common_grain());
        // QEMU's get_info fails for extents of different kinds.
        let kind = |e: &VmdkExtent| (e.grain(), e.compressed());
        let first = self.vmdk.extents().first().map(kind);
        info.driver_info = self.vmdk.extents().iter().all(|e| Some(kind(e)) == first);
        info.specific_type = "vmdk";
        info.specific = InfoValue::dict()
            .with("cid", InfoValue::UInt(u64::from(self.facts.cid)))
            .with(
                "parent-cid",
                InfoValue::UInt(u64::from(self.facts.parent_cid)),
            )
            .with(
                "create-type",
                InfoValue::Str(self.facts.create_type.clone()),
            )
            .with("extents", InfoValue::List(extents));
        if let Some(p) = &self.facts.parent {
            info.backing_filename = Some(p.clone());
            info.backing_format = Some("vmdk".into());
        }
        if !self.facts.monolithic {
            for (i, e) in self.vmdk.extents().iter().enumerate() {
                let f = e.file();
                info.children.push(ChildFile {
                    name: format!("extents.{i}"),
                    filename: e.name.clone(),
                    protocol: f.protocol(),
                    actual: f.allocated_bytes(),
                    length: f.file_len()?,
                });
            }
        }
        Ok(Some(info))
    }

    fn cluster_size(&self) -> Option<u64> {
        self.common_grain()
    }

    fn data_file_at(&self, guest: u64) -> Option<String> {
        if self.facts.monolithic {
            return None;
        }
        self.vmdk
            .extents()
            .iter()
            .find(|e| guest >= e.start && guest - e.start < e.size)
            .map(|e| e.name.clone())
    }

    fn compressed_writer(self: Arc<Self>) -> Result<(diskit_core::DeviceRef, u64)> {
        let grain = self.common_grain().unwrap_or(64 << 10);
        Ok((self.vmdk.clone(), grain))
    }

    fn needs_compressed_writes(&self) -> bool {
        self.vmdk.extents().iter().any(VmdkExtent::compressed)
    }

    fn check(&self, repair: Repair) -> Result<CheckReport> {
        if repair != Repair::None {
            return Err(Error::unsupported(
                "This image format does not support checks",
            ));
        }
        check(&self.vmdk)
    }
}

/// QEMU's check of a VMDK disk: every allocated grain lies inside its
/// file; the first that does not stops the check.
fn check(vmdk: &Vmdk) -> Result<CheckReport> {
    let mut r = CheckReport::default();
    let fail = |r: &mut CheckReport, msg: String| {
        r.messages.push(msg);
        r.check_errors += 1;
        r.failed = Some("Check failed: Invalid argument".into());
    };
    for e in vmdk.extents() {
        match &e.data {
            ExtentData::Flat { file, offset } => {
                if *offset >= file.file_len()? && e.size > 0 {
                    fail(
                        &mut r,
                        format!(
                            "ERROR: cluster offset for sector {} points after EOF",
                            e.start / SECTOR
                        ),
                    );
                    return Ok(r);
                }
            }
            ExtentData::Sparse(_) | ExtentData::SeSparse(_) => {
                let len = e.file().file_len()?;
                let grain = e.grain().unwrap_or(SECTOR);
                let mut g = 0;
                while g < e.size {
                    let (n, place) = e.locate(g, e.size - g).expect("a sparse extent")?;
                    let host = match place {
                        Place::Data(h) => Some(h),
                        Place::Compressed { offset, .. } => Some(offset),
                        _ => None,
                    };
                    if let Some(h) = host {
                        // Each grain of a data run is its own entry.
                        let last = h.saturating_add((n - 1) / grain * grain);
                        if h >= len || last >= len {
                            let bad = if h >= len { g } else { g + (last - h) };
                            fail(
                                &mut r,
                                format!(
                                    "ERROR: cluster offset for sector {} points after EOF",
                                    (e.start + bad / grain * grain) / SECTOR
                                ),
                            );
                            return Ok(r);
                        }
                    }
                    g += n;
                }
            }
        }
    }
    Ok(r)
}
