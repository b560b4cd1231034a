//! Regular files and block devices.
//!
//! Positional I/O (`pread`/`pwrite`) from any number of threads at once with
//! no lock. Extents come from SEEK_DATA/SEEK_HOLE, but only when asking can
//! pay off: a fully allocated file is answered from `fstat` alone, the last
//! region found is cached, and a file system whose seeks turn out slow stops
//! being asked (zero detection on the data then finds the zeros).

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use diskit_core::Preallocation;
use diskit_core::buffer::{ReusedBuf, with_reused};
use diskit_core::device::{BlockSizeLimits, check_range};
use diskit_core::error::ResultExt;

use crate::image_lock;
use diskit_core::sync;
use diskit_core::{
    BlockDevice, Capabilities, Error, ErrorKind, Extent, FileView, Result, Storage, StorageOptions,
    WriteFlags, ZeroFlags,
};

use crate::sys;

/// Seeks slower than this turn SEEK_DATA/SEEK_HOLE off for the file.
const SLOW_SEEK: Duration = Duration::from_millis(50);
/// Alignment used for O_DIRECT requests and buffers.
const DIRECT_ALIGN: u64 = 4096;

/// Bounce buffers up to this size are kept by their thread for the next
/// request; larger ones are made for the request and freed.
const BOUNCE_KEPT: usize = 4 << 20;

/// Whether `len` bytes at `offset` are whole O_DIRECT blocks (whatever
/// the memory they come from).
fn whole_blocks(len: usize, offset: u64) -> bool {
    (len as u64).is_multiple_of(DIRECT_ALIGN) && offset.is_multiple_of(DIRECT_ALIGN)
}

/// Runs `f` on the thread's O_DIRECT bounce buffer, `len` bytes long.
fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> Result<R>) -> Result<R> {
    thread_local! {
        static BOUNCE: ReusedBuf = const { std::cell::RefCell::new(None) };
    }
    with_reused(&BOUNCE, len, BOUNCE_KEPT, f)
}

/// A regular file or a block device.
pub struct FileDevice {
    file: File,
    path: PathBuf,
    /// `path` as text, for [`Storage::location`].
    location: String,
    size: AtomicU64,
    writable: bool,
    no_flush: bool,
    direct: bool,
    block_device: bool,
    rotational: bool,
    /// SEEK_DATA/SEEK_HOLE still worth asking.
    seek_ok: AtomicBool,
    /// See [`StorageOptions::host_zeros`].
    unwritten_map: bool,
    /// Whether a file whose blocks cover its length holds no unwritten
    /// (preallocated) ranges, which read as zeros although allocated:
    /// [`UNWRITTEN_UNKNOWN`], [`UNWRITTEN_NONE`] or [`UNWRITTEN_SOME`].
    unwritten: AtomicU8,
    /// The last region found by seeking, valid while `generation` is unchanged.
    seek_cache: Mutex<SeekCache>,
    /// Bumped by every request that can change allocation.
    generation: AtomicU64,
    /// Serialises read-modify-write of unaligned O_DIRECT writes.
    rmw: Mutex<()>,
    /// Fallocate modes found unsupported by the file system.
    no_punch: AtomicBool,
    no_zero_range: AtomicBool,
}

/// Not yet asked (or space was preallocated since).
const UNWRITTEN_UNKNOWN: u8 = 0;
/// Every allocated byte was written: `fstat` answers extents alone.
const UNWRITTEN_NONE: u8 = 1;
/// Some allocated ranges were never written: seeks find them.
const UNWRITTEN_SOME: u8 = 2;

#[derive(Default)]
struct SeekCache {
    generation: u64,
    start: u64,
    end: u64,
    data: bool,
}

/// QEMU's words for a name that is not a regular file or a block device
/// (FIFOs, sockets and character devices are refused before opening: opening
/// a FIFO would wait for a writer forever).
fn not_regular(path: &Path) -> Error {
    Error::invalid(format!(
        "'file' driver requires '{}' to be a regular file",
        path.display()
    ))
}

/// QEMU's words for a file that cannot be made or opened to be made.
fn could_not_create(e: std::io::Error, path: &Path) -> Error {
    Error::from(e).context(format!("Could not create '{}'", path.display()))
}

impl FileDevice {
    /// Opens an existing file or block device.
    pub fn open(path: impl AsRef<Path>, opts: StorageOptions) -> Result<FileDevice> {
        let path = path.as_ref();
        // Refuse FIFOs, sockets and character devices before opening: opening
        // a FIFO would wait for a writer forever.
        if let Ok(meta) = std::fs::metadata(path) {
            let ft = meta.file_type();
            if !(ft.is_file() || ft.is_block_device()) {
                return Err(not_regular(path));
            }
        }
        let mut oo = OpenOptions::new();
        oo.read(true).write(opts.writable);
        if opts.direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = oo
            .open(path)
            .map_err(|e| Error::from(e).context(format!("Could not open '{}'", path.display())))?;
        Self::adopt(file, path, opts)
    }

    /// Makes a device of a file already open as `path` (opened for writing
    /// when `opts.writable`). It must be a regular file or a block device;
    /// a writable one must not be a source of the running command
    /// ([`image_lock::hold_as_source`]).
    pub fn adopt(file: File, path: &Path, opts: StorageOptions) -> Result<FileDevice> {
        let meta = file.metadata()?;
        if !(meta.is_file() || meta.file_type().is_block_device()) {
            return Err(not_regular(path));
        }
        if opts.writable {
            // Never write a file the running command reads as its source.
            image_lock::refuse_if_source(&file, &path.display().to_string())?;
        }
        Self::from_file(file, path, opts)
    }

    /// Creates a regular file of `size` bytes, or empties an existing one,
    /// as QEMU's file creation does: the file is opened without truncating
    /// it, QEMU's creation locks are taken ([`image_lock::CREATE`]: a file
    /// another process uses is refused with QEMU's message), a source of
    /// the running command is refused, and only then is it emptied. A file
    /// this call made is removed again if it fails.
    pub fn create(
        path: impl AsRef<Path>,
        size: u64,
        prealloc: Preallocation,
    ) -> Result<FileDevice> {
        let path = path.as_ref();
        let location = path.display().to_string();
        let (file, made) = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                match OpenOptions::new().read(true).write(true).open(path) {
                    Ok(f) => (f, false),
                    Err(e) => return Err(could_not_create(e, path)),
                }
            }
            Err(e) => return Err(could_not_create(e, path)),
        };
        let ready = (|| {
            let (perm, unshare) = image_lock::CREATE;
            image_lock::take(&file, &location, perm, unshare)?;
            image_lock::refuse_if_source(&file, &location)?;
            if file.metadata()?.is_file() {
                file.set_len(0)?;
            }
            Ok(())
        })();
        if let Err(e) = ready {
            if made {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
        let dev = Self::from_file(
            file,
            path,
            StorageOptions {
                writable: true,
                ..Default::default()
            },
        )?;
        dev.resize(size, prealloc)?;
        Ok(dev)
    }

    fn from_file(file: File, path: &Path, opts: StorageOptions) -> Result<FileDevice> {
        let meta = file.metadata()?;
        let ft = meta.file_type();
        let block_device = ft.is_block_device();
        if ft.is_dir() {
            return Err(Error::invalid("Is a directory"));
        }
        let mut size = if block_device {
            sys::block_device_size(file.as_fd())?
        } else {
            meta.len()
        };
        if opts.sector_size {
            size = size.div_ceil(512) * 512;
        }
        let rdev = if block_device {
            meta.rdev()
        } else {
            meta.dev()
        };
        let unwritten_map =
            opts.host_zeros && !opts.writable && sys::extent_map_trusted(file.as_fd());
        Ok(FileDevice {
            rotational: is_rotational(rdev),
            file,
            path: path.to_path_buf(),
            location: path.to_string_lossy().into_owned(),
            size: AtomicU64::new(size),
            writable: opts.writable,
            no_flush: opts.no_flush,
            direct: opts.direct,
            block_device,
            seek_ok: AtomicBool::new(!block_device),
            unwritten: AtomicU8::new(UNWRITTEN_UNKNOWN),
            unwritten_map,
            seek_cache: Mutex::new(SeekCache::default()),
            generation: AtomicU64::new(1),
            rmw: Mutex::new(()),
            no_punch: AtomicBool::new(false),
            no_zero_range: AtomicBool::new(false),
        })
    }

    /// The path the device was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this is a block device rather than a regular file.
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// Bytes allocated on disk (st_blocks × 512), as `du` reports.
    pub fn allocated_bytes(&self) -> Result<u64> {
        Ok(self.file.metadata()?.blocks() * 512)
    }

    /// Writes zeros over the first block (up to 4 KiB), as qemu-img does on
    /// every new raw image, so that the image starts allocated.
    pub fn write_first_block(&self) -> Result<()> {
        let n = self.size().min(4096) as usize;
        self.file.write_all_at(&vec![0u8; n], 0)?;
        self.touched();
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` with no range check: bytes past
    /// the end of the file read as zeros. Image formats use it for their
    /// metadata, which QEMU does not pad to a whole cluster.
    pub fn read_padded(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.direct {
            self.direct_read(buf, offset)
        } else {
            self.pread_full(buf, offset)
        }
    }

    /// A write through the page cache. Writers of one regular file take
    /// turns on its inode lock in the kernel, which spins while the owner
    /// runs: cheaper here than sleeping on a lock of our own, whose
    /// wake-ups cost a context switch each (a user-space turn for writes
    /// of 256 KiB and more made 2-worker converts to tmpfs and ext4 6-7%
    /// slower, and copies from NBD, written from the connections' reader
    /// threads, 9% slower).
    fn buffered_write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.file.write_all_at(buf, offset)?;
        Ok(())
    }

    /// Writes all of `buf` at `offset`, growing the file when the write
    /// ends past its end (image formats allocate at the end of their file).
    pub fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.ensure_writable()?;
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::new(ErrorKind::Overflow, "write past the largest file offset"))?;
        if end > self.size() && self.block_device {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("write ends at {end}, past the end of the device"),
            ));
        }
        self.touched();
        if self.direct {
            // A write of whole blocks extends the file itself (from a bounce
            // buffer if its memory is not aligned); a read-modify-write
            // needs the range to exist first. (Growing by ftruncate for
            // every allocation also waits for all O_DIRECT I/O in flight.)
            if end > self.size() && !whole_blocks(buf.len(), offset) {
                self.file.set_len(end)?;
            }
            self.direct_write(buf, offset)?;
        } else {
            self.buffered_write(buf, offset)?;
        }
        self.size.fetch_max(end, Ordering::AcqRel);
        Ok(())
    }

    /// The length of the file now (not rounded to sectors).
    pub fn file_len(&self) -> Result<u64> {
        if self.block_device {
            return Ok(self.size());
        }
        Ok(self.file.metadata()?.len())
    }

    /// Changes the size of a regular file, reserving new space as `prealloc` says.
    pub fn resize(&self, new_size: u64, prealloc: Preallocation) -> Result<()> {
        if self.block_device {
            let size = self.size();
            if new_size > size {
                return Err(Error::unsupported(format!(
                    "Cannot grow device files (device size is {size})"
                )));
            }
            return Ok(());
        }
        let old = self.file.metadata()?.len();
        self.generation.fetch_add(1, Ordering::Relaxed);
        self.reserved();
        if new_size > old {
            match prealloc {
                Preallocation::Off => self.file.set_len(new_size)?,
                Preallocation::Falloc => {
                    sys::fallocate(self.file.as_fd(), 0, old, new_size - old)
                        .context("Could not preallocate new data")?;
                }
                Preallocation::Full => {
                    self.file.set_len(new_size)?;
                    // Allocate for real: write zeros (after trying fallocate,
                    // which makes the writes cheaper on most file systems).
                    let _ = sys::fallocate(self.file.as_fd(), 0, old, new_size - old);
                    self.size.store(new_size, Ordering::Release);
                    diskit_core::device::write_zero_buffer(self, old, new_size - old, false)
                        .context("Could not write zeros for preallocation")?;
                }
            }
        } else if new_size < old {
            self.file.set_len(new_size)?;
        }
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }

    fn ensure_writable(&self) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::PermissionDenied,
                "device is read-only",
            ))
        }
    }

    fn touched(&self) {
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads with the file at `offset`, zero-filling past end of file.
    fn pread_full(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn is_aligned(&self, ptr: usize, len: usize, offset: u64) -> bool {
        (ptr as u64).is_multiple_of(DIRECT_ALIGN) && whole_blocks(len, offset)
    }

    fn direct_read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.is_aligned(buf.as_ptr() as usize, buf.len(), offset) {
            return self.pread_full(buf, offset);
        }
        let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
        let end = (offset + buf.len() as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        with_bounce((end - start) as usize, |bounce| {
            self.pread_full(bounce, start)?;
            let skip = (offset - start) as usize;
            buf.copy_from_slice(&bounce[skip..skip + buf.len()]);
            Ok(())
        })
    }

    fn direct_write(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.is_aligned(buf.as_ptr() as usize, buf.len(), offset) {
            self.file.write_all_at(buf, offset)?;
            return Ok(());
        }
        if whole_blocks(buf.len(), offset) {
            // Whole blocks from memory that is not aligned (a server's
            // request buffer): copied to an aligned buffer, no
            // read-modify-write and no lock.
            return with_bounce(buf.len(), |bounce| {
                bounce.copy_from_slice(buf);
                Ok(self.file.write_all_at(bounce, offset)?)
            });
        }
        let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
        let end = (offset + buf.len() as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        with_bounce((end - start) as usize, |bounce| {
            let _guard = sync::lock(&self.rmw);
            self.pread_full(bounce, start)?;
            let skip = (offset - start) as usize;
            bounce[skip..skip + buf.len()].copy_from_slice(buf);
            // Never write past the end of a regular file: the tail block is partial.
            let file_end = self.size().div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
            let n = (end.min(file_end.max(offset + buf.len() as u64)) - start) as usize;
            self.file.write_all_at(
                &bounce[..n.div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize],
                start,
            )?;
            Ok(())
        })
    }

    fn try_fallocate(
        &self,
        mode: i32,
        offset: u64,
        len: u64,
        unsupported: &AtomicBool,
    ) -> Result<bool> {
        if unsupported.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match sys::fallocate(self.file.as_fd(), mode, offset, len) {
            Ok(()) => {
                self.reserved();
                Ok(true)
            }
            Err(e) => {
                let err: Error = e.into();
                if err.kind() == ErrorKind::NotSupported {
                    unsupported.store(true, Ordering::Relaxed);
                    Ok(false)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Answers an extents query from the cache, if it covers `offset`.
    fn cached_extent(&self, offset: u64, len: u64) -> Option<Extent> {
        let c = self.seek_cache.lock().ok()?;
        if c.generation != self.generation.load(Ordering::Relaxed)
            || offset < c.start
            || offset >= c.end
        {
            return None;
        }
        let n = (c.end - offset).min(len);
        let e = if c.data {
            Extent::data(n)
        } else {
            Extent::hole(n)
        };
        Some(e.at_host(offset))
    }

    fn seek_extents(&self, offset: u64, len: u64) -> Result<Option<Vec<Extent>>> {
        if let Some(e) = self.cached_extent(offset, len) {
            return Ok(Some(vec![e]));
        }
        let generation = self.generation.load(Ordering::Relaxed);
        let size = self.size();
        let fd = self.file.as_fd();
        let started = Instant::now();
        let data_at = sys::seek(fd, offset, libc::SEEK_DATA);
        let (start, end, data) = match data_at {
            Err(e) => {
                let err = Error::from(e);
                if err.kind() == ErrorKind::NotSupported {
                    self.seek_ok.store(false, Ordering::Relaxed);
                    return Ok(None);
                }
                return Err(err);
            }
            // No data from here to the end of the file: all hole.
            Ok(None) => (offset, size, false),
            Ok(Some(d)) if d > offset => (offset, d.min(size), false),
            Ok(Some(_)) => {
                let hole = sys::seek(fd, offset, libc::SEEK_HOLE)?.unwrap_or(size);
                (offset, hole.min(size).max(offset + 1), true)
            }
        };
        if started.elapsed() > SLOW_SEEK {
            self.seek_ok.store(false, Ordering::Relaxed);
        }
        if let Ok(mut c) = self.seek_cache.lock() {
            *c = SeekCache {
                generation,
                start,
                end,
                data,
            };
        }
        let n = (end - start).min(len);
        let e = if data {
            Extent::data(n)
        } else {
            Extent::hole(n)
        };
        Ok(Some(vec![e.at_host(offset)]))
    }

    /// The file's length when it is known to be fully allocated and
    /// written (no hole to find), so that no seek is needed.
    fn fully_allocated_len(&self) -> Option<u64> {
        let m = self.file.metadata().ok()?;
        (m.blocks() * 512 >= m.len() && self.all_written(m.len())).then_some(m.len())
    }

    /// Whether a file whose blocks cover its `len` bytes has no unwritten
    /// ranges: space reserved by fallocate (preallocation, zeroing) counts
    /// in its blocks but reads as zeros, and SEEK_HOLE finds it (ext4,
    /// xfs and tmpfs alike). One seek answers it until space is reserved
    /// again; writes only ever turn unwritten space into data.
    fn all_written(&self, len: u64) -> bool {
        match self.unwritten.load(Ordering::Relaxed) {
            UNWRITTEN_NONE => return true,
            UNWRITTEN_SOME => return false,
            _ => {}
        }
        // A reservation made during the scan makes its answer stale.
        let generation = self.generation.load(Ordering::Relaxed);
        let map = if self.unwritten_map {
            self.unwritten_in_map(len)
        } else {
            None
        };
        let none = match map {
            Some(found) => !found,
            None => {
                // No extent map asked or none kept (tmpfs): a hole before
                // the end is space reserved and never written.
                let started = Instant::now();
                let hole = sys::seek(self.file.as_fd(), 0, libc::SEEK_HOLE);
                if started.elapsed() > SLOW_SEEK {
                    self.seek_ok.store(false, Ordering::Relaxed);
                }
                match hole {
                    Ok(Some(h)) => h >= len,
                    // Seeking unsupported: take the blocks' word for it.
                    Ok(None) | Err(_) => true,
                }
            }
        };
        let state = if none { UNWRITTEN_NONE } else { UNWRITTEN_SOME };
        if self.generation.load(Ordering::Relaxed) != generation {
            return none;
        }
        // A reservation made meanwhile reset the state: leave it unknown.
        let _ = self.unwritten.compare_exchange(
            UNWRITTEN_UNKNOWN,
            state,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        none
    }

    /// Whether the file's extent map (FIEMAP) shows unwritten space in its
    /// first `len` bytes; `None` without an extent map, or when the map is
    /// too long to read through cheaply (then seeks decide).
    fn unwritten_in_map(&self, len: u64) -> Option<bool> {
        const BATCH: usize = 256;
        let mut at = 0;
        for _ in 0..64 {
            let v = sys::fiemap(self.file.as_fd(), at, len - at, 0, BATCH).ok()?;
            if v.iter()
                .any(|e| e.flags & sys::FIEMAP_EXTENT_UNWRITTEN != 0)
            {
                return Some(true);
            }
            match v.last() {
                Some(e) if v.len() == BATCH && e.flags & sys::FIEMAP_EXTENT_LAST == 0 => {
                    at = e.logical + e.length;
                    if at >= len {
                        return Some(false);
                    }
                }
                _ => return Some(false),
            }
        }
        None
    }

    /// Extents from the file's extent map, for a read-only file known to
    /// hold unwritten space: unlike SEEK_DATA, the map still calls space
    /// unwritten after it was read into the page cache (a copy that read
    /// it before, by another tool, leaves seeks reporting it as data).
    /// Dirty pages are written back first (FIEMAP_FLAG_SYNC), so data not
    /// yet on disk is never taken for zeros. `None` without a map.
    fn map_extents(&self, offset: u64, len: u64, file_len: u64) -> Option<Vec<Extent>> {
        const BATCH: usize = 64;
        let end = (offset + len).min(file_len);
        if offset >= end {
            return Some(vec![Extent::hole(len).at_host(offset)]);
        }
        let map = sys::fiemap(
            self.file.as_fd(),
            offset,
            end - offset,
            sys::FIEMAP_FLAG_SYNC,
            BATCH,
        )
        .ok()?;
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |at: u64, n: u64, data: bool| {
            if let Some(last) = out.last_mut()
                && last.flags.data == data
            {
                last.length += n;
                return;
            }
            let e = if data {
                Extent::data(n)
            } else {
                Extent::hole(n)
            };
            out.push(e.at_host(at));
        };
        let mut cursor = offset;
        for e in &map {
            let from = e.logical.max(cursor);
            let to = e.logical.saturating_add(e.length).min(end);
            if to <= from {
                continue;
            }
            if from > cursor {
                push(cursor, from - cursor, false);
            }
            push(from, to - from, e.flags & sys::FIEMAP_EXTENT_UNWRITTEN == 0);
            cursor = to;
        }
        let complete = map.len() < BATCH
            || map
                .last()
                .is_some_and(|e| e.flags & sys::FIEMAP_EXTENT_LAST != 0);
        if complete && cursor < offset + len {
            push(cursor, offset + len - cursor, false);
        }
        (!out.is_empty()).then_some(out)
    }

    /// Space was reserved without being written (fallocate): the next
    /// extents query looks for unwritten ranges again.
    fn reserved(&self) {
        let _ = self.unwritten.compare_exchange(
            UNWRITTEN_NONE,
            UNWRITTEN_UNKNOWN,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
}

impl BlockDevice for FileDevice {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn capabilities(&self) -> Capabilities {
        let w = self.writable;
        Capabilities {
            can_write: w,
            can_flush: w,
            can_fua: w,
            can_trim: w,
            can_write_zeroes: w,
            can_zero: w,
            can_fast_zero: w,
            can_extents: !self.block_device,
            can_multi_conn: true,
            can_cache: true,
            is_rotational: self.rotational,
        }
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 4096,
            maximum: 64 << 20,
        }
    }

    fn is_known_zero(&self) -> bool {
        !self.block_device
            && self
                .file
                .metadata()
                .map(|m| m.blocks() == 0)
                .unwrap_or(false)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        if self.direct {
            self.direct_read(buf, offset)
        } else {
            self.pread_full(buf, offset)
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.ensure_writable()?;
        check_range(self.size(), offset, buf.len() as u64)?;
        self.touched();
        if self.direct {
            self.direct_write(buf, offset)?;
        } else {
            self.buffered_write(buf, offset)?;
        }
        if flags.fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.ensure_writable()?;
        check_range(self.size(), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.touched();
        let fd = self.file.as_fd();
        let done = if self.block_device {
            // BLKZEROOUT may unmap (it uses REQ_OP_WRITE_ZEROES when the
            // device has it) and falls back to writing zeros in the kernel,
            // which is not fast: only claim fast when the queue has a
            // write-zeroes limit.
            if flags.fast && !block_write_zeroes_supported(&self.file) {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
            match sys::block_range_ioctl(fd, sys::BLKZEROOUT, offset, len) {
                Ok(()) => true,
                Err(e) => {
                    let err = Error::from(e);
                    if err.kind() != ErrorKind::NotSupported {
                        return Err(err);
                    }
                    false
                }
            }
        } else {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            (flags.may_trim && self.try_fallocate(punch, offset, len, &self.no_punch)?)
                || self.try_fallocate(libc::FALLOC_FL_ZERO_RANGE, offset, len, &self.no_zero_range)?
                // A punched hole re-allocated keeps NO_HOLE's promise.
                || (self.try_fallocate(punch, offset, len, &self.no_punch)?
                    && (flags.may_trim || self.try_fallocate(0, offset, len, &AtomicBool::new(false))?))
        };
        if !done {
            if flags.fast {
                return Err(Error::from_kind(ErrorKind::NotSupported));
            }
            diskit_core::device::write_zero_buffer(self, offset, len, false)?;
        }
        if flags.fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.ensure_writable()?;
        check_range(self.size(), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.touched();
        if self.block_device {
            // Discard is advisory: a device without it keeps its data.
            if let Err(e) = sys::block_range_ioctl(self.file.as_fd(), sys::BLKDISCARD, offset, len)
            {
                let err: Error = e.into();
                if err.kind() != ErrorKind::NotSupported {
                    return Err(err);
                }
            }
        } else {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            self.try_fallocate(punch, offset, len, &self.no_punch)?;
        }
        if flags.fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if self.writable && !self.no_flush {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size(), offset, len)?;
        sys::fadvise(self.file.as_fd(), offset, len, libc::POSIX_FADV_WILLNEED);
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size(), offset, len)?;
        let all_data = || Ok(vec![Extent::data(len).at_host(offset)]);
        if !self.seek_ok.load(Ordering::Relaxed) || len == 0 {
            return all_data();
        }
        if let Some(file_len) = self.fully_allocated_len() {
            // Data up to the end of the file; the sector padding beyond is a hole.
            return Ok(if offset >= file_len {
                vec![Extent::hole(len).at_host(offset)]
            } else {
                vec![Extent::data((file_len - offset).min(len)).at_host(offset)]
            });
        }
        if self.unwritten_map {
            let file_len = self.file_len()?;
            if !self.all_written(file_len)
                && let Some(v) = self.map_extents(offset, len, file_len)
            {
                return Ok(v);
            }
        }
        match self.seek_extents(offset, len)? {
            Some(v) => Ok(v),
            None => all_data(),
        }
    }

    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        // O_DIRECT reads have alignment rules and bypass the page cache.
        if self.direct || check_range(self.size(), offset, len).is_err() {
            return None;
        }
        Some(FileView {
            fd: self.file.as_fd(),
            offset,
        })
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

impl Storage for FileDevice {
    fn location(&self) -> &str {
        &self.location
    }

    fn protocol(&self) -> &'static str {
        if self.block_device {
            "host_device"
        } else {
            "file"
        }
    }

    fn file_len(&self) -> Result<u64> {
        FileDevice::file_len(self)
    }

    fn read_padded(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        FileDevice::read_padded(self, buf, offset)
    }

    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        FileDevice::write_extend(self, buf, offset)
    }

    fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
        FileDevice::resize(self, new_len, prealloc)
    }

    fn node_info(&self) -> Option<diskit_core::NodeInfo> {
        Some(diskit_core::NodeInfo::local_file())
    }

    fn allocated_bytes(&self) -> Option<u64> {
        FileDevice::allocated_bytes(self).ok()
    }

    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.file.as_fd())
    }

    fn lock_image(&self, perm: u8, unshare: u8) -> Result<()> {
        crate::image_lock::take(&self.file, &self.location, perm, unshare)
    }

    fn is_fixed_size(&self) -> bool {
        self.block_device
    }
}

/// Reads a queue attribute of the block device `dev` (a whole disk or a
/// partition, whose queue is its parent's).
fn queue_attribute(dev: u64, attr: &str) -> Option<String> {
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    [
        format!("/sys/dev/block/{maj}:{min}/queue/{attr}"),
        format!("/sys/dev/block/{maj}:{min}/../queue/{attr}"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .map(|s| s.trim().to_string())
}

/// Whether a block device's queue implements write-zeroes natively.
fn block_write_zeroes_supported(file: &File) -> bool {
    let Ok(meta) = file.metadata() else {
        return false;
    };
    queue_attribute(meta.rdev(), "write_zeroes_max_bytes")
        .and_then(|s| s.parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

/// Whether the block device `dev` (or the one holding a file) is rotational.
fn is_rotational(dev: u64) -> bool {
    queue_attribute(dev, "rotational").is_some_and(|s| s == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(path: &Path) -> FileDevice {
        FileDevice::open(
            path,
            StorageOptions {
                writable: true,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn create_read_write_and_extents() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.raw");
        let dev = FileDevice::create(&p, 1 << 20, Preallocation::Off).unwrap();
        assert_eq!(dev.size(), 1 << 20);
        assert!(dev.is_known_zero());
        dev.write_at(&[0xab; 4096], 65536, WriteFlags::NONE)
            .unwrap();
        let mut buf = vec![0u8; 8192];
        dev.read_at(&mut buf, 61440).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(buf[4096..].iter().all(|&b| b == 0xab));
        // Walk all extents; the data block must be found as data.
        let mut off = 0;
        let mut found = false;
        while off < dev.size() {
            let ex = dev.extents(off, dev.size() - off).unwrap();
            for e in ex {
                if e.flags.data && off <= 65536 && 65536 < off + e.length {
                    found = true;
                }
                if !e.flags.data {
                    let mut b = vec![1u8; e.length as usize];
                    dev.read_at(&mut b, off).unwrap();
                    assert!(b.iter().all(|&x| x == 0), "hole at {off} must read zeros");
                }
                off += e.length;
            }
        }
        assert!(found);
        assert!(dev.read_at(&mut buf, (1 << 20) - 10).is_err());
    }

    /// Runs of (data, length) over the whole device.
    fn runs(dev: &FileDevice) -> Vec<(bool, u64)> {
        let mut v: Vec<(bool, u64)> = Vec::new();
        let mut off = 0;
        while off < dev.size() {
            for e in dev.extents(off, dev.size() - off).unwrap() {
                match v.last_mut() {
                    Some(last) if last.0 == e.flags.data => last.1 += e.length,
                    _ => v.push((e.flags.data, e.length)),
                }
                off += e.length;
            }
        }
        v
    }

    #[test]
    fn preallocated_space_never_written_is_a_hole() {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.raw");
        let Ok(dev) = FileDevice::create(&p, 4 * MIB, Preallocation::Falloc) else {
            return; // no fallocate on this file system
        };
        dev.write_at(&[9u8; MIB as usize], MIB, WriteFlags::NONE)
            .unwrap();
        dev.flush().unwrap();
        // Data still in the page cache only, over reserved space, is data.
        dev.write_at(&[5u8; 4096], 3 * MIB, WriteFlags::NONE)
            .unwrap();
        let ro = FileDevice::open(&p, StorageOptions::default()).unwrap();
        let expect = vec![
            (false, MIB),
            (true, MIB),
            (false, MIB),
            (true, 4096),
            (false, MIB - 4096),
        ];
        assert_eq!(runs(&ro), expect);
        // Another reader pulls the reserved space into the page cache:
        // seeks would now call it data; the extent map still knows.
        std::fs::read(&p).unwrap();
        let ro = FileDevice::open(
            &p,
            StorageOptions {
                host_zeros: true,
                ..Default::default()
            },
        )
        .unwrap();
        if sys::fiemap(ro.file.as_fd(), 0, 4 * MIB, 0, 4).is_ok() {
            assert_eq!(runs(&ro), expect);
        }
        // Writable devices use seeks; space reserved by zeroing is asked
        // about again.
        dev.write_zeroes(MIB, MIB, ZeroFlags::default()).unwrap();
        let mut b = vec![1u8; MIB as usize];
        dev.read_at(&mut b, MIB).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn zeroing_and_trim_read_back_zero() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("z.raw");
        let dev = FileDevice::create(&p, 1 << 20, Preallocation::Full).unwrap();
        dev.write_at(&vec![7u8; 1 << 20], 0, WriteFlags::NONE)
            .unwrap();
        for may_trim in [false, true] {
            dev.write_zeroes(
                4096,
                8192,
                ZeroFlags {
                    may_trim,
                    ..Default::default()
                },
            )
            .unwrap();
            let mut b = vec![1u8; 8192];
            dev.read_at(&mut b, 4096).unwrap();
            assert!(b.iter().all(|&x| x == 0));
            dev.write_at(&[7u8; 8192], 4096, WriteFlags::FUA).unwrap();
        }
        // Unaligned zeroing keeps the neighbours.
        dev.write_zeroes(100, 50, ZeroFlags::default()).unwrap();
        let mut b = vec![0u8; 300];
        dev.read_at(&mut b, 0).unwrap();
        assert!(b[..100].iter().all(|&x| x == 7) && b[100..150].iter().all(|&x| x == 0));
        assert!(b[150..].iter().all(|&x| x == 7));
        dev.flush().unwrap();
    }

    #[test]
    fn read_only_refuses_writes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.raw");
        FileDevice::create(&p, 4096, Preallocation::Off).unwrap();
        let dev = FileDevice::open(&p, StorageOptions::default()).unwrap();
        let e = dev.write_at(&[1], 0, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(!dev.capabilities().can_write);
        let _ = rw(&p);
    }

    /// `p` opened writable with O_DIRECT, or None where the file system
    /// refuses it (tmpfs and some others).
    fn open_direct(p: &Path) -> Option<FileDevice> {
        let opts = StorageOptions {
            writable: true,
            direct: true,
            ..Default::default()
        };
        FileDevice::open(p, opts).ok()
    }

    #[test]
    fn direct_io_handles_unaligned_requests() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.raw");
        FileDevice::create(&p, 1 << 20, Preallocation::Off).unwrap();
        let Some(dev) = open_direct(&p) else {
            return;
        };
        dev.write_at(&[9u8; 1000], 12345, WriteFlags::NONE).unwrap();
        let mut b = vec![0u8; 1100];
        dev.read_at(&mut b, 12300).unwrap();
        assert!(b[..45].iter().all(|&x| x == 0));
        assert!(b[45..1045].iter().all(|&x| x == 9));
        assert!(b[1045..].iter().all(|&x| x == 0));
    }

    /// O_DIRECT writes of whole blocks from memory that is not aligned go
    /// through a bounce buffer (no read-modify-write), and whole-block
    /// writes past the end grow the file themselves; both read back, as do
    /// unaligned reads into unaligned memory.
    #[test]
    fn direct_io_from_unaligned_memory() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.qcow2");
        FileDevice::create(&p, 8192, Preallocation::Off).unwrap();
        let Some(dev) = open_direct(&p) else {
            return;
        };
        // A Vec's storage one byte in is never page-aligned.
        let mut backing = vec![0u8; 3 * 4096 + 1];
        let data = &mut backing[1..];
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        dev.write_at(&data[..4096], 4096, WriteFlags::NONE).unwrap();
        dev.write_extend(&data[..8192], 16384).unwrap();
        assert_eq!(dev.file_len().unwrap(), 24576);
        let mut out = vec![0u8; 3 * 4096 + 3];
        dev.read_at(&mut out[3..3 + 4096], 4096).unwrap();
        assert_eq!(&out[3..3 + 4096], &data[..4096]);
        dev.read_at(&mut out[1..1 + 8192], 16384).unwrap();
        assert_eq!(&out[1..1 + 8192], &data[..8192]);
        // The hole between reads as zeros; an unaligned read spans it.
        dev.read_at(&mut out[..100], 8190).unwrap();
        assert_eq!(&out[..2], &data[4094..4096]);
        assert!(out[2..100].iter().all(|&b| b == 0));
    }

    #[test]
    fn preallocation_modes_allocate() {
        let dir = tempfile::tempdir().unwrap();
        for (mode, expect_alloc) in [
            (Preallocation::Off, false),
            (Preallocation::Falloc, true),
            (Preallocation::Full, true),
        ] {
            let p = dir.path().join(format!("{}.raw", mode.name()));
            let dev = FileDevice::create(&p, 1 << 20, mode).unwrap();
            let alloc = dev.allocated_bytes().unwrap();
            assert_eq!(alloc >= 1 << 20, expect_alloc, "{mode:?}: {alloc}");
        }
    }
}
