//! The `s3` source: S3 objects (diskit-s3) by name (`s3://BUCKET/KEY`)
//! or by keys (`json:`, `--image-opts`: `bucket`, `key`, `endpoint-url`,
//! `region`, `access-key`, `secret-key`, `session-token`, `profile`).
//! Read-only opens read the object; a new object is made by a multipart
//! upload, written front to back and there only once closed. `serve s3`
//! takes nbdkit's S3 plugin's command line: one object, read-only, or,
//! with `size=` and `object-size=`, a read-write disk over many objects
//! laid out as that plugin lays them out.
//! The writer creation makes waits, by name, for the open that takes it
//! (an object being written cannot be opened again).

use std::sync::Arc;

use diskit_core::{DeviceRef, Error, ErrorKind, Result, StorageOptions, StorageRef};
use diskit_s3::{S3Name, S3Options, S3Sharded, S3Writer};

use crate::plugin::{PluginArgs, size_arg};
use crate::spec::Spec;
use crate::waiting::Waiting;

/// Every key, laid out so that the node's and the plugin's are two
/// windows on it: the plugin's first (its own two, then the shared
/// ones), the node's last (the shared ones, then `filename`).
const ALL_KEYS: [&str; 11] = [
    "size",
    "object-size",
    "bucket",
    "key",
    "endpoint-url",
    "region",
    "access-key",
    "secret-key",
    "session-token",
    "profile",
    "filename",
];

/// QEMU-style keys of the s3 driver.
pub const KEYS: &[&str] = ALL_KEYS.split_at(2).1;

/// The keys of `serve s3` (nbdkit's S3 plugin's, and `region` and
/// `profile`).
pub const PLUGIN_KEYS: &[&str] = ALL_KEYS.split_at(10).0;

/// The spellings with underscores that nbdkit's S3 plugin also takes.
pub const PLUGIN_ALIASES: &[(&str, &str)] = &[
    ("access_key", "access-key"),
    ("secret_key", "secret-key"),
    ("session_token", "session-token"),
    ("endpoint_url", "endpoint-url"),
];

/// Requests in flight at once for a server (its connections' threads).
const SERVER_CONNECTIONS: usize = 64;

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
    let mut opts = options(|k| node.get(k));
    if mode.connections > 0 {
        opts.connections = (mode.connections * 4).clamp(4, 64);
    }
    Ok((name, opts))
}

/// The settings that keys give (the same keys for a node and a plugin).
fn options<'a>(key: impl Fn(&str) -> Option<&'a str>) -> S3Options {
    let mut opts = S3Options::new();
    let key = |k: &str| key(k).map(str::to_string);
    opts.endpoint_url = key("endpoint-url");
    opts.region = key("region");
    opts.access_key = key("access-key");
    opts.secret_key = key("secret-key");
    opts.session_token = key("session-token");
    opts.profile = key("profile");
    opts
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

/// `serve s3 bucket=B key=K [endpoint-url=] [access-key=] [secret-key=]
/// [session-token=] [region=] [profile=] [size= object-size=]`: without
/// `size=`, the object `K`, read-only; with `size=` and `object-size=`
/// (always together, as nbdkit's plugin wants them), a disk of `size`
/// bytes over objects `K/%016x` of `object-size` bytes, writable unless
/// served read-only.
pub fn open_plugin(kv: &PluginArgs, readonly: bool) -> Result<DeviceRef> {
    let need = |k: &str| {
        kv.get(k)
            .map(String::as_str)
            .ok_or_else(|| Error::invalid(format!("s3: {k} parameter missing")))
    };
    let name = S3Name::new(need("bucket")?, need("key")?)?;
    let mut opts = options(|k| kv.get(k).map(String::as_str));
    opts.connections = SERVER_CONNECTIONS;
    let size = |k: &str| kv.get(k).map(|v| size_arg("s3", v)).transpose();
    match (size("size")?, size("object-size")?) {
        (None, None) => Ok(Arc::new(diskit_s3::open_object(&name, &opts)?)),
        (Some(size), Some(object_size)) => Ok(Arc::new(S3Sharded::open(
            &name,
            &opts,
            size,
            object_size,
            !readonly,
        )?)),
        _ => Err(Error::invalid(
            "s3: `size` and `object-size` parameters must always be specified together",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_and_the_plugin_take_their_keys() {
        assert_eq!(KEYS.first(), Some(&"bucket"));
        assert_eq!(KEYS.last(), Some(&"filename"));
        assert_eq!(PLUGIN_KEYS.first(), Some(&"size"));
        assert_eq!(PLUGIN_KEYS.last(), Some(&"profile"));
        assert!(!KEYS.contains(&"object-size"));
        assert!(!PLUGIN_KEYS.contains(&"filename"));
    }
}
