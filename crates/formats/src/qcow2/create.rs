//! Creating qcow2 images: `qemu-img create -f qcow2`, byte for byte.
//!
//! Three steps, each with qemu-img's own messages:
//!
//! 1. [`Qcow2CreateOptions::parse`] reads the `-o` list the way QEMU's
//!    option parser does (unknown keys, malformed sizes, numbers and
//!    booleans are refused before anything is printed);
//! 2. [`Qcow2CreateOptions::validate`] applies the checks QEMU's qcow2
//!    driver makes after the "Formatting" line (values of enumerations,
//!    combinations of options);
//! 3. [`create`] plans the layout exactly as QEMU allocates it
//!    ([`super::layout`]), then writes the data file and the image, the
//!    header last. Nothing is touched before every check has passed, and a
//!    failure while writing removes the files it made.

use diskit_core::{Error, ErrorKind, Preallocation, Result, Storage, WriteFlags};

use super::create_layout::{Geometry, HeaderSpec, Plan, PlanError, Prealloc};
use super::header::CompressionType;
use crate::OptionList;
use crate::options::{bool_value as parse_bool, size_value as parse_size_opt};

/// Default cluster size (64 KiB).
pub const DEFAULT_CLUSTER_SIZE: u64 = 65536;

/// The value type of an option, as QEMU's option parser knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Str,
    Bool,
    Size,
    Number,
}

/// Every option `qemu-img create -f qcow2` accepts (the qcow2 driver's,
/// then the file protocol's), in the order of QEMU's option list: the
/// order of the "Formatting" line. With the type and the default shown.
const OPTIONS: &[(&str, Kind, Option<&str>)] = &[
    ("encryption", Kind::Bool, None),
    ("encrypt.format", Kind::Str, None),
    ("encrypt.key-secret", Kind::Str, None),
    ("encrypt.cipher-alg", Kind::Str, None),
    ("encrypt.cipher-mode", Kind::Str, None),
    ("encrypt.ivgen-alg", Kind::Str, None),
    ("encrypt.ivgen-hash-alg", Kind::Str, None),
    ("encrypt.hash-alg", Kind::Str, None),
    ("encrypt.iter-time", Kind::Number, None),
    ("cluster_size", Kind::Size, Some("65536")),
    ("extended_l2", Kind::Bool, Some("off")),
    ("preallocation", Kind::Str, None),
    ("compression_type", Kind::Str, Some("zlib")),
    ("size", Kind::Size, None),
    ("compat", Kind::Str, None),
    ("backing_file", Kind::Str, None),
    ("backing_fmt", Kind::Str, None),
    ("data_file", Kind::Str, None),
    ("data_file_raw", Kind::Bool, None),
    ("lazy_refcounts", Kind::Bool, Some("off")),
    ("refcount_bits", Kind::Number, Some("16")),
    ("nocow", Kind::Bool, None),
    ("extent_size_hint", Kind::Size, None),
];

/// The option names, for `-o` checking.
pub fn option_names() -> impl Iterator<Item = &'static str> {
    OPTIONS.iter().map(|o| o.0)
}

/// Format names QEMU accepts for `backing_fmt` without opening the file
/// (its `BlockdevDriver` enumeration).
const BLOCK_DRIVERS: &[&str] = &[
    "blkdebug",
    "blklogwrites",
    "blkreplay",
    "blkverify",
    "bochs",
    "cloop",
    "compress",
    "copy-before-write",
    "copy-on-read",
    "dmg",
    "file",
    "snapshot-access",
    "ftp",
    "ftps",
    "gluster",
    "host_cdrom",
    "host_device",
    "http",
    "https",
    "io_uring",
    "iscsi",
    "luks",
    "nbd",
    "nfs",
    "null-aio",
    "null-co",
    "nvme",
    "nvme-io_uring",
    "parallels",
    "preallocate",
    "qcow",
    "qcow2",
    "qed",
    "quorum",
    "raw",
    "rbd",
    "replication",
    "ssh",
    "throttle",
    "vdi",
    "vhdx",
    "virtio-blk-vfio-pci",
    "virtio-blk-vhost-user",
    "virtio-blk-vhost-vdpa",
    "vmdk",
    "vpc",
    "vvfat",
];

/// An invalid-argument error.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid(msg)
}

/// qcow2 version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// compat=0.10.
    V2,
    /// compat=1.1 (default).
    V3,
}

/// An unsigned number as `strtoull(v, NULL, 0)` reads it (decimal, 0x hex
/// or 0 octal, leading blanks, a sign that wraps), with QEMU's messages.
fn parse_number_opt(name: &str, v: &str) -> Result<u64> {
    let bad = || invalid(format!("Parameter '{name}' expects a number"));
    let t = v.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (digits, radix) = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        (h, 16)
    } else if t.len() > 1 && t.starts_with('0') {
        (&t[1..], 8)
    } else {
        (t, 10)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(bad());
    }
    let n = u64::from_str_radix(digits, radix)
        .map_err(|_| invalid(format!("Value '{v}' is too large for parameter '{name}'")))?;
    Ok(if neg { n.wrapping_neg() } else { n })
}

/// A preallocation mode name (off, metadata, falloc, full).
pub fn parse_prealloc(s: &str) -> Option<Prealloc> {
    Prealloc::parse(s)
}

/// The `-o` options of a qcow2 creation, as QEMU's option parser leaves
/// them: typed, but not yet checked against each other.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Qcow2CreateOptions {
    /// Virtual size (`size`, or the size argument).
    pub size: Option<u64>,
    /// `compat` as given.
    pub compat: Option<String>,
    /// Backing file name.
    pub backing_file: Option<String>,
    /// Backing file format.
    pub backing_fmt: Option<String>,
    /// External data file name.
    pub data_file: Option<String>,
    /// `data_file_raw`.
    pub data_file_raw: Option<bool>,
    /// Deprecated `encryption` switch.
    pub encryption: Option<bool>,
    /// `encrypt.format`.
    pub encrypt_format: Option<String>,
    /// `cluster_size` in bytes.
    pub cluster_size: Option<u64>,
    /// `preallocation` as given.
    pub preallocation: Option<String>,
    /// `lazy_refcounts`.
    pub lazy_refcounts: Option<bool>,
    /// `refcount_bits`, as QEMU's 64-bit number.
    pub refcount_bits: Option<u64>,
    /// `compression_type` as given.
    pub compression_type: Option<String>,
    /// `extended_l2`.
    pub extended_l2: Option<bool>,
    /// `nocow` (only meaningful on btrfs; accepted and ignored).
    pub nocow: Option<bool>,
    /// `extent_size_hint` (accepted and ignored).
    pub extent_size_hint: Option<u64>,
    /// Every option given, by name, as QEMU would print it.
    given: Vec<(&'static str, String)>,
}

/// Everything [`Qcow2CreateOptions::validate`] settles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateSpec {
    /// Cluster size, refcount width, L2 entry size.
    pub geometry: Geometry,
    /// Preallocation (metadata when `data_file_raw` forces it).
    pub prealloc: Prealloc,
    /// Virtual size, rounded up to 512 bytes.
    pub size: u64,
    /// Header fields beyond the layout.
    pub header: HeaderSpec,
    /// LUKS encryption to set up once the image is made.
    pub encrypt: Option<crate::luks::create::LuksCreateOptions>,
}

impl Qcow2CreateOptions {
    /// Reads an option list: unknown keys and values that do not parse as
    /// their type are errors, with QEMU's messages.
    pub fn parse(options: &OptionList) -> Result<Qcow2CreateOptions> {
        let bool_names: Vec<String> = OPTIONS
            .iter()
            .filter(|o| o.1 == Kind::Bool)
            .map(|o| format!("no{}", o.0))
            .collect();
        let mut known: Vec<&str> = option_names().collect();
        known.extend(bool_names.iter().map(String::as_str));
        options.check_known(&known)?;
        let mut o = Qcow2CreateOptions::default();
        for &(name, kind, _) in OPTIONS {
            let value = match options.get(name) {
                Some(v) => v.to_string(),
                // A bare "noX" flag means X=off.
                None if kind == Kind::Bool => match options.get(&format!("no{name}")) {
                    Some("on") => "off".to_string(),
                    Some(_) => return Err(invalid(format!("Invalid parameter 'no{name}'"))),
                    None => continue,
                },
                None => continue,
            };
            let shown = match kind {
                Kind::Str | Kind::Bool => value.clone(),
                Kind::Size => parse_size_opt(name, &value)?.to_string(),
                Kind::Number => (parse_number_opt(name, &value)? as i64).to_string(),
            };
            let v = value.as_str();
            match name {
                "size" => o.size = Some(parse_size_opt(name, v)?),
                "compat" => o.compat = Some(value.clone()),
                "backing_file" => o.backing_file = Some(value.clone()),
                "backing_fmt" => o.backing_fmt = Some(value.clone()),
                "data_file" => o.data_file = Some(value.clone()),
                "data_file_raw" => o.data_file_raw = Some(parse_bool(name, v)?),
                "encryption" => o.encryption = Some(parse_bool(name, v)?),
                "encrypt.format" => o.encrypt_format = Some(value.clone()),
                "cluster_size" => o.cluster_size = Some(parse_size_opt(name, v)?),
                "preallocation" => o.preallocation = Some(value.clone()),
                "lazy_refcounts" => o.lazy_refcounts = Some(parse_bool(name, v)?),
                "refcount_bits" => o.refcount_bits = Some(parse_number_opt(name, v)?),
                "compression_type" => o.compression_type = Some(value.clone()),
                "extended_l2" => o.extended_l2 = Some(parse_bool(name, v)?),
                "nocow" => o.nocow = Some(parse_bool(name, v)?),
                "extent_size_hint" => o.extent_size_hint = Some(parse_size_opt(name, v)?),
                "encrypt.iter-time" => {
                    parse_number_opt(name, v)?;
                }
                _ => {}
            }
            o.given.push((name, shown));
        }
        Ok(o)
    }

    /// Sets the virtual size (from the size argument or the backing file).
    pub fn set_size(&mut self, size: u64) {
        self.size = Some(size);
        self.set_given("size", size.to_string());
    }

    /// Sets the backing file (from `-b`, which wins over `-o`).
    pub fn set_backing_file(&mut self, name: &str) {
        self.backing_file = Some(name.to_string());
        self.set_given("backing_file", name.to_string());
    }

    /// Sets the backing file format (from `-F`).
    pub fn set_backing_fmt(&mut self, name: &str) {
        self.backing_fmt = Some(name.to_string());
        self.set_given("backing_fmt", name.to_string());
    }

    fn set_given(&mut self, name: &'static str, shown: String) {
        match self.given.iter_mut().find(|(n, _)| *n == name) {
            Some(g) => g.1 = shown,
            None => self.given.push((name, shown)),
        }
    }

    /// The options of qemu-img's "Formatting" line (after `fmt=qcow2 `):
    /// every option given or with a default, in QEMU's order; sizes and
    /// numbers as parsed, strings with commas doubled.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        for &(name, kind, default) in OPTIONS {
            let value = match self.given.iter().find(|(n, _)| *n == name) {
                Some((_, v)) => v.clone(),
                None => match default {
                    Some(d) => d.to_string(),
                    None => continue,
                },
            };
            let value = if kind == Kind::Str {
                value.replace(',', ",,")
            } else {
                value
            };
            parts.push(format!("{name}={value}"));
        }
        parts.join(" ")
    }

    /// The cluster size, checked as `validate_cluster_size` does.
    pub(crate) fn cluster_size_checked(&self, extended_l2: bool) -> Result<u64> {
        let cs = self.cluster_size.unwrap_or(DEFAULT_CLUSTER_SIZE);
        if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
            return Err(invalid(
                "Cluster size must be a power of two between 512 and 2048k",
            ));
        }
        if extended_l2 && cs < 512 * 32 {
            return Err(invalid(
                "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes",
            ));
        }
        Ok(cs)
    }

    /// The refcount width, checked as QEMU does.
    pub(crate) fn refcount_bits_checked(&self) -> Result<u64> {
        let bits = self.refcount_bits.unwrap_or(16);
        if bits > 64 || !bits.is_power_of_two() {
            return Err(invalid(
                "Refcount width must be a power of two and may not exceed 64 bits",
            ));
        }
        Ok(bits)
    }

    /// The checks QEMU's qcow2 driver makes once the "Formatting" line is
    /// out: first the values of enumerations (in QEMU's field order), then
    /// the combinations, with its messages.
    pub fn validate(&self) -> Result<CreateSpec> {
        let v3_needed = |what: &str| {
            invalid(format!(
                "{what} only supported with compatibility level 1.1 and above (use version=v3 or greater)"
            ))
        };
        // Values of enumerations (the QAPI visitor, in field order).
        let version = match self.compat.as_deref() {
            None | Some("1.1") | Some("v3") => Version::V3,
            Some("0.10") | Some("v2") => Version::V2,
            Some(other) => {
                return Err(invalid(format!(
                    "Parameter 'version' does not accept value '{other}'"
                )));
            }
        };
        if let Some(f) = &self.backing_fmt
            && !BLOCK_DRIVERS.contains(&f.as_str())
        {
            return Err(invalid(format!(
                "Parameter 'backing-fmt' does not accept value '{f}'"
            )));
        }
        let encrypt = match (self.encryption, self.encrypt_format.as_deref()) {
            (Some(true), _) => Some("aes"),
            (_, Some(f)) => Some(f),
            _ => None,
        };
        let other_encrypt = self
            .given
            .iter()
            .any(|(n, _)| n.starts_with("encrypt.") && *n != "encrypt.format");
        let luks = match encrypt {
            None if other_encrypt => {
                return Err(invalid("Parameter 'encrypt.format' is missing"));
            }
            None => None,
            Some("luks") => {
                let mut list = OptionList::new();
                for (n, v) in &self.given {
                    if n.starts_with("encrypt.") && *n != "encrypt.format" {
                        list.set(n, v);
                    }
                }
                let o = crate::luks::create::LuksCreateOptions::parse_prefixed(&list, "encrypt.")?;
                if o.key_secret.is_none() {
                    return Err(invalid(
                        "Parameter 'encrypt.key-secret' is required for cipher",
                    ));
                }
                Some(o)
            }
            Some("aes" | "qcow") => {
                // Legacy AES is weak (no key derivation, predictable IVs):
                // diskit reads such images but makes none.
                return Err(Error::unsupported(
                    "Creating legacy AES-encrypted qcow2 images is not supported \
                     (use encrypt.format=luks)",
                ));
            }
            Some(f) => {
                return Err(invalid(format!(
                    "Parameter 'format' does not accept value '{f}'"
                )));
            }
        };
        if luks.is_some() && self.preallocation.as_deref().is_some_and(|p| p != "off") {
            // Preallocated clusters would read as decrypted garbage.
            return Err(Error::unsupported(
                "Preallocation of encrypted qcow2 images is not supported by diskit",
            ));
        }
        let mut prealloc = match self.preallocation.as_deref() {
            None => Prealloc::Off,
            Some(p) => parse_prealloc(p).ok_or_else(|| {
                invalid(format!(
                    "Parameter 'preallocation' does not accept value '{p}'"
                ))
            })?,
        };
        let compression = match self.compression_type.as_deref() {
            None | Some("zlib") => CompressionType::Zlib,
            Some("zstd") => CompressionType::Zstd,
            Some(c) => {
                return Err(invalid(format!(
                    "Parameter 'compression-type' does not accept value '{c}'"
                )));
            }
        };
        // qcow2_co_create's checks, in its order.
        let extended_l2 = self.extended_l2.unwrap_or(false);
        if extended_l2 && version == Version::V2 {
            return Err(invalid(
                "Extended L2 entries are only supported with compatibility level 1.1 \
                 and above (use version=v3 or greater)",
            ));
        }
        let cluster_size = self.cluster_size_checked(extended_l2)?;
        if self.backing_file.is_some() && prealloc != Prealloc::Off && !extended_l2 {
            return Err(invalid(
                "Backing file and preallocation can only be used at the same time if \
                 extended_l2 is on",
            ));
        }
        if self.backing_fmt.is_some() && self.backing_file.is_none() {
            return Err(invalid(
                "Backing format cannot be used without backing file",
            ));
        }
        let lazy_refcounts = self.lazy_refcounts.unwrap_or(false);
        if lazy_refcounts && version == Version::V2 {
            return Err(v3_needed("Lazy refcounts"));
        }
        let refcount_bits = self.refcount_bits_checked()?;
        if version == Version::V2 && refcount_bits != 16 {
            return Err(invalid(
                "Different refcount widths than 16 bits require compatibility level 1.1 \
                 or above (use version=v3 or greater)",
            ));
        }
        let data_file_raw = self.data_file_raw.unwrap_or(false);
        if data_file_raw && self.data_file.is_none() {
            return Err(invalid("data-file-raw requires data-file"));
        }
        if data_file_raw && self.backing_file.is_some() {
            return Err(invalid(
                "Backing file and data-file-raw cannot be used at the same time",
            ));
        }
        if data_file_raw && prealloc == Prealloc::Off {
            prealloc = Prealloc::Metadata;
        }
        if self.data_file.is_some() && version == Version::V2 {
            return Err(invalid(
                "External data files are only supported with compatibility level 1.1 \
                 and above (use version=v3 or greater)",
            ));
        }
        if compression != CompressionType::Zlib && version == Version::V2 {
            return Err(invalid(
                "Non-zlib compression type is only supported with compatibility level 1.1 \
                 and above (use version=v3 or greater)",
            ));
        }
        let size = self
            .size
            .ok_or_else(|| invalid("Image creation needs a size parameter"))?;
        let size = size
            .checked_next_multiple_of(512)
            .filter(|&s| s <= i64::MAX as u64)
            .ok_or_else(too_large)?;
        Ok(CreateSpec {
            geometry: Geometry {
                cluster_bits: cluster_size.trailing_zeros(),
                refcount_order: refcount_bits.trailing_zeros(),
                extended_l2,
            },
            prealloc,
            size,
            encrypt: luks,
            header: HeaderSpec {
                version: if version == Version::V2 { 2 } else { 3 },
                compression,
                lazy_refcounts,
                data_file: self.data_file.clone(),
                data_file_raw,
                backing_file: self.backing_file.clone(),
                backing_format: self.backing_fmt.clone(),
            },
        })
    }
}

fn too_large() -> Error {
    Error::invalid(
        "The image size is too large for file format 'qcow2' (try using a larger cluster size)",
    )
}

/// Everything to write, decided before any file is touched.
struct Prepared {
    plan: Plan,
    header: Vec<u8>,
}

fn plan_error(e: PlanError) -> Error {
    match e {
        PlanError::TooBig => too_large(),
        PlanError::Again => Error::io("Could not resize image: allocation did not settle"),
        PlanError::Internal(m) => Error::io(format!("Could not resize image: {m}")),
    }
}

/// Plans a creation and renders the header, with QEMU's errors in QEMU's
/// order: the header without the backing file must fit (QEMU writes it
/// before sizing the image), then the layout, then the backing file name.
fn prepare(spec: &CreateSpec) -> Result<Prepared> {
    let has_data_file = spec.header.data_file.is_some();
    let early = HeaderSpec {
        backing_file: None,
        backing_format: None,
        ..spec.header.clone()
    };
    let empty = Plan::create(spec.geometry, 0, Prealloc::Off, has_data_file).map_err(plan_error)?;
    if empty.header(&early).to_bytes().is_err() {
        return Err(Error::new(
            ErrorKind::NoSpace,
            "Could not update qcow2 header: No space left on device",
        ));
    }
    let plan =
        Plan::create(spec.geometry, spec.size, spec.prealloc, has_data_file).map_err(plan_error)?;
    if let Some(b) = &spec.header.backing_file {
        let fmt = spec.header.backing_format.as_deref().unwrap_or("(null)");
        let fail = |why: &str| {
            Error::invalid(format!(
                "Could not assign backing file '{b}' with format '{fmt}': {why}"
            ))
        };
        if b.len() > 1023 {
            return Err(fail("Invalid argument"));
        }
        if plan.header(&spec.header).to_bytes().is_err() {
            return Err(fail("No space left on device"));
        }
    }
    let header = plan.header(&spec.header).to_bytes()?;
    Ok(Prepared { plan, header })
}

/// Creates a qcow2 image (and its external data file, if any) where
/// `target` says, exactly as `qemu-img create -f qcow2` would with these
/// options. The options must carry the size.
pub fn create(target: &mut dyn crate::creation::NewFiles, opts: &Qcow2CreateOptions) -> Result<()> {
    let spec = opts.validate()?;
    let prepared = prepare(&spec)?;
    let image = target.make_image()?;
    let data = match &spec.header.data_file {
        None => None,
        Some(name) => Some(target.make(name)?),
    };
    let mode = prealloc_of(spec.prealloc);
    if let Some(d) = &data {
        write_data_file(&prepared.plan, &**d, mode)?;
    }
    write_image(&prepared, &*image, mode)?;
    if let Some(luks) = &spec.encrypt {
        set_up_luks(image.clone(), data.clone(), luks)?;
    }
    if let Some(d) = &data {
        d.flush()?;
    }
    image.flush()
}

/// Encrypts the new, empty image with LUKS, as QEMU does once the image
/// exists: the LUKS header and key slots in new clusters, then the header
/// marked.
fn set_up_luks(
    file: diskit_core::StorageRef,
    data: Option<diskit_core::StorageRef>,
    luks: &crate::luks::create::LuksCreateOptions,
) -> Result<()> {
    let plan = luks.plan()?;
    let pass = luks.passphrase()?;
    let image = super::open::open(
        file,
        super::open::Qcow2Options {
            writable: true,
            ..Default::default()
        },
        &mut NewImageFiles { data },
    )?;
    image.set_up_luks(&plan, pass.bytes())
}

/// The files a new image names: its data file as just made; the backing
/// file is not needed to set the image up and reads as absent.
struct NewImageFiles {
    data: Option<diskit_core::StorageRef>,
}

impl crate::implied::ImpliedFiles for NewImageFiles {
    fn backing(
        &mut self,
        _name: &str,
        _format: Option<&str>,
    ) -> Result<(diskit_core::DeviceRef, u64)> {
        Ok((std::sync::Arc::new(diskit_backends::NullDevice::new(0)), 0))
    }

    fn data_file(&mut self, name: &str, _writable: bool) -> Result<diskit_core::StorageRef> {
        self.data
            .clone()
            .ok_or_else(|| Error::invalid(format!("Could not open data file '{name}'")))
    }
}

fn prealloc_of(mode: Prealloc) -> Preallocation {
    match mode {
        Prealloc::Full => Preallocation::Full,
        Prealloc::Falloc => Preallocation::Falloc,
        Prealloc::Off | Prealloc::Metadata => Preallocation::Off,
    }
}

/// Grows `dev` from its current length to `end`, reserving the new space
/// the way `mode` says.
fn grow(dev: &dyn Storage, end: u64, mode: Preallocation) -> Result<()> {
    if end > dev.size() {
        dev.resize(end, mode)?;
    }
    Ok(())
}

/// Writes `len` zero bytes at `offset`, growing the file if needed.
fn write_zeros(dev: &dyn Storage, offset: u64, len: u64) -> Result<()> {
    const CHUNK: u64 = 1 << 20;
    grow(dev, offset + len, Preallocation::Off)?;
    let zeros = vec![0u8; len.min(CHUNK) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        dev.write_at(&zeros[..n as usize], offset + done, WriteFlags::NONE)?;
        done += n;
    }
    Ok(())
}

/// The external data file, in QEMU's order: copy-on-write zeros, then the
/// final length, its new space reserved as the preallocation mode says.
fn write_data_file(plan: &Plan, dev: &dyn Storage, mode: Preallocation) -> Result<()> {
    for &(o, l) in plan.data_zero_writes() {
        write_zeros(dev, o, l)?;
    }
    if let Some((from, to)) = plan.data_reserved() {
        grow(dev, from, Preallocation::Off)?;
        grow(dev, to, mode)?;
    }
    grow(dev, plan.data_len(), Preallocation::Off)?;
    if plan.data_first_block() {
        write_zeros(dev, 0, dev.size().min(4096))?;
    }
    dev.flush()
}

/// The image file: reserved data space first, then the bytes of outgrown
/// tables, copy-on-write zeros, the metadata, and the header last.
fn write_image(p: &Prepared, dev: &dyn Storage, mode: Preallocation) -> Result<()> {
    let plan = &p.plan;
    if let Some((from, to)) = plan.reserved() {
        grow(dev, from, Preallocation::Off)?;
        grow(dev, to, mode)?;
    }
    grow(dev, plan.file_len(), Preallocation::Off)?;
    let put = |bytes: &[u8], at: u64| dev.write_at(bytes, at, WriteFlags::NONE);
    for (off, bytes) in plan.stale() {
        put(bytes, *off)?;
    }
    for &(o, l) in plan.zero_writes() {
        write_zeros(dev, o, l)?;
    }
    for (index, offset) in plan.refblocks() {
        put(&plan.refblock_bytes(index), offset)?;
    }
    put(&plan.reftable_bytes(), plan.reftable_offset())?;
    let (l1_offset, l1_len) = plan.l1();
    let per_write = (1usize << 20) / 8;
    let mut i = 0;
    while i < l1_len {
        let n = per_write.min(l1_len - i);
        put(&plan.l1_bytes(i, n), l1_offset + i as u64 * 8)?;
        i += n;
    }
    for (index, offset) in plan.l2_tables() {
        put(&plan.l2_bytes(index), offset)?;
    }
    dev.flush()?;
    // The header last, so that nothing half-written is ever referenced.
    put(&p.header, 0)?;
    dev.flush()
}

#[cfg(test)]
mod tests;
