//! diskit-open: one opener that turns a name into storage → format →
//! backing chain, for every tool.
//!
//! A name is a path, a protocol URI (`nbd://`, `nbd+unix://`, `http://`,
//! `null-co://`), `json:{...}`, or qemu-img's `--image-opts` text. All of
//! them become one [`spec::Spec`]; the table of sources
//! ([`protocol::PROTOCOLS`]) opens the storage, the probe table
//! (`diskit_formats::probe`) picks the format, and the files an image names
//! come back here through [`diskit_formats::implied::ImpliedFiles`], where
//! the trust [`gate`] checks them before anything is opened.
//!
//! The format-neutral types tools need (an [`Image`] and what its format
//! offers through [`FormatImage`], [`Format`] and its driver's
//! [`Capability`]s, creation and check types) are re-exported here, so
//! that a tool reaches formats through this crate alone.

pub mod authz;
pub mod create;
pub mod export_bitmaps;
pub mod gate;
pub mod local;
mod nbd_plugin;
pub mod objects;
mod overlay;
pub mod plugin;
pub mod protocol;
mod rbd;
mod s3;
mod scripts;
pub mod spec;
mod ssh;
mod synthetic;
mod waiting;

use std::path::PathBuf;
use std::sync::Arc;

use diskit_core::error::ResultExt;
use diskit_core::{DeviceRef, Error, Result, StorageRef};
use diskit_formats::implied::ImpliedFiles;
use diskit_formats::options::{bool_value, size_value};
use diskit_formats::probe;

pub use diskit_formats::image_ops::{AfterClose, Bits};
pub use diskit_formats::implied::Named;
pub use diskit_formats::info::ChildFile;
pub use diskit_formats::probe::probe as probe_format;
pub use diskit_formats::{
    BackingName, BitmapEdit, BitmapInfo, Capability, CheckReport, Creation, Format, FormatDriver,
    FormatImage, FormatInfo, Image, InfoValue, Measured, NewBitmap, OpenOptions, OptionList,
    Prealloc, Repair, SnapshotInfo,
};
pub use objects::define_object;

use gate::{Role, Trust};
use protocol::{Protocol, StorageOptions};
use spec::{Spec, Value};

/// Backing chains deeper than this are refused (a loop that escaped
/// detection, or an absurd image).
pub const MAX_CHAIN_DEPTH: usize = 256;

/// Opens the image called `name` (a path, a protocol URI or `json:{...}`)
/// with `format`, or the probed format; with
/// [`OpenOptions::temporary_overlay`], under a temporary qcow2 overlay.
pub fn open_image(name: &str, format: Option<Format>, opts: OpenOptions) -> Result<Image> {
    let spec = name_spec(name, format)?;
    open_spec(&spec, name, opts)
}

/// Opens the image described by qemu-img's `--image-opts` text
/// (`driver=qcow2,file.filename=...`), under a temporary overlay as
/// [`open_image`] opens one.
pub fn open_image_opts(text: &str, opts: OpenOptions) -> Result<Image> {
    let spec = spec::parse_image_opts(text)?;
    let display = display_name(&spec).unwrap_or_else(|| text.to_string());
    open_spec(&spec, &display, opts)
}

/// Opens the image `spec` describes, shown as `display`.
fn open_spec(spec: &Spec, display: &str, opts: OpenOptions) -> Result<Image> {
    if opts.temporary_overlay {
        let opts = OpenOptions {
            temporary_overlay: false,
            ..opts
        };
        return overlay::open(spec, display, &opts);
    }
    Chain::new(&opts).open(spec, display, &opts)
}

/// Opens the storage called `name` (a path or a protocol URI) with no
/// format over it: for tools that work on an image's own bytes (check).
pub fn open_storage(name: &str, writable: bool) -> Result<StorageRef> {
    open_storage_with(
        name,
        StorageOptions {
            writable,
            ..Default::default()
        },
    )
}

/// Opens the storage called `name` as `mode` says (a copy's sides: over
/// several connections where the storage allows).
pub fn open_storage_with(name: &str, mode: StorageOptions) -> Result<StorageRef> {
    let proto = protocol::for_name(name)?;
    let mut node = Spec::default();
    node.set("filename", Value::Str(name.to_string()));
    protocol::open(proto, &node, mode)
}

/// Opens the storage under an image description (`--image-opts` text when
/// `image_opts`, a `json:` description, or a plain name), with the format
/// it names if any: for tools that work on an image's own bytes (check).
pub fn open_described_storage(
    name: &str,
    image_opts: bool,
    writable: bool,
) -> Result<(Option<Format>, StorageRef)> {
    if !image_opts && !name.starts_with("json:") {
        return Ok((None, open_storage(name, writable)?));
    }
    let spec = if image_opts {
        spec::parse_image_opts(name)?
    } else {
        name_spec(name, None)?
    };
    let format = spec
        .get("driver")
        .filter(|d| protocol::by_name(d).is_none())
        .map(Format::from_name)
        .transpose()?;
    let node = spec.child("file");
    if node.is_empty() {
        return Err(Error::invalid(
            "A block device must be specified for \"file\"",
        ));
    }
    let proto = protocol_of(&node)?;
    let storage = protocol::open(
        proto,
        &node,
        StorageOptions {
            writable,
            ..Default::default()
        },
    )?;
    Ok((format, storage))
}

/// A file an image names, checked against the untrusted rules.
#[derive(Debug, Clone)]
pub struct Audited {
    /// The file as the image names it.
    pub named: diskit_formats::implied::Named,
    /// The name resolved against the image's location.
    pub resolved: String,
    /// Why `--untrusted` would refuse it, if it would.
    pub refusal: Option<gate::Refusal>,
}

/// The files `img` names, each with what the untrusted gate says of it,
/// without opening any (what a service checks before converting).
pub fn audit(img: &Image) -> Vec<Audited> {
    let location = img.file.location();
    img.implied_names()
        .into_iter()
        .map(|named| Audited {
            resolved: img.file.resolve(&named.name),
            refusal: gate::check_untrusted(location, &named.name, 1).err(),
            named,
        })
        .collect()
}

/// The spec a plain name stands for: `json:` text parsed, anything else the
/// `file` of a node of `format` (probed when `None`).
pub fn name_spec(name: &str, format: Option<Format>) -> Result<Spec> {
    let mut spec = match name.strip_prefix("json:") {
        Some(text) => spec::parse_json(text)?,
        // A protocol named as the format (-f host_device) is the node
        // itself: the name is its own filename.
        None if format.is_some_and(|f| protocol::by_name(f.name()).is_some()) => {
            let mut s = Spec::default();
            s.set("filename", Value::Str(name.to_string()));
            s
        }
        None => {
            let mut s = Spec::default();
            s.set("file.filename", Value::Str(name.to_string()));
            s
        }
    };
    if let Some(f) = format {
        match spec.get("driver") {
            Some(d) if d != f.name() && protocol::by_name(d).is_none() => {
                return Err(Error::invalid(format!(
                    "Cannot use format '{}': the description says driver '{d}'",
                    f.name()
                )));
            }
            Some(_) => {}
            None => spec.set("driver", Value::Str(f.name().to_string())),
        }
    }
    Ok(spec)
}

/// The file name QEMU shows for a spec: its file's `filename`.
fn display_name(spec: &Spec) -> Option<String> {
    spec.get("file.filename")
        .or_else(|| spec.get("filename"))
        .map(str::to_string)
}

/// Keys every format node takes (besides `file.*` and its driver's own).
const FORMAT_KEYS: &[&str] = &[
    "driver",
    "file",
    "node-name",
    "read-only",
    "cache.direct",
    "cache.no-flush",
];

/// The chain being opened: loop detection and depth.
struct Chain {
    seen: Vec<diskit_backends::image_lock::FileId>,
    trust: Trust,
    /// Set when the chain itself was refused (a loop, too deep): the error
    /// then goes up unwrapped, said once rather than once per image.
    refused: bool,
}

impl Chain {
    fn new(opts: &OpenOptions) -> Chain {
        Chain {
            seen: Vec::new(),
            refused: false,
            trust: if opts.untrusted {
                Trust::Untrusted
            } else {
                Trust::Trusted
            },
        }
    }

    /// Opens the node `spec` (shown as `display`) and, through the
    /// implied-file callback, everything below it.
    fn open(&mut self, spec: &Spec, display: &str, opts: &OpenOptions) -> Result<Image> {
        let driver = spec.get("driver");
        // A node whose driver is a protocol is raw over that protocol.
        let (format, file_node, file_proto) = match driver.and_then(protocol::by_name) {
            // (host_device, which has a row of its own, shows as itself).
            Some(p) => (
                Some(Format::from_name(p.name).unwrap_or(Format::RAW)),
                spec.clone(),
                p,
            ),
            None => {
                let format = driver.map(Format::from_name).transpose()?;
                let (node, proto) = self.file_node(spec)?;
                (format, node, proto)
            }
        };
        let mut opts = opts.clone();
        if let Some(v) = spec.get("cache.direct") {
            opts.direct = bool_value("cache.direct", v)?;
        }
        if let Some(v) = spec.get("read-only")
            && bool_value("read-only", v)?
        {
            opts.writable = false;
        }
        if let Some(v) = spec.get("l2-cache-size") {
            opts.l2_cache_size = Some(size_value("l2-cache-size", v)?);
        }
        // Each node names its own secret: a backing file's is given as
        // backing.key-secret, never inherited.
        if let Some(id) = spec
            .get("key-secret")
            .or_else(|| spec.get("encrypt.key-secret"))
        {
            opts.key_secret = Some(id.to_string());
        }
        if let Some(v) = spec.get("cache.no-flush")
            && bool_value("cache.no-flush", v)?
        {
            opts.no_flush = true;
        }
        let mode = StorageOptions {
            sector_size: format.is_some_and(|f| f.driver().sector_sized()),
            ..mode_of(&opts, opts.writable)
        };
        let storage = protocol::open(file_proto, &file_node, mode)?;
        self.note(&storage, display)?;
        let format = match format {
            Some(f) => f,
            None => probe::probe(&*storage, display)?,
        };
        let driver = format.driver();
        let is_protocol = protocol::by_name(spec.get("driver").unwrap_or("")).is_some();
        if !is_protocol {
            let known: Vec<&str> = FORMAT_KEYS
                .iter()
                .chain(driver.open_keys())
                .copied()
                .collect();
            let children: Vec<&str> = ["file"].iter().chain(driver.children()).copied().collect();
            spec.check_keys(spec::NodeKind::Format, format.name(), &known, &children)?;
        }
        // The format's own keys go to its driver as they are.
        opts.node_options = driver
            .open_keys()
            .iter()
            .filter(|k| {
                !matches!(
                    **k,
                    "backing" | "data-file" | "l2-cache-size" | "key-secret" | "encrypt.key-secret"
                )
            })
            .filter_map(|k| spec.get(k).map(|v| (k.to_string(), v.to_string())))
            .collect();
        // A probed file is reopened with its size rounded to sectors when
        // the format shows it so (raw), as QEMU does.
        let storage = if driver.sector_sized() && !mode.sector_size && file_proto.local {
            drop(storage);
            protocol::open(
                file_proto,
                &file_node,
                StorageOptions {
                    sector_size: true,
                    ..mode
                },
            )?
        } else {
            storage
        };
        // QEMU's image locks: a writer uses writes (a qcow2 resizes its
        // file), a reader reads; a qcow2 lets no one else write or resize
        // its file (its metadata would change under it), as in QEMU. `-U`
        // takes none on a read-only open.
        guard(
            &storage,
            opts.writable,
            &opts,
            diskit_core::storage::lock::for_image(opts.writable, format == Format::QCOW2),
        )?;
        let mut implied = Implied {
            chain: self,
            parent: storage.clone(),
            spec,
            opts: &opts,
            below: None,
        };
        let opened = driver.open(diskit_formats::driver::Opening {
            storage: storage.clone(),
            opts: &opts,
            implied: &mut implied,
        })?;
        let backing = implied.below;
        Ok(Image {
            device: opened.device,
            driver: if is_protocol {
                file_proto.name
            } else {
                format.name()
            },
            format,
            filename: PathBuf::from(storage.location()),
            file: storage,
            ops: opened.image,
            backing,
        })
    }

    /// The protocol node under a format node: `file` as a name, or the
    /// `file.*` keys.
    fn file_node(&self, spec: &Spec) -> Result<(Spec, &'static Protocol)> {
        no_node_reference(spec, "file")?;
        let node = spec.child("file");
        if node.is_empty() {
            return Err(Error::invalid(
                "A block device must be specified for \"file\"",
            ));
        }
        let proto = protocol_of(&node)?;
        Ok((node, proto))
    }

    /// Records a local file in the chain, refusing loops and absurd depth.
    fn note(&mut self, storage: &StorageRef, display: &str) -> Result<()> {
        let Some(fd) = storage.fd() else {
            return Ok(());
        };
        let Ok(id) = diskit_backends::image_lock::FileId::of(fd) else {
            return Ok(());
        };
        if self.seen.contains(&id) {
            self.refused = true;
            return Err(Error::invalid(format!(
                "Backing file chain of '{display}' contains a loop"
            )));
        }
        if self.seen.len() >= MAX_CHAIN_DEPTH {
            self.refused = true;
            return Err(Error::invalid(format!(
                "Backing file chain is too deep: '{display}' is more than \
                 {MAX_CHAIN_DEPTH} images down"
            )));
        }
        self.seen.push(id);
        Ok(())
    }

    fn depth(&self) -> usize {
        self.seen.len()
    }
}

/// The files one image names, opened for it through the gate.
struct Implied<'a> {
    chain: &'a mut Chain,
    parent: StorageRef,
    spec: &'a Spec,
    opts: &'a OpenOptions,
    below: Option<Box<Image>>,
}

impl Implied<'_> {
    /// Resolves and admits `name`, as stored in the parent image.
    fn admit(&self, role: Role, name: &str) -> Result<String> {
        gate::admit(
            self.chain.trust,
            self.parent.location(),
            role,
            name,
            self.chain.depth(),
        )?;
        Ok(self.parent.resolve(name))
    }
}

impl ImpliedFiles for Implied<'_> {
    fn backing(&mut self, name: &str, format: Option<&str>) -> Result<(DeviceRef, u64)> {
        if self.opts.no_backing || self.spec.is_null("backing") {
            let none: DeviceRef = Arc::new(diskit_backends::NullDevice::new(0));
            return Ok((none, 0));
        }
        no_node_reference(self.spec, "backing")?;
        let writable = self.opts.writable && self.opts.writable_backing_depth > 0;
        let below_opts = OpenOptions {
            writable,
            snapshot: None,
            writable_backing_depth: self.opts.writable_backing_depth.saturating_sub(1),
            l2_cache_size: None,
            key_secret: None,
            node_options: Vec::new(),
            ..self.opts.clone()
        };
        // The user's description (backing.driver=..., backing.file.filename=...)
        // overrides what the image says, and is trusted as the user's own.
        let given = self.spec.child("backing");
        let (spec, shown) = if given.is_empty() {
            let path = self.admit(Role::Backing, name)?;
            let fmt = format.map(Format::from_name).transpose()?;
            (name_spec(&path, fmt)?, path)
        } else {
            let shown = display_name(&given).unwrap_or_else(|| "backing".into());
            (given, shown)
        };
        let img = match self.chain.open(&spec, &shown, &below_opts) {
            Ok(img) => img,
            // A refused chain is said once, not once per image above.
            Err(e) if self.chain.refused => return Err(e),
            Err(e) => return Err(e.context("Could not open backing file")),
        };
        let r = (img.device.clone(), img.virtual_size());
        self.below = Some(Box::new(img));
        Ok(r)
    }

    fn data_file(&mut self, name: &str, writable: bool) -> Result<StorageRef> {
        if self.opts.metadata_only {
            // Reads as empty: nothing of the data is looked at.
            return Ok(Arc::new(diskit_backends::NullDevice::new(0)));
        }
        no_node_reference(self.spec, "data-file")?;
        let given = self.spec.child("data-file");
        let (node, proto) = if given.is_empty() {
            let path = self.admit(Role::DataFile, name)?;
            let mut node = Spec::default();
            node.set("filename", Value::Str(path.clone()));
            (node, protocol::for_name(&path)?)
        } else {
            let proto = protocol_of(&given)?;
            (given, proto)
        };
        let shown = node.get("filename").unwrap_or(name).to_string();
        let storage = protocol::open(proto, &node, mode_of(self.opts, writable))
            .context(format!("Could not open data file '{shown}'"))?;
        // QEMU's image locks on the data file too: a writer's while the
        // image is written, a reader's otherwise (none with -U on a
        // read-only open).
        guard(
            &storage,
            writable,
            self.opts,
            diskit_core::storage::lock::for_data_file(writable),
        )
        .context(format!("Could not open data file '{shown}'"))?;
        Ok(storage)
    }

    fn extent(&mut self, name: &str, writable: bool) -> Result<StorageRef> {
        self.part(Role::Extent, name, writable)
    }
}

impl Implied<'_> {
    /// Opens a file the image names as part of itself (a vmdk extent),
    /// through the gate, with the image's own locks.
    fn part(&mut self, role: Role, name: &str, writable: bool) -> Result<StorageRef> {
        let path = self.admit(role, name)?;
        let mut node = Spec::default();
        node.set("filename", Value::Str(path.clone()));
        let storage = protocol::open(
            protocol::for_name(&path)?,
            &node,
            mode_of(self.opts, writable),
        )
        .context(format!("Could not open '{path}'"))?;
        guard(
            &storage,
            writable,
            self.opts,
            diskit_core::storage::lock::for_image(writable, false),
        )
        .context(format!("Could not open '{path}'"))?;
        Ok(storage)
    }
}

/// Takes QEMU's image locks on `storage`, opened `writable` or not: the
/// permissions `perm` it uses and those `unshare` it keeps from others
/// (none at all on a read-only open with `-U`); with
/// [`OpenOptions::no_share`], writing and resizing too. A command's
/// source's files ([`OpenOptions::source`]) are noted so that the command
/// never writes them (`-U` or not).
fn guard(
    storage: &StorageRef,
    writable: bool,
    opts: &OpenOptions,
    (perm, unshare): (u8, u8),
) -> Result<()> {
    use diskit_core::storage::lock::{RESIZE, WRITE};
    let unshare = if opts.no_share && !writable {
        unshare | WRITE | RESIZE
    } else {
        unshare
    };
    if writable || !opts.force_share {
        storage.lock_image(perm, unshare)?;
    }
    if opts.source
        && !writable
        && let Some(fd) = storage.fd()
    {
        diskit_backends::image_lock::hold_as_source(fd, storage.location())?;
    }
    Ok(())
}

/// How the files of an image opened with `opts` are opened (`writable`
/// or not).
fn mode_of(opts: &OpenOptions, writable: bool) -> StorageOptions {
    StorageOptions {
        writable,
        direct: opts.direct,
        no_flush: opts.no_flush,
        host_zeros: opts.host_zeros,
        ..StorageOptions::default()
    }
}

/// Refuses a child given as a string: in QEMU's descriptions that is a
/// reference to another node by name, and diskit's nodes have none.
fn no_node_reference(spec: &Spec, key: &str) -> Result<()> {
    match spec.get(key) {
        Some(name) => Err(Error::invalid(format!(
            "Cannot find device='{name}' nor node-name='{name}'"
        ))),
        None => Ok(()),
    }
}

/// The protocol a protocol node names (`driver`), or its filename selects.
fn protocol_of(node: &Spec) -> Result<&'static Protocol> {
    match node.get("driver") {
        Some(d) => protocol::by_name(d)
            .ok_or_else(|| Error::invalid(format!("Unknown protocol driver '{d}'"))),
        None => protocol::for_name(node.get("filename").unwrap_or("")),
    }
}
