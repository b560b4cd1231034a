//! diskit-s3: S3 objects (`s3://BUCKET/KEY`) as diskit storage.
//!
//! [`S3Object`] reads an object: its size and entity tag from a HEAD,
//! its bytes by signed range requests over a pool of kept-alive
//! connections, many in flight at once, retried with a growing wait when
//! the failure may pass (a dropped connection, 5xx, `SlowDown`); an
//! object that changes under the reader (another entity tag) is an error.
//! [`S3Writer`] writes a new object by multipart upload, front to back,
//! parts uploaded in parallel, aborted on failure. [`S3Sharded`] is a
//! read-write disk over many objects of a fixed size, laid out as
//! nbdkit's S3 plugin lays it out.
//!
//! Requests are signed (Signature V4) by rusty-s3, a sans-I/O library
//! that only builds signed URLs and parses answers; diskit-http's client
//! sends them. The endpoint, region and credentials are found as the AWS
//! tools find them ([`Settings::find`]).

mod client;
mod config;
mod name;
mod object;
mod sharded;
mod upload;

pub use client::xml_text;
pub use config::{Keys, S3Options, Settings, parse_ini};
pub use name::{PREFIX, S3Name};
pub use object::{S3Object, Seen, open as open_object};
pub use sharded::S3Sharded;
pub use upload::{MAX_PART, MAX_PARTS, MIN_PART, S3Writer, part_size};
