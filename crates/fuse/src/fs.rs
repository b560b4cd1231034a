//! The filesystem: one regular file whose bytes are a block device's.
//!
//! Reads and writes go to the device as submitted requests that own
//! their buffers ([`diskit_core::aio`]): the FUSE thread that received
//! one hands it on and takes the next, and the reply is sent from
//! wherever the request completes (an NBD connection's reader, or the
//! FUSE thread itself for a device that runs requests as they come). So
//! the kernel's concurrent requests (readahead, several readers) are in
//! flight at once, and no lock is held around I/O. Sequential reads are
//! also read ahead by the mount itself ([`crate::readahead`]).

use std::ffi::{OsStr, OsString};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use diskit_core::aio::{Completion, CompletionQueue, Request as IoRequest};
use diskit_core::buffer::AlignedBuf;
use diskit_core::{DeviceRef, WriteFlags, ZeroFlags};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request,
};

use crate::pool::BufPool;
use crate::readahead::{Answer, Found, Readahead};

/// The file's inode when the root is a directory holding it.
const FILE_INO: INodeNo = INodeNo(2);
/// How long the kernel may keep attributes and names: they never change.
const TTL: Duration = Duration::from_secs(3600);
/// The largest read or write the kernel is asked to send at once.
pub const MAX_IO: u32 = 1 << 20;

/// How the file is shown.
#[derive(Debug, Clone, Default)]
pub struct FileOptions {
    /// The file's name in the mounted directory; `None`: the mount root
    /// is the file (a naked mount over a regular file).
    pub name: Option<OsString>,
    /// Refuse opens for writing.
    pub read_only: bool,
    /// Keep the kernel's cached pages across opens (libfuse's
    /// `kernel_cache`).
    pub keep_cache: bool,
    /// Bypass the kernel's page cache (libfuse's `direct_io`).
    pub direct_io: bool,
}

/// One file over a device.
pub struct OneFile {
    io: Arc<Io>,
    opts: FileOptions,
    size: u64,
    uid: u32,
    gid: u32,
    mounted_at: SystemTime,
}

/// What moves the file's bytes: shared with the thread that takes
/// finished requests.
struct Io {
    dev: DeviceRef,
    /// Where reads ahead complete: the thread that waits there answers
    /// the readers waiting for them.
    cq: CompletionQueue,
    /// Where the other requests complete once replied to (nobody waits
    /// there, so nobody is woken): their buffers are taken back for the
    /// next request.
    replied: CompletionQueue,
    pool: Arc<BufPool>,
    ahead: Readahead<ReplyData>,
    next_tag: AtomicU64,
}

impl OneFile {
    /// A filesystem showing `dev` as described; starts the thread that
    /// takes finished reads ahead.
    pub fn new(dev: DeviceRef, opts: FileOptions) -> OneFile {
        let pool = Arc::new(BufPool::new(MAX_IO as usize));
        let size = dev.size();
        let io = Arc::new(Io {
            dev,
            cq: CompletionQueue::new(),
            replied: CompletionQueue::new(),
            ahead: Readahead::new(size, pool.clone()),
            pool,
            next_tag: AtomicU64::new(0),
        });
        {
            // It does not keep the device open once the file is gone.
            let (cq, io) = (io.cq.clone(), Arc::downgrade(&io));
            std::thread::Builder::new()
                .name("fuse-done".into())
                .spawn(move || {
                    loop {
                        let c = cq.wait();
                        match io.upgrade() {
                            Some(io) => io.finished(c),
                            None => return,
                        }
                    }
                })
                .expect("start a thread");
        }
        // SAFETY: getuid and getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        OneFile {
            size,
            io,
            opts,
            uid,
            gid,
            mounted_at: SystemTime::now(),
        }
    }

    fn file_ino(&self) -> INodeNo {
        if self.opts.name.is_some() {
            FILE_INO
        } else {
            INodeNo::ROOT
        }
    }

    fn is_file(&self, ino: INodeNo) -> bool {
        ino == self.file_ino()
    }

    fn attr(&self, ino: INodeNo) -> FileAttr {
        let t = self.mounted_at;
        let (kind, perm, size, nlink) = if self.is_file(ino) {
            let perm = if self.opts.read_only { 0o444 } else { 0o666 };
            (FileType::RegularFile, perm, self.size, 1)
        } else {
            (FileType::Directory, 0o555, 0, 2)
        };
        FileAttr {
            ino,
            size,
            blocks: 0,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        }
    }

    /// The part of `offset..offset+len` inside the device.
    fn clamp(&self, offset: u64, len: u64) -> u64 {
        len.min(self.size.saturating_sub(offset))
    }
}

impl Io {
    /// A handle to the completion queue of replied requests that runs
    /// `reply` on the request's completion first.
    fn replying(&self, reply: impl FnOnce(&Completion) + Send + 'static) -> CompletionQueue {
        self.replied.watched(reply)
    }

    /// A buffer of at least `len` bytes: one of a request replied to if
    /// there is one (the others go back to the pool), else the pool's.
    fn buffer(&self, len: usize) -> diskit_core::Result<AlignedBuf> {
        while let Some(c) = self.replied.try_pop() {
            if let Some(b) = c.buf {
                self.pool.give(b);
            }
        }
        self.pool.take(len)
    }

    fn tag(&self) -> u64 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes a finished read ahead: its bytes go to the readers waiting
    /// for them.
    fn finished(&self, c: Completion) {
        let buf = c.buf.filter(|_| c.result.is_ok());
        for a in self.ahead.completed(c.tag, buf) {
            self.answer(a);
        }
    }

    /// Answers a reader that waited for a read ahead.
    fn answer(&self, a: Answer<ReplyData>) {
        match a.bytes {
            Some(b) => {
                a.waiter.data(&b[a.range]);
                self.ahead.recycle(b);
            }
            None => self.read(a.offset, a.range.len(), a.waiter),
        }
    }

    /// Reads `len` bytes (inside the device) at `offset` from the device
    /// and replies with them when they come.
    fn read(&self, offset: u64, len: usize, reply: ReplyData) {
        let buf = match self.buffer(len) {
            Ok(b) => b,
            Err(e) => return reply.error(errno(&e)),
        };
        let cq = self.replying(move |c| match (&c.result, &c.buf) {
            (Ok(()), Some(b)) => reply.data(&b[..len]),
            (Err(e), _) => reply.error(errno(e)),
            (Ok(()), None) => reply.error(Errno::EIO),
        });
        self.dev
            .submit(self.tag(), IoRequest::Read { offset, buf, len }, &cq);
    }

    /// Sends reads ahead.
    fn prefetch(&self, reads: Vec<crate::readahead::Prefetch>) {
        for p in reads {
            match self.buffer(p.len) {
                Ok(buf) => {
                    let req = IoRequest::Read {
                        offset: p.offset,
                        buf,
                        len: p.len,
                    };
                    self.dev.submit(p.tag, req, &self.cq);
                }
                Err(_) => {
                    for a in self.ahead.completed(p.tag, None) {
                        self.answer(a);
                    }
                }
            }
        }
    }

    /// Runs a change of the device's bytes other than a write (a trim,
    /// zeroing) with the reads ahead made stale around it.
    fn changing<T>(&self, f: impl FnOnce() -> T) -> T {
        self.ahead.write_starts();
        let out = f();
        self.ahead.write_ends();
        out
    }
}

/// The errno a device error is reported with.
fn errno(e: &diskit_core::Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// Replies with the outcome of an operation that returns nothing.
fn answer(reply: ReplyEmpty, result: diskit_core::Result<()>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
    }
}

impl Filesystem for OneFile {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Large requests for sequential readers and writers, many in
        // flight (readahead is sent in the background); the kernel caps
        // what it cannot do.
        let _ = config.set_max_write(MAX_IO);
        if let Err(max) = config.set_max_readahead(MAX_IO) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match &self.opts.name {
            Some(n) if parent == INodeNo::ROOT && n == name => {
                reply.entry(&TTL, &self.attr(FILE_INO), Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT || self.is_file(ino) {
            reply.attr(&TTL, &self.attr(ino));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // The size is the device's: a truncation to it changes nothing
        // (an opening with O_TRUNC of an empty device, `truncate -s` to
        // the same size); nothing else can change.
        match (mode, uid, gid, size) {
            (None, None, None, Some(s)) if self.is_file(ino) && s == self.size => {
                reply.attr(&TTL, &self.attr(ino))
            }
            _ => reply.error(Errno::ENOSYS),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if !self.is_file(ino) {
            return reply.error(Errno::EISDIR);
        }
        if self.opts.read_only && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EACCES);
        }
        let mut f = FopenFlags::empty();
        if self.opts.keep_cache {
            f |= FopenFlags::FOPEN_KEEP_CACHE;
        } else {
            self.io.ahead.reset();
        }
        if self.opts.direct_io {
            f |= FopenFlags::FOPEN_DIRECT_IO;
        }
        reply.opened(FileHandle(0), f);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if !self.is_file(ino) {
            return reply.error(Errno::EISDIR);
        }
        let len = self.clamp(offset, u64::from(size)) as usize;
        if len == 0 {
            return reply.data(&[]);
        }
        let io = &self.io;
        // Reads that bypass the kernel's cache (O_DIRECT, the direct_io
        // option) are not read ahead either: they see what other clients
        // of the device wrote before they were made.
        if self.opts.direct_io || flags.0 & libc::O_DIRECT != 0 {
            return io.read(offset, len, reply);
        }
        let (found, ahead) = io.ahead.read(offset, len, reply);
        match found {
            Found::Ready(reply, buf, range) => {
                reply.data(&buf[range]);
                io.ahead.recycle(buf);
            }
            Found::Waiting => {}
            Found::Miss(reply) => io.read(offset, len, reply),
        }
        io.prefetch(ahead);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if !self.is_file(ino) {
            return reply.error(Errno::EISDIR);
        }
        if self.opts.read_only {
            return reply.error(Errno::EACCES);
        }
        // Past the end of the device, as a block device: a short write,
        // then no space.
        let len = self.clamp(offset, data.len() as u64) as usize;
        if len == 0 {
            return reply.error(if data.is_empty() {
                Errno::EINVAL
            } else {
                Errno::ENOSPC
            });
        }
        let io = &self.io;
        let mut buf = match io.buffer(len) {
            Ok(b) => b,
            Err(e) => return reply.error(errno(&e)),
        };
        buf[..len].copy_from_slice(&data[..len]);
        // Reads ahead of the write are stale once it is answered.
        io.ahead.write_starts();
        let done = io.clone();
        let cq = io.replying(move |c| {
            done.ahead.write_ends();
            match &c.result {
                Ok(()) => reply.written(len as u32),
                Err(e) => reply.error(errno(e)),
            }
        });
        let req = IoRequest::Write {
            offset,
            buf,
            range: 0..len,
            flags: WriteFlags::NONE,
        };
        io.dev.submit(io.tag(), req, &cq);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // A close: fsync is what makes writes durable.
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if !self.is_file(ino) {
            return reply.ok();
        }
        answer(reply, self.io.dev.flush());
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if !self.is_file(ino) {
            return reply.error(Errno::EISDIR);
        }
        if self.opts.read_only {
            return reply.error(Errno::EACCES);
        }
        let len = self.clamp(offset, length);
        let dev = &self.io.dev;
        let caps = dev.capabilities();
        let result = if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 {
            if mode & libc::FALLOC_FL_KEEP_SIZE == 0 {
                return reply.error(Errno::EINVAL);
            }
            // A trim where the device has one, as nbdfuse does; else
            // zeros that may be punched.
            if len == 0 {
                Ok(())
            } else if caps.can_trim {
                self.io.changing(|| dev.trim(offset, len, WriteFlags::NONE))
            } else {
                let flags = ZeroFlags {
                    may_trim: true,
                    ..ZeroFlags::default()
                };
                self.io.changing(|| dev.write_zeroes(offset, len, flags))
            }
        } else if mode & libc::FALLOC_FL_ZERO_RANGE != 0 {
            if len == 0 {
                Ok(())
            } else {
                self.io
                    .changing(|| dev.write_zeroes(offset, len, ZeroFlags::default()))
            }
        } else {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        };
        answer(reply, result);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(name) = self.opts.name.as_deref().filter(|_| ino == INodeNo::ROOT) else {
            return reply.error(Errno::ENOTDIR);
        };
        let entries = [
            (INodeNo::ROOT, FileType::Directory, OsStr::new(".")),
            (INodeNo::ROOT, FileType::Directory, OsStr::new("..")),
            (FILE_INO, FileType::RegularFile, name),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}
