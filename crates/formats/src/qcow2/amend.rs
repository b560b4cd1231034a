//! `qemu-img amend` for qcow2: changing the compatibility level, the
//! refcount width, lazy refcounts, the size and the external data file of
//! an existing image, with QEMU's checks, order and messages.
//!
//! The order is QEMU's: options are checked first, an upgrade comes before
//! everything else, a downgrade after everything else (so that what v2
//! cannot hold is gone by then). Each header change is one write of the
//! header cluster, made after everything it points at is on disk.

use diskit_core::{BlockDevice, Error, Result};

use super::Qcow2;
use super::amend_refcount;
use super::amend_zero;
use super::create_layout::feature_table;
use super::header::{CompressionType, Header, autoclear, compat, ext, incompat};
use super::meta::Meta;
use super::open::read_header;
use super::snapshot;
use crate::options::{OptionList, bool_value, size_value};

/// The options `amend` accepts for qcow2, in qemu-img's help order.
pub const AMEND_OPTIONS: [(&str, &str); 13] = [
    ("backing_file", "<str>     - File name of a base image"),
    ("backing_fmt", "<str>      - Image format of the base image"),
    (
        "compat",
        "<str>           - Compatibility level (v2 [0.10] or v3 [1.1])",
    ),
    (
        "data_file",
        "<str>        - File name of an external data file",
    ),
    (
        "data_file_raw",
        "<bool (on/off)> - The external data file must stay valid as a raw image",
    ),
    (
        "encrypt.iter-time",
        "<num> - Time to spend in PBKDF in milliseconds",
    ),
    (
        "encrypt.keyslot",
        "<num>  - Select a single keyslot to modify explicitly",
    ),
    (
        "encrypt.new-secret",
        "<str> - New secret to set in the matching keyslots. Empty string to erase",
    ),
    (
        "encrypt.old-secret",
        "<str> - Select all keyslots that match this password",
    ),
    (
        "encrypt.state",
        "<str>    - Select new state of affected keyslots (active/inactive)",
    ),
    (
        "lazy_refcounts",
        "<bool (on/off)> - Postpone refcount updates",
    ),
    (
        "refcount_bits",
        "<num>    - Width of a reference count entry in bits",
    ),
    ("size", "<size>            - Virtual disk size"),
];

/// The help qemu-img prints for `amend -o help` on a qcow2 image.
pub fn help() -> String {
    let mut out = "Amend options for 'qcow2':\n".to_string();
    for (name, text) in AMEND_OPTIONS {
        out += &format!("  {name}={text}\n");
    }
    out
}

/// The changes asked for, checked as QEMU checks them before acting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Amend {
    /// New version (2 or 3).
    pub version: Option<u32>,
    /// New virtual size.
    pub size: Option<u64>,
    /// Backing file name (must equal the current one).
    pub backing_file: Option<String>,
    /// Backing file format (must equal the current one).
    pub backing_fmt: Option<String>,
    /// Lazy refcounts on or off.
    pub lazy_refcounts: Option<bool>,
    /// New refcount width in bits.
    pub refcount_bits: Option<u32>,
    /// New external data file name ("" removes it, as in QEMU).
    pub data_file: Option<String>,
    /// The raw external data bit.
    pub data_file_raw: Option<bool>,
    /// Key slot changes (`encrypt.state`, `encrypt.keyslot`, ...), for a
    /// LUKS-encrypted image.
    pub encrypt: Option<OptionList>,
    /// `--force`: key slot changes qemu-img guards go ahead.
    pub force: bool,
}

impl Amend {
    /// Parses `-o` options (every key must be an amend option; keys only
    /// `create` knows get qemu-img's hint).
    pub fn parse(o: &OptionList) -> Result<Amend> {
        let names: Vec<&str> = AMEND_OPTIONS.iter().map(|(n, _)| *n).collect();
        if let Err(e) = o.check_known(&names) {
            let create_only = super::create::option_names()
                .any(|n| e.to_string() == format!("Invalid parameter '{n}'"));
            return Err(if create_only {
                Error::invalid(format!(
                    "{e}\nThis option is only supported for image creation"
                ))
            } else {
                e
            });
        }
        let mut a = Amend::default();
        if let Some(v) = o.get("compat") {
            a.version = Some(match v {
                "0.10" | "v2" => 2,
                "1.1" | "v3" => 3,
                _ => return Err(Error::invalid(format!("Unknown compatibility level {v}"))),
            });
        }
        if let Some(v) = o.get("size") {
            a.size = Some(size_value("size", v)?);
        }
        a.backing_file = o.get("backing_file").map(String::from);
        a.backing_fmt = o.get("backing_fmt").map(String::from);
        if let Some(v) = o.get("lazy_refcounts") {
            a.lazy_refcounts = Some(bool_value("lazy_refcounts", v)?);
        }
        if let Some(v) = o.get("refcount_bits") {
            let bits: u64 = v.parse().map_err(|_| {
                Error::invalid("Parameter 'refcount_bits' expects a non-negative number below 2^64")
            })?;
            if bits == 0 || bits > 64 || !bits.is_power_of_two() {
                return Err(Error::invalid(
                    "Refcount width must be a power of two and may not exceed 64 bits",
                ));
            }
            a.refcount_bits = Some(bits as u32);
        }
        a.data_file = o.get("data_file").map(String::from);
        if let Some(v) = o.get("data_file_raw") {
            a.data_file_raw = Some(bool_value("data_file_raw", v)?);
        }
        if names
            .iter()
            .any(|n| n.starts_with("encrypt.") && o.get(n).is_some())
        {
            let mut list = OptionList::new();
            for n in names.iter().filter(|n| n.starts_with("encrypt.")) {
                if let Some(v) = o.get(n) {
                    list.set(n, v);
                }
            }
            // Checked when applied: qemu-img first says when the image
            // has no encryption to amend.
            a.encrypt = Some(list);
        }
        Ok(a)
    }
}

/// Writes `h` as the header (one write of the header cluster) and syncs.
fn write_header(meta: &Meta, h: &Header) -> Result<()> {
    meta.file.flush()?;
    meta.file.write_extend(&h.to_bytes()?, 0)?;
    meta.file.flush()
}

impl Qcow2 {
    /// Applies `a` to the image, as `qemu-img amend` does.
    pub fn amend(&self, a: &Amend) -> Result<()> {
        let mut h = read_header(&self.file)?;
        if let Some(list) = &a.encrypt {
            if h.crypt_method != super::crypt::LUKS {
                return Err(Error::invalid(
                    "Can't amend encryption options - encryption not present",
                ));
            }
            let (offset, _) = super::crypt::luks_area(&h)?;
            let lh = crate::luks::read_header(&*self.file, offset)?;
            crate::luks::create::amend_slots(
                &*self.file,
                offset,
                &lh,
                list,
                "encrypt.",
                self.key_secret(),
                a.force,
            )?;
        }
        let old_version = h.version;
        let new_version = a.version.unwrap_or(old_version);
        let external = h.incompatible_features & incompat::EXTERNAL_DATA != 0;
        if a.data_file.is_some() && !external {
            return Err(Error::invalid(
                "data-file can only be set for images that use an external data file",
            ));
        }
        let raw_now = h.autoclear_features & autoclear::RAW_EXTERNAL != 0;
        if a.data_file_raw == Some(true) && !raw_now {
            return Err(Error::invalid(
                "data-file-raw cannot be set on existing images",
            ));
        }
        if new_version > old_version {
            self.upgrade(&mut h)?;
        }
        if (a.backing_file.is_some() || a.backing_fmt.is_some())
            && (a.backing_file != h.backing_file || a.backing_fmt != h.backing_format())
        {
            return Err(Error::invalid(
                "Cannot amend the backing file\nYou can use 'qemu-img rebase' instead.",
            ));
        }
        let lazy_now = h.compatible_features & compat::LAZY_REFCOUNTS != 0;
        if let Some(lazy) = a.lazy_refcounts.filter(|&l| l != lazy_now) {
            if lazy && new_version < 3 {
                return Err(Error::invalid(
                    "Lazy refcounts only supported with compatibility level 1.1 and above \
                     (use compat=1.1 or greater)",
                ));
            }
            // Opening read-write already left the image clean.
            self.lock().write_back()?;
            h.compatible_features ^= compat::LAZY_REFCOUNTS;
            write_header(&self.lock(), &h)?;
        }
        if let Some(bits) = a.refcount_bits {
            if new_version < 3 && bits != 16 {
                return Err(Error::invalid(
                    "Refcount widths other than 16 bits require compatibility level 1.1 \
                     or above (use compat=1.1 or greater)",
                ));
            }
            let order = bits.trailing_zeros();
            if order != h.refcount_order {
                let mut meta = self.lock();
                h = amend_refcount::change_order(&mut meta, &h, order)?;
            }
        }
        if a.data_file_raw.is_some() || a.data_file.is_some() {
            if a.data_file_raw == Some(false) {
                h.autoclear_features &= !autoclear::RAW_EXTERNAL;
            }
            if let Some(name) = &a.data_file {
                h.extensions.retain(|e| e.kind != ext::DATA_FILE);
                if !name.is_empty() {
                    let at = h
                        .extensions
                        .iter()
                        .position(|e| e.kind == ext::FEATURE_TABLE)
                        .unwrap_or(h.extensions.len());
                    h.extensions.insert(
                        at,
                        super::header::HeaderExtension {
                            kind: ext::DATA_FILE,
                            data: name.as_bytes().to_vec(),
                        },
                    );
                }
            }
            let meta = self.lock();
            write_header(&meta, &h)?;
        }
        if let Some(size) = a.size.filter(|&s| s != self.size()) {
            self.resize(size, true)?;
            h = read_header(&self.file)?;
        }
        if new_version < old_version {
            self.downgrade(&mut h)?;
        }
        let mut meta = self.lock();
        meta.write_back()?;
        meta.write_back()?;
        meta.file.flush()
    }

    /// Turns a v2 image into v3: the v3 header fields, as QEMU writes them.
    fn upgrade(&self, h: &mut Header) -> Result<()> {
        let mut meta = self.lock();
        meta.write_back()?;
        meta.write_back()?;
        // Entries without the extra data v3 requires (written by old
        // versions of QEMU) are completed first, as QEMU's upgrade does.
        if h.nb_snapshots > 0 {
            let snaps = snapshot::read_checked(&self.file, h)?;
            if snaps.iter().any(|sn| sn.incomplete(3)) {
                let cs = meta.cx.geo.cluster_size();
                let file = meta.file.clone();
                let old = (h.snapshots_offset, snapshot::table_len(&snaps));
                let disk_size = self.size() / 512 * 512;
                snapshot::place_table(&file, meta.refs()?, cs, old, &snaps, disk_size)?;
                meta.write_back()?;
                meta.write_back()?;
                *h = read_header(&self.file)?;
            }
        }
        h.version = 3;
        h.incompatible_features = 0;
        h.compatible_features = 0;
        h.autoclear_features = 0;
        h.refcount_order = 4;
        h.compression_type = CompressionType::Zlib;
        if h.cluster_size() > 4096 && h.extension(ext::FEATURE_TABLE).is_none() {
            h.extensions.push(feature_table());
        }
        write_header(&meta, h)?;
        meta.cx.version = 3;
        Ok(())
    }

    /// Turns a v3 image into v2, refusing what v2 cannot hold, as QEMU does.
    fn downgrade(&self, h: &mut Header) -> Result<()> {
        if h.refcount_order != 4 {
            return Err(Error::unsupported("compat=0.10 requires refcount_bits=16"));
        }
        if h.incompatible_features & incompat::EXTERNAL_DATA != 0 {
            return Err(Error::unsupported(
                "Cannot downgrade an image with a data file",
            ));
        }
        let snaps = snapshot::read_checked(&self.file, h)?;
        let size = self.size() / 512 * 512;
        if snaps
            .iter()
            .any(|s| s.vm_state_size() > u32::MAX as u64 || s.disk_size().unwrap_or(size) != size)
        {
            return Err(Error::unsupported(
                "Internal snapshots prevent downgrade of image",
            ));
        }
        let blocking = h.incompatible_features & !(incompat::COMPRESSION_TYPE | incompat::DIRTY);
        if blocking != 0 {
            return Err(Error::unsupported(format!(
                "Cannot downgrade an image with incompatible features {blocking:#x} set"
            )));
        }
        let mut meta = self.lock();
        if h.incompatible_features & incompat::COMPRESSION_TYPE != 0 {
            if amend_zero::has_compressed(&mut meta)? {
                return Err(Error::unsupported(
                    "Cannot downgrade an image with zstd compression type and existing \
                     compressed clusters",
                ));
            }
            h.compression_type = CompressionType::Zlib;
        }
        let mut l1s = vec![None];
        l1s.extend(snaps.iter().map(Some));
        amend_zero::expand(&mut meta, &l1s, self.backing().is_some())?;
        meta.write_back()?;
        meta.write_back()?;
        h.version = 2;
        h.extensions.retain(|e| e.kind != ext::FEATURE_TABLE);
        h.incompatible_features = 0;
        h.compatible_features = 0;
        h.autoclear_features = 0;
        write_header(&meta, h)?;
        meta.cx.version = 2;
        Ok(())
    }
}
