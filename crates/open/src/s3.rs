//! The `s3` source: S3 objects (diskit-s3) by name (`s3://BUCKET/KEY`)
//! or by keys (`json:`, `--image-opts`: `bucket`, `key`, `endpoint-url`,
//! `region`, `access-key`, `secret-key`, `session-token`, `profile`).
//! Read-only opens read the object; a new object is made by a multipart
//! upload, written front to back and there only once closed.
//! The writer creation makes waits, by name, for the open that takes it
//! (an object being written cannot be opened again).

use std::sync::Arc;

use diskit_core::{Error, ErrorKind, Result, StorageOptions, StorageRef};
use diskit_s3::{S3Name, S3Options, S3Writer};

use crate::spec::Spec;
use crate::waiting::Waiting;

/// QEMU-style keys of the s3 driver.
pub const KEYS: &[&str] = &[
    "filename",
    "bucket",
    "key",
    "endpoint-url",
    "region",
    "access-key",
    "secret-key",
    "session-token",
    "profile",
];

/// New objects made and not yet opened.
static MADE: Waiting<Arc<S3Writer>> = Waiting::new();

/// Takes the new object `name` that creation made, if it waits.
fn take_made(name: &S3Name) -> Option<Arc<S3Writer>> {
    MADE.take(&name.to_string())
}

/// The object a node names, and the settings its keys give.
fn name_of(node: &Spec, mode: &StorageOptions) -> Result<(S3Name, S3Options)> {
    let name = match node.get("filename") {
        Some(f) => S3Name::parse(f)?,
        None => {
            let need = |k: &str| {
                node.get(k)
                    .ok_or_else(|| Error::invalid(format!("Parameter '{k}' is missing")))
            };
            S3Name::new(need("bucket")?, need("key")?)?
        }
    };
    let mut opts = S3Options::new();
    let key = |k: &str| node.get(k).map(str::to_string);
    opts.endpoint_url = key("endpoint-url");
    opts.region = key("region");
    opts.access_key = key("access-key");
    opts.secret_key = key("secret-key");
    opts.session_token = key("session-token");
    opts.profile = key("profile");
    if mode.connections > 0 {
        opts.connections = (mode.connections * 4).clamp(4, 64);
    }
    Ok((name, opts))
}

/// Opens the object a node names: for reading, or, for writing, the new
/// object creation made. An object that is there is never opened for
/// writing: S3 replaces an object whole, so a write in place (a server,
/// a resize, a bitmap or snapshot change, `convert -n`) would lose every
/// byte it does not write again.
pub fn open(node: &Spec, mode: StorageOptions) -> Result<StorageRef> {
    let (name, opts) = name_of(node, &mode)?;
    if !mode.writable {
        return Ok(Arc::new(diskit_s3::open_object(&name, &opts)?));
    }
    if let Some(w) = take_made(&name) {
        return Ok(w);
    }
    Err(Error::new(
        ErrorKind::PermissionDenied,
        format!(
            "{name}: an S3 object cannot be changed in place (S3 replaces objects whole); \
             write a new object instead, or open it read-only"
        ),
    ))
}

/// Makes the new object `name`, empty, with parts sized for about
/// `size_hint` bytes; it waits for the open that takes it.
pub fn create(name: &str, size_hint: u64) -> Result<StorageRef> {
    let n = S3Name::parse(name)?;
    let w = Arc::new(S3Writer::create(&n, &S3Options::new(), 0, size_hint)?);
    MADE.keep(n.to_string(), w.clone());
    Ok(w)
}

/// Gives up the new object `name` (a failed creation's undo): its upload
/// is aborted, or the object removed if it was completed.
pub fn remove(name: &str) -> Result<()> {
    match take_made(&S3Name::parse(name)?) {
        Some(w) => w.discard(),
        None => Ok(()),
    }
}

/// Completes the new object `name` that no open took (`create` alone).
pub fn finish(name: &str) -> Result<()> {
    let n = S3Name::parse(name)?;
    match take_made(&n) {
        Some(w) => diskit_core::BlockDevice::close(&*w),
        None => Err(Error::new(
            ErrorKind::NotFound,
            format!("{n}: no new object of that name"),
        )),
    }
}
