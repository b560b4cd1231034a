//! The rate filter (nbdkit-rate-filter): limits the bandwidth of reads and
//! writes, over all connections and per connection.
//!
//! - `rate=BITSPERSEC`: the limit over all connections (`1M` is 2^20 bits
//!   a second, as nbdkit reads sizes).
//! - `connection-rate=BITSPERSEC`: the limit of each connection.
//! - `rate-file=FILE`, `connection-rate-file=FILE`: the limits are read
//!   from these files again when they change (write a new file and rename
//!   it over the old one); while a file is missing the last rate stays
//!   (at first the `rate=` value, or no limit).
//! - `burstiness=SECS` (default 2): how long a client that was idle may
//!   go at full speed, as the token bucket's capacity in seconds of rate.
//!
//! Reads and writes have separate buckets; zeroes, trims and the other
//! requests carry no data and are free, as in nbdkit. Buckets start full;
//! a request takes its bits from the bucket, sleeping for what is
//! missing. A rate of 0 read from a file lifts the limit.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use diskit_core::sync::lock;
use diskit_core::{DeviceRef, Error, Result, Session};

use crate::call::{Call, Op};
use crate::gate::{Gate, Gated};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "rate",
    "connection-rate",
    "rate-file",
    "connection-rate-file",
    "burstiness",
];

/// How often a rate file is looked at for a change, at most.
const FILE_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// The parameters, as given.
#[derive(Debug, Clone, PartialEq)]
pub struct RateConfig {
    /// Bits per second over all connections (0: no limit).
    pub rate: u64,
    /// Bits per second per connection (0: no limit).
    pub connection_rate: u64,
    /// Where `rate` is read from again.
    pub rate_file: Option<PathBuf>,
    /// Where `connection_rate` is read from again.
    pub connection_rate_file: Option<PathBuf>,
    /// Bucket capacity, in seconds of rate.
    pub burstiness: f64,
}

impl Default for RateConfig {
    fn default() -> RateConfig {
        RateConfig {
            rate: 0,
            connection_rate: 0,
            rate_file: None,
            connection_rate_file: None,
            burstiness: 2.0,
        }
    }
}

impl Configure for RateConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "rate" => self.rate = rate(key, value, self.rate)?,
            "connection-rate" => self.connection_rate = rate(key, value, self.connection_rate)?,
            "rate-file" => self.rate_file = Some(absolute(value)?),
            "connection-rate-file" => self.connection_rate_file = Some(absolute(value)?),
            "burstiness" => {
                self.burstiness = value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|b| b.is_finite() && *b > 0.0)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "rate: burstiness must be a positive number of seconds, not '{value}'"
                        ))
                    })?
            }
            _ => return Err(unknown("rate", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Gated(Rate::new(self)), next))
    }
}

/// A rate given as `key=value`, replacing `old` (0: not set yet).
fn rate(key: &str, value: &str, old: u64) -> Result<u64> {
    if old > 0 {
        return Err(Error::invalid(format!(
            "rate: {key} set twice on the command line"
        )));
    }
    match params::size("rate", key, value)? {
        0 => Err(Error::invalid(format!("rate: {key} cannot be set to 0"))),
        n => Ok(n),
    }
}

/// `path` made absolute, so that a server that changes directory still
/// finds it.
fn absolute(path: &str) -> Result<PathBuf> {
    std::path::absolute(path).map_err(|e| Error::invalid(format!("rate: {path}: {e}")))
}

/// A token bucket counting bits.
#[derive(Debug, Clone)]
struct Bucket {
    /// Bits per second; 0: no limit.
    rate: u64,
    capacity_secs: f64,
    capacity: u64,
    level: u64,
    last: Instant,
}

impl Bucket {
    /// A full bucket.
    fn new(rate: u64, capacity_secs: f64, now: Instant) -> Bucket {
        let capacity = (rate as f64 * capacity_secs) as u64;
        Bucket {
            rate,
            capacity_secs,
            capacity,
            level: capacity,
            last: now,
        }
    }

    /// Takes up to `bits` from the bucket at `now`: the bits still
    /// missing, and how long they take to come (zero when none are).
    fn take(&mut self, bits: u64, now: Instant) -> (u64, Duration) {
        if self.rate == 0 {
            return (0, Duration::ZERO);
        }
        let elapsed = now.saturating_duration_since(self.last);
        let add = (u128::from(self.rate) * elapsed.as_micros() / 1_000_000) as u64;
        self.level += add.min(self.capacity - self.level);
        self.last = now;
        if self.level >= bits {
            self.level -= bits;
            return (0, Duration::ZERO);
        }
        let missing = bits - self.level;
        self.level = 0;
        let nanos = u128::from(missing) * 1_000_000_000 / u128::from(self.rate);
        (missing, Duration::from_nanos(nanos as u64))
    }

    /// Changes the rate, keeping the capacity in seconds.
    fn set_rate(&mut self, rate: u64) {
        self.rate = rate;
        self.capacity = (rate as f64 * self.capacity_secs) as u64;
        self.level = self.level.min(self.capacity);
    }
}

/// What a rate file looked like when last read.
type FileStamp = (u64, SystemTime, u64);

/// A bucket and the file its rate may come from.
#[derive(Debug)]
struct Limiter {
    state: Mutex<LimiterState>,
    file: Option<PathBuf>,
}

#[derive(Debug)]
struct LimiterState {
    bucket: Bucket,
    stamp: Option<FileStamp>,
    checked: Option<Instant>,
}

impl Limiter {
    fn new(rate: u64, burstiness: f64, file: Option<PathBuf>) -> Limiter {
        Limiter {
            state: Mutex::new(LimiterState {
                bucket: Bucket::new(rate, burstiness, Instant::now()),
                stamp: None,
                checked: None,
            }),
            file,
        }
    }

    /// Reads the rate file again if it changed (looking at most every
    /// [`FILE_CHECK_INTERVAL`]). A missing or unreadable file keeps the
    /// rate there is.
    fn adjust(&self, now: Instant) {
        let Some(path) = &self.file else { return };
        let mut st = lock(&self.state);
        if st
            .checked
            .is_some_and(|t| now.saturating_duration_since(t) < FILE_CHECK_INTERVAL)
        {
            return;
        }
        st.checked = Some(now);
        use std::os::unix::fs::MetadataExt;
        let Ok(meta) = std::fs::metadata(path) else {
            return;
        };
        let stamp = (
            meta.ino(),
            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            meta.len(),
        );
        if st.stamp == Some(stamp) {
            return;
        }
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let line = text.lines().next().unwrap_or("").trim();
        if let Ok(rate) = diskit_core::size::parse_size(line) {
            st.stamp = Some(stamp);
            st.bucket.set_rate(rate);
        }
    }

    /// Waits until `bytes` may pass. A request larger than the bucket
    /// takes its bits a bucketful at a time, so that none of the time it
    /// waits is lost to a bucket already full.
    fn wait(&self, bytes: u64) {
        let now = Instant::now();
        self.adjust(now);
        let mut bits = bytes.saturating_mul(8);
        while bits > 0 {
            let (taken, missing, sleep) = {
                let mut st = lock(&self.state);
                let b = &mut st.bucket;
                let chunk = if b.rate == 0 {
                    bits
                } else {
                    bits.min(b.capacity.max(1))
                };
                let (missing, sleep) = b.take(chunk, Instant::now());
                (chunk - missing, missing, sleep)
            };
            bits -= taken;
            if missing > 0 {
                std::thread::sleep(sleep);
            }
        }
    }
}

/// A read and a write bucket.
#[derive(Debug)]
struct Pair {
    read: Limiter,
    write: Limiter,
}

impl Pair {
    fn new(rate: u64, burstiness: f64, file: &Option<PathBuf>) -> Pair {
        Pair {
            read: Limiter::new(rate, burstiness, file.clone()),
            write: Limiter::new(rate, burstiness, file.clone()),
        }
    }
}

/// The filter: the buckets of all connections, and one connection's.
#[derive(Debug)]
pub struct Rate {
    config: std::sync::Arc<RateConfig>,
    global: std::sync::Arc<Pair>,
    connection: Pair,
}

impl Rate {
    /// Full buckets at the configured rates.
    pub fn new(config: &RateConfig) -> Rate {
        Rate {
            global: std::sync::Arc::new(Pair::new(
                config.rate,
                config.burstiness,
                &config.rate_file,
            )),
            connection: Pair::new(
                config.connection_rate,
                config.burstiness,
                &config.connection_rate_file,
            ),
            config: std::sync::Arc::new(config.clone()),
        }
    }
}

impl Gate for Rate {
    const NAME: &'static str = "rate";

    /// Reads and writes wait until their bits may pass, over all
    /// connections and on this one; the other requests carry no data.
    fn before(&self, call: &Call) -> Result<()> {
        for pair in [&*self.global, &self.connection] {
            match call.op {
                Op::Read => pair.read.wait(call.len),
                Op::Write => pair.write.wait(call.len),
                _ => {}
            }
        }
        Ok(())
    }

    fn connect(&self, _next: &DeviceRef, _session: &Session) -> Result<Option<Rate>> {
        let c = &self.config;
        Ok(Some(Rate {
            config: c.clone(),
            global: self.global.clone(),
            connection: Pair::new(c.connection_rate, c.burstiness, &c.connection_rate_file),
        }))
    }

    // Reads keep their bytes: a view may skip the filter only where there
    // is no limit at all.
    fn reads_unchanged(&self) -> bool {
        let c = &self.config;
        c.rate == 0
            && c.connection_rate == 0
            && c.rate_file.is_none()
            && c.connection_rate_file.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::kv;

    #[test]
    fn parameters_are_read_as_nbdkit_reads_them() {
        let c = RateConfig::from_params(&kv(&[
            ("rate", "1M"),
            ("connection-rate", "64k"),
            ("burstiness", "0.5"),
        ]))
        .unwrap();
        assert_eq!((c.rate, c.connection_rate), (1 << 20, 64 << 10));
        assert_eq!(c.burstiness, 0.5);
        for (bad, why) in [
            (&[("rate", "0")][..], "cannot be set to 0"),
            (&[("rate", "1M"), ("rate", "2M")], "set twice"),
            (&[("connection-rate", "fast")], "could not parse"),
            (&[("burstiness", "-1")], "burstiness"),
        ] {
            let e = RateConfig::from_params(&kv(bad)).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            assert!(e.to_string().starts_with("rate: "), "{e}");
        }
        let c = RateConfig::from_params(&kv(&[("rate-file", "r")])).unwrap();
        assert!(c.rate_file.unwrap().is_absolute());
    }

    #[test]
    fn the_bucket_lets_a_burst_through_then_paces() {
        let t0 = Instant::now();
        // 8000 bits a second, 2 seconds of burst.
        let mut b = Bucket::new(8000, 2.0, t0);
        assert_eq!(b.take(16000, t0), (0, Duration::ZERO));
        // Empty: 8000 more bits take a second.
        assert_eq!(b.take(8000, t0), (8000, Duration::from_secs(1)));
        // Half a second later, half of them have come.
        let (missing, wait) = b.take(8000, t0 + Duration::from_millis(500));
        assert_eq!(missing, 4000);
        assert_eq!(wait, Duration::from_millis(500));
        // A long idle time fills the bucket no further than its capacity.
        assert_eq!(
            b.take(16000, t0 + Duration::from_secs(100)),
            (0, Duration::ZERO)
        );
        assert_eq!(b.take(1, t0 + Duration::from_secs(100)).0, 1);
        // No limit.
        let mut free = Bucket::new(0, 2.0, t0);
        assert_eq!(free.take(u64::MAX / 2, t0), (0, Duration::ZERO));
    }

    #[test]
    fn a_request_larger_than_the_bucket_waits_only_for_its_bits() {
        // 10 KB a second, a bucket of 1 KB: 5 KB take 0.4 s once the
        // bucket is spent, not the sum of waits for refills the full
        // bucket cannot hold (1 s).
        let l = Limiter::new(80_000, 0.1, None);
        let t0 = Instant::now();
        l.wait(5000);
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(350), "{took:?}");
        assert!(took < Duration::from_millis(800), "{took:?}");
    }

    #[test]
    fn a_new_rate_file_changes_the_rate_and_a_missing_one_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rate");
        let l = Limiter::new(1000, 2.0, Some(path.clone()));
        let t0 = Instant::now();
        l.adjust(t0);
        assert_eq!(lock(&l.state).bucket.rate, 1000);
        std::fs::write(dir.path().join("new"), "1M\n").unwrap();
        std::fs::rename(dir.path().join("new"), &path).unwrap();
        // Not looked at again so soon.
        l.adjust(t0 + Duration::from_millis(10));
        assert_eq!(lock(&l.state).bucket.rate, 1000);
        l.adjust(t0 + Duration::from_secs(1));
        assert_eq!(lock(&l.state).bucket.rate, 1 << 20);
        assert_eq!(lock(&l.state).bucket.capacity, 2 << 20);
        std::fs::remove_file(&path).unwrap();
        l.adjust(t0 + Duration::from_secs(2));
        assert_eq!(lock(&l.state).bucket.rate, 1 << 20);
        std::fs::write(&path, "0").unwrap();
        l.adjust(t0 + Duration::from_secs(3));
        assert_eq!(lock(&l.state).bucket.rate, 0);
    }
}
