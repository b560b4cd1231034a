//! diskit-http: an `http://` or `https://` URL as a read-only block device.
//!
//! The size comes from a HEAD (or, when the HEAD does not say that ranges
//! are accepted, from a one-byte range request); reads are range requests
//! over a pool of kept-alive connections, any number at once from any
//! number of threads, and [`HttpDevice`]'s `submit` keeps up to
//! `connections` of them in flight without a thread per request. A server
//! that cannot answer range requests is refused when the device opens. A
//! request that fails in a way that may pass (a dropped connection, a
//! short body, 5xx, 408, 429) is tried again with a growing wait; an
//! answer that shows the resource changed (another size, another entity
//! tag, bytes other than those asked) is an I/O error, never wrong data.
//! TLS is verified against the system's certificates, or `cainfo` /
//! `capath`. nbdkit's curl plugin is the model for the options.

pub mod direct;
mod options;
mod source;
pub mod transport;

use std::sync::Arc;

use diskit_core::aio::{self, CompletionQueue, Request};
use diskit_core::buffer::AlignedBuf;
use diskit_core::chunks::{RangeReader, ReadRange};
use diskit_core::device::check_range;
use diskit_core::workers::Workers;
use diskit_core::{BlockDevice, BlockSizeLimits, Capabilities, Lent, Result};

pub use options::{HttpOptions, KEYS, PLUGIN_KEYS};
pub use source::Source;
pub use transport::parse_content_range;

/// A URL as a read-only block device.
pub type HttpDevice = RangeDevice<Source>;

impl HttpDevice {
    /// Opens `url`: learns its size, and checks that the server answers
    /// range requests.
    pub fn open(url: &str, opts: &HttpOptions) -> Result<HttpDevice> {
        Ok(RangeDevice::new(
            Source::open(url, opts)?,
            opts.connections,
            "diskit-http",
        ))
    }
}

/// The chunk of a [`RangeDevice::chunked`] resource: 4 MiB, radosgw's
/// stripe. A range request costs a store far more per request than per
/// byte (radosgw spent 4.4 s of processor time serving 1 GiB in 256 KiB
/// requests, 1.1-1.3 s in 4 MiB ones, and its OSD half as much again).
pub const CHUNK: u64 = 4 << 20;

/// A resource read by ranges over the network as a read-only device and
/// storage (a URL, an S3 object): reads from any number of threads, and
/// `submit` keeps up to `connections` of them in flight without a thread
/// per request. Made [`RangeDevice::chunked`], small reads that continue
/// one another are served from whole chunks (see [`CHUNK`] and
/// [`diskit_core::chunks`]).
pub struct RangeDevice<R> {
    reader: Arc<RangeReader<R>>,
    connections: usize,
    /// Threads that run submitted requests, started at the first one.
    pool: Workers,
}

impl<R: RangeRead> std::fmt::Debug for RangeDevice<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeDevice")
            .field("name", &self.reader.source().name())
            .finish_non_exhaustive()
    }
}

impl<R: RangeRead> RangeDevice<R> {
    /// The device over `reader`, with `connections` threads named
    /// `thread_name` for submitted reads.
    pub fn new(reader: R, connections: usize, thread_name: &'static str) -> RangeDevice<R> {
        Self::made(RangeReader::direct(reader), connections, thread_name)
    }

    /// As [`RangeDevice::new`], and a read shorter than a chunk that
    /// continues a recent one takes the whole chunk it falls in with one
    /// request, which the reads after it share: a stream read in small
    /// requests costs the server few big ones. At most
    /// [`MEMORY`](diskit_core::chunks::MEMORY) bytes of chunks of
    /// [`CHUNK`] bytes are held.
    pub fn chunked(reader: R, connections: usize, thread_name: &'static str) -> RangeDevice<R> {
        let size = reader.size();
        Self::made(
            RangeReader::chunked(reader, size, CHUNK, thread_name),
            connections,
            thread_name,
        )
    }

    fn made(
        reader: RangeReader<R>,
        connections: usize,
        thread_name: &'static str,
    ) -> RangeDevice<R> {
        let connections = connections.max(1);
        RangeDevice {
            reader: Arc::new(reader),
            connections,
            pool: Workers::new(thread_name, connections),
        }
    }
}

impl<R: RangeRead> BlockDevice for RangeDevice<R> {
    fn size(&self) -> u64 {
        self.reader.source().size()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::READ_ONLY
    }
    /// Made [`chunked`](RangeDevice::chunked), whole chunks are preferred:
    /// a copier or converter reading that much at once sends each read as
    /// one request of its own, neither split nor copied out of a chunk
    /// (1 GiB from radosgw to null: 1.2-1.3 s in 4 MiB requests, 1.6-1.7 s
    /// in the copier's 1 MiB ones served from chunks).
    fn block_size(&self) -> BlockSizeLimits {
        let preferred = if let Some(chunk) = self.reader.chunk_size() {
            chunk as u32
        } else {
            64 << 10
        };
        BlockSizeLimits {
            minimum: 1,
            preferred,
            maximum: source::MAX_REQUEST as u32,
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.reader.read(buf, offset)
    }
    fn read_or_lend(&self, buf: &mut [u8], offset: u64) -> Result<Option<Lent>> {
        check_range(self.size(), offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(None);
        }
        self.reader.read_or_lend(buf, offset, true)
    }
    fn describe(&self) -> String {
        self.reader.source().name().to_string()
    }
    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        submit_reads(self, &self.pool, &self.reader, tag, req, cq);
    }
    fn queue_depth(&self) -> usize {
        self.connections
    }
}

impl<R: RangeRead> diskit_core::Storage for RangeDevice<R> {
    fn location(&self) -> &str {
        self.reader.source().name()
    }

    fn protocol(&self) -> &'static str {
        self.reader.source().protocol()
    }
}

/// A resource read by ranges over the network, from any thread (its
/// reads, in requests of at most 32 MiB, are its [`ReadRange`]).
pub trait RangeRead: ReadRange {
    /// Its size.
    fn size(&self) -> u64;
    /// Its name (a URL, an `s3://` name).
    fn name(&self) -> &str;
    /// The protocol, as `info` names it.
    fn protocol(&self) -> &'static str;
}

impl RangeRead for Source {
    fn size(&self) -> u64 {
        self.size
    }
    fn name(&self) -> &str {
        self.url()
    }
    fn protocol(&self) -> &'static str {
        if self.url().starts_with("https://") {
            "https"
        } else {
            "http"
        }
    }
}

impl ReadRange for Source {
    fn read_range(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read(buf, offset)
    }
}

/// `submit` for a read-only device whose reads `reader` makes: a read
/// runs on one of `pool`'s threads, which hands the data to the request's
/// sink if it has one and posts the completion to `cq`, so that as many
/// reads are in flight as the pool has threads; other requests run at
/// once on `dev`.
fn submit_reads<R: RangeRead>(
    dev: &dyn BlockDevice,
    pool: &Workers,
    reader: &Arc<RangeReader<R>>,
    tag: u64,
    req: Request,
    cq: &CompletionQueue,
) {
    let (offset, buf, len, sink) = match req {
        Request::Read { offset, buf, len } => (offset, buf, len, None),
        Request::ReadTo {
            offset,
            buf,
            len,
            sink,
        } => (offset, buf, len, Some(sink)),
        req => return cq.push(aio::run(dev, tag, req)),
    };
    let cq = cq.clone();
    let size = dev.size();
    let reader = reader.clone();
    pool.run(move || {
        let mut buf: AlignedBuf = buf;
        let result = match buf.get_mut(..len) {
            Some(b) => check_range(size, offset, len as u64)
                .and_then(|()| reader.read(b, offset))
                .and_then(|()| match &sink {
                    Some(sink) => aio::hand_over(&**sink, offset, b),
                    None => Ok(()),
                }),
            None => Err(diskit_core::Error::invalid("read longer than its buffer")),
        };
        cq.push(aio::Completion {
            tag,
            result,
            buf: Some(buf),
        });
    });
}
