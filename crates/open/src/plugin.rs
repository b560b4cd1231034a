//! nbdkit's face of the sources: a source is served by `diskit serve
//! NAME ARGS` (and named by nbdkit's introspection) through its row's
//! [`Plugin`], with nbdkit's keys; the `image` plugin opens any image
//! through the opener. Arguments are `key=value` pairs or bare values for
//! the plugin's "magic" key.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use diskit_backends::{FileDevice, MemoryDevice, NullDevice, PatternDevice};
use diskit_core::StorageOptions;
use diskit_core::size::parse_size;
use diskit_core::{DeviceRef, Error, Result};

use diskit_nbd::server::ExportBitmap;

use crate::protocol::PROTOCOLS;
use crate::{Format, Image, OpenOptions};

/// Parsed `key=value` arguments of a plugin.
pub type PluginArgs = BTreeMap<String, String>;

/// A plugin's `key=value` arguments in command-line order.
pub type OrderedArgs = [(String, String)];

/// Joins the values of a key given more than once (a NUL: no command-line
/// argument holds one).
pub const LIST_SEPARATOR: char = '\0';

/// How a plugin opens what it serves.
#[derive(Debug, Clone, Copy)]
pub enum PluginOpen {
    /// A source: its storage (read-only when the flag says so).
    Source(fn(&PluginArgs, bool) -> Result<DeviceRef>),
    /// An image of any format over any source, with its backing chain.
    Image,
    /// A source whose parameters apply to those that follow them (the
    /// partitioning plugin's `alignment=` to the next `file=`s): the
    /// `key=value` pairs in command-line order, bare values under the
    /// magic key.
    InOrder(fn(&OrderedArgs, bool) -> Result<DeviceRef>),
}

/// One plugin: the name nbdkit's command line gives it and its keys.
#[derive(Debug)]
pub struct Plugin {
    /// Its name on the command line.
    pub name: &'static str,
    /// The key a bare value is given to.
    pub magic: &'static str,
    /// Whether the magic key must be given.
    pub magic_required: bool,
    /// Every key it takes.
    pub keys: &'static [&'static str],
    /// The keys that may be given more than once: their values are kept in
    /// order, joined by [`LIST_SEPARATOR`].
    pub lists: &'static [&'static str],
    /// Other spellings the plugin takes for some of its keys, `(spelling,
    /// key)`: the arguments hold the key.
    pub aliases: &'static [(&'static str, &'static str)],
    /// Whether keys beyond `keys` are taken too, as the plugin's
    /// variables (the data plugin's `$VAR`s, tmpdisk's shell variables).
    pub variables: bool,
    /// One line of help.
    pub help: &'static str,
    /// Opens it.
    pub open: PluginOpen,
}

impl Plugin {
    /// The key `spelling` names, if the plugin takes it: one of its keys,
    /// another spelling of one ([`aliases`](Plugin::aliases)), or, for a
    /// plugin that takes [`variables`](Plugin::variables), any other.
    pub fn key<'a>(&self, spelling: &'a str) -> Option<&'a str> {
        if let Some(k) = self.keys.iter().copied().find(|k| *k == spelling) {
            return Some(k);
        }
        self.aliases
            .iter()
            .find(|(other, _)| *other == spelling)
            .map(|(_, key)| *key)
            .or(self.variables.then_some(spelling))
    }

    /// Whether the plugin takes `spelling` as a key.
    pub fn takes(&self, spelling: &str) -> bool {
        self.key(spelling).is_some()
    }

    /// A plugin whose one key, `size=` (the magic key, required), is the
    /// size of the device it makes.
    pub const fn sized(
        name: &'static str,
        help: &'static str,
        open: fn(&PluginArgs, bool) -> Result<DeviceRef>,
    ) -> Plugin {
        Plugin {
            name,
            magic: "size",
            magic_required: true,
            keys: &["size"],
            lists: &[],
            aliases: &[],
            variables: false,
            help,
            open: PluginOpen::Source(open),
        }
    }
}

/// What a plugin opened: the device to serve, the image behind it, if
/// any, to close (write back its metadata) when the server stops, and
/// what the export offers besides the bytes.
pub struct Opened {
    /// The device to serve.
    pub device: DeviceRef,
    /// The image behind it, for `image`.
    pub image: Option<Image>,
    /// The image's dirty bitmaps to serve (`bitmap=NAME`), describing
    /// `device`'s offsets.
    pub bitmaps: Vec<Arc<ExportBitmap>>,
    /// Whether `qemu:allocation-depth` is offered (`allocation-depth=`;
    /// offered unless told otherwise).
    pub allocation_depth: bool,
}

impl Opened {
    /// A device with nothing more to serve.
    fn device(device: DeviceRef) -> Opened {
        Opened {
            device,
            image: None,
            bitmaps: Vec::new(),
            allocation_depth: true,
        }
    }
}

/// The `image` plugin: every format, over every source the opener knows.
pub const IMAGE: Plugin = Plugin {
    name: "image",
    magic: "file",
    magic_required: true,
    keys: &[
        "file",
        "format",
        "l2-cache-size",
        "cache",
        "bitmap",
        "allocation-depth",
    ],
    lists: &["bitmap"],
    aliases: &[],
    variables: false,
    help: "a disk image of any format diskit reads, with its backing chain \
           (file=NAME: a path, a protocol URI or json:{...} [format=FORMAT] \
           [l2-cache-size=SIZE: qcow2 L2 tables cached, as QEMU's] \
           [cache=none|writeback|unsafe: as qemu-nbd's --cache; none bypasses \
           the page cache (O_DIRECT) for the image and its backing chain] \
           [bitmap=NAME: serve the persistent dirty bitmap NAME as the \
           qemu:dirty-bitmap:NAME context, as qemu-nbd -B; repeatable] \
           [allocation-depth=BOOL: offer qemu:allocation-depth (default \
           true; qemu-nbd offers it only with -A)])",
    open: PluginOpen::Image,
};

/// Every plugin: the sources' faces in the table's order, then `image`.
pub fn all() -> impl Iterator<Item = &'static Plugin> {
    PROTOCOLS
        .iter()
        .flat_map(|p| p.plugins.iter())
        .chain(std::iter::once(&IMAGE))
}

/// The plugin called `name`, or an error listing the plugins.
pub fn find(name: &str) -> Result<&'static Plugin> {
    all().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<&str> = all().map(|p| p.name).collect();
        Error::invalid(format!(
            "unknown plugin '{name}' (plugins: {})",
            names.join(", ")
        ))
    })
}

/// Whether `s` is a key as nbdkit defines them: a letter, then letters,
/// digits, '.', '_' or '-'.
pub fn is_key(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

pub use diskit_core::params::boolean;

/// Sorts a plugin's arguments into keys, bare values going to its magic key.
pub fn parse_args(name: &str, args: &[String]) -> Result<PluginArgs> {
    let plugin = find(name)?;
    let mut out = BTreeMap::new();
    for (k, v) in in_order(plugin, args)? {
        if plugin.lists.contains(&k.as_str()) {
            let all = out.entry(k).or_insert_with(String::new);
            if !all.is_empty() {
                all.push(LIST_SEPARATOR);
            }
            all.push_str(&v);
            continue;
        }
        if out.insert(k.clone(), v).is_some() {
            return Err(Error::invalid(format!(
                "{name}: parameter '{k}' given twice"
            )));
        }
    }
    Ok(out)
}

/// A plugin's arguments as `(key, value)` pairs in command-line order,
/// bare values under its magic key; each key checked, and the magic key's
/// presence if it is required.
fn in_order(plugin: &Plugin, args: &[String]) -> Result<Vec<(String, String)>> {
    let name = plugin.name;
    if plugin.keys.is_empty() && !plugin.variables && !args.is_empty() {
        return Err(Error::invalid(format!(
            "{name}: this plugin does not need command line configuration"
        )));
    }
    let mut out = Vec::with_capacity(args.len());
    for a in args {
        let (k, v) = match a.split_once('=') {
            Some((k, v)) if is_key(k) => (k.to_string(), v.to_string()),
            _ => (plugin.magic.to_string(), a.clone()),
        };
        let Some(key) = plugin.key(&k) else {
            return Err(Error::invalid(format!(
                "{name}: unknown parameter '{k}' (parameters: {})",
                plugin.keys.join(", ")
            )));
        };
        out.push((key.to_string(), v));
    }
    if plugin.magic_required && !out.iter().any(|(k, _)| k == plugin.magic) {
        return Err(Error::invalid(format!(
            "{name}: missing parameter '{}'",
            plugin.magic
        )));
    }
    Ok(out)
}

/// Opens what plugin `name` describes with `args`; images are opened with
/// `base` (the caller's policy: untrusted, force-share).
pub fn open_plugin(
    name: &str,
    args: &[String],
    readonly: bool,
    base: &OpenOptions,
) -> Result<Opened> {
    let plugin = find(name)?;
    match plugin.open {
        PluginOpen::Source(open) => Ok(Opened::device(open(&parse_args(name, args)?, readonly)?)),
        PluginOpen::Image => open_image_plugin(&parse_args(name, args)?, readonly, base),
        PluginOpen::InOrder(open) => Ok(Opened::device(open(&in_order(plugin, args)?, readonly)?)),
    }
}

/// Prints plugins' debug messages (a Python script's `nbdkit.debug`) on
/// standard error from now on: the server's `-v`.
pub fn set_verbose(on: bool) {
    diskit_backends::shared_plugin::set_verbose(on);
}

/// The `key=value` lines a plugin adds to `--dump-plugin` (the python
/// plugin's Python version: its library is loaded to tell).
pub fn dump_lines(name: &str) -> Result<Vec<String>> {
    match name {
        #[cfg(feature = "python")]
        "python" => crate::scripts::dump_python(),
        _ => Ok(Vec::new()),
    }
}

/// The plugin list for --help.
pub fn help() -> String {
    let mut s = String::from("Plugins:\n");
    for p in all() {
        s.push_str(&format!("  {:<8} {}\n", p.name, p.help));
    }
    let formats: Vec<&str> = Format::all()
        .filter(|f| f.driver().supported())
        .map(|f| f.name())
        .collect();
    s.push_str(&format!("Image formats: {}\n", formats.join(", ")));
    s
}

/// A size argument, with the plugin's name in the message.
pub fn size_arg(plugin: &str, v: &str) -> Result<u64> {
    parse_size(v).map_err(|_| Error::invalid(format!("{plugin}: invalid size '{v}'")))
}

/// The absolute name of `path`, or nbdkit's message when it cannot be
/// resolved (its plugins resolve file names first).
pub fn realpath(path: &Path) -> Result<std::path::PathBuf> {
    std::fs::canonicalize(path).map_err(|e| {
        let e = Error::from(e);
        Error::new(
            e.kind(),
            format!("realpath: {}: {}", path.display(), e.detail()),
        )
    })
}

/// nbdkit's file plugin: a file or block device, locked as a writer when
/// served writable.
pub fn open_file(kv: &PluginArgs, readonly: bool) -> Result<DeviceRef> {
    let path = Path::new(&kv["file"]);
    realpath(path)?;
    let f = serve_file(path, readonly)
        .map_err(|e| Error::new(e.kind(), format!("file: {}: {e}", path.display())))?;
    Ok(Arc::new(f))
}

/// A file a plugin serves (file, split, partitioning): opened for writing
/// unless `readonly`, and then locked as a writer with QEMU's locks, so
/// that a file another process keeps from writers (a running VM's image)
/// is refused.
pub(crate) fn serve_file(path: &Path, readonly: bool) -> Result<FileDevice> {
    let opts = StorageOptions {
        writable: !readonly,
        ..StorageOptions::default()
    };
    let f = FileDevice::open(path, opts)?;
    if !readonly {
        let (perm, unshare) = diskit_core::storage::lock::for_image(true, false);
        diskit_core::Storage::lock_image(&f, perm, unshare)?;
    }
    Ok(f)
}

/// nbdkit's memory plugin: a sparse RAM disk.
pub fn open_memory(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    Ok(Arc::new(MemoryDevice::new(size_arg(
        "memory",
        &kv["size"],
    )?)))
}

/// nbdkit's null plugin: reads zeros, discards writes (size 0 by default).
pub fn open_null(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    let size = kv.get("size").map_or(Ok(0), |s| size_arg("null", s))?;
    Ok(Arc::new(NullDevice::new(size)))
}

/// nbdkit's pattern plugin: each 8-byte word holds its offset.
pub fn open_pattern(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    Ok(Arc::new(PatternDevice::new(size_arg(
        "pattern",
        &kv["size"],
    )?)))
}

/// nbdkit's curl plugin (as `http` and `curl`): a URL by range requests.
pub fn open_http(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    let mut opts = diskit_http::HttpOptions::default();
    for (k, v) in kv.iter().filter(|(k, _)| *k != "url") {
        for value in v.split(LIST_SEPARATOR) {
            opts.set(k, value)?;
        }
    }
    Ok(Arc::new(diskit_http::HttpDevice::open(&kv["url"], &opts)?))
}

fn open_image_plugin(kv: &PluginArgs, readonly: bool, base: &OpenOptions) -> Result<Opened> {
    let name = &kv["file"];
    let format = kv.get("format").map(|f| Format::from_name(f)).transpose()?;
    let l2_cache_size = match kv.get("l2-cache-size") {
        Some(v) => Some(size_arg("image", v)?),
        None => None,
    };
    // qemu-nbd's --cache modes that mean something here: the page cache
    // or not, and flushes kept or dropped.
    // (qemu-nbd's --cache takes these three.)
    let cache = match kv.get("cache").map(String::as_str) {
        None => Some(diskit_core::CacheMode::default()),
        Some(m) => ["none", "writeback", "unsafe"]
            .contains(&m)
            .then(|| diskit_core::CacheMode::parse(m))
            .flatten(),
    }
    .ok_or_else(|| {
        Error::invalid(format!(
            "image: cache={}: expected none, writeback or unsafe",
            kv["cache"]
        ))
    })?;
    let (direct, no_flush) = (cache.direct, cache.no_flush);
    let opts = OpenOptions {
        writable: !readonly,
        l2_cache_size,
        direct,
        no_flush,
        ..base.clone()
    };
    let allocation_depth = kv
        .get("allocation-depth")
        .map_or(Ok(true), |v| boolean("image", "allocation-depth", v))?;
    let image = crate::open_image(name, format, opts)
        .map_err(|e| Error::new(e.kind(), format!("Could not open '{name}': {e}")))?;
    let names: Vec<String> = kv
        .get("bitmap")
        .map(|v| v.split(LIST_SEPARATOR).map(str::to_string).collect())
        .unwrap_or_default();
    let bitmaps = match crate::export_bitmaps::for_export(&image, &names) {
        Ok(b) => b,
        Err(e) => {
            // Best effort: the bitmap's error is the one to report.
            let _ = image.close();
            return Err(e);
        }
    };
    Ok(Opened {
        device: image.device.clone(),
        image: Some(image),
        bitmaps,
        allocation_depth,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn magic_keys_and_errors() {
        let kv = parse_args("image", &args(&["disk.qcow2", "format=qcow2"])).unwrap();
        assert_eq!(kv["file"], "disk.qcow2");
        assert_eq!(kv["format"], "qcow2");
        let kv = parse_args("file", &args(&["/tmp/a=b"])).unwrap();
        assert_eq!(kv["file"], "/tmp/a=b", "not a key: bare value");
        assert_eq!(
            parse_args("memory", &args(&["size=1M"])).unwrap()["size"],
            "1M"
        );
        assert!(parse_args("memory", &args(&[])).is_err());
        assert!(parse_args("memory", &args(&["1M", "2M"])).is_err());
        assert!(parse_args("memory", &args(&["colour=red"])).is_err());
        assert!(parse_args("nope", &args(&[])).is_err());
        let kv = parse_args("image", &args(&["d.qcow2", "bitmap=a", "bitmap=b"])).unwrap();
        assert_eq!(kv["bitmap"], format!("a{LIST_SEPARATOR}b"), "repeatable");
        assert!(
            open_plugin(
                "image",
                &args(&["d.qcow2", "allocation-depth=maybe"]),
                true,
                &OpenOptions::default()
            )
            .is_err()
        );
        let kv = parse_args("image", &args(&["d.qcow2", "l2-cache-size=1M"])).unwrap();
        assert_eq!(kv["l2-cache-size"], "1M");
        let base = OpenOptions::default();
        assert!(
            open_plugin(
                "image",
                &args(&["d.qcow2", "l2-cache-size=lots"]),
                true,
                &base
            )
            .is_err()
        );
    }

    #[test]
    fn other_spellings_of_a_key_are_the_key() {
        let kv = parse_args(
            "s3",
            &args(&["bucket=b", "key=k", "access_key=A", "secret-key=S"]),
        )
        .unwrap();
        assert_eq!(kv["access-key"], "A");
        assert_eq!(kv["secret-key"], "S");
        assert!(!kv.contains_key("access_key"));
        // One key under both spellings is given twice.
        let twice = args(&["k", "endpoint-url=http://a", "endpoint_url=http://b"]);
        assert!(parse_args("s3", &twice).is_err());
        // Only where the plugin takes them.
        assert!(parse_args("memory", &args(&["1M", "access_key=A"])).is_err());
    }

    #[test]
    fn every_plugin_is_found_once_by_its_name() {
        let names: Vec<&str> = all().map(|p| p.name).collect();
        for n in [
            "file",
            "memory",
            "null",
            "pattern",
            "zero",
            "ones",
            "full",
            "random",
            "sparse-random",
            "data",
            "split",
            "partitioning",
            "tmpdisk",
            "sh",
            "eval",
            "ssh",
            #[cfg(feature = "python")]
            "python",
            "nbd",
            "http",
            "curl",
            "rbd",
            "s3",
            "image",
        ] {
            assert_eq!(
                names.iter().filter(|m| **m == n).count(),
                1,
                "{n}: {names:?}"
            );
        }
    }
}
