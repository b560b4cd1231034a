//! The `rbd` source: Ceph RBD images (diskit-rbd), by QEMU's names
//! (`rbd:POOL[/NAMESPACE]/IMAGE[@SNAP][:KEY=VALUE...]`), QEMU's keys
//! (`json:`, `--image-opts`: `pool`, `namespace`, `image`, `snapshot`,
//! `conf`, `user`, `key-secret`) and nbdkit-style plugin keys
//! (`serve rbd POOL/IMAGE [snap=] [conf=] [id=]`). Images are made by
//! `rbd_create`, empty, and grow as the format writes them.

use std::sync::Arc;

use base64::Engine;
use diskit_core::{DeviceRef, Error, Result, StorageOptions, StorageRef};
use diskit_rbd::{RbdImage, RbdName};

use crate::plugin::PluginArgs;
use crate::spec::Spec;
use crate::waiting::Waiting;

/// QEMU's keys of its rbd driver that diskit takes.
pub const KEYS: &[&str] = &[
    "filename",
    "pool",
    "namespace",
    "image",
    "snapshot",
    "conf",
    "user",
    "key-secret",
];

/// The keys of `serve rbd`.
pub const PLUGIN_KEYS: &[&str] = &["image", "snap", "conf", "id"];

/// The image a node names: by `filename` (an `rbd:` name) or by keys.
fn name_of(node: &Spec) -> Result<RbdName> {
    let mut name = match node.get("filename") {
        Some(f) => RbdName::parse(f)?,
        None => {
            let need = |k: &str| {
                node.get(k)
                    .map(str::to_string)
                    .ok_or_else(|| Error::invalid(format!("Parameter '{k}' is missing")))
            };
            RbdName {
                pool: need("pool")?,
                image: need("image")?,
                namespace: node.get("namespace").map(str::to_string),
                snapshot: node.get("snapshot").map(str::to_string),
                conf: node.get("conf").map(str::to_string),
                user: node.get("user").map(str::to_string),
                options: Vec::new(),
            }
        }
    };
    if let Some(id) = node.get("key-secret") {
        // QEMU hands librados the secret's bytes in base64 as `key`.
        let secret = diskit_formats::crypto::secret::Secrets::global().get(id)?;
        let key = base64::engine::general_purpose::STANDARD.encode(secret.bytes());
        name.options.push(("key".into(), key));
    }
    Ok(name)
}

/// Opens the image a node names.
pub fn open(node: &Spec, mode: StorageOptions) -> Result<StorageRef> {
    let mut name = name_of(node)?;
    if mode.writable
        && let Some(made) = MADE.take(&name.canonical())
    {
        return Ok(made);
    }
    if mode.direct {
        // As QEMU: no librbd cache with cache.direct (`-t none`), whatever
        // the configuration says.
        name.options.push(("rbd_cache".into(), "false".into()));
    }
    Ok(Arc::new(RbdImage::open(&name, mode.writable)?))
}

/// Images made and not yet opened: the open for the copy takes the
/// creation's image and its cluster connection.
static MADE: Waiting<Arc<RbdImage>> = Waiting::new();

/// Makes the image `name` (an `rbd:` name), empty (it grows as written:
/// the size to come is no matter).
pub fn create(name: &str, _size_hint: u64) -> Result<StorageRef> {
    let n = RbdName::parse(name)?;
    let image = Arc::new(diskit_rbd::create(&n, 0)?);
    MADE.keep(n.canonical(), image.clone());
    Ok(image)
}

/// Removes the image `name` (a failed creation's undo), closed first if
/// it waits for an open.
pub fn remove(name: &str) -> Result<()> {
    let n = RbdName::parse(name)?;
    drop(MADE.take(&n.canonical()));
    diskit_rbd::remove(&n)
}

/// Closes the image `name` if no open took it (`create` alone): it is
/// there as soon as it is made.
pub fn finish(name: &str) -> Result<()> {
    match MADE.take(&RbdName::parse(name)?.canonical()) {
        Some(image) => diskit_core::BlockDevice::close(&*image),
        None => Ok(()),
    }
}

/// `serve rbd POOL[/NAMESPACE]/IMAGE [snap=SNAP] [conf=FILE] [id=USER]`.
pub fn open_plugin(kv: &PluginArgs, readonly: bool) -> Result<DeviceRef> {
    let spec = &kv["image"];
    let (pool, rest) = spec
        .split_once('/')
        .ok_or_else(|| Error::invalid(format!("rbd: image={spec}: expected POOL/IMAGE")))?;
    let (namespace, image) = match rest.split_once('/') {
        Some((ns, image)) => (Some(ns.to_string()), image),
        None => (None, rest),
    };
    let name = RbdName {
        pool: pool.to_string(),
        namespace,
        image: image.to_string(),
        snapshot: kv.get("snap").cloned(),
        conf: kv.get("conf").cloned(),
        user: kv.get("id").cloned(),
        options: Vec::new(),
    };
    Ok(Arc::new(RbdImage::open(&name, !readonly)?))
}
