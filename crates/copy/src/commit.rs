//! Committing: what the upper layers of a backing chain hold, written into a
//! layer below them (`commit`).
//!
//! The top device's extents say, for every range, which layer of its chain
//! answers (`depth`). Ranges answered above the base are copied into the
//! base: data as data, ranges that read as zeros as write-zeroes. Ranges the
//! base (or a layer below it) answers already are skipped. Works for any
//! device whose extents report depths, whatever its format.

use std::time::{Duration, Instant};

use diskit_core::{BlockDevice, Result, WriteFlags, ZeroFlags};

use crate::Progress;

/// Bytes read and written per request.
const CHUNK: u64 = 2 << 20;

/// What a commit did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CommitStats {
    /// Bytes copied as data.
    pub data_bytes: u64,
    /// Bytes written as zeroes.
    pub zeroed_bytes: u64,
}

/// Writes at most `bytes_per_sec` on average (None: no limit).
#[derive(Debug)]
pub struct RateLimit {
    bytes_per_sec: Option<u64>,
    started: Instant,
    written: u64,
}

impl RateLimit {
    /// A limit of `bytes_per_sec` (None or 0: unlimited).
    pub fn new(bytes_per_sec: Option<u64>) -> RateLimit {
        RateLimit {
            bytes_per_sec: bytes_per_sec.filter(|&r| r > 0),
            started: Instant::now(),
            written: 0,
        }
    }

    /// Accounts for `n` bytes about to be written, sleeping first as long as
    /// the limit asks.
    pub fn take(&mut self, n: u64) {
        if let Some(rate) = self.bytes_per_sec {
            let due = Duration::from_secs_f64(self.written as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(self.started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        self.written += n;
    }
}

/// Copies into `base` every range of `top` that a layer above depth
/// `base_depth` of `top`'s chain answers (`base` is that layer, opened
/// writable, at least as large as `top`).
pub fn commit(
    top: &dyn BlockDevice,
    base: &dyn BlockDevice,
    base_depth: u32,
    progress: &Progress,
    limit: &mut RateLimit,
) -> Result<CommitStats> {
    let size = top.size();
    progress.start(size);
    let mut stats = CommitStats::default();
    let mut buf = Vec::new();
    let mut pos = 0;
    while pos < size {
        let extents = top.extents(pos, size - pos)?;
        let mut any = false;
        for e in extents {
            let len = e.length.min(size - pos);
            if len == 0 {
                break;
            }
            any = true;
            // A range no layer allocates, above the base, reads as zeros
            // (past the end of a shorter layer): the base must too.
            if e.depth < base_depth {
                if e.flags.zero || !e.flags.present {
                    base.write_zeroes(
                        pos,
                        len,
                        ZeroFlags {
                            may_trim: true,
                            ..Default::default()
                        },
                    )?;
                    stats.zeroed_bytes += len;
                } else {
                    copy_range(top, base, pos, len, &mut buf, limit)?;
                    stats.data_bytes += len;
                }
            }
            pos += len;
            progress.advance(len);
        }
        if !any {
            // A device that answers nothing: treat the rest as data.
            copy_range(top, base, pos, size - pos, &mut buf, limit)?;
            stats.data_bytes += size - pos;
            progress.advance(size - pos);
            pos = size;
        }
    }
    base.flush()?;
    Ok(stats)
}

fn copy_range(
    src: &dyn BlockDevice,
    dst: &dyn BlockDevice,
    mut pos: u64,
    len: u64,
    buf: &mut Vec<u8>,
    limit: &mut RateLimit,
) -> Result<()> {
    let end = pos + len;
    while pos < end {
        let n = (end - pos).min(CHUNK) as usize;
        buf.resize(n, 0);
        src.read_at(&mut buf[..n], pos)
            .map_err(|e| e.context(format!("error while reading at byte {pos}")))?;
        limit.take(n as u64);
        dst.write_at(&buf[..n], pos, WriteFlags::NONE)
            .map_err(|e| e.context(format!("error while writing at byte {pos}")))?;
        pos += n as u64;
    }
    Ok(())
}
