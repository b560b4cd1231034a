//! An RBD image as [`Storage`]: reads, writes, zeroes, discards, flushes
//! and resizes go to librbd; extents come from `rbd_diff_iterate2`, so
//! holes are known both ways. librbd serialises what it must inside: any
//! number of threads may have requests in flight on one image.

use std::ffi::{CString, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use diskit_core::aio::{self as core_aio, CompletionQueue, Request};
use diskit_core::chunks::{RangeReader, ReadRange};
use diskit_core::workers::Workers;

use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, Extent, Lent, Preallocation, Result,
    SnapshotChange, Storage, WriteFlags, ZeroFlags,
};

use crate::api::{self, Api, Handle, ImageInfo, SnapInfo, failed, request_failed};
use crate::name::RbdName;
use crate::objects::{self, ObjectNames};

/// Requests worth keeping in flight on one image from one submitter:
/// each is an object-sized read or write on its own OSD request.
const QUEUE_DEPTH: usize = 32;

/// Largest request handed to librbd at once (its lengths are `size_t`,
/// and huge requests only hold memory longer).
const MAX_REQUEST: usize = 64 << 20;

/// librados and librbd options set before the configuration file and the
/// name's options, which may say otherwise:
/// - how long (seconds) a monitor and an OSD may take to answer before a
///   request fails with ETIMEDOUT (librados waits forever by default);
/// - writes sent from the caller's buffer, not a copy of it: diskit's
///   requests own their buffers until librbd completes them, and librbd
///   completes a zero-copy write only once the cluster is done with the
///   bytes. Its cache (write-around by default) would copy every write
///   to acknowledge it early; without it a write completes when the OSD
///   has it, and a flush has nothing left to send. (A copy of 2 GiB into
///   RBD spent a quarter of its processor time on that copy.)
const DEFAULT_OPTIONS: &[(&str, &str)] = &[
    ("client_mount_timeout", "30"),
    ("rados_mon_op_timeout", "30"),
    ("rados_osd_op_timeout", "120"),
    ("rbd_cache", "false"),
    ("rbd_disable_zero_copy_writes", "false"),
];

/// A connection to a cluster with an I/O context on one pool (and
/// namespace), closed when dropped.
struct Pool {
    api: &'static Api,
    cluster: Handle,
    ioctx: Handle,
}

// SAFETY: librados's cluster and I/O context handles may be used from any
// thread (librados is thread-safe; QEMU shares them between threads).
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

fn c_string(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} contains a NUL byte")))
}

impl Pool {
    /// Connects as `name` says and opens its pool.
    fn connect(name: &RbdName) -> Result<Pool> {
        let api = api::api()?;
        let user = name
            .user
            .as_deref()
            .map(|u| c_string(u, "the user"))
            .transpose()?;
        let mut cluster: Handle = std::ptr::null_mut();
        // SAFETY: `cluster` is written on success; `user` is NUL-terminated
        // or null (librados's default user).
        let r = unsafe {
            (api.rados_create)(
                &mut cluster,
                user.as_ref().map_or(std::ptr::null(), |u| u.as_ptr()),
            )
        };
        if r < 0 {
            return Err(failed(r.into(), "error initializing"));
        }
        // From here `pool` shuts the cluster down when dropped.
        let mut pool = Pool {
            api,
            cluster,
            ioctx: std::ptr::null_mut(),
        };
        // Set before the configuration file and the name's options, which
        // may say otherwise.
        for (k, v) in DEFAULT_OPTIONS {
            let (ck, cv) = (c_string(k, "an option")?, c_string(v, "an option")?);
            // SAFETY: `cluster` is live; both strings are NUL-terminated.
            unsafe { (api.rados_conf_set)(cluster, ck.as_ptr(), cv.as_ptr()) };
        }
        let conf = name
            .conf
            .as_deref()
            .map(|c| c_string(c, "conf"))
            .transpose()?;
        // SAFETY: `cluster` is live; the path is NUL-terminated or null
        // (Ceph's default search).
        let r = unsafe {
            (api.rados_conf_read_file)(
                cluster,
                conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if r < 0 && name.conf.is_some() {
            return Err(failed(r.into(), "error reading conf file"));
        }
        for (k, v) in &name.options {
            let (ck, cv) = (c_string(k, "an option")?, c_string(v, "an option")?);
            // SAFETY: `cluster` is live; both strings are NUL-terminated.
            let r = unsafe { (api.rados_conf_set)(cluster, ck.as_ptr(), cv.as_ptr()) };
            if r < 0 {
                return Err(failed(r.into(), format!("invalid conf option {k}")));
            }
        }
        // SAFETY: `cluster` is live and configured.
        let r = unsafe { (api.rados_connect)(cluster) };
        if r < 0 {
            return Err(failed(r.into(), "error connecting"));
        }
        let cpool = c_string(&name.pool, "the pool")?;
        // SAFETY: `cluster` is connected; `ioctx` is written on success.
        let r = unsafe { (api.rados_ioctx_create)(cluster, cpool.as_ptr(), &mut pool.ioctx) };
        if r < 0 {
            return Err(failed(
                r.into(),
                format!("error opening pool {}", name.pool),
            ));
        }
        let ns = c_string(name.namespace.as_deref().unwrap_or(""), "the namespace")?;
        // SAFETY: `ioctx` is live; the namespace is NUL-terminated.
        unsafe { (api.rados_ioctx_set_namespace)(pool.ioctx, ns.as_ptr()) };
        Ok(pool)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: the handles are live and used by nothing else now (the
        // image on them is closed first: it is dropped before its pool).
        unsafe {
            if !self.ioctx.is_null() {
                (self.api.rados_ioctx_destroy)(self.ioctx);
            }
            (self.api.rados_shutdown)(self.cluster);
        }
    }
}

/// An image handle on the connection it is open on: the image is closed
/// (librbd's close waits for the submitted requests still in flight,
/// whose callbacks own all they use), then the connection, when the last
/// holder lets it go (the image, or a chunk still loading ahead).
struct Open {
    image: Handle,
    /// Closed after the image (the image is closed in `drop`, before the
    /// fields are dropped).
    pool: Pool,
}

// SAFETY: an `rbd_image_t` may be used from several threads at once for
// I/O (librbd serialises inside; QEMU issues requests from any thread).
unsafe impl Send for Open {}
// SAFETY: as above.
unsafe impl Sync for Open {}

impl Drop for Open {
    fn drop(&mut self) {
        // SAFETY: the image is open, and nothing else holds it any more.
        unsafe { (self.pool.api.rbd_close)(self.image) };
    }
}

impl ReadRange for Open {
    /// Reads in requests of at most [`MAX_REQUEST`] bytes; bytes past the
    /// end of an image that shrank read as zeros.
    fn read_range(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        pieces(offset, len, |at, skip, n| {
            // SAFETY: `ptr[skip..skip+n]` lies in `buf`, which outlives the
            // call; the image is open.
            let r =
                unsafe { (self.pool.api.rbd_read2)(self.image, at, n, ptr.add(skip).cast(), 0) };
            if r < 0 {
                return Err(request_failed(r as i64));
            }
            if (r as usize) < n {
                // Past the end of a shrunk image: zeros.
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(ptr.add(skip + r as usize), 0, n - r as usize) };
            }
            Ok(())
        })
    }
}

/// Calls `op(offset, skip, n)` over `[offset, offset+len)` in pieces of
/// at most [`MAX_REQUEST`] bytes, `skip` bytes from the start.
fn pieces(
    offset: u64,
    len: usize,
    mut op: impl FnMut(u64, usize, usize) -> Result<()>,
) -> Result<()> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_REQUEST);
        op(offset + done as u64, done, n)?;
        done += n;
    }
    Ok(())
}

/// An open RBD image.
///
/// Opened read-only (or at a snapshot), its bytes cannot change under a
/// reader, and small reads that continue one another (a client reading a
/// stream through `serve`) are served from whole objects, each read with
/// one request and the next one loaded ahead ([`diskit_core::chunks`]):
/// an OSD's cost is mostly per request. Submitted requests go to librbd
/// as they are (a copier's reads are whole objects already).
pub struct RbdImage {
    /// The image, and its reads (through chunks when read-only).
    reads: Arc<RangeReader<Open>>,
    size: AtomicU64,
    object_size: u64,
    writable: bool,
    /// Whether the image keeps a valid fast-diff object map: extents then
    /// come from it, whole objects at a time, without asking each object.
    fast_diff: bool,
    /// How the data objects are named, where their sizes bound the data
    /// of the objects fast-diff reports whole (the head of an image with
    /// the default striping; see [`crate::objects`]).
    object_names: Option<ObjectNames>,
    location: Arc<str>,
    /// Threads that hand read data on to sinks.
    workers: Arc<Workers>,
    /// Held while the image grows for a write past its end.
    growing: std::sync::Mutex<()>,
}

/// Creates the image `name` of `size` bytes (Ceph's default object size
/// and features) and opens it for writing, on one connection.
pub fn create(name: &RbdName, size: u64) -> Result<RbdImage> {
    let pool = Pool::connect(name)?;
    let image = c_string(&name.image, "the image")?;
    let mut order: c_int = 0;
    // SAFETY: `ioctx` is live; `order` 0 asks for the default.
    let r = unsafe { (pool.api.rbd_create)(pool.ioctx, image.as_ptr(), size, &mut order) };
    if r < 0 {
        return Err(failed(r.into(), "error rbd create"));
    }
    RbdImage::open_on(pool, name, true)
}

/// Removes the image `name` (a failed creation's undo).
pub fn remove(name: &RbdName) -> Result<()> {
    let pool = Pool::connect(name)?;
    let image = c_string(&name.image, "the image")?;
    // SAFETY: `ioctx` is live; the name is NUL-terminated.
    let r = unsafe { (pool.api.rbd_remove)(pool.ioctx, image.as_ptr()) };
    if r < 0 {
        return Err(failed(r.into(), "error rbd remove"));
    }
    Ok(())
}

impl RbdImage {
    /// Opens the image `name` (read-only at a snapshot, or when not
    /// `writable`).
    pub fn open(name: &RbdName, writable: bool) -> Result<RbdImage> {
        Self::open_on(Pool::connect(name)?, name, writable)
    }

    /// Opens the image `name` on the connection `pool`.
    fn open_on(pool: Pool, name: &RbdName, writable: bool) -> Result<RbdImage> {
        let writable = writable && name.snapshot.is_none();
        let api = pool.api;
        let cimage = c_string(&name.image, "the image")?;
        let snap = name
            .snapshot
            .as_deref()
            .map(|s| c_string(s, "the snapshot"))
            .transpose()?;
        let snap_ptr = snap.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        let mut image: Handle = std::ptr::null_mut();
        // SAFETY: `ioctx` is live; `image` is written on success; the
        // names are NUL-terminated (the snapshot null for the head).
        let r = unsafe {
            if writable {
                (api.rbd_open)(pool.ioctx, cimage.as_ptr(), &mut image, snap_ptr)
            } else {
                (api.rbd_open_read_only)(pool.ioctx, cimage.as_ptr(), &mut image, snap_ptr)
            }
        };
        if r < 0 {
            return Err(failed(
                r.into(),
                format!("error reading header from {}", name.image),
            ));
        }
        let mut info = ImageInfo::default();
        // SAFETY: `image` is open; `info` is an `rbd_image_info_t`.
        let r = unsafe { (api.rbd_stat)(image, &mut info, std::mem::size_of::<ImageInfo>()) };
        if r < 0 {
            // SAFETY: `image` is open and used by nothing else.
            unsafe { (api.rbd_close)(image) };
            return Err(failed(r.into(), "error getting image info"));
        }
        let fast_diff = Self::has_fast_diff(api, image);
        // An object's size bounds the head's data only; a snapshot's
        // bytes may lie past the head's end of the object.
        let object_names = (fast_diff
            && name.snapshot.is_none()
            && Self::default_striping(api, image, info.obj_size))
        .then(|| ObjectNames::new(&info.block_name_prefix))
        .flatten();
        let open = Open { image, pool };
        let object_size = info.obj_size.max(512);
        let reads = if writable {
            RangeReader::direct(open)
        } else {
            RangeReader::chunked(open, info.size, object_size, "diskit-rbd")
        };
        Ok(RbdImage {
            reads: Arc::new(reads),
            size: AtomicU64::new(info.size),
            object_size,
            writable,
            fast_diff,
            object_names,
            location: name.canonical().into(),
            workers: Arc::new(Workers::new("diskit-rbd", 2)),
            growing: std::sync::Mutex::new(()),
        })
    }

    fn api(&self) -> &'static Api {
        self.reads.source().pool.api
    }

    /// The image's librbd handle.
    fn handle(&self) -> Handle {
        self.reads.source().image
    }

    /// Whether the image `image` has the fast-diff feature with a valid
    /// object map.
    fn has_fast_diff(api: &Api, image: Handle) -> bool {
        /// `RBD_FEATURE_FAST_DIFF` (features.h).
        const FEATURE_FAST_DIFF: u64 = 1 << 4;
        /// `RBD_FLAG_OBJECT_MAP_INVALID | RBD_FLAG_FAST_DIFF_INVALID`.
        const MAP_INVALID: u64 = 0b11;
        let (mut features, mut flags) = (0u64, 0u64);
        // SAFETY: the image is open; both are written on success.
        let known = unsafe {
            (api.rbd_get_features)(image, &mut features) == 0
                && (api.rbd_get_flags)(image, &mut flags) == 0
        };
        known && features & FEATURE_FAST_DIFF != 0 && flags & MAP_INVALID == 0
    }

    /// Whether the image `image` stripes as by default: object `n` holds
    /// the bytes from `n * object_size` on.
    fn default_striping(api: &Api, image: Handle, object_size: u64) -> bool {
        let (mut unit, mut count) = (0u64, 0u64);
        // SAFETY: the image is open; both are written on success.
        let known = unsafe {
            (api.rbd_get_stripe_unit)(image, &mut unit) == 0
                && (api.rbd_get_stripe_count)(image, &mut count) == 0
        };
        known && unit == object_size && count == 1
    }

    /// `runs` (allocated ranges in order, whole objects as fast-diff
    /// reports them) narrowed to where each object's bytes reach: an
    /// object holds data from its start up to its size at most. Objects
    /// whose size is not known (absent from this pool: a parent's or a
    /// data pool's) stay whole.
    fn narrowed(&self, runs: Vec<(u64, u64)>, names: &ObjectNames) -> Vec<(u64, u64)> {
        let os = self.object_size;
        let objects: Vec<u64> = runs
            .iter()
            .flat_map(|&(s, e)| s / os..e.div_ceil(os))
            .collect();
        if objects.is_empty() || objects.len() > objects::MAX_ASKED {
            return runs;
        }
        let source = self.reads.source();
        // In the order `objects` lists them, walked again below.
        let mut sizes =
            objects::sizes(source.pool.api, source.pool.ioctx, names, &objects).into_iter();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (s, e) in runs {
            for n in s / os..e.div_ceil(os) {
                let start = n * os;
                let end = match sizes.next().flatten() {
                    Some(size) => start + size.min(os),
                    None => start + os,
                };
                let (a, b) = (s.max(start), e.min(end));
                if a < b {
                    match out.last_mut() {
                        Some(last) if last.1 == a => last.1 = b,
                        _ => out.push((a, b)),
                    }
                }
            }
        }
        out
    }

    /// Learns the image's size again (after a resize or a rollback).
    fn refresh_size(&self) -> Result<()> {
        let mut size = 0u64;
        // SAFETY: the image is open; `size` is written on success.
        let r = unsafe { (self.api().rbd_get_size)(self.handle(), &mut size) };
        if r < 0 {
            return Err(failed(r.into(), "error getting the image size"));
        }
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    fn read_only() -> Error {
        Error::new(
            diskit_core::ErrorKind::PermissionDenied,
            "the image is read-only",
        )
    }
}

/// What `rbd_diff_iterate2` reports, gathered.
struct Diff {
    start: u64,
    end: u64,
    /// Allocated ranges, in order.
    runs: Vec<(u64, u64)>,
}

unsafe extern "C" fn collect_diff(
    offset: u64,
    len: usize,
    exists: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: `arg` is the `Diff` the caller passed, alive for the call.
    let diff = unsafe { &mut *arg.cast::<Diff>() };
    if exists != 0 {
        let s = offset.max(diff.start);
        let e = (offset + len as u64).min(diff.end);
        if s < e {
            match diff.runs.last_mut() {
                Some(last) if last.1 >= s => last.1 = last.1.max(e),
                _ => diff.runs.push((s, e)),
            }
        }
    }
    0
}

impl BlockDevice for RbdImage {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            can_write: self.writable,
            can_flush: self.writable,
            can_fua: self.writable,
            can_trim: self.writable,
            can_write_zeroes: self.writable,
            can_zero: self.writable,
            can_fast_zero: false,
            can_extents: true,
            // One image handle serves every connection of a server: a
            // flush on any of them flushes what all of them wrote.
            can_multi_conn: true,
            can_cache: false,
            is_rotational: false,
        }
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: self.object_size.min(4 << 20) as u32,
            maximum: MAX_REQUEST as u32,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        diskit_core::device::check_range(self.size(), offset, buf.len() as u64)?;
        self.reads.read(buf, offset)
    }

    fn read_or_lend(&self, buf: &mut [u8], offset: u64) -> Result<Option<Lent>> {
        diskit_core::device::check_range(self.size(), offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(None);
        }
        self.reads.read_or_lend(buf, offset, true)
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        if !self.writable {
            return Err(Self::read_only());
        }
        diskit_core::device::check_range(self.size(), offset, buf.len() as u64)?;
        pieces(offset, buf.len(), |at, skip, n| {
            let piece = &buf[skip..skip + n];
            // SAFETY: `piece` outlives the call; the image is open.
            let r =
                unsafe { (self.api().rbd_write2)(self.handle(), at, n, piece.as_ptr().cast(), 0) };
            if r < 0 {
                return Err(request_failed(r as i64));
            }
            Ok(())
        })?;
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if !self.writable {
            return Err(Self::read_only());
        }
        if flags.fast {
            return Err(Error::from_kind(diskit_core::ErrorKind::NotSupported));
        }
        diskit_core::device::check_range(self.size(), offset, len)?;
        // Without may_trim the range must stay allocated: librbd's thick
        // provisioning flag.
        let zflags: c_int = if flags.may_trim { 0 } else { 1 };
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(MAX_REQUEST as u64) as usize;
            // SAFETY: the image is open.
            let r = unsafe { (self.api().rbd_write_zeroes)(self.handle(), at, n, zflags, 0) };
            if r < 0 {
                return Err(request_failed(r as i64));
            }
            at += n as u64;
        }
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        if !self.writable {
            return Err(Self::read_only());
        }
        diskit_core::device::check_range(self.size(), offset, len)?;
        // SAFETY: the image is open.
        let r = unsafe { (self.api().rbd_discard)(self.handle(), offset, len) };
        if r < 0 {
            return Err(request_failed(r.into()));
        }
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if !self.writable {
            return Ok(());
        }
        // SAFETY: the image is open.
        let r = unsafe { (self.api().rbd_flush)(self.handle()) };
        if r < 0 {
            return Err(failed(
                r.into(),
                format!("error flushing {}", self.location),
            ));
        }
        Ok(())
    }

    fn close(&self) -> Result<()> {
        // What librbd's cache holds reaches the cluster here, and a
        // failure is reported (rbd_close in drop flushes too, but cannot
        // say that it failed): whatever the cache mode, a process that
        // ends loses what is not written.
        self.flush()
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        diskit_core::device::check_range(self.size(), offset, len)?;
        let mut diff = Diff {
            start: offset,
            end: offset + len,
            runs: Vec::new(),
        };
        // SAFETY: the image is open; `diff` outlives the call, which runs
        // the callback on this thread only.
        let r = unsafe {
            (self.api().rbd_diff_iterate2)(
                self.handle(),
                std::ptr::null(),
                offset,
                len,
                1,
                // Whole objects from the object map where it is valid.
                u8::from(self.fast_diff),
                Some(collect_diff),
                (&mut diff as *mut Diff).cast(),
            )
        };
        if r < 0 {
            return Err(failed(
                r.into(),
                format!("error reading the allocation of {}", self.location),
            ));
        }
        let runs = match (&self.object_names, self.fast_diff) {
            (Some(names), true) => self.narrowed(diff.runs, names),
            _ => diff.runs,
        };
        let mut out = Vec::new();
        let mut at = offset;
        for (s, e) in runs {
            if s > at {
                out.push(Extent::hole(s - at));
            }
            out.push(Extent::data(e - s));
            at = e;
        }
        if at < offset + len {
            out.push(Extent::hole(offset + len - at));
        }
        Ok(out)
    }

    /// No: asking costs a round trip to the cluster (`rbd_diff_iterate2`
    /// loads the object map, or lists each object's snapshots), as long as
    /// reading 256 KiB, so planning every read of a server by the extents
    /// first doubled its trips. The data itself tells zeros apart (librbd
    /// reads an object the object map says is absent as zeros without
    /// asking an OSD); `extents` still answers block status and copies.
    fn extents_before_reads(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        self.location.to_string()
    }

    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        let (offset, len) = req.span();
        let writes = matches!(req, Request::Write { .. } | Request::Zero { .. });
        let synchronous = match &req {
            // FUA is a flush after the write; fast zeroing is refused.
            Request::Write { flags, .. } => flags.fua,
            Request::Zero { flags, .. } => flags.fua || flags.fast,
            _ => false,
        };
        if synchronous || (writes && !self.writable) || len > MAX_REQUEST as u64 {
            return cq.push(core_aio::run(self, tag, req));
        }
        if let Err(e) = diskit_core::device::check_range(self.size(), offset, len) {
            return cq.push(req.fail(tag, Err(e)));
        }
        crate::aio::start(self.api(), self.handle(), tag, req, cq, &self.workers);
    }

    fn queue_depth(&self) -> usize {
        QUEUE_DEPTH
    }
}

impl Storage for RbdImage {
    fn location(&self) -> &str {
        &self.location
    }

    fn resolve(&self, name: &str) -> String {
        // Names an image on RBD stores stand as they are (QEMU does not
        // resolve them against an rbd: name).
        name.to_string()
    }

    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::invalid("write past the largest offset"))?;
        if end > self.size() {
            // Writers placed side by side may end past the end at once:
            // the image only grows.
            let _growing = diskit_core::sync::lock(&self.growing);
            if end > self.size() {
                self.resize(end, Preallocation::Off)?;
            }
        }
        self.write_at(buf, offset, WriteFlags::NONE)
    }

    fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
        if !self.writable {
            return Err(Self::read_only());
        }
        if prealloc != Preallocation::Off {
            return Err(Error::unsupported(format!(
                "Unsupported preallocation mode '{}'",
                prealloc.name()
            )));
        }
        // SAFETY: the image is open.
        let r = unsafe { (self.api().rbd_resize)(self.handle(), new_len) };
        if r < 0 {
            return Err(failed(r.into(), "error resizing the image"));
        }
        self.refresh_size()
    }

    fn protocol(&self) -> &'static str {
        "rbd"
    }

    fn snapshots(&self) -> Result<Vec<(String, u64)>> {
        let api = self.api();
        let mut max: c_int = 16;
        loop {
            let mut snaps: Vec<SnapInfo> = (0..max)
                .map(|_| SnapInfo {
                    id: 0,
                    size: 0,
                    name: std::ptr::null(),
                })
                .collect();
            // SAFETY: `snaps` has room for `max` entries (librbd says how
            // many it needs with ERANGE); the image is open.
            let r = unsafe { (api.rbd_snap_list)(self.handle(), snaps.as_mut_ptr(), &mut max) };
            if r == -libc::ERANGE {
                continue;
            }
            if r < 0 {
                return Err(request_failed(r.into()));
            }
            let list = snaps[..r as usize]
                .iter()
                .map(|sn| {
                    // SAFETY: librbd filled the first `r` entries with
                    // NUL-terminated names, alive until list_end.
                    let name = unsafe { std::ffi::CStr::from_ptr(sn.name) };
                    (name.to_string_lossy().into_owned(), sn.size)
                })
                .collect();
            // SAFETY: the entries librbd filled, released once.
            unsafe { (api.rbd_snap_list_end)(snaps.as_mut_ptr()) };
            return Ok(list);
        }
    }

    fn change_snapshot(&self, change: SnapshotChange<'_>) -> Result<()> {
        let api = self.api();
        let (f, name) = match change {
            SnapshotChange::Create(n) => (api.rbd_snap_create, n),
            SnapshotChange::Delete(n) => (api.rbd_snap_remove, n),
            SnapshotChange::Rollback(n) => (api.rbd_snap_rollback, n),
        };
        let cname = c_string(name, "the snapshot")?;
        // SAFETY: the image is open; the name is NUL-terminated.
        let r = unsafe { f(self.handle(), cname.as_ptr()) };
        if r < 0 {
            return Err(request_failed(r.into()));
        }
        if let SnapshotChange::Rollback(_) = change {
            // The image has the snapshot's size now.
            self.refresh_size()?;
        }
        Ok(())
    }

    fn node_info(&self) -> Option<diskit_core::NodeInfo> {
        // As QEMU's rbd driver: the object size as the cluster size, and
        // the encryption librbd's own header announces (RBD encryption
        // puts a LUKS header at the image's start).
        let mut head = [0u8; 8];
        let format = match self.read_padded(&mut head, 0) {
            Ok(()) if &head[..6] == b"LUKS\xba\xbe" => match head[6..8] {
                [0, 1] => Some("luks"),
                [0, 2] => Some("luks2"),
                _ => None,
            },
            _ => None,
        };
        Some(diskit_core::NodeInfo {
            cluster_size: Some(self.object_size),
            specific: Some((
                "rbd",
                format
                    .map(|f| ("encryption-format", f.to_string()))
                    .into_iter()
                    .collect(),
            )),
        })
    }

    fn is_fixed_size(&self) -> bool {
        false
    }
}
