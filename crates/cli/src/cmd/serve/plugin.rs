//! Plugins of `diskit serve`, nbdkit style: a name, then arguments that are
//! `key=value` pairs or bare values for the plugin's "magic" key.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::util::{CliError, open, parse_format};
use diskit_backends::{FileDevice, FileOptions, MemoryDevice, NullDevice, PatternDevice};
use diskit_core::DeviceRef;
use diskit_core::size::parse_size;
use diskit_open::{Image, OpenOptions};

/// What a plugin opened: the device to export, and the image to close
/// (write back its metadata) when the server stops.
pub struct Opened {
    /// The device to export.
    pub device: DeviceRef,
    /// The image behind it, for `image`.
    pub image: Option<Image>,
}

/// Parsed `key=value` arguments of a plugin.
pub type PluginArgs = BTreeMap<String, String>;

/// Joins the values of a key given more than once (a NUL: no command-line
/// argument holds one).
pub const LIST_SEPARATOR: char = '\0';

/// A plugin: one row of [`PLUGINS`].
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
    /// One line of help.
    pub help: &'static str,
    /// Opens the device (read-only when the flag says so).
    pub open: fn(&PluginArgs, bool) -> Result<Opened, CliError>,
}

/// The plugins: a new one is a row here.
pub const PLUGINS: &[Plugin] = &[
    Plugin {
        name: "file",
        magic: "file",
        magic_required: true,
        keys: &["file"],
        lists: &[],
        help: "a file or block device (file=PATH)",
        open: open_file,
    },
    Plugin {
        name: "memory",
        magic: "size",
        magic_required: true,
        keys: &["size"],
        lists: &[],
        help: "a sparse RAM disk (size=SIZE)",
        open: |kv, _| {
            plain(Arc::new(MemoryDevice::new(size_arg(
                "memory",
                &kv["size"],
            )?)))
        },
    },
    Plugin {
        name: "null",
        magic: "size",
        magic_required: false,
        keys: &["size"],
        lists: &[],
        help: "reads zeros, discards writes (size=SIZE, default 0 as in nbdkit)",
        open: |kv, _| {
            let size = kv.get("size").map_or(Ok(0), |s| size_arg("null", s))?;
            plain(Arc::new(NullDevice::new(size)))
        },
    },
    Plugin {
        name: "pattern",
        magic: "size",
        magic_required: true,
        keys: &["size"],
        lists: &[],
        help: "read-only test data: each 8-byte word holds its offset (size=SIZE)",
        open: |kv, _| {
            plain(Arc::new(PatternDevice::new(size_arg(
                "pattern",
                &kv["size"],
            )?)))
        },
    },
    Plugin {
        name: "nbd",
        magic: "uri",
        magic_required: false,
        keys: super::nbd_plugin::KEYS,
        lists: &["arg"],
        help: "proxies another NBD server, as nbdkit's nbd plugin \
               ([uri=]NBD_URI | socket=PATH | hostname=HOST [port=PORT] | \
               command=PROGRAM [arg=ARG]... | socket-fd=FD; [export=NAME] \
               [retry=N] [shared=BOOL] [tls=off|require] [tls-certificates=DIR] \
               [tls-verify=BOOL] [tls-username=NAME] [tls-psk=FILE])",
        open: super::nbd_plugin::open,
    },
    Plugin {
        name: "http",
        magic: "url",
        magic_required: true,
        keys: diskit_http::PLUGIN_KEYS,
        lists: &["header"],
        help: "an http:// or https:// URL, read-only, by range requests over a \
               pool of connections (url=URL [cainfo=FILE] [capath=DIR] [sslverify=BOOL] \
               [user=NAME] [password=PASSWORD|+FILE] [header='NAME: VALUE']... \
               [cookie=C|+FILE] [user-agent=UA] [timeout=SECS] [followlocation=BOOL] \
               [connections=N] [retries=N])",
        open: open_http,
    },
    Plugin {
        name: "curl",
        magic: "url",
        magic_required: true,
        keys: diskit_http::PLUGIN_KEYS,
        lists: &["header"],
        help: "the http plugin under nbdkit's name for it",
        open: open_http,
    },
    Plugin {
        name: "image",
        magic: "file",
        magic_required: true,
        keys: &["file", "format", "l2-cache-size", "cache"],
        lists: &[],
        help: "a disk image of any format diskit reads, with its backing chain \
               (file=NAME: a path, a protocol URI or json:{...} [format=FORMAT] \
               [l2-cache-size=SIZE: qcow2 L2 tables cached, as QEMU's] \
               [cache=none|writeback|unsafe: as qemu-nbd's --cache; none bypasses \
               the page cache (O_DIRECT) for the image and its backing chain])",
        open: open_image_plugin,
    },
];

fn plain(device: DeviceRef) -> Result<Opened, CliError> {
    Ok(Opened {
        device,
        image: None,
    })
}

fn open_file(kv: &PluginArgs, readonly: bool) -> Result<Opened, CliError> {
    let path = PathBuf::from(&kv["file"]);
    // nbdkit's file plugin resolves the name first, with this message.
    std::fs::canonicalize(&path).map_err(|e| {
        CliError::new(format!(
            "realpath: {}: {}",
            path.display(),
            crate::util::strerror(&e)
        ))
    })?;
    let opts = FileOptions {
        writable: !readonly,
        ..FileOptions::default()
    };
    let fail = |e: diskit_core::Error| CliError::new(format!("file: {}: {e}", path.display()));
    let f = FileDevice::open(&path, opts).map_err(fail)?;
    if !readonly {
        // A file served writable is written: QEMU's locks say so, and a
        // file another process keeps from writers is refused.
        let (perm, unshare) = diskit_core::storage::lock::for_image(true, false);
        diskit_core::Storage::lock_image(&f, perm, unshare).map_err(fail)?;
    }
    plain(Arc::new(f))
}

fn open_http(kv: &PluginArgs, _readonly: bool) -> Result<Opened, CliError> {
    let mut opts = diskit_http::HttpOptions::default();
    for (k, v) in kv.iter().filter(|(k, _)| *k != "url") {
        for value in v.split(LIST_SEPARATOR) {
            opts.set(k, value)
                .map_err(|e| CliError::new(e.to_string()))?;
        }
    }
    let dev = diskit_http::HttpDevice::open(&kv["url"], &opts)
        .map_err(|e| CliError::new(e.to_string()))?;
    plain(Arc::new(dev))
}

fn open_image_plugin(kv: &PluginArgs, readonly: bool) -> Result<Opened, CliError> {
    let path = PathBuf::from(&kv["file"]);
    let format = parse_format(kv.get("format").map(String::as_str))?;
    let l2_cache_size = match kv.get("l2-cache-size") {
        Some(v) => Some(size_arg("image", v)?),
        None => None,
    };
    // qemu-nbd's --cache modes that mean something here: the page cache
    // or not, and flushes kept or dropped.
    let (direct, no_flush) = match kv.get("cache").map(String::as_str) {
        None | Some("writeback") => (false, false),
        Some("none") => (true, false),
        Some("unsafe") => (false, true),
        Some(other) => {
            return Err(CliError::new(format!(
                "image: cache={other}: expected none, writeback or unsafe"
            )));
        }
    };
    let opts = OpenOptions {
        writable: !readonly,
        l2_cache_size,
        direct,
        no_flush,
        ..OpenOptions::default()
    };
    let image = open(&path, format, opts)?;
    Ok(Opened {
        device: image.device.clone(),
        image: Some(image),
    })
}

/// Whether `s` is a key as nbdkit defines them: a letter, then letters,
/// digits, '.', '_' or '-'.
pub fn is_key(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The plugin's row, or an error listing the plugins.
pub fn find(plugin: &str) -> Result<&'static Plugin, CliError> {
    PLUGINS.iter().find(|p| p.name == plugin).ok_or_else(|| {
        let names: Vec<&str> = PLUGINS.iter().map(|p| p.name).collect();
        CliError::new(format!(
            "unknown plugin '{plugin}' (plugins: {})",
            names.join(", ")
        ))
    })
}

/// Every key the plugin takes.
pub fn keys(plugin: &str) -> Result<&'static [&'static str], CliError> {
    Ok(find(plugin)?.keys)
}

/// Sorts a plugin's arguments into keys, bare values going to its magic key.
pub fn parse_args(plugin: &str, args: &[String]) -> Result<PluginArgs, CliError> {
    let Plugin {
        magic,
        magic_required,
        keys,
        lists,
        ..
    } = find(plugin)?;
    let mut out = BTreeMap::new();
    for a in args {
        let (k, v) = match a.split_once('=') {
            Some((k, v)) if is_key(k) => (k.to_string(), v.to_string()),
            _ => (magic.to_string(), a.clone()),
        };
        if !keys.contains(&k.as_str()) {
            return Err(CliError::new(format!(
                "{plugin}: unknown parameter '{k}' (parameters: {})",
                keys.join(", ")
            )));
        }
        if lists.contains(&k.as_str()) {
            let all = out.entry(k).or_insert_with(String::new);
            if !all.is_empty() {
                all.push(LIST_SEPARATOR);
            }
            all.push_str(&v);
            continue;
        }
        if out.insert(k.clone(), v).is_some() {
            return Err(CliError::new(format!(
                "{plugin}: parameter '{k}' given twice"
            )));
        }
    }
    if *magic_required && !out.contains_key(*magic) {
        return Err(CliError::new(format!(
            "{plugin}: missing parameter '{magic}'"
        )));
    }
    Ok(out)
}

fn size_arg(plugin: &str, v: &str) -> Result<u64, CliError> {
    parse_size(v).map_err(|_| CliError::new(format!("{plugin}: invalid size '{v}'")))
}

/// Opens the device a plugin describes.
pub fn open_plugin(plugin: &str, args: &[String], readonly: bool) -> Result<Opened, CliError> {
    let kv = parse_args(plugin, args)?;
    (find(plugin)?.open)(&kv, readonly)
}

/// The plugin list for --help.
pub fn help() -> String {
    let mut s = String::from("Plugins:\n");
    for p in PLUGINS {
        s.push_str(&format!("  {:<8} {}\n", p.name, p.help));
    }
    let formats: Vec<&str> = diskit_open::Format::all()
        .filter(|f| f.driver().supported())
        .map(|f| f.name())
        .collect();
    s.push_str(&format!("Image formats: {}\n", formats.join(", ")));
    s
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
        let kv = parse_args("image", &args(&["d.qcow2", "l2-cache-size=1M"])).unwrap();
        assert_eq!(kv["l2-cache-size"], "1M");
        assert!(open_plugin("image", &args(&["d.qcow2", "l2-cache-size=lots"]), true).is_err());
    }
}
