//! An object as a read-only device: its size and entity tag from a HEAD,
//! its bytes by signed range requests, many in flight at once.

use std::sync::Arc;

use diskit_core::aio::{CompletionQueue, Request};
use diskit_core::device::check_range;
use diskit_core::workers::Workers;
use diskit_core::{BlockDevice, BlockSizeLimits, Capabilities, Result};
use diskit_http::RangeRead;

use crate::client::{Client, MAX_REQUEST};
use crate::config::S3Options;
use crate::name::S3Name;

/// The object as first seen: a later answer of another size or entity
/// tag is an error, never other bytes.
struct Seen {
    client: Client,
    size: u64,
    etag: Option<String>,
}

impl RangeRead for Seen {
    fn read_range(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.client
            .read(buf, offset, self.size, self.etag.as_deref())
    }
}

/// An S3 object, read-only.
pub struct S3Object {
    seen: Arc<Seen>,
    connections: usize,
    /// Threads that run submitted reads, started at the first one.
    pool: Workers,
}

impl std::fmt::Debug for S3Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Object")
            .field("name", &self.seen.client.what)
            .finish_non_exhaustive()
    }
}

impl S3Object {
    /// Opens the object `name`: learns its size and entity tag.
    pub fn open(name: &S3Name, opts: &S3Options) -> Result<S3Object> {
        let client = Client::new(name, opts)?;
        let (size, etag) = client.head()?;
        let connections = opts.connections.max(1);
        Ok(S3Object {
            seen: Arc::new(Seen { client, size, etag }),
            connections,
            pool: Workers::new("diskit-s3", connections),
        })
    }
}

impl BlockDevice for S3Object {
    fn size(&self) -> u64 {
        self.seen.size
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::READ_ONLY
    }
    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 64 << 10,
            maximum: MAX_REQUEST as u32,
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.seen.read_range(buf, offset)
    }
    fn describe(&self) -> String {
        self.seen.client.what.clone()
    }
    fn submit(&self, tag: u64, req: Request, cq: &CompletionQueue) {
        diskit_http::submit_reads(self, &self.pool, &self.seen, tag, req, cq);
    }
    fn queue_depth(&self) -> usize {
        self.connections
    }
}

impl diskit_core::Storage for S3Object {
    fn location(&self) -> &str {
        &self.seen.client.what
    }

    fn protocol(&self) -> &'static str {
        "s3"
    }
}
