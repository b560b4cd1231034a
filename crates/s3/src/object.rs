//! An object as a read-only device: its size and entity tag from a HEAD,
//! its bytes by signed range requests, many in flight at once
//! (diskit-http's [`RangeDevice`]), small reads that continue one another
//! served from whole chunks ([`RangeDevice::chunked`]: a store's cost is
//! mostly per request).

use diskit_core::Result;
use diskit_core::chunks::ReadRange;
use diskit_http::{RangeDevice, RangeRead};

use crate::client::Client;
use crate::config::S3Options;
use crate::name::S3Name;

/// An S3 object, read-only.
pub type S3Object = RangeDevice<Seen>;

/// The object as first seen: a later answer of another size or entity
/// tag is an error, never other bytes.
pub struct Seen {
    client: Client,
    size: u64,
    etag: Option<String>,
}

impl RangeRead for Seen {
    fn size(&self) -> u64 {
        self.size
    }
    fn name(&self) -> &str {
        &self.client.what
    }
    fn protocol(&self) -> &'static str {
        "s3"
    }
}

impl ReadRange for Seen {
    fn read_range(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.client
            .read(buf, offset, self.size, self.etag.as_deref())
    }
}

/// Opens the object `name`: learns its size and entity tag.
pub fn open(name: &S3Name, opts: &S3Options) -> Result<S3Object> {
    let client = Client::new(name, opts)?;
    let (size, etag) = client.head()?;
    Ok(RangeDevice::chunked(
        Seen { client, size, etag },
        opts.connections,
        "diskit-s3",
    ))
}
