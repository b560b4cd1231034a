//! Opening a qcow2 image: header, tables, external data file and backing chain.

use diskit_core::{Error, ErrorKind, Result, Storage, StorageRef};

use super::device::{Backing, Qcow2, Qcow2Format};
use super::header::{Header, autoclear, ext, incompat};
use super::l2::DecodeContext;
use super::layout::Geometry;
use super::meta::Meta;
use super::refcount::Refcounts;
use crate::implied::ImpliedFiles;
use crate::mapped::Mapped;

/// The default L2 cache: enough for 256 GiB at 64 KiB clusters (32 MiB), or
/// the whole image when it needs less.
pub const DEFAULT_L2_CACHE_BYTES: u64 = 32 << 20;

/// Options for opening a qcow2 image.
#[derive(Debug, Clone, Default)]
pub struct Qcow2Options {
    /// Open for writing.
    pub writable: bool,
    /// Bytes of L2 tables to cache (QEMU's l2-cache-size).
    pub l2_cache_size: Option<u64>,
    /// QEMU's `l2-cache-entry-size`: checked as QEMU checks it (a power of
    /// two from 512 bytes to a cluster). diskit's cache keeps whole L2
    /// tables, so it changes nothing else: `l2-cache-size` still bounds
    /// the bytes cached.
    pub l2_cache_entry_size: Option<u64>,
    /// Read this internal snapshot (by id, then by name) instead of the
    /// active disk; read-only.
    pub snapshot: Option<String>,
    /// The secret that unlocks an encrypted image (`encrypt.key-secret`).
    pub key_secret: Option<String>,
    /// The encryption the description says the image has
    /// (`encrypt.format`): checked against the header, as QEMU does.
    pub encrypt_format: Option<String>,
    /// Open for `info`: nothing is unlocked, nothing of the data read.
    pub metadata_only: bool,
    /// Ask the file about every data cluster's zeros (a copier's source).
    pub host_zeros: bool,
    /// Trims and write-zeroes never deallocate (see
    /// [`Mapped::keeping_allocations`]).
    pub keep_allocations: bool,
}

/// Reads and validates the header of an open file.
pub fn read_header(file: &dyn Storage) -> Result<Header> {
    let mut head = vec![0u8; 104];
    file.read_padded(&mut head, 0)?;
    let bits = u32::from_be_bytes(head[20..24].try_into().unwrap());
    let cs = if (9..=21).contains(&bits) {
        1usize << bits
    } else {
        4096
    };
    let len = (file.file_len()? as usize).min(cs);
    let mut cluster0 = vec![0u8; len.max(104)];
    file.read_padded(&mut cluster0, 0)?;
    cluster0.truncate(len);
    Header::parse(&cluster0)
}

/// Opens the qcow2 image on `file`; the files it names (external data
/// file, backing file) are opened through `implied`.
pub fn open(file: StorageRef, opts: Qcow2Options, implied: &mut dyn ImpliedFiles) -> Result<Qcow2> {
    let mut header = read_header(&file)?;
    let cs = header.cluster_size();
    if header.refcount_table_offset < cs || header.l1_table_offset < cs && header.l1_size > 0 {
        return Err(Error::new(
            ErrorKind::Io,
            "qcow2 image is corrupt: the L1 or refcount table overlaps the header",
        ));
    }
    if opts.writable {
        if header.incompatible_features & incompat::CORRUPT != 0 {
            return Err(Error::new(
                ErrorKind::Io,
                "qcow2: Image is corrupt; cannot be opened read/write",
            ));
        }
        if header.incompatible_features & incompat::DIRTY != 0 {
            // Lazy refcounts were left stale: rebuild them, as QEMU does.
            let report = super::check::check(&file, super::check::Repair::All)?;
            if report.corruptions > 0 || report.check_errors > 0 {
                return Err(Error::new(
                    ErrorKind::Io,
                    "qcow2: the dirty image could not be repaired; run 'diskit check -r all'",
                ));
            }
            header = read_header(&file)?;
        }
    }
    if opts.writable && header.version >= 3 && header.autoclear_features & !autoclear::KNOWN != 0 {
        // Unknown autoclear bits go at a read-write open, as the format asks
        // of programs that do not maintain what they stand for.
        header.autoclear_features &= autoclear::KNOWN;
        file.write_extend(&header.autoclear_features.to_be_bytes(), 88)?;
        file.flush()?;
    }
    let external = header.incompatible_features & incompat::EXTERNAL_DATA != 0;
    let data = if external {
        let name = header
            .extension(ext::DATA_FILE)
            .map(|e| String::from_utf8_lossy(&e.data).into_owned())
            .ok_or_else(|| {
                Error::invalid("Could not open data file: no data file name in the image")
            })?;
        implied.data_file(&name, opts.writable)?
    } else {
        file.clone()
    };
    let backing = match &header.backing_file {
        None => None,
        Some(name) => {
            let fmt = header.backing_format();
            let (device, size) = implied.backing(name, fmt.as_deref())?;
            Some(Backing { device, size })
        }
    };
    if let Some(want) = &opts.snapshot {
        if opts.writable {
            return Err(Error::invalid("internal snapshots can only be read"));
        }
        // QEMU's -l: "snapshot.id=X", "snapshot.name=X", or X as an id then a name.
        let snapshots = super::snapshot::read(&file, &header)?;
        let (by_id, by_name) = match (
            want.strip_prefix("snapshot.id="),
            want.strip_prefix("snapshot.name="),
        ) {
            (Some(id), _) => (Some(id), None),
            (_, Some(name)) => (None, Some(name)),
            _ => (Some(want.as_str()), Some(want.as_str())),
        };
        let found = by_id
            .and_then(|id| snapshots.iter().find(|s| s.id == id.as_bytes()))
            .or_else(|| by_name.and_then(|n| snapshots.iter().find(|s| s.name == n.as_bytes())))
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "Can't find snapshot"))?;
        let index = snapshots
            .iter()
            .position(|s| std::ptr::eq(s, found))
            .unwrap_or(0);
        let cx = super::snapshot::TableContext {
            cluster_size: header.cluster_size(),
            file_len: file.file_len()?,
        };
        super::snapshot::check_placement(found, index as u32, &cx)?;
        // The disk keeps its current size; the snapshot's table maps it.
        header.l1_table_offset = found.l1_table_offset;
        header.l1_size = found.l1_size;
    }
    let geo = Geometry::of(&header);
    let cx = DecodeContext {
        geo,
        version: header.version,
        external_data: external,
    };
    let refs = if opts.writable {
        Some(Refcounts::load(file.clone(), &header, 256)?)
    } else {
        None
    };
    if let Some(n) = opts.l2_cache_entry_size
        && (!n.is_power_of_two() || n < 512 || n > cs)
    {
        return Err(Error::invalid(format!(
            "L2 cache entry size must be a power of two between 512 and the cluster size ({cs})"
        )));
    }
    let cache_bytes = opts
        .l2_cache_size
        .unwrap_or(DEFAULT_L2_CACHE_BYTES)
        .min(header.l1_size as u64 * cs)
        .max(2 * cs);
    let mut meta = Meta::load(
        file.clone(),
        cx,
        header.l1_table_offset,
        header.l1_size,
        (cache_bytes / cs) as usize,
        refs,
    )?;
    if opts.writable && file.writes_in_order() {
        // Written once, front to back: the tables writes make are placed
        // after the data, at the end.
        meta.defer_placement()?;
    }
    if !opts.writable {
        // A bitmap directory that does not hold together makes the image
        // unopenable, read-only too, as in QEMU: info, map, convert and
        // check then agree on it.
        super::bitmap::read(&file, &header)?;
    }
    let path = super::crypt::data_path(&file, data, &header, &opts)?;
    let mut image = Qcow2Format::new(file, path.data, backing, header, meta, opts.writable);
    image.set_guest_cipher(path.guest_cipher);
    image.set_key_secret(opts.key_secret.clone());
    image.set_host_zeros(opts.host_zeros && !image.encrypted());
    if opts.writable {
        image.track_bitmaps()?;
    }
    Ok(Mapped::new(image).keeping_allocations(opts.keep_allocations))
}
