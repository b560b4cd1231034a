//! nbdkit's synthetic-disk plugins, their parameters read as nbdkit reads
//! them: `zero`, `ones`, `full`, `random`, `sparse-random`, `data`,
//! `split`, `partitioning` and `tmpdisk`. The devices are diskit-backends'.

use std::sync::Arc;

use diskit_backends::data::{DataDevice, Source};
use diskit_backends::partitioning::{
    DEFAULT_MBR_ID, DEFAULT_TYPE_GUID, MAX_ALIGNMENT, Partition, PartitioningDevice, SECTOR,
    TableType, parse_guid,
};
use diskit_backends::tmpdisk::{DEFAULT_COMMAND, TmpDisk, TmpDiskSpec};
use diskit_backends::{
    FullDevice, NullDevice, RandomDevice, SparseRandomDevice, SparseRandomLayout, SplitDevice,
    ZeroDevice,
};
use diskit_core::params::{boolean, nbdkit_unsigned};
use diskit_core::{DeviceRef, Error, Result};

use crate::plugin::{LIST_SEPARATOR, OrderedArgs, PluginArgs, realpath, size_arg};

/// A size that may be left out (0 then, as nbdkit's plugins default it).
fn size_or_zero(plugin: &str, kv: &PluginArgs) -> Result<u64> {
    kv.get("size").map_or(Ok(0), |v| size_arg(plugin, v))
}

/// `seed=`, or the time as nbdkit seeds by default.
fn seed(kv: &PluginArgs) -> Result<u32> {
    match kv.get("seed") {
        Some(v) => Ok(nbdkit_unsigned("seed", v, u32::MAX.into())? as u32),
        None => Ok(std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as u32)),
    }
}

/// nbdkit's zero plugin: a read-only device of no bytes.
pub fn open_zero(_kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    Ok(Arc::new(ZeroDevice))
}

/// nbdkit's ones plugin: `byte=` (0xff) repeated, writes dropped.
pub fn open_ones(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    let byte = match kv.get("byte") {
        Some(v) => nbdkit_unsigned("byte", v, 0xff)? as u8,
        None => 0xff,
    };
    Ok(Arc::new(NullDevice::filled(
        size_or_zero("ones", kv)?,
        byte,
    )))
}

/// nbdkit's full plugin: zeros, and ENOSPC for every write.
pub fn open_full(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    Ok(Arc::new(FullDevice::new(size_arg("full", &kv["size"])?)))
}

/// nbdkit's random plugin: random bytes fixed by `seed=`.
pub fn open_random(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    Ok(Arc::new(RandomDevice::new(
        size_or_zero("random", kv)?,
        seed(kv)?,
    )))
}

/// The number at the start of `s` as `sscanf("%lf")` reads it.
fn c_double(s: &str) -> Option<f64> {
    let t = s.trim_start();
    (1..=t.len())
        .rev()
        .filter(|&n| t.is_char_boundary(n))
        .find_map(|n| t[..n].parse::<f64>().ok())
}

/// nbdkit's sparse-random plugin: `seed=`, `percent=`, `runlength=`,
/// `random-content=`.
pub fn open_sparse_random(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    let mut layout = SparseRandomLayout::new(size_or_zero("sparse-random", kv)?, seed(kv)?);
    if let Some(v) = kv.get("percent") {
        layout.percent = c_double(v)
            .filter(|p| (0.0..=100.0).contains(p))
            .ok_or_else(|| Error::invalid(format!("cannot parse percent parameter: {v}")))?;
    }
    if let Some(v) = kv.get("runlength") {
        layout.runlength = nbdkit_unsigned("runlength", v, u64::MAX)?;
        if layout.runlength == 0 {
            return Err(Error::invalid("runlength parameter must be > 0"));
        }
    }
    if let Some(v) = kv.get("random-content") {
        layout.random_content = boolean("sparse-random", "random-content", v)?;
    }
    Ok(Arc::new(SparseRandomDevice::new(layout)))
}

/// The data plugin's own keys; any other is a variable for `$NAME`.
pub const DATA_KEYS: &[&str] = &["data", "raw", "base64", "size", "allocator"];

/// nbdkit's data plugin: a RAM disk starting with `data=` (an
/// expression), `raw=` or `base64=` bytes, `size=` long.
pub fn open_data(kv: &PluginArgs, _readonly: bool) -> Result<DeviceRef> {
    use base64::Engine as _;
    let given: Vec<&str> = ["raw", "base64", "data"]
        .into_iter()
        .filter(|k| kv.contains_key(*k))
        .collect();
    match given.len() {
        0 => {
            return Err(Error::invalid(
                "raw|base64|data parameter was not specified",
            ));
        }
        1 => {}
        _ => {
            return Err(Error::invalid(
                "raw|base64|data parameter must be specified exactly once",
            ));
        }
    }
    let has_variables = kv.keys().any(|k| !DATA_KEYS.contains(&k.as_str()));
    if given[0] != "data" && has_variables {
        return Err(Error::invalid(
            "extra parameters passed and not using data='...'",
        ));
    }
    if let Some(a) = kv.get("allocator").filter(|a| *a != "sparse") {
        return Err(Error::unsupported(format!(
            "data: allocator={a}: only the sparse allocator is available"
        )));
    }
    let size = kv.get("size").map(|v| size_arg("data", v)).transpose()?;
    let lookup = |name: &str| -> Option<String> {
        match kv.get(name).filter(|_| !DATA_KEYS.contains(&name)) {
            Some(v) => Some(v.clone()),
            None => std::env::var(name).ok(),
        }
    };
    let decoded;
    let source = match given[0] {
        "raw" => Source::Raw(kv["raw"].as_bytes()),
        "base64" => {
            decoded = base64::engine::general_purpose::STANDARD
                .decode(kv["base64"].as_bytes())
                .map_err(|_| Error::invalid("base64: Base64 decoding error."))?;
            Source::Raw(&decoded)
        }
        _ => Source::Expression(&kv["data"]),
    };
    Ok(Arc::new(DataDevice::new(source, size, &lookup)?))
}

/// A file of a split or partitioned disk, opened for writing unless
/// `readonly`; a failure is told after `label`, as nbdkit tells it.
fn open_part(path: &std::path::Path, label: &str, readonly: bool) -> Result<DeviceRef> {
    let f = crate::plugin::serve_file(path, readonly)
        .map_err(|e| Error::new(e.kind(), format!("{label}: {}", e.detail())))?;
    Ok(Arc::new(f))
}

/// nbdkit's split plugin: the `file=`s end to end.
pub fn open_split(kv: &PluginArgs, readonly: bool) -> Result<DeviceRef> {
    let files = kv["file"]
        .split(LIST_SEPARATOR)
        .map(|name| {
            let path = realpath(std::path::Path::new(name))?;
            open_part(&path, &format!("open: {}", path.display()), readonly)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(SplitDevice::new(files, !readonly)?))
}

/// nbdkit's partitioning plugin: each `file=` a partition, described by
/// the `alignment=`, `mbr-id=` and `type-guid=` given before it.
pub fn open_partitioning(args: &OrderedArgs, readonly: bool) -> Result<DeviceRef> {
    let mut alignment = MAX_ALIGNMENT;
    let mut mbr_id = DEFAULT_MBR_ID;
    let default_guid = parse_guid(DEFAULT_TYPE_GUID).expect("a valid GUID");
    let mut type_guid = default_guid;
    let mut table = None;
    let mut partitions = Vec::new();
    for (k, v) in args {
        match k.as_str() {
            "file" => {
                let device = open_part(std::path::Path::new(v), v, readonly)?;
                if device.size() == 0 {
                    return Err(Error::invalid(format!(
                        "{v}: zero length partitions are not allowed"
                    )));
                }
                partitions.push(Partition {
                    name: v.clone(),
                    device,
                    alignment,
                    mbr_id,
                    type_guid,
                });
            }
            "partition-type" => {
                table = Some(match v.to_ascii_lowercase().as_str() {
                    "mbr" | "dos" => TableType::Mbr,
                    "gpt" => TableType::Gpt,
                    _ => return Err(Error::invalid(format!("unknown partition-type: {v}"))),
                });
            }
            "alignment" => {
                let a = size_arg("partitioning", v)?;
                if !(SECTOR..=MAX_ALIGNMENT).contains(&a) {
                    return Err(Error::invalid(format!(
                        "partition alignment {a} should be >= sector size {SECTOR} and \
                         <= maximum alignment {MAX_ALIGNMENT}"
                    )));
                }
                if !a.is_multiple_of(SECTOR) {
                    return Err(Error::invalid(format!(
                        "partition alignment {a} should be a multiple of sector size {SECTOR}"
                    )));
                }
                if !a.is_power_of_two() {
                    return Err(Error::invalid(format!(
                        "partition alignment {a} should be a power of 2"
                    )));
                }
                alignment = a;
            }
            "mbr-id" if v.eq_ignore_ascii_case("default") => mbr_id = DEFAULT_MBR_ID,
            "mbr-id" => mbr_id = nbdkit_unsigned("mbr-id", v, 0xff)? as u8,
            "type-guid" if v.eq_ignore_ascii_case("default") => type_guid = default_guid,
            "type-guid" => {
                type_guid = parse_guid(v)
                    .ok_or_else(|| Error::invalid(format!("could not validate GUID: {v}")))?;
            }
            _ => return Err(Error::invalid(format!("unknown parameter '{k}'"))),
        }
    }
    Ok(Arc::new(PartitioningDevice::new(
        partitions, table, !readonly,
    )?))
}

/// tmpdisk's own keys; any other is a shell variable for the command.
pub const TMPDISK_KEYS: &[&str] = &["size", "command"];

/// nbdkit's tmpdisk plugin: a new disk for each client, made by
/// `command=` (nbdkit's mkfs script by default) with the other
/// parameters (`type=`, `label=`, ...) as shell variables.
pub fn open_tmpdisk(kv: &PluginArgs, readonly: bool) -> Result<DeviceRef> {
    if kv.contains_key("disk") {
        return Err(Error::invalid(
            "'disk' parameter cannot be set on the command line",
        ));
    }
    let spec = TmpDiskSpec {
        size: size_arg("tmpdisk", &kv["size"])?,
        command: kv
            .get("command")
            .cloned()
            .unwrap_or_else(|| DEFAULT_COMMAND.to_string()),
        variables: kv
            .iter()
            .filter(|(k, _)| !TMPDISK_KEYS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        tmpdir: std::env::var_os("TMPDIR")
            .map_or_else(|| "/var/tmp".into(), std::path::PathBuf::from),
    };
    Ok(Arc::new(TmpDisk::new(spec, readonly)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_read_as_scanf_reads_them() {
        assert_eq!(c_double("12.5"), Some(12.5));
        assert_eq!(c_double(" 7%"), Some(7.0));
        assert_eq!(c_double("x"), None);
    }
}
