//! Committing: what the upper layers of a backing chain hold, written into a
//! layer below them (`commit`).
//!
//! The top device's extents say, for every range, which layer of its chain
//! answers (`depth`). Ranges answered above the base are copied into the
//! base: data as data, ranges that read as zeros as write-zeroes. Ranges the
//! base (or a layer below it) answers already are skipped. Works for any
//! device whose extents report depths, whatever its format.

use std::time::{Duration, Instant};

use diskit_core::{BlockDevice, Result, WriteFlags, ZeroFlags, extent};

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
///
/// As QEMU's commit job does, the work is done in whole blocks of
/// `granularity` bytes (the base's cluster size): every block touched by a
/// range above the base is written, as zeroes when whole blocks read as
/// zeros without data, otherwise copied (from the whole chain, so the parts
/// of a block that come from the base are rewritten unchanged).
pub fn commit(
    top: &dyn BlockDevice,
    base: &dyn BlockDevice,
    base_depth: u32,
    granularity: u64,
    progress: &Progress,
    limit: &mut RateLimit,
) -> Result<CommitStats> {
    let size = top.size();
    let g = granularity.max(512);
    progress.start(size);
    let mut stats = CommitStats::default();
    let mut buf = Vec::new();
    let mut pos = 0;
    while pos < size {
        let (above, n) = run(top, pos, size - pos, base_depth)?;
        if !above {
            pos += n;
            progress.advance(n);
            continue;
        }
        // The block holding `pos` starts at or after the end of the last
        // one written (those ends are block aligned).
        let start = pos / g * g;
        let end = (pos + n).div_ceil(g).saturating_mul(g).min(size);
        let mut at = start;
        while at < end {
            let e = top.extents(at, end - at)?.first().copied();
            let len = e.map_or(0, |e| e.length.min(end - at));
            let whole = len / g * g;
            match e {
                Some(e) if whole > 0 && !e.flags.data => {
                    base.write_zeroes(
                        at,
                        whole,
                        ZeroFlags {
                            may_trim: true,
                            ..Default::default()
                        },
                    )?;
                    stats.zeroed_bytes += whole;
                    at += whole;
                }
                Some(_) if whole > 0 => {
                    copy_range(top, base, at, whole, &mut buf, limit)?;
                    stats.data_bytes += whole;
                    at += whole;
                }
                _ => {
                    let n = g.min(end - at);
                    copy_range(top, base, at, n, &mut buf, limit)?;
                    stats.data_bytes += n;
                    at += n;
                }
            }
        }
        progress.advance(end - pos);
        pos = end;
    }
    base.flush()?;
    Ok(stats)
}

/// Whether `[offset, ...)` is answered above depth `base_depth`, and for
/// how many bytes (at most `max`, at least 1) that holds.
fn run(dev: &dyn BlockDevice, offset: u64, max: u64, base_depth: u32) -> Result<(bool, u64)> {
    let mut state = None;
    let mut n = 0;
    let mut walk = extent::walk(dev, offset, max);
    while let Some(e) = walk.next_answered()? {
        let above = e.depth < base_depth;
        match state {
            None => state = Some(above),
            Some(s) if s != above => return Ok((s, n)),
            _ => {}
        }
        n += e.length;
    }
    if walk.stalled() {
        // A device that answers nothing: copy the rest.
        return Ok((true, max));
    }
    Ok((state.unwrap_or(true), n))
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
