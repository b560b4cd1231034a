//! The qcow2 format as the generic mapped layer sees it ([`Qcow2`] is
//! `Mapped<Qcow2Format>`): the metadata answers where guest bytes live,
//! the generic layer moves them.
//!
//! Reads look a range up under the metadata lock, take the guest clusters
//! shared, and read outside the lock. Writes to clusters that are this
//! image's alone (copied) go the same way. Writes that need new clusters
//! go through the generic allocation: with the clusters' units held, new
//! host clusters are allocated under the lock ([`MappedFormat::allocate`]),
//! what the old mapping held around the new data is copied (at subcluster
//! granularity with extended L2), the bytes are written outside the lock,
//! and only then, with the clusters taken from their readers, do the L2
//! entries point at the new data ([`MappedFormat::commit`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use diskit_core::sync;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, Result, ZeroFlags,
};
use diskit_core::{Storage, StorageRef};

use super::compress;
use super::header::Header;
use super::l2::{COPIED, ClusterKind, L2Entry, Mapping, ZERO, map_in_cluster};
use super::layout::{Geometry, GuestOffset, HostOffset};
use super::meta::{Meta, RangeTicket};
use crate::mapped::{self, Allocation, Fill, Layers, Mapped, MappedFormat, Place, Zeroed};

pub use crate::mapped::Backing;

/// An open qcow2 image as a block device: the generic mapped layer over
/// the format.
pub type Qcow2 = Mapped<Qcow2Format>;

/// An open qcow2 image's format: metadata, mappings, allocation.
pub struct Qcow2Format {
    pub(super) file: StorageRef,
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    header: Header,
    geo: Geometry,
    /// The virtual size (changed by resize).
    pub(super) size: AtomicU64,
    meta: Mutex<Meta>,
    released: Condvar,
    /// Whether data clusters may be holes in the file (metadata
    /// preallocation), decided on first use as QEMU decides it.
    prealloc_like: std::sync::OnceLock<bool>,
    /// Ask the file about every data cluster ([`crate::OpenOptions::host_zeros`]).
    host_zeros: bool,
    /// Autoclear bits still to clear (and bitmaps to mark in use) before
    /// the first change.
    pub(super) autoclear_pending: std::sync::atomic::AtomicBool,
    /// Persistent bitmaps kept up to date (writable images only).
    pub(super) bitmaps: super::bitmap_store::TrackerSlot,
    /// Whether `bitmaps` holds any (a lock-free test on the write path).
    pub(super) has_bitmaps: std::sync::atomic::AtomicBool,
    last_cluster: Mutex<Option<(HostOffset, Arc<Vec<u8>>)>>,
    /// Legacy AES encryption: data decrypted by guest sector after reading.
    guest_cipher: Option<Arc<crate::crypto::SectorCipher>>,
    /// The secret the image was opened with (`encrypt.key-secret`).
    key_secret: Option<String>,
}

/// The largest run one lookup returns (bounds the work under the lock).
const MAX_RUN: u64 = 32 << 20;

impl Qcow2Format {
    /// Assembles an image from its opened parts (see [`super::open`]).
    pub fn new(
        file: StorageRef,
        data: StorageRef,
        backing: Option<Backing>,
        header: Header,
        meta: Meta,
        writable: bool,
    ) -> Qcow2Format {
        let pending =
            writable && header.autoclear_features & !super::header::autoclear::RAW_EXTERNAL != 0;
        Qcow2Format {
            geo: Geometry::of(&header),
            size: AtomicU64::new(header.size),
            file,
            layers: Layers {
                data,
                backing,
                writable,
            },
            header,
            autoclear_pending: std::sync::atomic::AtomicBool::new(pending),
            bitmaps: std::sync::Mutex::new(None),
            has_bitmaps: std::sync::atomic::AtomicBool::new(false),
            prealloc_like: std::sync::OnceLock::new(),
            host_zeros: false,
            meta: Mutex::new(meta),
            released: Condvar::new(),
            last_cluster: Mutex::new(None),
            guest_cipher: None,
            key_secret: None,
        }
    }

    /// Records the secret the image was opened with (amend needs it to
    /// add key slots).
    pub fn set_key_secret(&mut self, id: Option<String>) {
        self.key_secret = id;
    }

    /// The secret the image was opened with.
    pub fn key_secret(&self) -> Option<&str> {
        self.key_secret.as_deref()
    }

    /// Asks the file about every data cluster's zeros (see
    /// [`crate::OpenOptions::host_zeros`]).
    pub fn set_host_zeros(&mut self, on: bool) {
        self.host_zeros = on;
    }

    /// Sets legacy AES's cipher (reads decrypt by guest sector).
    pub fn set_guest_cipher(&mut self, cipher: Option<Arc<crate::crypto::SectorCipher>>) {
        self.guest_cipher = cipher;
    }

    /// Whether the guest data is encrypted (LUKS or legacy AES).
    pub fn encrypted(&self) -> bool {
        self.header.crypt_method != super::crypt::NONE
    }

    /// The virtual size (changed by resize).
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// The header as opened.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The image's geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    /// The backing image, if any.
    pub fn backing(&self) -> Option<&Backing> {
        self.layers.backing.as_ref()
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Meta> {
        sync::lock(&self.meta)
    }

    /// Runs `f` with the metadata locked (for check and other whole-image tools).
    pub fn with_meta<R>(&self, f: impl FnOnce(&mut Meta) -> R) -> R {
        f(&mut self.lock())
    }

    /// Looks up the mapping at `g`: how many bytes (at most `max`) share it.
    fn map_run(&self, meta: &mut Meta, g: GuestOffset, max: u64) -> Result<(u64, Mapping)> {
        let geo = self.geo;
        let table_end = (g.0 / geo.l2_coverage() + 1) * geo.l2_coverage();
        let max = max.min(table_end - g.0).min(MAX_RUN);
        let cx = meta.cx;
        let Some(table) = meta.l2_of(geo.l1_index(g))? else {
            return Ok((max, Mapping::Backing { alloc: None }));
        };
        let mut pos = g.0;
        let mut first: Option<(u64, Mapping)> = None;
        while pos < g.0 + max {
            let e = table[geo.l2_index(GuestOffset(pos))];
            let start = geo.cluster_start(GuestOffset(pos)).0;
            let kind = e.decode(&cx, start)?;
            let (n, m) = map_in_cluster(&geo, &e, kind, pos - start, g.0 + max - pos);
            match &mut first {
                None => first = Some((n, m)),
                Some((len, fm)) if fm.continues(*len, &m) => *len += n,
                Some(_) => break,
            }
            pos += n;
        }
        Ok(first.expect("max > 0"))
    }

    /// Guest clusters `[g, g+len)` touches, as an inclusive range.
    fn clusters(&self, g: u64, len: u64) -> (u64, u64) {
        (
            g >> self.geo.cluster_bits,
            (g + len - 1) >> self.geo.cluster_bits,
        )
    }

    /// Takes guest clusters `first..=last` exclusively, waiting for the
    /// requests that use them; returns the metadata still locked.
    fn take_exclusive(&self, first: u64, last: u64) -> (MutexGuard<'_, Meta>, RangeTicket) {
        let mut meta = self.lock();
        loop {
            if let Some(t) = meta.try_take(first, last, true) {
                return (meta, t);
            }
            meta = sync::wait(&self.released, meta);
        }
    }

    fn give_back(&self, t: Option<RangeTicket>) {
        if let Some(t) = t {
            self.lock().give_back(t);
            self.released.notify_all();
        }
    }

    fn decompressed(&self, stream: super::l2::Compressed) -> Result<Arc<Vec<u8>>> {
        if let Some((at, data)) = &*sync::lock(&self.last_cluster)
            && *at == stream.offset
        {
            return Ok(data.clone());
        }
        let file_len = self.file.file_len()?;
        if stream.offset.0 >= file_len {
            return Err(Error::new(
                ErrorKind::Io,
                format!(
                    "qcow2 image is corrupt: compressed cluster at {} is past the end of the file",
                    stream.offset
                ),
            ));
        }
        let mut input = vec![0u8; stream.size as usize];
        self.file.read_padded(&mut input, stream.offset.0)?;
        let mut out = vec![0u8; self.geo.cluster_size() as usize];
        let end = stream.offset.0.saturating_add(stream.size);
        compress::decompress(self.header.compression_type, &input, &mut out).map_err(|e| {
            let past = if end > file_len {
                format!(
                    ", of which {} bytes lie past the end of the file ({file_len} bytes)",
                    end - file_len
                )
            } else {
                String::new()
            };
            e.context(format!(
                "qcow2 image is corrupt: compressed cluster at host offset {:#x} ({} bytes{past})",
                stream.offset.0, stream.size
            ))
        })?;
        let out = Arc::new(out);
        *sync::lock(&self.last_cluster) = Some((stream.offset, out.clone()));
        Ok(out)
    }

    /// Bitmap bits (allocation half) of the subclusters `[off, off+len)` touches.
    fn subcluster_mask(&self, off: u64, len: u64) -> u64 {
        let scs = self.geo.subcluster_size();
        let a = off / scs;
        let b = (off + len).div_ceil(scs);
        ((1u64 << b) - 1) & !((1u64 << a) - 1)
    }

    /// The old mappings of the run of whole clusters from `g` (cluster
    /// aligned) that `buf` covers and that all need new host clusters (none
    /// writable in place or kept), within one L2 table and [`MAX_RUN`];
    /// fewer than two when there is no such run.
    fn new_cluster_run(
        &self,
        meta: &mut Meta,
        buf: &[u8],
        g: u64,
        e: L2Entry,
        kind: ClusterKind,
    ) -> Result<Vec<(L2Entry, ClusterKind)>> {
        let geo = self.geo;
        let cs = geo.cluster_size();
        let needs_new = |e: &L2Entry, k: ClusterKind| own_host(e, k).is_none();
        let mut olds = Vec::new();
        if geo.cluster_start(GuestOffset(g)).0 != g
            || (buf.len() as u64) < 2 * cs
            || !needs_new(&e, kind)
        {
            return Ok(olds);
        }
        olds.push((e, kind));
        let mut len = cs;
        while len + cs <= buf.len() as u64 && len < MAX_RUN {
            let ng = g + len;
            if geo.l2_index(GuestOffset(ng)) == 0 {
                break;
            }
            let (e2, k2) = meta.kind(GuestOffset(ng))?;
            if !needs_new(&e2, k2) {
                break;
            }
            olds.push((e2, k2));
            len += cs;
        }
        Ok(olds)
    }

    /// Makes every cluster of `[g, g+len)` (cluster aligned) unallocated,
    /// dropping its host clusters (used past the end when shrinking).
    pub(super) fn discard_clusters(&self, g: u64, len: u64) -> Result<()> {
        self.before_change()?;
        let cs = self.geo.cluster_size();
        let mut meta = self.lock();
        let mut pos = g;
        while pos < g + len {
            let l1i = self.geo.l1_index(GuestOffset(pos));
            if !meta.has_l2(l1i)? {
                // A whole unallocated L2 table: skip to the next one.
                pos = (pos / self.geo.l2_coverage() + 1) * self.geo.l2_coverage();
                continue;
            }
            let (e, kind) = meta.kind(GuestOffset(pos))?;
            if e != L2Entry::default() {
                meta.set_entry(GuestOffset(pos), L2Entry::default())?;
                meta.release(kind);
            }
            pos += cs;
        }
        Ok(())
    }

    /// Zeroes or discards whole clusters (or subclusters) of `[g, g+len)`,
    /// which must be aligned to the zeroing granularity. `discard` drops the
    /// data (the backing file shows through where the format allows it).
    fn zero_aligned(&self, g: u64, len: u64, keep_alloc: bool, discard: bool) -> Result<()> {
        self.before_change()?;
        let geo = self.geo;
        let cs = geo.cluster_size();
        let v3 = self.header.version >= 3;
        let mut pos = g;
        while pos < g + len {
            let start = geo.cluster_start(GuestOffset(pos)).0;
            let n = (start + cs).min(g + len) - pos;
            let (first, _) = self.clusters(pos, 1);
            let (mut meta, t) = self.take_exclusive(first, first);
            let r = (|| -> Result<()> {
                let (e, kind) = meta.kind(GuestOffset(pos))?;
                let whole = n == cs;
                let unalloc_reads_zero = self.layers.backing.is_none();
                if !geo.extended_l2 {
                    let new_word = if discard && !v3 || discard && unalloc_reads_zero && !keep_alloc
                    {
                        0
                    } else {
                        match kind.host() {
                            Some(h) if keep_alloc && e.word & COPIED != 0 => h.0 | COPIED | ZERO,
                            _ if unalloc_reads_zero && !v3 => 0,
                            _ => ZERO,
                        }
                    };
                    if new_word & ZERO != 0 && !v3 {
                        return Err(Error::from_kind(ErrorKind::NotSupported));
                    }
                    if new_word == e.word {
                        return Ok(());
                    }
                    meta.set_entry(
                        GuestOffset(pos),
                        L2Entry {
                            word: new_word,
                            bitmap: 0,
                        },
                    )?;
                    if new_word & COPIED == 0 {
                        meta.release(kind);
                    }
                    return Ok(());
                }
                let mask = self.subcluster_mask(pos - start, n);
                let fill = if discard && unalloc_reads_zero {
                    0
                } else {
                    mask << 32
                };
                let new = match kind {
                    _ if whole && (!keep_alloc || kind.host().is_none()) => L2Entry {
                        word: 0,
                        bitmap: fill,
                    },
                    ClusterKind::Compressed(_) => {
                        return Err(Error::from_kind(ErrorKind::NotSupported));
                    }
                    _ => L2Entry {
                        word: e.word,
                        bitmap: (e.bitmap & !mask & !(mask << 32)) | fill,
                    },
                };
                if new == e {
                    return Ok(());
                }
                meta.set_entry(GuestOffset(pos), new)?;
                if new.word == 0 {
                    meta.release(kind);
                }
                Ok(())
            })();
            drop(meta);
            self.give_back(Some(t));
            r?;
            pos += n;
        }
        Ok(())
    }

    /// Stores one whole guest cluster at `g` (cluster aligned) as the
    /// compressed stream `stream`, with the cluster's unit held by the
    /// device ([`Mapped::with_units`]). Only a cluster with nothing in it
    /// can become compressed: for one already allocated, nothing is
    /// stored and the answer is `false` (the caller writes it plainly).
    pub fn write_compressed(&self, g: u64, stream: &[u8]) -> Result<bool> {
        self.changing(g, self.geo.cluster_size())?;
        let geo = self.geo;
        if self.data_is_external() {
            return Err(Error::unsupported(
                "Compression is not supported with an external data file",
            ));
        }
        let (first, _) = self.clusters(g, 1);
        let (mut meta, t) = self.take_exclusive(first, first);
        // Only a cluster with nothing in it can become compressed.
        let prepared = (|| -> Result<Option<HostOffset>> {
            let (_, kind) = meta.kind(GuestOffset(g))?;
            if !matches!(kind, ClusterKind::Unallocated | ClusterKind::ZeroPlain) {
                return Ok(None);
            }
            meta.l2_for_write(GuestOffset(g))?;
            Ok(Some(meta.alloc_bytes(stream.len() as u64)?))
        })();
        drop(meta);
        let stored = matches!(prepared, Ok(Some(_)));
        let r = match prepared {
            Ok(Some(at)) => self.file.write_extend(stream, at.0).and_then(|_| {
                let word = super::l2::Compressed::encode(&geo, at, stream.len() as u64);
                self.lock()
                    .set_entry(GuestOffset(g), L2Entry { word, bitmap: 0 })
            }),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        self.give_back(Some(t));
        r?;
        Ok(stored)
    }

    /// The file that holds guest data (the image itself, or its external
    /// data file).
    pub fn data_location(&self) -> &str {
        self.layers.data.location()
    }

    /// Before the image first changes: marks the enabled persistent bitmaps
    /// in use, and clears the autoclear bits of features diskit does not
    /// maintain, as the format asks. Opening alone changes nothing.
    pub(super) fn before_change(&self) -> Result<()> {
        if !self.autoclear_pending.swap(false, Ordering::AcqRel) || self.header.version < 3 {
            return Ok(());
        }
        let keep_bitmaps = self.keeps_bitmaps();
        if keep_bitmaps {
            self.mark_bitmaps_in_use()?;
        }
        let mut raw = [0u8; 8];
        self.file.read_padded(&mut raw, 88)?;
        let now = u64::from_be_bytes(raw);
        let mut keep = super::header::autoclear::RAW_EXTERNAL;
        if keep_bitmaps {
            keep |= super::header::autoclear::BITMAPS;
        }
        if now & !keep != 0 {
            self.file.write_extend(&(now & keep).to_be_bytes(), 88)?;
            self.file.flush()?;
        }
        Ok(())
    }

    /// Before guest bytes `[g, g+len)` change: see [`Self::before_change`];
    /// the range is recorded in the dirty bitmaps.
    fn changing(&self, g: u64, len: u64) -> Result<()> {
        self.before_change()?;
        self.note_dirty(g, g + len);
        Ok(())
    }

    /// The file that holds guest data.
    pub(super) fn data_file(&self) -> &StorageRef {
        &self.layers.data
    }

    /// Whether guest data lives in an external data file.
    pub fn data_is_external(&self) -> bool {
        self.header.incompatible_features & super::header::incompat::EXTERNAL_DATA != 0
    }

    /// Writes all cached metadata out and syncs (twice, so that deferred
    /// refcount decrements land too); written front to back, the metadata
    /// held in memory is placed after the data first
    /// ([`super::meta::deferred`]).
    pub fn close(&self) -> Result<()> {
        if self.layers.writable {
            self.persist_bitmaps()?;
            let mut meta = self.lock();
            meta.place_deferred()?;
            meta.write_back()?;
            meta.write_back()?;
            drop(meta);
            self.file.flush()?;
        }
        Ok(())
    }

    fn zero_granularity(&self) -> u64 {
        self.geo.subcluster_size()
    }

    /// The whole granules of `gran` bytes inside `[g, end)`, as a range
    /// (empty when `a >= b`); an unaligned end at the very end of the
    /// image counts as aligned.
    fn whole(&self, g: u64, end: u64, gran: u64) -> (u64, u64) {
        let b = if end == self.size() {
            end
        } else {
            end / gran * gran
        };
        (g.div_ceil(gran) * gran, b)
    }
}

impl Drop for Qcow2Format {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            eprintln!("diskit: error writing qcow2 metadata on close: {e}");
        }
    }
}

impl Qcow2Format {
    /// QEMU's test for metadata preallocation: many more clusters have a
    /// reference than the file has allocated on disk. Only then are data
    /// clusters worth asking the file about (their unwritten parts read as
    /// zeros); otherwise a data cluster is data, as qemu-img reports it.
    fn looks_preallocated(&self) -> bool {
        *self.prealloc_like.get_or_init(|| {
            (|| -> Result<bool> {
                let cs = self.geo.cluster_size();
                let Some(real) = self.file.allocated_bytes() else {
                    return Ok(false);
                };
                let real = real / cs;
                let threshold = (real * 10 / 9).max(real + 2);
                let clusters = self.file.file_len()?.div_ceil(cs);
                if clusters > 1 << 26 {
                    return Ok(false);
                }
                let mut refs =
                    super::refcount::Refcounts::load(self.file.clone(), &self.header, 16)?;
                let mut used = 0u64;
                for c in 0..clusters {
                    if refs.get(super::layout::HostCluster(c))? > 0 {
                        used += 1;
                        if used > threshold {
                            return Ok(true);
                        }
                    }
                }
                Ok(false)
            })()
            .unwrap_or(false)
        })
    }
}

/// The host cluster an entry keeps for new writes: a normal or
/// preallocated zero cluster that is this image's alone (copied).
fn own_host(e: &L2Entry, kind: ClusterKind) -> Option<HostOffset> {
    match kind {
        ClusterKind::Normal(h) | ClusterKind::ZeroAlloc(h) if e.word & COPIED != 0 => Some(h),
        _ => None,
    }
}

/// The generic layer's view of a qcow2 mapping.
fn place(m: Mapping) -> Place {
    match m {
        Mapping::Data(h) => Place::Data(h.0),
        Mapping::Shared(h) => Place::Shared(h.0),
        Mapping::Zero { alloc } => Place::Zero {
            alloc: alloc.map(|h| h.0),
        },
        Mapping::Backing { alloc } => Place::Unallocated {
            alloc: alloc.map(|h| h.0),
        },
        Mapping::Compressed { stream, skip } => Place::Compressed {
            offset: stream.offset.0,
            size: stream.size,
            skip,
        },
    }
}

/// Guest clusters held shared while a read moves their bytes.
pub struct ReadHold<'a> {
    image: &'a Qcow2Format,
    ticket: Option<RangeTicket>,
}

impl Drop for ReadHold<'_> {
    fn drop(&mut self) {
        self.image.give_back(self.ticket.take());
    }
}

impl MappedFormat for Qcow2Format {
    type Hold<'a> = ReadHold<'a>;

    fn guest_size(&self) -> u64 {
        self.size()
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    /// Clusters mapped as [`Place::Data`] (copied: this image alone maps
    /// them) are freed only by a discard or a zero that may deallocate; a
    /// zero that keeps allocations keeps them as preallocated zero
    /// clusters. (Shared and compressed clusters are freed when written
    /// over, but neither is viewed in a writable image.)
    fn frees_data_only_when_trimmed(&self) -> bool {
        true
    }

    fn guest_cipher(&self) -> Option<&crate::crypto::SectorCipher> {
        self.guest_cipher.as_deref()
    }

    fn lookup(&self, g: u64, max: u64, hold: bool) -> Result<(u64, Place, Option<ReadHold<'_>>)> {
        let mut meta = self.lock();
        loop {
            let (n, m) = self.map_run(&mut meta, GuestOffset(g), max)?;
            if !hold {
                return Ok((n, place(m), None));
            }
            // Writers change mappings only with the clusters taken
            // exclusively: wait for them, then look again.
            let (first, last) = self.clusters(g, n);
            if let Some(t) = meta.try_take(first, last, false) {
                let held = ReadHold {
                    image: self,
                    ticket: Some(t),
                };
                return Ok((n, place(m), Some(held)));
            }
            meta = sync::wait(&self.released, meta);
        }
    }

    fn read_compressed(&self, offset: u64, size: u64, skip: u64, buf: &mut [u8]) -> Result<()> {
        let stream = super::l2::Compressed {
            offset: HostOffset(offset),
            size,
        };
        let cluster = self.decompressed(stream)?;
        let part = usize::try_from(skip)
            .ok()
            .and_then(|a| cluster.get(a..a.checked_add(buf.len())?))
            .ok_or_else(|| Error::new(ErrorKind::Io, "qcow2: read past a compressed cluster"))?;
        buf.copy_from_slice(part);
        Ok(())
    }

    fn data_may_be_sparse(&self) -> bool {
        !self.data_is_external() && (self.host_zeros || self.looks_preallocated())
    }

    fn unit(&self) -> u64 {
        self.geo.cluster_size()
    }

    fn describe(&self) -> String {
        self.file.describe()
    }

    fn capabilities(&self) -> Capabilities {
        // The mapped image's, with trim, fast zeroing on v3 and cache; a
        // read-only image flushes nothing either.
        let caps = Capabilities {
            can_trim: true,
            can_fast_zero: self.header.version >= 3,
            can_cache: true,
            ..mapped::image_capabilities(true, true, false)
        };
        if self.layers.writable {
            caps
        } else {
            Capabilities {
                can_flush: false,
                ..caps.read_only()
            }
        }
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: self.geo.cluster_size().min(1 << 20) as u32,
            maximum: 64 << 20,
        }
    }

    fn before_change(&self, g: u64, len: u64) -> Result<()> {
        self.changing(g, len)
    }

    /// A run of new clusters may go on over clusters that map something
    /// else but need new ones too (as QEMU allocates): to the write's end,
    /// within the L2 table.
    fn allocation_span(&self, g: u64, run: u64, max: u64) -> u64 {
        let cov = self.geo.l2_coverage();
        run.max(max.min((g / cov + 1) * cov - g))
    }

    /// New host clusters for the write at `g`: one run when `data` covers
    /// two or more whole clusters that all need new ones (a convert writes
    /// so, as QEMU does: one allocation and one write, not one by one);
    /// otherwise the cluster holding `g`, copied whole from what it maps
    /// (a compressed cluster, one a snapshot shares), or, with extended L2
    /// entries, only the subclusters the write touches. A cluster that is
    /// already this image's (subclusters missing, or preallocated zeros)
    /// keeps its host cluster. External data files map guest clusters 1:1,
    /// unrefcounted.
    fn allocate(&self, g: u64, data: &[u8]) -> Result<Allocation> {
        let geo = self.geo;
        let cs = geo.cluster_size();
        let start = geo.cluster_start(GuestOffset(g)).0;
        let mut meta = self.lock();
        let (e, kind) = meta.kind(GuestOffset(g))?;
        let olds = self.new_cluster_run(&mut meta, data, g, e, kind)?;
        meta.l2_for_write(GuestOffset(g))?;
        if olds.len() > 1 {
            let n = olds.len() as u64;
            let host = if self.data_is_external() {
                g
            } else {
                geo.host_offset(meta.refs()?.alloc(n)?.0).0
            };
            return Ok(Allocation {
                guest: g,
                len: n * cs,
                host,
                fill: Fill::DataOnly,
            });
        }
        let off = g - start;
        let len = (cs - off).min(data.len() as u64);
        let own = own_host(&e, kind);
        // Which part of the cluster the old mapping fills around the data.
        let whole = match kind {
            ClusterKind::Compressed(_) => true,
            ClusterKind::Normal(_) | ClusterKind::ZeroAlloc(_) => own.is_none(),
            _ => false,
        };
        let (ra, rb) = if geo.extended_l2 && !whole {
            let scs = geo.subcluster_size();
            (off / scs * scs, (off + len).div_ceil(scs) * scs)
        } else {
            (0, cs)
        };
        let (host, fresh) = match own {
            Some(h) => (h, false),
            None if self.data_is_external() => (HostOffset(start), false),
            None => {
                let (c, fresh) = meta.refs()?.alloc(1)?;
                (geo.host_offset(c), fresh)
            }
        };
        // A fresh cluster reads as zeros (unless encrypted: a hole reads
        // as ciphertext, not zeros).
        Ok(Allocation {
            guest: start + ra,
            len: rb - ra,
            host: host.0 + ra,
            fill: if fresh && !self.encrypted() {
                Fill::OverZeros
            } else {
                Fill::Whole
            },
        })
    }

    /// Points the entries at the written clusters (copied, their written
    /// subclusters allocated and no longer zero), with the clusters taken
    /// from readers of the old mapping, and releases what they mapped
    /// before (a host cluster they keep stays).
    fn commit(&self, a: Allocation) -> Result<()> {
        let geo = self.geo;
        let cs = geo.cluster_size();
        let (first, last) = self.clusters(a.guest, a.len);
        let (mut meta, t) = self.take_exclusive(first, last);
        let r = (|| -> Result<()> {
            for c in first..=last {
                let cg = c << geo.cluster_bits;
                let (e, kind) = meta.kind(GuestOffset(cg))?;
                let from = a.guest.max(cg) - cg;
                let to = (a.guest + a.len).min(cg + cs) - cg;
                let bitmap = if geo.extended_l2 {
                    let mask = self.subcluster_mask(from, to - from);
                    (e.bitmap | mask) & !(mask << 32)
                } else {
                    0
                };
                let word = (a.host + cg - a.guest) | COPIED;
                meta.set_entry(GuestOffset(cg), L2Entry { word, bitmap })?;
                if own_host(&e, kind).is_none() {
                    meta.release(kind);
                }
            }
            Ok(())
        })();
        drop(meta);
        self.give_back(Some(t));
        r
    }

    /// Whole (sub)clusters of a v3 image become zero clusters (the host
    /// cluster kept unless the range may be trimmed); unaligned edges, and
    /// what the format cannot mark, are written.
    fn zero(&self, g: u64, len: u64, flags: ZeroFlags) -> Result<Zeroed> {
        let end = g + len;
        let (a, b) = self.whole(g, end, self.zero_granularity());
        // Only whole (sub)clusters of a v3 image are cheap to zero.
        if flags.fast && (self.header.version < 3 || a != g || b != end) {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        if a >= b {
            return Ok(Zeroed::Write(len));
        }
        if a > g {
            return Ok(Zeroed::Write(a - g));
        }
        match self.zero_aligned(a, b - a, !flags.may_trim, false) {
            Err(e) if e.kind() == ErrorKind::NotSupported && !flags.fast => {
                Ok(Zeroed::Write(b - a))
            }
            r => r.map(|()| Zeroed::Done(b - a)),
        }
    }

    /// Whole clusters are dropped where the format allows it (the backing
    /// file shows through); discard is advisory, so what cannot be dropped
    /// cheaply stays.
    fn discard(&self, g: u64, len: u64) -> Result<()> {
        let (a, b) = self.whole(g, g + len, self.geo.cluster_size());
        if a < b && !(self.header.version < 3 && self.layers.backing.is_some()) {
            match self.zero_aligned(a, b - a, false, true) {
                Err(e) if e.kind() == ErrorKind::NotSupported => {}
                r => r?,
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if !self.layers.writable {
            return Ok(());
        }
        let mut meta = self.lock();
        meta.write_back()?;
        drop(meta);
        self.layers.data.flush()?;
        if self.data_is_external() {
            self.file.flush()?;
        }
        Ok(())
    }

    fn close(&self) -> Result<()> {
        Qcow2Format::close(self)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut v = mapped::extents(self, offset, len)?;
        if self.encrypted() {
            // Encrypted bytes are not the guest's: no host offset is shown
            // for them, as in QEMU.
            for e in &mut v {
                e.host_offset = None;
            }
        }
        Ok(v)
    }
}
