//! nbdkit's synthetic-disk plugins, their parameters read as nbdkit reads
//! them: `zero`, `ones`, `full`, `random` and `sparse-random`. The devices
//! are diskit-backends'.

use std::sync::Arc;

use diskit_backends::{
    FullDevice, NullDevice, RandomDevice, SparseRandomDevice, SparseRandomLayout, ZeroDevice,
};
use diskit_core::params::{boolean, nbdkit_unsigned};
use diskit_core::{DeviceRef, Error, Result};

use crate::plugin::{PluginArgs, size_arg};

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
