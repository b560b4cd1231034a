//! QEMU's unmap policy of a block node, its `discard=` and
//! `detect-zeroes=` options (qemu-nbd's `--discard` and
//! `--detect-zeroes`): what trims and write-zeroes may deallocate, and
//! whether written zeros become write-zeroes.
//!
//! - `discard=ignore` (QEMU's default, also spelt `off`): trims succeed and
//!   do nothing; write-zeroes keep the range allocated (the may-trim flag
//!   is dropped).
//! - `discard=unmap` (also `on`): trims and write-zeroes reach the device
//!   as they came.
//! - `detect-zeroes=on`: a write whose data is all zeros is done as a
//!   write-zeroes that keeps the range allocated; `unmap` lets it
//!   deallocate, and is only taken with `discard=unmap`, as QEMU requires.
//!
//! Not one of nbdkit's filters (it has no row in [`crate::FILTERS`]):
//! commands that take QEMU's options stack it themselves ([`Unmap::stack`]).

use std::sync::Arc;

use diskit_core::zero::is_zero;
use diskit_core::{
    BlockDevice, DeviceRef, Error, Filter, Filtered, Request, Result, Route, WriteFlags, ZeroFlags,
};

/// What trims do (`discard=`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Discard {
    /// Trims do nothing; write-zeroes keep their range allocated.
    #[default]
    Ignore,
    /// Trims and write-zeroes pass down unchanged.
    Unmap,
}

impl Discard {
    /// The mode QEMU calls `name` (`ignore`/`off`, `unmap`/`on`).
    pub fn from_name(name: &str) -> Option<Discard> {
        match name {
            "ignore" | "off" => Some(Discard::Ignore),
            "unmap" | "on" => Some(Discard::Unmap),
            _ => None,
        }
    }
}

/// What writes of zeros become (`detect-zeroes=`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DetectZeroes {
    /// Written as they are.
    #[default]
    Off,
    /// Write-zeroes that keep the range allocated.
    On,
    /// Write-zeroes that may deallocate the range.
    Unmap,
}

impl DetectZeroes {
    /// The mode QEMU calls `name` (`off`, `on`, `unmap`).
    pub fn from_name(name: &str) -> Option<DetectZeroes> {
        match name {
            "off" => Some(DetectZeroes::Off),
            "on" => Some(DetectZeroes::On),
            "unmap" => Some(DetectZeroes::Unmap),
            _ => None,
        }
    }
}

/// The policy: a filter over the node's device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unmap {
    /// `discard=`.
    pub discard: Discard,
    /// `detect-zeroes=`.
    pub detect_zeroes: DetectZeroes,
}

impl Unmap {
    /// The policy, refusing `detect-zeroes=unmap` without `discard=unmap`
    /// in QEMU's words.
    pub fn new(discard: Discard, detect_zeroes: DetectZeroes) -> Result<Unmap> {
        if detect_zeroes == DetectZeroes::Unmap && discard != Discard::Unmap {
            return Err(Error::invalid(
                "setting detect-zeroes to unmap is not allowed without setting discard \
                 operation to unmap",
            ));
        }
        Ok(Unmap {
            discard,
            detect_zeroes,
        })
    }

    /// `next` under this policy: `next` itself when it changes nothing
    /// (`discard=unmap`, `detect-zeroes=off`).
    pub fn stack(self, next: DeviceRef) -> DeviceRef {
        if self.discard == Discard::Unmap && self.detect_zeroes == DetectZeroes::Off {
            return next;
        }
        Arc::new(Filtered::new(self, next))
    }

    /// Write-zeroes flags as the policy lets them through.
    fn zero_flags(&self, flags: ZeroFlags) -> ZeroFlags {
        ZeroFlags {
            may_trim: flags.may_trim && self.discard == Discard::Unmap,
            ..flags
        }
    }
}

impl Filter for Unmap {
    fn name(&self) -> &str {
        "unmap"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        if self.detect_zeroes == DetectZeroes::Off || !is_zero(buf) {
            return next.write_at(buf, offset, flags);
        }
        let zero = ZeroFlags {
            fua: flags.fua,
            may_trim: self.detect_zeroes == DetectZeroes::Unmap,
            fast: false,
        };
        next.write_zeroes(offset, buf.len() as u64, zero)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        next.write_zeroes(offset, len, self.zero_flags(flags))
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        match self.discard {
            Discard::Unmap => next.trim(offset, len, flags),
            Discard::Ignore => Ok(()),
        }
    }
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        match req {
            Request::Read { .. } | Request::ReadTo { .. } => Route::Below(req),
            Request::Write { .. } if self.detect_zeroes == DetectZeroes::Off => Route::Below(req),
            Request::Zero { offset, len, flags } => Route::Below(Request::Zero {
                offset,
                len,
                flags: self.zero_flags(flags),
            }),
            req => Route::Here(req),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use std::sync::Mutex;

    /// Records the trims and write-zeroes that reach the device below.
    struct Below {
        seen: Arc<Mutex<Vec<String>>>,
    }

    impl Filter for Below {
        fn name(&self) -> &str {
            "below"
        }
        fn write_zeroes(
            &self,
            next: &dyn BlockDevice,
            offset: u64,
            len: u64,
            flags: ZeroFlags,
        ) -> Result<()> {
            let line = format!("zero {offset} {len} may_trim={}", flags.may_trim);
            self.seen.lock().unwrap().push(line);
            next.write_zeroes(offset, len, flags)
        }
        fn trim(
            &self,
            next: &dyn BlockDevice,
            offset: u64,
            len: u64,
            flags: WriteFlags,
        ) -> Result<()> {
            self.seen
                .lock()
                .unwrap()
                .push(format!("trim {offset} {len}"));
            next.trim(offset, len, flags)
        }
    }

    /// Runs a trim, a may-trim zero and writes of zeros and of data
    /// through `u`; what reached the device below.
    fn through(u: Unmap) -> Vec<String> {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let below = Below { seen: seen.clone() };
        let mem: DeviceRef = Arc::new(MemoryDevice::new(1 << 20));
        let d = u.stack(Arc::new(Filtered::new(below, mem)));
        d.trim(0, 4096, WriteFlags::NONE).unwrap();
        let may_trim = ZeroFlags {
            may_trim: true,
            ..ZeroFlags::default()
        };
        d.write_zeroes(4096, 4096, may_trim).unwrap();
        d.write_at(&[0u8; 4096], 8192, WriteFlags::NONE).unwrap();
        d.write_at(&[1u8; 4096], 12288, WriteFlags::NONE).unwrap();
        let mut b = [9u8; 4];
        d.read_at(&mut b, 12288).unwrap();
        assert_eq!(b, [1; 4]);
        seen.lock().unwrap().clone()
    }

    #[test]
    fn ignore_drops_trims_and_keeps_zeroed_ranges_allocated() {
        assert_eq!(through(Unmap::default()), ["zero 4096 4096 may_trim=false"]);
    }

    #[test]
    fn unmap_passes_through_and_detects_zeros() {
        let plain = Unmap::new(Discard::Unmap, DetectZeroes::Off).unwrap();
        assert_eq!(
            through(plain),
            ["trim 0 4096", "zero 4096 4096 may_trim=true"]
        );
        let mem: DeviceRef = Arc::new(MemoryDevice::new(4096));
        assert!(
            Arc::ptr_eq(&plain.stack(mem.clone()), &mem),
            "nothing stacked"
        );
        let detect = Unmap::new(Discard::Unmap, DetectZeroes::Unmap).unwrap();
        assert_eq!(
            through(detect),
            [
                "trim 0 4096",
                "zero 4096 4096 may_trim=true",
                "zero 8192 4096 may_trim=true"
            ]
        );
        let keep = Unmap::new(Discard::Ignore, DetectZeroes::On).unwrap();
        assert_eq!(
            through(keep),
            [
                "zero 4096 4096 may_trim=false",
                "zero 8192 4096 may_trim=false"
            ]
        );
    }

    #[test]
    fn modes_have_qemus_names_and_rule() {
        assert_eq!(Discard::from_name("off"), Some(Discard::Ignore));
        assert_eq!(Discard::from_name("on"), Some(Discard::Unmap));
        assert_eq!(Discard::from_name("x"), None);
        assert_eq!(DetectZeroes::from_name("unmap"), Some(DetectZeroes::Unmap));
        let e = Unmap::new(Discard::Ignore, DetectZeroes::Unmap).unwrap_err();
        assert!(e.to_string().starts_with("setting detect-zeroes to unmap"));
    }
}
