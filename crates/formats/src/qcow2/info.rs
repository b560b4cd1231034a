//! What a qcow2 image adds to `info`: cluster size, dirty flag, backing
//! file, snapshots and QAPI's ImageInfoSpecificQCow2.

use diskit_core::{Result, Storage};

use super::bitmap::{self, Bitmap, BitmapsState};
use super::header::{CompressionType, Header, autoclear, compat, ext, incompat};
use super::snapshot::{self, Snapshot};
use crate::info::{FormatInfo, InfoValue, SnapshotInfo};

/// Reads what `info` shows of the qcow2 image in `file` with `header`.
pub fn read(file: &dyn Storage, h: &Header) -> Result<FormatInfo> {
    let snapshots = snapshot::read(file, h)?;
    let (state, bitmaps) = bitmap::read(file, h)?;
    let mut warnings = Vec::new();
    if state == BitmapsState::Stale {
        warnings.push(stale_bitmaps_warning(h.version));
    }
    let backing_filename = h
        .backing_file
        .as_deref()
        .map(c_string)
        .filter(|b| !b.is_empty())
        .map(str::to_string);
    Ok(FormatInfo {
        cluster_size: Some(h.cluster_size()),
        encrypted: h.crypt_method != 0,
        dirty: h.incompatible_features & incompat::DIRTY != 0,
        driver_info: true,
        backing_format: backing_filename
            .as_ref()
            .and(h.backing_format())
            .map(|f| c_string(&f).to_string())
            .filter(|f| !f.is_empty()),
        backing_filename,
        snapshots: snapshots.iter().map(snapshot_info).collect(),
        specific_type: "qcow2",
        specific: specific(
            h,
            matches!(state, BitmapsState::Present(_)),
            &bitmaps,
            encryption(file, h)?,
        ),
        warnings,
        children: Vec::new(),
    })
}

/// A snapshot as the format-neutral listing shows it.
pub fn snapshot_info(sn: &Snapshot) -> SnapshotInfo {
    SnapshotInfo {
        id: sn.display_id(),
        name: sn.display_name(),
        vm_state_size: sn.vm_state_size(),
        date_sec: sn.date_sec,
        date_nsec: sn.date_nsec,
        vm_clock_nsec: sn.vm_clock_nsec,
        icount: sn.icount(),
    }
}

/// A C string stored in an image, shown as QEMU shows it (cut at NUL).
fn c_string(s: &str) -> &str {
    s.split('\0').next().unwrap_or_default()
}

/// The warning QEMU prints when it opens an image whose bitmaps a program
/// without bitmap support may have made stale.
fn stale_bitmaps_warning(version: u32) -> String {
    let first = if version < 3 {
        "This qcow2 v2 image contains bitmaps, but they may have been modified by a program \
         without persistent bitmap support; so now they must all be considered inconsistent"
    } else {
        "a program lacking bitmap support modified this file, so all bitmaps are now \
         considered inconsistent"
    };
    format!("{first}\nSome clusters may be leaked, run 'diskit check -r' on the image file to fix.")
}

/// QAPI ImageInfoSpecificQCow2 (keys in schema order): v2 images show only
/// compat, refcount-bits and compression-type.
fn specific(
    h: &Header,
    has_bitmaps: bool,
    bitmaps: &[Bitmap],
    encrypt: Option<InfoValue>,
) -> InfoValue {
    let compression = InfoValue::Str(
        match h.compression_type {
            CompressionType::Zlib => "zlib",
            CompressionType::Zstd => "zstd",
        }
        .into(),
    );
    let refcount_bits = InfoValue::Int(h.refcount_bits() as i64);
    if h.version < 3 {
        let mut v = InfoValue::dict()
            .with("compat", InfoValue::Str("0.10".into()))
            .with("refcount-bits", refcount_bits);
        if let Some(e) = encrypt {
            v = v.with("encrypt", e);
        }
        return v.with("compression-type", compression);
    }
    let mut v = InfoValue::dict().with("compat", InfoValue::Str("1.1".into()));
    if let Some(e) = h.extension(ext::DATA_FILE) {
        let name = String::from_utf8_lossy(&e.data);
        v = v.with("data-file", InfoValue::Str(c_string(&name).to_string()));
    }
    if h.incompatible_features & incompat::EXTERNAL_DATA != 0 {
        let raw = h.autoclear_features & autoclear::RAW_EXTERNAL != 0;
        v = v.with("data-file-raw", InfoValue::Bool(raw));
    }
    v = v
        .with("extended-l2", InfoValue::Bool(h.extended_l2()))
        .with(
            "lazy-refcounts",
            InfoValue::Bool(h.compatible_features & compat::LAZY_REFCOUNTS != 0),
        )
        .with(
            "corrupt",
            InfoValue::Bool(h.incompatible_features & incompat::CORRUPT != 0),
        )
        .with("refcount-bits", refcount_bits);
    if let Some(e) = encrypt {
        v = v.with("encrypt", e);
    }
    if has_bitmaps {
        v = v.with(
            "bitmaps",
            InfoValue::List(bitmaps.iter().map(bitmap_info).collect()),
        );
    }
    v.with("compression-type", compression)
}

/// QAPI's ImageInfoSpecificQCow2 `encrypt`: the LUKS header's fields, or
/// only the format of legacy AES.
fn encryption(file: &dyn Storage, h: &Header) -> Result<Option<InfoValue>> {
    Ok(match h.crypt_method {
        super::crypt::AES => Some(InfoValue::dict().with("format", InfoValue::Str("aes".into()))),
        super::crypt::LUKS => {
            let (offset, _) = super::crypt::luks_area(h)?;
            let lh = crate::luks::read_header(file, offset)?;
            Some(crate::luks::info_value(&lh, Some("luks")))
        }
        _ => None,
    })
}

/// One QAPI Qcow2BitmapInfo.
fn bitmap_info(b: &Bitmap) -> InfoValue {
    let mut flags = Vec::new();
    if b.in_use() {
        flags.push(InfoValue::Str("in-use".into()));
    }
    if b.auto() {
        flags.push(InfoValue::Str("auto".into()));
    }
    InfoValue::dict()
        .with("name", InfoValue::Str(b.display_name()))
        .with("granularity", InfoValue::Int(b.granularity() as i64))
        .with("flags", InfoValue::List(flags))
}
