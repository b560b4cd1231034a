//! The fua filter (nbdkit-fua-filter): changes how Forced Unit Access and
//! flush are offered and done.
//!
//! `fuamode=`:
//! - `none` (the default): FUA is not offered; flush stays as it is.
//! - `emulate`: FUA is offered and done here as the operation then a
//!   flush. Needs a device below that flushes.
//! - `native`: FUA is offered and passed down. Needs a device below that
//!   honours FUA.
//! - `force`: every write, zero and trim is passed down with FUA
//!   (write-through), so flush has nothing left to do and succeeds at once;
//!   FUA and flush are both offered. Needs a device below that honours FUA.
//! - `pass`: nothing changes.
//! - `discard`: FUA and flush are offered and ignored (unsafe: data may be
//!   lost on a crash; for throw-away data).
//!
//! The needs are checked when the filter is stacked on a writable device.
//! nbdkit 1.32 refuses `fuamode=none` by mistake (its parser falls through
//! to "unknown fuamode"); diskit takes it, as the manual documents it.

use diskit_core::{BlockDevice, Capabilities, Error, Filter, Result, WriteFlags, ZeroFlags};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["fuamode"];

/// How FUA and flush are offered and done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FuaMode {
    /// FUA not offered.
    #[default]
    None,
    /// FUA done as a flush after the operation.
    Emulate,
    /// FUA passed down.
    Native,
    /// FUA on every write; flush does nothing.
    Force,
    /// No change.
    Pass,
    /// FUA and flush ignored.
    Discard,
}

impl FuaMode {
    fn name(self) -> &'static str {
        match self {
            FuaMode::None => "none",
            FuaMode::Emulate => "emulate",
            FuaMode::Native => "native",
            FuaMode::Force => "force",
            FuaMode::Pass => "pass",
            FuaMode::Discard => "discard",
        }
    }
}

/// The filter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fua {
    /// `fuamode=`.
    pub mode: FuaMode,
}

impl Configure for Fua {
    /// Takes `fuamode=`.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "fuamode" => {
                let modes = [
                    FuaMode::None,
                    FuaMode::Emulate,
                    FuaMode::Native,
                    FuaMode::Force,
                    FuaMode::Pass,
                    FuaMode::Discard,
                ];
                let choices: Vec<(&str, FuaMode)> = modes.iter().map(|&m| (m.name(), m)).collect();
                self.mode = params::choice("fua", key, value, &choices)?;
            }
            _ => return Err(unknown("fua", key)),
        }
        Ok(())
    }

    fn check_below(&self, next: &dyn BlockDevice) -> Result<()> {
        let c = next.capabilities();
        let missing = match self.mode {
            FuaMode::Emulate if !c.can_flush => "flush",
            FuaMode::Native | FuaMode::Force if !c.can_fua => "fua",
            _ => return Ok(()),
        };
        Err(Error::unsupported(format!(
            "fua: fuamode '{}' requires plugin {missing} support",
            self.mode.name()
        )))
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(*self, next))
    }
}

impl Fua {
    /// The FUA flag to pass down for a request that asked for `fua`, and
    /// whether to flush after it.
    fn plan(&self, fua: bool) -> (bool, bool) {
        match self.mode {
            FuaMode::None | FuaMode::Native | FuaMode::Pass => (fua, false),
            FuaMode::Emulate => (false, fua),
            FuaMode::Force => (true, false),
            FuaMode::Discard => (false, false),
        }
    }
}

impl Filter for Fua {
    fn name(&self) -> &str {
        "fua"
    }
    fn reads_unchanged(&self) -> bool {
        // Reads are untouched.
        true
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        let mut c = next.capabilities();
        match self.mode {
            FuaMode::None => c.can_fua = false,
            FuaMode::Emulate | FuaMode::Native => c.can_fua = true,
            FuaMode::Force | FuaMode::Discard => {
                c.can_fua = true;
                c.can_flush = true;
            }
            FuaMode::Pass => {}
        }
        c
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let (fua, flush) = self.plan(flags.fua);
        next.write_at(buf, offset, WriteFlags { fua })?;
        if flush { next.flush() } else { Ok(()) }
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        let (fua, flush) = self.plan(flags.fua);
        next.write_zeroes(offset, len, ZeroFlags { fua, ..flags })?;
        if flush { next.flush() } else { Ok(()) }
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        let (fua, flush) = self.plan(flags.fua);
        next.trim(offset, len, WriteFlags { fua })?;
        if flush { next.flush() } else { Ok(()) }
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        match self.mode {
            FuaMode::Force | FuaMode::Discard => Ok(()),
            _ => next.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Probe;
    use diskit_backends::MemoryDevice;
    use diskit_core::{ErrorKind, Filtered};

    /// Memory that flushes, or not.
    fn below(flushes: bool) -> Probe {
        Probe::new(1 << 20).caps(|c| Capabilities {
            can_flush: flushes,
            ..c
        })
    }

    fn run(mode: &str) -> (Capabilities, Vec<String>) {
        let rec = std::sync::Arc::new(below(true));
        let f = Fua::from_params(&[("fuamode".into(), mode.into())]).unwrap();
        f.check_below(&*rec).unwrap();
        let d = Filtered::new(f, rec.clone());
        d.write_at(b"x", 0, WriteFlags::FUA).unwrap();
        d.write_at(b"x", 0, WriteFlags::NONE).unwrap();
        d.write_zeroes(
            0,
            1,
            ZeroFlags {
                fua: true,
                ..ZeroFlags::default()
            },
        )
        .unwrap();
        d.trim(0, 1, WriteFlags::FUA).unwrap();
        d.flush().unwrap();
        let log = rec.log();
        (d.capabilities(), log)
    }

    #[test]
    fn each_mode_offers_and_passes_what_it_says() {
        // What reaches the device below of: a FUA write, a write, a FUA
        // zero, a FUA trim, a flush.
        let passed = "write fua=true, write fua=false, zero fua=true, trim fua=true, flush";
        for (mode, can_fua, log) in [
            (
                "emulate",
                true,
                "write fua=false, flush, write fua=false, zero fua=false, flush, \
                 trim fua=false, flush, flush",
            ),
            (
                "force",
                true,
                "write fua=true, write fua=true, zero fua=true, trim fua=true",
            ),
            (
                "discard",
                true,
                "write fua=false, write fua=false, zero fua=false, trim fua=false",
            ),
            ("native", true, passed),
            ("pass", true, passed),
            ("none", false, passed),
        ] {
            let (c, got) = run(mode);
            assert_eq!((c.can_fua, c.can_flush), (can_fua, true), "{mode}");
            assert_eq!(got.join(", "), log, "{mode}");
        }
    }

    #[test]
    fn modes_check_the_device_below() {
        let no_flush = below(false);
        let f = |m: &str| Fua::from_params(&[("fuamode".into(), m.into())]).unwrap();
        let e = f("emulate").check_below(&no_flush).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotSupported);
        assert!(
            e.to_string()
                .contains("fuamode 'emulate' requires plugin flush support"),
            "{e}"
        );
        let ro = MemoryDevice::new(1);
        assert!(f("force").check_below(&ro).is_ok());
        let pattern = diskit_backends::PatternDevice::new(8);
        let e = f("native").check_below(&pattern).unwrap_err();
        assert!(
            e.to_string()
                .contains("fuamode 'native' requires plugin fua support"),
            "{e}"
        );
        assert!(Fua::from_params(&[("fuamode".into(), "advertise".into())]).is_err());
        assert_eq!(Fua::from_params(&[]).unwrap().mode, FuaMode::None);
    }
}
