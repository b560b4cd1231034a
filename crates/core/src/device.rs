//! The [`BlockDevice`] trait: one set of operations and capabilities for
//! every layer (files, image formats, NBD connections, filters).

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::aio::{CompletionQueue, Request};
use crate::error::{Error, ErrorKind, Result};
use crate::extent::Extent;
use crate::serving::{Peer, Serialize, ServerRef};

/// A shared, dynamically typed block device: what layers hold of the layer below.
pub type DeviceRef = Arc<dyn BlockDevice>;

/// A range of a device's bytes as it lies in a file: reading `len` bytes of
/// `fd` at `offset` gives what the device would read (see
/// [`BlockDevice::file_view`]).
#[derive(Debug, Clone, Copy)]
pub struct FileView<'a> {
    /// The file holding the bytes.
    pub fd: BorrowedFd<'a>,
    /// Where in that file the range starts.
    pub offset: u64,
}

/// Bytes a device holds in memory (a chunk of a remote object read ahead),
/// lent to a reader instead of copied out (see
/// [`BlockDevice::read_or_lend`]): a server sends them as they are.
#[derive(Clone)]
pub struct Lent {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: std::ops::Range<usize>,
}

impl Lent {
    /// The bytes `range` of `owner`; `None` when the range is not in it.
    pub fn new(
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        range: std::ops::Range<usize>,
    ) -> Option<Lent> {
        (*owner).as_ref().get(range.clone())?;
        Some(Lent { owner, range })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lent({} bytes)", self.range.len())
    }
}

/// A client connection, as the layers of a device see it when it starts
/// (see [`BlockDevice::connect`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Session {
    /// The server's number for the connection.
    pub id: u64,
    /// The export name the client asked for.
    pub export: String,
    /// Whether the connection runs over TLS.
    pub tls: bool,
    /// Whether the export is served read-only.
    pub read_only: bool,
    /// Who the client is.
    pub peer: crate::serving::Peer,
    /// Raised to have the server close the connection.
    pub hangup: crate::serving::Hangup,
}

/// What a server tells a device when it asks about the exports it
/// answers for (nbdkit passes the same to `list_exports` and
/// `default_export`): the answer may depend on them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportQuery {
    /// Whether the export is served read-only.
    pub read_only: bool,
    /// Whether the client's connection runs over TLS.
    pub tls: bool,
}

/// One export as a listing (NBD_OPT_LIST) shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportEntry {
    /// The name a client asks for.
    pub name: String,
    /// Its description, if it has one.
    pub description: Option<String>,
}

impl ExportEntry {
    /// An export named `name`, with `description` if any.
    pub fn new(name: impl Into<String>, description: Option<String>) -> ExportEntry {
        ExportEntry {
            name: name.into(),
            description,
        }
    }
}

/// Flags of a write request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteFlags {
    /// Force unit access: the data is on stable storage when the call returns.
    pub fua: bool,
}

impl WriteFlags {
    /// No flags.
    pub const NONE: WriteFlags = WriteFlags { fua: false };
    /// Force unit access.
    pub const FUA: WriteFlags = WriteFlags { fua: true };
}

/// Flags of a write-zeroes request (NBD_CMD_WRITE_ZEROES semantics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Force unit access.
    pub fua: bool,
    /// The range may be deallocated (punched) as long as it reads back as zeros.
    /// Without it (NBD_CMD_FLAG_NO_HOLE) the range must stay allocated.
    pub may_trim: bool,
    /// Fail at once with [`ErrorKind::NotSupported`] unless zeroing is faster
    /// than writing zeros would be (NBD_CMD_FLAG_FAST_ZERO).
    pub fast: bool,
}

/// What a device can do. Layers above must not use an operation whose
/// capability is false (the NBD server also advertises exactly these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Writes, zeroes and trims are accepted.
    pub can_write: bool,
    /// Flush does something (the device has a volatile cache).
    pub can_flush: bool,
    /// The FUA flag is honoured (natively, or by flushing after the write).
    pub can_fua: bool,
    /// Trim may deallocate.
    pub can_trim: bool,
    /// Write-zeroes is offered at all (NBD_FLAG_SEND_WRITE_ZEROES). Every
    /// writable device offers it, since [`BlockDevice::write_zeroes`] falls
    /// back to writing zeros; only a layer that hides it on purpose (nbdkit's
    /// nozero filter) turns it off, and callers then write zeros themselves.
    pub can_write_zeroes: bool,
    /// Write-zeroes is implemented more efficiently than writing a zero buffer.
    pub can_zero: bool,
    /// Write-zeroes with the fast flag can succeed on at least some ranges.
    pub can_fast_zero: bool,
    /// Extents report real allocation (otherwise everything is "data").
    pub can_extents: bool,
    /// Several connections (or handles) see each other's flushed writes.
    pub can_multi_conn: bool,
    /// Cache (prefetch) does something.
    pub can_cache: bool,
    /// The medium is rotational (seeks are expensive).
    pub is_rotational: bool,
}

impl Capabilities {
    /// Capabilities of a read-only device with nothing special.
    pub const READ_ONLY: Capabilities = Capabilities {
        can_write: false,
        can_flush: false,
        can_fua: false,
        can_trim: false,
        can_write_zeroes: false,
        can_zero: false,
        can_fast_zero: false,
        can_extents: false,
        can_multi_conn: true,
        can_cache: false,
        is_rotational: false,
    };

    /// Capabilities of a device held in memory: every operation is cheap and
    /// coherent, nothing is volatile, and caching is free (it is all in
    /// memory already), so it is offered, as nbdkit's memory plugin does.
    pub const IN_MEMORY: Capabilities = Capabilities {
        can_write: true,
        can_flush: false,
        can_fua: true,
        can_trim: true,
        can_write_zeroes: true,
        can_zero: true,
        can_fast_zero: true,
        can_extents: true,
        can_multi_conn: true,
        can_cache: true,
        is_rotational: false,
    };

    /// The same capabilities with every write-side one switched off.
    pub fn read_only(self) -> Capabilities {
        Capabilities {
            can_write: false,
            can_fua: false,
            can_trim: false,
            can_write_zeroes: false,
            can_zero: false,
            can_fast_zero: false,
            ..self
        }
    }
}

/// Block size constraints (NBD_INFO_BLOCK_SIZE semantics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizeLimits {
    /// Requests must be aligned to this (a power of two, 1 for byte granularity).
    pub minimum: u32,
    /// Requests aligned to and sized in multiples of this are efficient.
    pub preferred: u32,
    /// The largest read or write payload accepted at once.
    pub maximum: u32,
}

impl Default for BlockSizeLimits {
    fn default() -> Self {
        BlockSizeLimits {
            minimum: 1,
            preferred: 4096,
            maximum: 64 << 20,
        }
    }
}

/// A block device. All offsets and lengths are in bytes; every operation must
/// lie within `0..size()`. Implementations are thread-safe and take `&self`
/// so that many requests may be in flight at once, without a lock around I/O.
///
/// Each optional operation has a default that is correct for a device without
/// that capability; a device overrides what it does better.
pub trait BlockDevice: Send + Sync {
    /// The size of the device in bytes.
    fn size(&self) -> u64;

    /// What the device can do.
    fn capabilities(&self) -> Capabilities;

    /// Block size constraints.
    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits::default()
    }

    /// Whether the whole device is known to read as zeros right now
    /// (a freshly created image, the null device). False when unknown.
    fn is_known_zero(&self) -> bool {
        false
    }

    /// Reads `buf.len()` bytes at `offset`, fully.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;

    /// Reads `buf.len()` bytes at `offset` as [`read_at`](Self::read_at)
    /// does, or leaves `buf` as it is and lends the same bytes out of
    /// memory the device holds (`Some`), so that a server sends them
    /// without copying them first. The default reads.
    fn read_or_lend(&self, buf: &mut [u8], offset: u64) -> Result<Option<Lent>> {
        self.read_at(buf, offset).map(|()| None)
    }

    /// Writes all of `buf` at `offset`.
    fn write_at(&self, _buf: &[u8], _offset: u64, _flags: WriteFlags) -> Result<()> {
        Err(Error::new(
            ErrorKind::PermissionDenied,
            "device is read-only",
        ))
    }

    /// Makes `len` bytes at `offset` read as zeros.
    ///
    /// The default writes a zero buffer, which is correct for any writable
    /// device: a device that can do better overrides it and sets `can_zero`.
    /// With `flags.fast` the default fails at once, as writing zeros is never
    /// faster than writing zeros.
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        write_zero_buffer(self, offset, len, flags.fua)
    }

    /// Hints that `len` bytes at `offset` are no longer needed; after a trim
    /// the contents of the range are unspecified. The default does nothing.
    fn trim(&self, _offset: u64, _len: u64, flags: WriteFlags) -> Result<()> {
        if flags.fua { self.flush() } else { Ok(()) }
    }

    /// Makes all completed writes durable.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// Prefetches a range into any cache. The default does nothing.
    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    /// Describes the allocation of a prefix of `offset..offset+len` (`len > 0`).
    ///
    /// Returns at least one extent; the extents are contiguous from `offset`
    /// and may end before `offset + len` (never after). The default reports
    /// the whole range as data.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let _ = offset;
        Ok(vec![Extent::data(len)])
    }

    /// The file holding `offset..offset+len` of this device byte for byte,
    /// when there is one (a raw file read through the page cache), so that
    /// a server can send the bytes without copying them (splice). A read
    /// of the view must give what [`read_at`](Self::read_at) gives; a
    /// device or filter that cannot promise that (other bytes, alignment
    /// rules, side effects on reads) answers `None`, the default.
    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        let _ = (offset, len);
        None
    }

    /// A short description for messages and logs.
    fn describe(&self) -> String {
        String::from("device")
    }

    /// This device as one client connection sees it: `None`, the default,
    /// when every connection shares it unchanged; otherwise a view that
    /// keeps per-connection state (a log's connection number, a
    /// connection's own rate limit) and passes the rest to this device.
    /// The view lives as long as the connection and is dropped at its end;
    /// the shared device is still the one that is closed.
    fn connect(&self, session: &Session) -> Result<Option<DeviceRef>> {
        let _ = session;
        Ok(None)
    }

    /// The exports a client that lists them (NBD_OPT_LIST) is shown, as
    /// nbdkit's `list_exports`: `None`, the default, leaves the list to
    /// the server (its own export names); an error refuses the listing.
    fn list_exports(&self, query: &ExportQuery) -> Result<Option<Vec<ExportEntry>>> {
        let _ = query;
        Ok(None)
    }

    /// The name the default export `""` stands for, as nbdkit's
    /// `default_export`: the name connections to `""` open and listings
    /// show. `None`, the default, keeps the server's own; an error refuses
    /// connections to `""`.
    fn default_export(&self, query: &ExportQuery) -> Result<Option<String>> {
        let _ = query;
        Ok(None)
    }

    /// The export's description as this device (a connection's view, or
    /// the export's own device) gives it, as nbdkit's
    /// `export_description`: `None`, the default, keeps the server's.
    fn export_description(&self) -> Option<String> {
        None
    }

    /// The server that serves the device starts: a layer that may stop it
    /// keeps `server` (see [`crate::serving`]). Nothing by default.
    fn serving(&self, server: &ServerRef) {
        let _ = server;
    }

    /// A client `peer` connects, before its handshake: an error refuses
    /// it (the server closes the connection). Accepted by default.
    fn preconnect(&self, peer: &Peer) -> Result<()> {
        let _ = peer;
        Ok(())
    }

    /// How many requests and connections the device takes at once: any
    /// number by default.
    fn serialize(&self) -> Serialize {
        Serialize::Parallel
    }

    /// Whether a server may ask for extents before a large read, to send
    /// the holes in it as hole chunks: true where extents are real. A layer
    /// that counts or logs requests answers false, so that what it sees is
    /// what the client asked for.
    fn extents_before_reads(&self) -> bool {
        self.capabilities().can_extents
    }

    /// Drops whatever connection the device keeps to its storage and makes
    /// a new one, after an error that a new connection may cure (a server
    /// that went away). The default does nothing: a device with no
    /// connection has nothing to renew, and a retried request simply runs
    /// again.
    fn reopen(&self) -> Result<()> {
        Ok(())
    }

    /// Writes cached metadata and makes the device durable before it is
    /// dropped: the last call its owner makes, after every request has
    /// completed. Layers finalize here, where a failure can be reported,
    /// not in `Drop`; a layer over another closes the one below after
    /// itself. Requests after a close are not expected. The default does
    /// nothing, which is right for a device with nothing to finalize.
    fn close(&self) -> Result<()> {
        Ok(())
    }

    /// Starts `req` and delivers its [`Completion`](crate::aio::Completion)
    /// with `tag` to `cq`. The default runs it before returning; a device
    /// that can keep requests in flight without a thread each (an NBD
    /// connection) sends it and returns at once.
    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        cq.push(crate::aio::run(self, tag, req));
    }

    /// How many submitted requests are worth keeping in flight at once
    /// from one submitter: 1 for a device whose `submit` runs requests
    /// before it returns.
    fn queue_depth(&self) -> usize {
        1
    }
    /// Whether writes go nowhere (the null device): a copy into it need
    /// not look at the bytes it reads.
    fn discards_writes(&self) -> bool {
        false
    }

    /// A hint that `buf` will be written at `offset` soon, given by a
    /// writer that must make its writes in order (a copy in source
    /// order): a device whose writes are costly before their bytes are
    /// placed (compression) may do that part now, on the caller's thread,
    /// in parallel with other callers. Nothing is written; the write still
    /// comes.
    fn prepare_write(&self, buf: &[u8], offset: u64) {
        let _ = (buf, offset);
    }

    /// Writes `buf` at `offset` for a writer that must place its writes in
    /// order (a copy in source order, whose destination lays data out in
    /// the order it comes): `placed` is called once the device has decided
    /// where every byte goes (new space taken), before the bytes move, so
    /// that the caller's next write may be placed while these are written.
    /// By default the whole write comes first; `placed` is called whatever
    /// the result.
    fn write_placed(
        &self,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
        placed: &mut dyn FnMut(),
    ) -> Result<()> {
        let result = self.write_at(buf, offset, flags);
        placed();
        result
    }
}

/// How a request with `fua` that goes to `dev` as `pieces` writes keeps
/// its promise: `(fua for each piece, flush after all of them)`. FUA covers
/// only the write that carries it, so a request split in several pieces
/// passes them down without it and flushes once after them, when the
/// device has a cache to flush.
pub fn split_fua<D: BlockDevice + ?Sized>(dev: &D, fua: bool, pieces: u64) -> (bool, bool) {
    if fua && pieces > 1 && dev.capabilities().can_flush {
        (false, true)
    } else {
        (fua, false)
    }
}

/// Writes zeros from a shared zero buffer: the fallback for write-zeroes.
pub fn write_zero_buffer<D: BlockDevice + ?Sized>(
    dev: &D,
    mut offset: u64,
    mut len: u64,
    fua: bool,
) -> Result<()> {
    const CHUNK: usize = 1 << 20;
    static ZEROS: [u8; CHUNK] = [0u8; CHUNK];
    let (fua, flush) = split_fua(dev, fua, len.div_ceil(CHUNK as u64));
    while len > 0 {
        let n = len.min(CHUNK as u64) as usize;
        dev.write_at(&ZEROS[..n], offset, WriteFlags { fua })?;
        offset += n as u64;
        len -= n as u64;
    }
    if flush {
        dev.flush()?;
    }
    Ok(())
}

/// Checks that `offset..offset+len` lies within a device of `size` bytes.
pub fn check_range(size: u64, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::invalid(format!(
            "request out of range: offset {offset} length {len} beyond device size {size}"
        ))),
    }
}

macro_rules! forward_device {
    ($ty:ty) => {
        impl<T: BlockDevice + ?Sized> BlockDevice for $ty {
            fn size(&self) -> u64 {
                (**self).size()
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            fn block_size(&self) -> BlockSizeLimits {
                (**self).block_size()
            }
            fn is_known_zero(&self) -> bool {
                (**self).is_known_zero()
            }
            fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                (**self).read_at(buf, offset)
            }
            fn read_or_lend(&self, buf: &mut [u8], offset: u64) -> Result<Option<Lent>> {
                (**self).read_or_lend(buf, offset)
            }
            fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
                (**self).write_at(buf, offset, flags)
            }
            fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
                (**self).write_zeroes(offset, len, flags)
            }
            fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
                (**self).trim(offset, len, flags)
            }
            fn flush(&self) -> Result<()> {
                (**self).flush()
            }
            fn cache(&self, offset: u64, len: u64) -> Result<()> {
                (**self).cache(offset, len)
            }
            fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
                (**self).extents(offset, len)
            }
            fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
                (**self).file_view(offset, len)
            }
            fn describe(&self) -> String {
                (**self).describe()
            }
            fn connect(&self, session: &Session) -> Result<Option<DeviceRef>> {
                (**self).connect(session)
            }
            fn list_exports(&self, query: &ExportQuery) -> Result<Option<Vec<ExportEntry>>> {
                (**self).list_exports(query)
            }
            fn default_export(&self, query: &ExportQuery) -> Result<Option<String>> {
                (**self).default_export(query)
            }
            fn export_description(&self) -> Option<String> {
                (**self).export_description()
            }
            fn serving(&self, server: &ServerRef) {
                (**self).serving(server)
            }
            fn preconnect(&self, peer: &Peer) -> Result<()> {
                (**self).preconnect(peer)
            }
            fn serialize(&self) -> Serialize {
                (**self).serialize()
            }
            fn extents_before_reads(&self) -> bool {
                (**self).extents_before_reads()
            }
            fn reopen(&self) -> Result<()> {
                (**self).reopen()
            }
            fn close(&self) -> Result<()> {
                (**self).close()
            }
            fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
                (**self).submit(tag, req, cq)
            }
            fn queue_depth(&self) -> usize {
                (**self).queue_depth()
            }
            fn discards_writes(&self) -> bool {
                (**self).discards_writes()
            }
            fn prepare_write(&self, buf: &[u8], offset: u64) {
                (**self).prepare_write(buf, offset)
            }
            fn write_placed(
                &self,
                buf: &[u8],
                offset: u64,
                flags: WriteFlags,
                placed: &mut dyn FnMut(),
            ) -> Result<()> {
                (**self).write_placed(buf, offset, flags, placed)
            }
        }
    };
}

forward_device!(Arc<T>);
forward_device!(Box<T>);
forward_device!(&T);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records the writes (length, FUA) and flushes it is asked for.
    #[derive(Default)]
    struct Recorder {
        writes: Mutex<Vec<(usize, bool)>>,
        flushes: Mutex<usize>,
    }

    impl BlockDevice for Recorder {
        fn size(&self) -> u64 {
            64 << 20
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                can_flush: true,
                ..Capabilities::IN_MEMORY
            }
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            buf.fill(0);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], _offset: u64, flags: WriteFlags) -> Result<()> {
            self.writes.lock().unwrap().push((buf.len(), flags.fua));
            Ok(())
        }
        fn flush(&self) -> Result<()> {
            *self.flushes.lock().unwrap() += 1;
            Ok(())
        }
    }

    #[test]
    fn zero_buffer_fua_covers_every_chunk() {
        let one = Recorder::default();
        write_zero_buffer(&one, 0, 4096, true).unwrap();
        assert_eq!(*one.writes.lock().unwrap(), vec![(4096, true)]);
        assert_eq!(*one.flushes.lock().unwrap(), 0);

        // Three chunks: FUA on the last alone would leave the first two
        // in a volatile cache, so the writes are flushed instead.
        let many = Recorder::default();
        write_zero_buffer(&many, 0, (2 << 20) + 512, true).unwrap();
        let writes = many.writes.lock().unwrap().clone();
        assert_eq!(
            writes,
            vec![(1 << 20, false), (1 << 20, false), (512, false)]
        );
        assert_eq!(*many.flushes.lock().unwrap(), 1);

        let plain = Recorder::default();
        write_zero_buffer(&plain, 0, 3 << 20, false).unwrap();
        assert!(plain.writes.lock().unwrap().iter().all(|w| !w.1));
        assert_eq!(*plain.flushes.lock().unwrap(), 0);
    }
}
