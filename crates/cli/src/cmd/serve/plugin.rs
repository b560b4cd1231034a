//! Plugins of `diskit serve`, nbdkit style: a name, then arguments that are
//! `key=value` pairs or bare values for the plugin's "magic" key.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::util::{CliError, open, parse_format};
use diskit_backends::{FileDevice, FileOptions, MemoryDevice, NullDevice, PatternDevice};
use diskit_core::DeviceRef;
use diskit_core::size::parse_size;
use diskit_formats::{Image, OpenOptions};

/// What a plugin opened: the device to export, and the image to close
/// (write back its metadata) when the server stops.
pub struct Opened {
    /// The device to export.
    pub device: DeviceRef,
    /// The image behind it, for `image`.
    pub image: Option<Image>,
}

/// The plugins: name, magic key, every key accepted, one-line help.
const PLUGINS: &[(&str, &str, &[&str], &str)] = &[
    (
        "file",
        "file",
        &["file"],
        "a file or block device (file=PATH)",
    ),
    ("memory", "size", &["size"], "a sparse RAM disk (size=SIZE)"),
    (
        "null",
        "size",
        &["size"],
        "reads zeros, discards writes (size=SIZE)",
    ),
    (
        "pattern",
        "size",
        &["size"],
        "read-only test data: each 8-byte word holds its offset (size=SIZE)",
    ),
    (
        "image",
        "file",
        &["file", "format", "l2-cache-size"],
        "a disk image of any format diskit reads, with its backing chain \
         (file=PATH [format=raw|qcow2] [l2-cache-size=SIZE: qcow2 L2 tables cached, as QEMU's])",
    ),
];

/// Whether `s` is a key as nbdkit defines them: a letter, then letters,
/// digits, '.', '_' or '-'.
pub fn is_key(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The plugin's entry, or an error listing the plugins.
fn find(
    plugin: &str,
) -> Result<
    &'static (
        &'static str,
        &'static str,
        &'static [&'static str],
        &'static str,
    ),
    CliError,
> {
    PLUGINS.iter().find(|p| p.0 == plugin).ok_or_else(|| {
        let names: Vec<&str> = PLUGINS.iter().map(|p| p.0).collect();
        CliError::new(format!(
            "unknown plugin '{plugin}' (plugins: {})",
            names.join(", ")
        ))
    })
}

/// Every key the plugin takes.
pub fn keys(plugin: &str) -> Result<&'static [&'static str], CliError> {
    Ok(find(plugin)?.2)
}

/// Sorts a plugin's arguments into keys, bare values going to its magic key.
pub fn parse_args(plugin: &str, args: &[String]) -> Result<BTreeMap<String, String>, CliError> {
    let &(_, magic, keys, _) = find(plugin)?;
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
        if out.insert(k.clone(), v).is_some() {
            return Err(CliError::new(format!(
                "{plugin}: parameter '{k}' given twice"
            )));
        }
    }
    if !out.contains_key(magic) {
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
    let plain = |device: DeviceRef| Opened {
        device,
        image: None,
    };
    Ok(match plugin {
        "file" => {
            let path = PathBuf::from(&kv["file"]);
            let opts = FileOptions {
                writable: !readonly,
                ..FileOptions::default()
            };
            let f = FileDevice::open(&path, opts)
                .map_err(|e| CliError::new(format!("file: {}: {e}", path.display())))?;
            plain(Arc::new(f))
        }
        "memory" => plain(Arc::new(MemoryDevice::new(size_arg(plugin, &kv["size"])?))),
        "null" => plain(Arc::new(NullDevice::new(size_arg(plugin, &kv["size"])?))),
        "pattern" => plain(Arc::new(PatternDevice::new(size_arg(plugin, &kv["size"])?))),
        "image" => {
            let path = PathBuf::from(&kv["file"]);
            let format = parse_format(kv.get("format").map(String::as_str))?;
            let l2_cache_size = match kv.get("l2-cache-size") {
                Some(v) => Some(size_arg(plugin, v)?),
                None => None,
            };
            let opts = OpenOptions {
                writable: !readonly,
                l2_cache_size,
                ..OpenOptions::default()
            };
            let image = open(&path, format, opts)?;
            Opened {
                device: image.device.clone(),
                image: Some(image),
            }
        }
        _ => unreachable!("parse_args knows every plugin"),
    })
}

/// The plugin list for --help.
pub fn help() -> String {
    let mut s = String::from("Plugins:\n");
    for (name, _, _, text) in PLUGINS {
        s.push_str(&format!("  {name:<8} {text}\n"));
    }
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
