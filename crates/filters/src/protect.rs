//! The protect filter (nbdkit-protect-filter): write-protects ranges of
//! the device while the export stays writable.
//!
//! `protect=START-END` (repeatable) protects the bytes START to END
//! inclusive; either bound may be left out (the start or the end of the
//! device); `protect=~START-END` protects everything outside the range.
//! The numbers are C's (decimal, `0x` hexadecimal, `0` octal), as nbdkit
//! reads them. Reads pass; a write, write-zeroes or trim that would
//! change a protected byte fails with EPERM and changes nothing; one
//! that writes what is already there passes.

use diskit_core::params::nbdkit_unsigned;
use diskit_core::{
    BlockDevice, DeviceRef, Error, ErrorKind, Filter, Result, WriteFlags, ZeroFlags,
};

use crate::registry::{Configure, over, unknown};
use crate::verify::{Expected, below_holds};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["protect"];

/// The end of the address space, as nbdkit bounds it.
const END: u64 = i64::MAX as u64;

/// A protected range, its bounds inclusive, and the parameter that made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    /// The first byte.
    pub start: u64,
    /// The last byte.
    pub end: u64,
    /// The `protect=` value, for messages.
    pub description: String,
}

/// The configuration: the ranges given, as given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProtectConfig {
    /// The protected ranges, in the order given.
    pub ranges: Vec<Range>,
}

/// `value`'s ranges (one, or two for a complement).
fn parse_range(value: &str) -> Result<Vec<Range>> {
    let (negate, body) = match value.strip_prefix('~') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let Some((a, b)) = body.split_once('-') else {
        return Err(Error::invalid(format!(
            "protect: cannot parse range, missing '-': {value}"
        )));
    };
    let bound = |s: &str, default: u64| {
        if s.is_empty() {
            Ok(default)
        } else {
            nbdkit_unsigned("range", s, u64::MAX).map_err(|e| e.context("protect"))
        }
    };
    let (start, end) = (bound(a, 0)?, bound(b, END)?);
    if end < start {
        return Err(Error::invalid(format!(
            "protect: invalid range, end < start: {value}"
        )));
    }
    let range = |start, end| Range {
        start,
        end,
        description: value.to_string(),
    };
    if !negate {
        return Ok(vec![range(start, end)]);
    }
    let mut out = Vec::new();
    if start > 0 {
        out.push(range(0, start - 1));
    }
    if end < END {
        out.push(range(end + 1, END));
    }
    Ok(out)
}

/// `ranges` sorted, adjacent and overlapping ones merged (the first
/// keeps its description).
fn merged(mut ranges: Vec<Range>) -> Vec<Range> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.end.saturating_add(1) >= r.start => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

impl Configure for ProtectConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "protect" => self.ranges.extend(parse_range(value)?),
            _ => return Err(unknown("protect", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(
            Protect {
                ranges: merged(self.ranges.clone()),
            },
            next,
        ))
    }
}

/// The filter: the protected ranges, sorted and merged.
pub struct Protect {
    ranges: Vec<Range>,
}

impl Protect {
    /// Fails with EPERM when writing `expected` at `offset` would change a
    /// protected byte.
    fn check(&self, next: &dyn BlockDevice, offset: u64, expected: Expected<'_>) -> Result<()> {
        let end = offset + expected.len();
        for r in &self.ranges {
            let (a, b) = (offset.max(r.start), end.min(r.end.saturating_add(1)));
            if a >= b {
                continue;
            }
            if !below_holds(next, a, expected.part(a - offset, b - a))? {
                return Err(Error::new(
                    ErrorKind::PermissionDenied,
                    format!(
                        "protect filter prevented write to protected range {}",
                        r.description
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Filter for Protect {
    fn name(&self) -> &str {
        "protect"
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
        self.check(next, offset, Expected::Bytes(buf))?;
        next.write_at(buf, offset, flags)
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.check(next, offset, Expected::Zeros(len))?;
        next.write_zeroes(offset, len, flags)
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.check(next, offset, Expected::Zeros(len))?;
        next.trim(offset, len, flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FilterSpec;
    use crate::testing::kv;
    use diskit_backends::MemoryDevice;
    use std::sync::Arc;

    fn protected(params: &[(&str, &str)]) -> DeviceRef {
        let mem: DeviceRef = Arc::new(MemoryDevice::new(1 << 20));
        mem.write_at(&[7u8; 4096], 0, WriteFlags::NONE).unwrap();
        FilterSpec::parse("protect", &kv(params))
            .unwrap()
            .stack(mem, false)
            .unwrap()
    }

    #[test]
    fn writes_into_a_protected_range_fail_unless_they_change_nothing() {
        let d = protected(&[("protect", "0-0x1ff"), ("protect", "0x1000-")]);
        let e = d.write_at(&[1u8; 16], 500, WriteFlags::NONE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("protected range 0-0x1ff"), "{e}");
        // The same bytes again, and a write outside every range, pass.
        d.write_at(&[7u8; 600], 0, WriteFlags::NONE).unwrap();
        d.write_at(&[1u8; 512], 512, WriteFlags::NONE).unwrap();
        // Zeros over zeros pass; over data they do not.
        d.write_zeroes(8192, 4096, ZeroFlags::default()).unwrap();
        assert!(d.trim(0, 4096, WriteFlags::NONE).is_err());
        let mut b = [0u8; 4];
        d.read_at(&mut b, 510).unwrap();
        assert_eq!(b, [7, 7, 1, 1]);
    }

    #[test]
    fn a_complement_protects_what_is_outside() {
        let d = protected(&[("protect", "~0x1000-0x1fff")]);
        d.write_at(&[3u8; 4096], 0x1000, WriteFlags::NONE).unwrap();
        assert!(d.write_at(&[3u8; 2], 0xfff, WriteFlags::NONE).is_err());
        assert!(d.write_at(&[3u8; 2], 0x1fff, WriteFlags::NONE).is_err());
    }

    #[test]
    fn ranges_merge_and_bad_ones_are_refused() {
        let r = merged(
            ["10-20", "0-9", "30-40", "35-50"]
                .iter()
                .flat_map(|v| parse_range(v).unwrap())
                .collect(),
        );
        let bounds: Vec<_> = r.iter().map(|r| (r.start, r.end)).collect();
        assert_eq!(bounds, [(0, 20), (30, 50)]);
        for (v, why) in [
            ("100", "missing '-'"),
            ("20-10", "end < start"),
            ("x-10", "protect: range: "),
        ] {
            let e = parse_range(v).unwrap_err().to_string();
            assert!(e.contains(why), "{v}: {e}");
        }
    }
}
