//! The stats filter (nbdkit-stats-filter): counts the requests that pass,
//! with their bytes and time, and writes a summary when the device closes
//! (the server stops), in nbdkit's format, so that scripts reading
//! nbdkit's stats files read diskit's.
//!
//! - `statsfile=FILE` (required): where the summary goes (created, or
//!   truncated when the filter starts).
//! - `statsappend=BOOL`: append instead.
//! - `statsthreshold=PERCENT` (default 95): the request size and
//!   alignment breakdown lists the sizes of this share of the requests
//!   (0: no breakdown).
//!
//! Per operation: successful requests, bytes, time spent below, the rates;
//! then the request sizes (by power of two) and, for each, the alignment
//! of their offsets. Totals count every operation but cache, and the bytes
//! of reads, writes, trims and zeroes, over the time since the filter
//! started. Where nbdkit 1.32's breakdown loses a size whose request count
//! equals another's, or reports every byte as "other sizes", this one
//! counts them right. The bookkeeping takes a lock per request; requests
//! below run in parallel, and submitted ones stay in flight there
//! (counted as they complete). The server does not ask for extents through the
//! filter before large reads (as it does elsewhere, to send holes without
//! reading them), so the counts are the client's requests, as nbdkit's.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use diskit_core::sync::lock;
use diskit_core::{BlockDevice, Error, Result};

use crate::call::{Call, Op};
use crate::watch::{Outcome, Watch, Watching};

use crate::params;
use crate::registry::{Configure, over, unknown};
use diskit_core::DeviceRef;

/// The keys the filter takes.
pub const KEYS: &[&str] = &["statsfile", "statsappend", "statsthreshold"];

/// The parameters, as given.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsConfig {
    /// Where the summary goes.
    pub file: Option<PathBuf>,
    /// Append rather than truncate.
    pub append: bool,
    /// The share of requests the breakdown lists (0 to 1).
    pub threshold: f64,
}

impl Default for StatsConfig {
    fn default() -> StatsConfig {
        StatsConfig {
            file: None,
            append: false,
            threshold: 0.95,
        }
    }
}

impl Configure for StatsConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "statsfile" => self.file = Some(PathBuf::from(value)),
            "statsappend" => self.append = params::boolean("stats", key, value)?,
            "statsthreshold" => {
                let n: i64 = value.trim().parse().map_err(|_| {
                    Error::invalid(format!("stats: statsthreshold: could not parse '{value}'"))
                })?;
                if !(0..=100).contains(&n) {
                    return Err(Error::invalid(
                        "stats: statsthreshold must be between 0 and 100 (percent)",
                    ));
                }
                self.threshold = n as f64 / 100.0;
            }
            _ => return Err(unknown("stats", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Watching(Stats::new(self)?), next))
    }
}

/// One operation's counters.
#[derive(Debug, Default, Clone)]
struct OpStat {
    ops: u64,
    bytes: u64,
    usecs: u64,
    /// Size bits -> alignment bits (-1: offset 0) -> requests.
    count: BTreeMap<i32, BTreeMap<i32, u64>>,
    /// Size bits -> bytes.
    size: BTreeMap<i32, u64>,
}

/// The operations, in the order nbdkit prints them.
/// The names of the operations, in [`Op`]'s order (nbdkit's).
const NAMES: [&str; 7] = ["read", "write", "trim", "zero", "extents", "cache", "flush"];

/// The filter.
#[derive(Debug)]
pub struct Stats {
    out: Mutex<Option<File>>,
    start: Instant,
    counts: Arc<Counts>,
}

/// The counters, shared with the requests in flight below.
#[derive(Debug)]
pub(crate) struct Counts {
    threshold: f64,
    /// Per [`Op`].
    ops: Mutex<[OpStat; 7]>,
}

impl Counts {
    /// Records `call`, started at `started`, which succeeded.
    fn record(&self, call: &Call, started: Instant) {
        let (size, offset) = (call.len, call.offset);
        let usecs = started.elapsed().as_micros() as u64;
        let mut all = lock(&self.ops);
        let st = &mut all[call.op as usize];
        st.ops += 1;
        st.bytes += size;
        st.usecs += usecs;
        if self.threshold == 0.0 || size == 0 {
            return;
        }
        let size_bits = 63 - size.leading_zeros() as i32;
        let align_bits = if offset == 0 {
            -1
        } else {
            offset.trailing_zeros() as i32
        };
        *st.count
            .entry(size_bits)
            .or_default()
            .entry(align_bits)
            .or_default() += 1;
        *st.size.entry(size_bits).or_default() += size;
    }
}

impl Stats {
    /// Opens the stats file and starts the clock.
    pub fn new(config: &StatsConfig) -> Result<Stats> {
        let path = config.file.as_ref().ok_or_else(|| {
            Error::invalid("stats: the stats filter requires the statsfile parameter")
        })?;
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .append(config.append)
            .truncate(!config.append)
            .open(path)
            .map_err(|e| Error::from(e).context(format!("stats: open: {}", path.display())))?;
        Ok(Stats {
            out: Mutex::new(Some(file)),
            start: Instant::now(),
            counts: Arc::new(Counts {
                threshold: config.threshold,
                ops: Mutex::new(Default::default()),
            }),
        })
    }

    /// The summary, as nbdkit writes it.
    fn summary(&self) -> String {
        let usecs = self.start.elapsed().as_micros() as u64;
        let all = lock(&self.counts.ops).clone();
        let mut s = String::new();
        let ops: u64 = [
            Op::Read,
            Op::Write,
            Op::Trim,
            Op::Zero,
            Op::Extents,
            Op::Flush,
        ]
        .iter()
        .map(|&op| all[op as usize].ops)
        .sum();
        let bytes: u64 = [Op::Read, Op::Write, Op::Trim, Op::Zero]
            .iter()
            .map(|&op| all[op as usize].bytes)
            .sum();
        s += &format!(
            "total: {ops} ops, {:.6} s, {}, {}/s\n",
            usecs as f64 / 1e6,
            human_size(bytes),
            human_rate(bytes, usecs)
        );
        for (i, st) in all.iter().enumerate() {
            if st.ops == 0 {
                continue;
            }
            s += &format!(
                "{}: {} ops, {:.6} s, {}, {}/s op, {}/s total\n",
                NAMES[i],
                st.ops,
                st.usecs as f64 / 1e6,
                human_size(st.bytes),
                human_rate(st.bytes, st.usecs),
                human_rate(st.bytes, usecs)
            );
            if self.counts.threshold != 0.0 && !st.count.is_empty() {
                s += "  Request size and alignment breakdown:\n";
                self.histogram(st, &mut s);
                s += "\n";
            }
        }
        s
    }

    fn histogram(&self, st: &OpStat, s: &mut String) {
        let mut sizes: Vec<(u64, i32)> = st
            .count
            .iter()
            .map(|(&bits, aligns)| (aligns.values().sum(), bits))
            .collect();
        // Most requests first (ties: the smaller size first).
        sizes.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let total: u64 = sizes.iter().map(|x| x.0).sum();
        let to_print = (self.counts.threshold * total as f64) as u64;
        let (mut printed_reqs, mut printed_bytes) = (0u64, 0u64);
        for (requests, bits) in sizes {
            if printed_reqs >= to_print {
                let rest = st.ops - printed_reqs;
                *s += &format!(
                    "    other sizes: {:4.1}% ({rest} reqs, {} total)\n",
                    rest as f64 / total as f64 * 100.0,
                    human_size(st.bytes - printed_bytes)
                );
                break;
            }
            let bytes = st.size[&bits];
            *s += &format!(
                "    {bits:2} bits: {:4.1}% ({requests} reqs, {} total)\n",
                requests as f64 / total as f64 * 100.0,
                human_size(bytes)
            );
            printed_reqs += requests;
            printed_bytes += bytes;
            self.alignments(&st.count[&bits], s);
        }
    }

    fn alignments(&self, aligns: &BTreeMap<i32, u64>, s: &mut String) {
        let total: u64 = aligns.values().sum();
        let any = aligns.get(&-1).copied().unwrap_or(0);
        // Requests aligned to 2^b are aligned to every smaller power too;
        // offset 0 is aligned to all.
        let present: Vec<i32> = aligns.keys().copied().filter(|&b| b >= 0).collect();
        let cumulative: Vec<(i32, u64)> = present
            .iter()
            .map(|&b| {
                let n: u64 = aligns
                    .iter()
                    .filter(|&(&k, _)| k >= b)
                    .map(|(_, &v)| v)
                    .sum();
                (b, n + any)
            })
            .collect();
        let cutoff = ((1.0 - self.counts.threshold) * total as f64) as u64;
        for (i, &(bits, requests)) in cumulative.iter().enumerate() {
            if requests < cutoff {
                *s += &format!(
                    "         {bits:2}+ bit-aligned: {:4.1}% ({requests})\n",
                    requests as f64 / total as f64 * 100.0
                );
                break;
            }
            if cumulative
                .get(i + 1)
                .is_none_or(|&(_, next)| next != requests)
            {
                *s += &format!(
                    "         {bits:2} bit aligned: {:5.1}% ({requests})\n",
                    (requests * 100) as f64 / total as f64
                );
            }
        }
    }
}

/// A size as nbdkit prints it.
fn human_size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else if bytes < 1 << 20 {
        format!("{:.2} KiB", b / KIB)
    } else if bytes < 1 << 30 {
        format!("{:.2} MiB", b / (KIB * KIB))
    } else {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    }
}

/// A rate as nbdkit prints it ("(n/a)" over no time).
fn human_rate(bytes: u64, usecs: u64) -> String {
    if usecs == 0 {
        return "(n/a)".into();
    }
    human_size((bytes as f64 / (usecs as f64 / 1e6)) as u64)
}

impl Watch for Stats {
    const NAME: &'static str = "stats";
    type Started = (Call, Instant, Arc<Counts>);

    fn start(&self, call: &Call) -> Self::Started {
        (*call, Instant::now(), self.counts.clone())
    }

    fn end((call, started, counts): Self::Started, outcome: Outcome<'_>) {
        if !matches!(outcome, Outcome::Failed(_)) {
            counts.record(&call, started);
        }
    }

    fn close(&self, next: &dyn BlockDevice) -> Result<()> {
        let written = match lock(&self.out).take() {
            Some(mut f) => f
                .write_all(self.summary().as_bytes())
                .and_then(|()| f.flush())
                .map_err(|e| Error::from(e).context("stats: writing the stats file")),
            None => Ok(()),
        };
        let closed = next.close();
        written.and(closed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Writing;
    use diskit_core::{BlockDevice, WriteFlags, ZeroFlags};

    #[test]
    fn counts_and_breakdown_in_nbdkit_format() {
        let stats = Writing::new("stats", "statsfile", 8 << 20);
        let d = &stats.dev;
        let mut b = vec![0u8; 65536];
        for i in 0..19u64 {
            d.read_at(&mut b, i * 65536).unwrap();
        }
        d.read_at(&mut b[..512], 512).unwrap();
        d.write_at(&b[..4096], 4096, WriteFlags::NONE).unwrap();
        d.flush().unwrap();
        assert!(d.read_at(&mut b, 9 << 20).is_err(), "out of range");
        d.close().unwrap();
        let out = stats.text();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("total: 22 ops, "), "{out}");
        assert!(lines[0].contains(", 1.19 MiB, "), "{out}");
        assert!(lines[1].starts_with("read: 20 ops, "), "{out}");
        assert_eq!(lines[2], "  Request size and alignment breakdown:");
        assert_eq!(lines[3], "    16 bits: 95.0% (19 reqs, 1.19 MiB total)");
        assert_eq!(lines[4], "         16 bit aligned: 100.0% (19)");
        // Offsets 2^17 * odd, plus offset 0 (aligned to everything).
        assert_eq!(lines[5], "         17 bit aligned:  52.6% (10)");
        assert!(
            out.contains("\n    other sizes:  5.0% (1 reqs, 512 bytes total)\n"),
            "{out}"
        );
        assert!(out.contains("\nwrite: 1 ops, "), "{out}");
        // One request: under 95% of one is none, so all are "other" (as nbdkit).
        assert!(
            out.contains("    other sizes: 100.0% (1 reqs, 4.00 KiB total)"),
            "{out}"
        );
        assert!(out.contains("\nflush: 1 ops, "), "{out}");
    }

    #[test]
    fn submitted_requests_are_counted_and_stay_in_flight_below() {
        use crate::testing::{read_request, submit, write_request, zero_request};
        let stats = Writing::new("stats", "statsfile", 1 << 20);
        let (d, probe) = (&*stats.dev, &stats.below);
        assert_eq!(d.queue_depth(), probe.queue_depth());
        for i in 0..3 {
            assert!(submit(d, read_request(i * 4096, 4096)).result.is_ok());
        }
        assert!(submit(d, write_request(0, &[1; 4096])).result.is_ok());
        let zero = zero_request(0, 8192, ZeroFlags::default());
        assert!(submit(d, zero).result.is_ok());
        assert_eq!(probe.submitted.load(std::sync::atomic::Ordering::SeqCst), 5);
        d.close().unwrap();
        let out = stats.text();
        assert!(out.starts_with("total: 5 ops, "), "{out}");
        for line in ["read: 3 ops, 0.", "write: 1 ops, 0.", "zero: 1 ops, 0."] {
            assert!(out.contains(&format!("\n{line}")), "{out}");
        }
    }

    #[test]
    fn the_file_is_required_and_the_threshold_checked() {
        assert!(
            Stats::new(&StatsConfig::default())
                .unwrap_err()
                .to_string()
                .contains("statsfile")
        );
        let e = StatsConfig::from_params(&[("statsthreshold".into(), "101".into())]).unwrap_err();
        assert!(e.to_string().contains("between 0 and 100"), "{e}");
    }
}
