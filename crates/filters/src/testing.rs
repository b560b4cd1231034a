//! What the filters' tests share: a device to put below a filter that
//! records what reaches it, and helpers for parameters, data and flags.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use diskit_backends::MemoryDevice;
use diskit_core::aio::{Completion, CompletionQueue, Request};
use diskit_core::buffer::AlignedBuf;
use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Error, Extent, Result, ServerHandle, WriteFlags,
    ZeroFlags,
};

use crate::{FilterSpec, stack};

/// A memory device that records what reaches it. Submitted requests are
/// counted and kept in flight (up to 8), as an NBD connection keeps them.
pub(crate) struct Probe {
    /// The bytes.
    pub(crate) mem: MemoryDevice,
    /// What it offers (memory's, unless changed).
    caps: Capabilities,
    /// How long each read takes.
    read_delay: Duration,
    /// Reads that reached it (failed ones too).
    pub(crate) reads: AtomicU64,
    /// The bytes they read.
    pub(crate) bytes: AtomicU64,
    /// Requests submitted to it.
    pub(crate) submitted: AtomicU64,
    /// Flushes.
    pub(crate) flushes: AtomicU64,
    /// Writes, zeroes and trims with their FUA flag, and flushes, in
    /// order: `write fua=true`, `zero fua=false`, `trim fua=false`,
    /// `flush`.
    pub(crate) log: Mutex<Vec<String>>,
    /// The ranges asked to be cached (nothing is done with them).
    pub(crate) cached: Mutex<Vec<(u64, u64)>>,
    /// Reads wait while this is true (see [`Probe::hold_reads`]).
    held: Mutex<bool>,
    /// The reads were let go.
    let_go: Condvar,
    /// Reads waiting now.
    waiting: AtomicU64,
    /// Reads that touch this range fail with EIO.
    failing: Option<(u64, u64)>,
}

impl Probe {
    /// `size` bytes of zeros, offering what memory offers.
    pub(crate) fn new(size: u64) -> Probe {
        Probe {
            mem: MemoryDevice::new(size),
            caps: Capabilities::IN_MEMORY,
            read_delay: Duration::ZERO,
            reads: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            submitted: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            cached: Mutex::new(Vec::new()),
            held: Mutex::new(false),
            let_go: Condvar::new(),
            waiting: AtomicU64::new(0),
            failing: None,
        }
    }

    /// The same, reads touching `offset..offset+len` failing with EIO.
    pub(crate) fn failing(self, offset: u64, len: u64) -> Probe {
        Probe {
            failing: Some((offset, offset + len)),
            ..self
        }
    }

    /// From now on reads wait (counted by [`waiting`](Self::waiting))
    /// until [`let_reads_go`](Self::let_reads_go).
    pub(crate) fn hold_reads(&self) {
        *lock(&self.held) = true;
    }

    /// Lets waiting reads and later ones go.
    pub(crate) fn let_reads_go(&self) {
        *lock(&self.held) = false;
        self.let_go.notify_all();
    }

    /// Reads waiting now.
    pub(crate) fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::SeqCst)
    }

    /// The same, its first `len` bytes holding [`pattern`].
    pub(crate) fn patterned(self, len: u64) -> Probe {
        self.mem
            .write_at(&pattern(len), 0, WriteFlags::NONE)
            .unwrap();
        self
    }

    /// The same, offering what `change` makes of its capabilities.
    pub(crate) fn caps(self, change: impl FnOnce(Capabilities) -> Capabilities) -> Probe {
        Probe {
            caps: change(self.caps),
            ..self
        }
    }

    /// The same, each read taking `delay`.
    pub(crate) fn slow_reads(self, delay: Duration) -> Probe {
        Probe {
            read_delay: delay,
            ..self
        }
    }

    /// Reads that reached it so far.
    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    /// The bytes read from it so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }

    /// The log so far (see [`Probe::log`]).
    pub(crate) fn log(&self) -> Vec<String> {
        lock(&self.log).clone()
    }

    fn note(&self, what: &str, fua: bool) {
        lock(&self.log).push(format!("{what} fua={fua}"));
    }
}

impl BlockDevice for Probe {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if !self.read_delay.is_zero() {
            std::thread::sleep(self.read_delay);
        }
        {
            let mut held = lock(&self.held);
            if *held {
                self.waiting.fetch_add(1, Ordering::SeqCst);
                while *held {
                    held = self.let_go.wait(held).unwrap();
                }
                self.waiting.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.reads.fetch_add(1, Ordering::SeqCst);
        if let Some((start, end)) = self.failing
            && offset < end
            && start < offset + buf.len() as u64
        {
            return Err(Error::from(std::io::Error::from_raw_os_error(libc::EIO)));
        }
        self.bytes.fetch_add(buf.len() as u64, Ordering::SeqCst);
        self.mem.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.note("write", flags.fua);
        self.mem.write_at(buf, offset, flags)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.note("zero", flags.fua);
        self.mem.write_zeroes(offset, len, flags)
    }
    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.note("trim", flags.fua);
        self.mem.trim(offset, len, flags)
    }
    fn flush(&self) -> Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        lock(&self.log).push("flush".into());
        Ok(())
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        lock(&self.cached).push((offset, len));
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.mem.extents(offset, len)
    }
    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        self.submitted.fetch_add(1, Ordering::SeqCst);
        cq.push(diskit_core::aio::run(self, tag, req));
    }
    fn queue_depth(&self) -> usize {
        8
    }
}

/// A filter that writes a file (log, stats), stacked by its row over a
/// [`Probe`].
pub(crate) struct Writing {
    /// Holds the file (removed when dropped).
    _dir: tempfile::TempDir,
    /// The file.
    pub(crate) path: PathBuf,
    /// The device below.
    pub(crate) below: Arc<Probe>,
    /// The filter over it.
    pub(crate) dev: DeviceRef,
}

impl Writing {
    /// `filter`, its parameter `key` naming a new file, over a probe of
    /// `size` bytes.
    pub(crate) fn new(filter: &str, key: &str, size: u64) -> Writing {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(filter);
        let spec = FilterSpec::parse(filter, &kv(&[(key, path.to_str().unwrap())])).unwrap();
        let below = Arc::new(Probe::new(size));
        let dev = stack(&[spec], below.clone(), false).unwrap();
        Writing {
            _dir: dir,
            path,
            below,
            dev,
        }
    }

    /// What the file holds now.
    pub(crate) fn text(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap()
    }
}

/// `len` bytes of a pattern with no zero byte in it (so that what reads
/// as zeros stands out).
pub(crate) fn pattern(len: u64) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 + 1).collect()
}

/// The `len` bytes at `offset` of `d`.
pub(crate) fn read(d: &dyn BlockDevice, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    d.read_at(&mut v, offset).unwrap();
    v
}

/// `data` in an aligned buffer, as requests carry it.
pub(crate) fn buf(data: &[u8]) -> AlignedBuf {
    let mut b = AlignedBuf::new(data.len().max(1), 4096).unwrap();
    b[..data.len()].copy_from_slice(data);
    b
}

/// A read of `len` bytes at `offset`, to submit.
pub(crate) fn read_request(offset: u64, len: usize) -> Request {
    Request::Read {
        offset,
        buf: buf(&vec![0; len]),
        len,
    }
}

/// A write of `data` at `offset`, to submit.
pub(crate) fn write_request(offset: u64, data: &[u8]) -> Request {
    Request::Write {
        offset,
        buf: buf(data),
        range: 0..data.len(),
        flags: WriteFlags::NONE,
    }
}

/// A write-zeroes of `len` bytes at `offset`, to submit.
pub(crate) fn zero_request(offset: u64, len: u64, flags: ZeroFlags) -> Request {
    Request::Zero { offset, len, flags }
}

/// Submits `req` to `dev` and waits for it to complete.
pub(crate) fn submit(dev: &dyn BlockDevice, req: Request) -> Completion {
    let cq = CompletionQueue::new();
    dev.submit(1, req, &cq);
    cq.wait()
}

/// Waits until `f` holds (at most a minute, then fails: something that
/// should happen in the background did not).
pub(crate) fn wait_until(f: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(60), "timed out");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `below` holding `size` bytes of [`pattern`], each read taking 2 ms:
/// slow enough that the cache and cow filters prefetch over it.
pub(crate) fn slow_source(below: Probe, size: u64) -> Arc<Probe> {
    Arc::new(below.patterned(size).slow_reads(Duration::from_millis(2)))
}

/// Reads the first 4 KiB of `d` over a [`slow_source`]: the first read
/// below, which tells the filter that reads below are slow.
pub(crate) fn read_first(d: &dyn BlockDevice) {
    assert_eq!(read(d, 0, 4096), pattern(4096));
}

/// Writes racing a prefetch: a read of block 0 of `d` (held already, in
/// 64 KiB blocks, over `below` holding the test pattern) makes it prefetch
/// the 2 MiB after it; while that prefetch waits below (`below` holds its
/// reads), a partial and a whole-block write into them start, and wait for
/// it; then the reads go. Returns the disk's bytes as they must read now
/// (`size` of them): the writes kept.
pub(crate) fn writes_racing_a_prefetch(d: &DeviceRef, below: &Probe, size: u64) -> Vec<u8> {
    below.hold_reads();
    assert_eq!(read(&**d, 100, 4096), pattern(4196)[100..]);
    wait_until(|| below.waiting() == 1);
    let writes = [(1_000_100u64, 1000usize, 0xaa), (20 << 16, 1 << 16, 0xbb)];
    let writers: Vec<_> = writes
        .into_iter()
        .map(|(off, len, v)| {
            let d = d.clone();
            std::thread::spawn(move || d.write_at(&vec![v; len], off, WriteFlags::NONE))
        })
        .collect();
    // Time to reach the blocks the prefetch holds (if they have not,
    // they write after it: they must win all the same).
    std::thread::sleep(Duration::from_millis(20));
    below.let_reads_go();
    for w in writers {
        w.join().unwrap().unwrap();
    }
    let mut want = pattern(size);
    for (off, len, v) in writes {
        want[off as usize..off as usize + len].fill(v);
    }
    want
}

/// A fast zero.
pub(crate) const FAST: ZeroFlags = ZeroFlags {
    fua: false,
    may_trim: true,
    fast: true,
};

/// `key=value` pairs from string slices.
pub(crate) fn kv(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A server, as the layers see it, that counts the times they stop it.
#[derive(Debug, Default)]
pub(crate) struct Stops(AtomicUsize);

impl Stops {
    /// How many times a layer asked the server to stop.
    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl ServerHandle for Stops {
    fn shutdown(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}
