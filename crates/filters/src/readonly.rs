//! The readonly filter (nbdkit-readonly-filter, nbdkit 1.38): makes the
//! device read-only, always or while a file exists.
//!
//! Without `readonly-file=` the export is read-only, as with `-r`. With
//! `readonly-file=PATH` it stays writable, but while PATH exists every
//! write, write-zeroes and trim fails with EPERM ("pwrite operation
//! rejected by readonly filter"); flushes still pass, for writes made
//! before.

use std::path::PathBuf;

use diskit_core::{BlockDevice, Capabilities, DeviceRef, Error, ErrorKind, Result};

use crate::call::{Call, Op};
use crate::gate::{Gate, Gated};

use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["readonly-file"];

/// The filter: the file whose presence makes it read-only, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readonly {
    /// `readonly-file=`.
    pub file: Option<PathBuf>,
}

impl Configure for Readonly {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "readonly-file" if self.file.is_some() => Err(Error::invalid(
                "readonly: readonly-file parameter appears multiple times",
            )),
            "readonly-file" => {
                self.file = Some(PathBuf::from(value));
                Ok(())
            }
            _ => Err(unknown("readonly", key)),
        }
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Gated(self.clone()), next))
    }
}

impl Readonly {
    /// Refuses `op` while read-only.
    fn check(&self, op: &str) -> Result<()> {
        match &self.file {
            Some(f) if !f.exists() => Ok(()),
            _ => Err(Error::new(
                ErrorKind::PermissionDenied,
                format!("{op} operation rejected by readonly filter"),
            )),
        }
    }
}

impl Gate for Readonly {
    const NAME: &'static str = "readonly";

    fn before(&self, call: &Call) -> Result<()> {
        match call.op {
            Op::Write => self.check("pwrite"),
            Op::Zero => self.check("zero"),
            Op::Trim => self.check("trim"),
            _ => Ok(()),
        }
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        match self.file {
            None => next.capabilities().read_only(),
            Some(_) => next.capabilities(),
        }
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::{Filtered, WriteFlags, ZeroFlags};
    use std::sync::Arc;

    #[test]
    fn the_file_switches_writes_off_and_on() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("ro");
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let d = Filtered::new(
            Gated(Readonly {
                file: Some(flag.clone()),
            }),
            mem.clone(),
        );
        assert!(d.capabilities().can_write);
        d.write_at(&[1], 0, WriteFlags::NONE).unwrap();
        std::fs::write(&flag, "").unwrap();
        let e = d.write_at(&[1], 0, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("rejected by readonly filter"));
        assert!(d.trim(0, 512, WriteFlags::NONE).is_err());
        d.flush().unwrap();
        std::fs::remove_file(&flag).unwrap();
        d.write_zeroes(0, 512, ZeroFlags::default()).unwrap();
        let always = Filtered::new(Gated(Readonly::default()), mem);
        assert!(!always.capabilities().can_write);
    }
}
