//! The ddrescue filter (nbdkit-ddrescue-filter): serves a disk image
//! recovered by GNU ddrescue with its bad blocks, as its mapfile lists
//! them, failing to read (EIO) instead of reading as zeros.
//!
//! `ddrescue-mapfile=FILE` (repeatable: the blocks of every file count)
//! is read as nbdkit reads it: `#` lines are comments, the first other
//! line is the status line (skipped), then each line `POS SIZE STATUS`
//! (C numbers: decimal, `0x` hexadecimal, `0` octal) describes a block;
//! those with status `+` (finished) are readable, anything else is bad.
//! A read succeeds only inside rescued bytes (adjacent `+` blocks join,
//! where nbdkit 1.32 fails a read that spans two of them). The export
//! is read-only, and cache is not offered.

use diskit_core::params::c_integer_prefix;
use diskit_core::{BlockDevice, Capabilities, DeviceRef, Error, ErrorKind, Filter, Result};

use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["ddrescue-mapfile"];

/// A run of rescued bytes: `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rescued {
    /// The first byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

/// The number at the start of `s` as sscanf's `%i` into an int64 reads
/// it (clamped to the int64 range), and the rest of `s`.
fn number(s: &str) -> Option<(i64, &str)> {
    let (v, used, _) = c_integer_prefix(s)?;
    let v = v.clamp(i64::MIN.into(), i64::MAX.into()) as i64;
    Some((v, &s[used..]))
}

/// One block line: its position, its size and its status; `None` when
/// the line is not one (nbdkit skips it).
fn block_line(line: &str) -> Option<(i64, i64, char)> {
    let (pos, rest) = number(line)?;
    let (size, rest) = number(rest)?;
    let status = rest.trim_start().chars().next()?;
    Some((pos, size, status))
}

/// The rescued runs a mapfile's text lists, sorted and joined.
pub fn parse_mapfile(text: &str) -> Result<Vec<Rescued>> {
    let mut runs = Vec::new();
    let mut status_seen = false;
    for line in text.split('\n') {
        if line.starts_with('#') {
            continue;
        }
        if !line.is_empty() && !status_seen {
            status_seen = true;
            continue;
        }
        let Some((pos, size, status)) = block_line(line) else {
            continue;
        };
        if pos < 0 {
            return Err(Error::invalid(
                "ddrescue: block offset must not be negative",
            ));
        }
        if size < 0 {
            return Err(Error::invalid(
                "ddrescue: block length must not be negative",
            ));
        }
        if status == '+' && size > 0 {
            let start = pos as u64;
            runs.push(Rescued {
                start,
                end: start.saturating_add(size as u64),
            });
        }
    }
    Ok(joined(runs))
}

/// The configuration: the rescued runs of the mapfiles given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ddrescue {
    /// Sorted, joined.
    pub rescued: Vec<Rescued>,
}

impl Configure for Ddrescue {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "ddrescue-mapfile" => {
                let bytes = std::fs::read(value)
                    .map_err(|e| Error::from(e).context(format!("{value}: ddrescue: open")))?;
                let mut all = parse_mapfile(&String::from_utf8_lossy(&bytes))
                    .map_err(|e| e.context(value))?;
                all.extend_from_slice(&self.rescued);
                self.rescued = joined(all);
            }
            _ => return Err(unknown("ddrescue", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(self.clone(), next))
    }
}

/// `runs` sorted and joined.
fn joined(mut runs: Vec<Rescued>) -> Vec<Rescued> {
    runs.sort_by_key(|r| r.start);
    let mut joined: Vec<Rescued> = Vec::with_capacity(runs.len());
    for r in runs {
        match joined.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => joined.push(r),
        }
    }
    joined
}

impl Filter for Ddrescue {
    fn name(&self) -> &str {
        "ddrescue"
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        Capabilities {
            can_cache: false,
            ..next.capabilities().read_only()
        }
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset + buf.len() as u64;
        let i = self.rescued.partition_point(|r| r.end <= offset);
        match self.rescued.get(i) {
            Some(r) if r.start <= offset && end <= r.end => next.read_at(buf, offset),
            _ => Err(Error::new(
                ErrorKind::Io,
                format!(
                    "ddrescue: read of {} bytes at {offset} touches a bad block",
                    buf.len()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::Filtered;
    use std::sync::Arc;

    const MAP: &str = "# Mapfile. Created by GNU ddrescue version 1.27\n\
        # current_pos  current_status  current_pass\n\
        0x00001000     +               1\n\
        #      pos        size  status\n\
        0x00000000  0x00001000  +\n\
        0x00001000  0x00000200  -\n\
        0x00001200  0x00000E00  +\n\
        0x00002000  0x00001000  +\n\
        0x00003000  0x0000D000  ?\n";

    #[test]
    fn the_mapfile_gives_the_rescued_runs() {
        let runs = parse_mapfile(MAP).unwrap();
        assert_eq!(
            runs,
            [
                Rescued {
                    start: 0,
                    end: 0x1000
                },
                Rescued {
                    start: 0x1200,
                    end: 0x3000
                }
            ]
        );
        assert!(parse_mapfile("status\n-1 10 +\n").is_err());
        assert!(parse_mapfile("status\n1 -10 +\n").is_err());
        assert_eq!(parse_mapfile("status\ngarbage\n5 5\n").unwrap(), []);
    }

    #[test]
    fn reads_outside_the_rescued_runs_fail() {
        let d = Filtered::new(
            Ddrescue {
                rescued: parse_mapfile(MAP).unwrap(),
            },
            Arc::new(MemoryDevice::new(0x10000)),
        );
        let mut b = [0u8; 512];
        d.read_at(&mut b, 0xe00).unwrap();
        assert_eq!(d.read_at(&mut b, 0xf00).unwrap_err().kind(), ErrorKind::Io);
        d.read_at(&mut b, 0x1e00).unwrap();
        assert!(d.read_at(&mut b, 0x3000).is_err());
        assert!(!d.capabilities().can_write);
    }
}
