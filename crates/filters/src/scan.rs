//! The scan filter (nbdkit-scan-filter): while a client is connected, a
//! background thread asks the layer below to cache the whole disk, from
//! the start in `scan-size` pieces, for clients that will read it all
//! (stack `cache`, or `cow` with `cow-on-cache=true`, below it where the
//! device has no cache of its own).
//!
//! `scan-ahead=BOOL` (true): a read past the scan point moves it after
//! the read. `scan-clock=BOOL` (true): a new connection's scan goes on
//! from where the last one got to (false: from the start).
//! `scan-forever=BOOL` (false): start over at the end, while connected.
//! `scan-size=SIZE` (2M; a power of two from 512 to 32M). As in nbdkit,
//! nothing is scanned (a warning says why) for an export other than the
//! default one, a device below that takes one request at a time, or one
//! without cache requests.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, DeviceRef, Error, Filter, Request, Result, Route, Serialize, Session,
};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["scan-ahead", "scan-clock", "scan-forever", "scan-size"];

/// The configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanConfig {
    /// `scan-ahead=`.
    pub ahead: bool,
    /// `scan-clock=`.
    pub clock: bool,
    /// `scan-forever=`.
    pub forever: bool,
    /// `scan-size=`.
    pub size: u64,
}

impl Default for ScanConfig {
    fn default() -> Self {
        ScanConfig {
            ahead: true,
            clock: true,
            forever: false,
            size: 2 << 20,
        }
    }
}

impl Configure for ScanConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "scan-ahead" => self.ahead = params::boolean("scan", key, value)?,
            "scan-clock" => self.clock = params::boolean("scan", key, value)?,
            "scan-forever" => self.forever = params::boolean("scan", key, value)?,
            "scan-size" => self.size = params::size("scan", key, value)?,
            _ => return Err(unknown("scan", key)),
        }
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        if !(512..=32 << 20).contains(&self.size) || !self.size.is_power_of_two() {
            return Err(Error::invalid(
                "scan: scan-size parameter should be [512..32M] and a power of two",
            ));
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(
            Scan {
                cfg: *self,
                clock: Arc::default(),
                scanner: None,
            },
            next,
        ))
    }
}

/// What a connection tells its scanning thread.
#[derive(Debug, Default)]
struct Orders {
    /// The connection has ended.
    quit: bool,
    /// The end of the furthest read since the thread last looked.
    read_to: Option<u64>,
}

/// A connection's scanning thread.
struct Scanner {
    orders: Arc<Mutex<Orders>>,
    thread: Option<JoinHandle<()>>,
}

/// The filter; a connection's view scans, while it lives.
pub struct Scan {
    cfg: ScanConfig,
    /// Where the scans got to, shared by every connection (the clock).
    clock: Arc<Mutex<u64>>,
    scanner: Option<Scanner>,
}

impl Drop for Scan {
    fn drop(&mut self) {
        if let Some(s) = &mut self.scanner {
            lock(&s.orders).quit = true;
            if let Some(t) = s.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Scan {
    /// Tells the scanning thread, if any, that a read ends at `end`.
    fn note_read(&self, end: u64) {
        if let (true, Some(s)) = (self.cfg.ahead, &self.scanner) {
            let mut o = lock(&s.orders);
            o.read_to = o.read_to.max(Some(end));
        }
    }

    /// Why a connection to `next` on `session` is not scanned, if it
    /// is not.
    fn why_not(next: &dyn BlockDevice, session: &Session) -> Option<&'static str> {
        if !session.export.is_empty() {
            Some("not the default export, not scanning")
        } else if next.serialize() != Serialize::Parallel {
            Some("underlying plugin does not support the PARALLEL thread model, not scanning")
        } else if !next.capabilities().can_cache {
            Some(
                "underlying plugin does not support NBD_CMD_CACHE, not scanning; \
                 try adding --filter=cache after this filter",
            )
        } else {
            None
        }
    }
}

/// The scanning thread of a connection: caches `next` piece by piece.
fn scan(next: DeviceRef, cfg: ScanConfig, clock: Arc<Mutex<u64>>, orders: Arc<Mutex<Orders>>) {
    let size = next.size();
    loop {
        let mut offset = if cfg.clock { *lock(&clock) } else { 0 };
        while offset < size {
            {
                let mut o = lock(&orders);
                if o.quit {
                    return;
                }
                if let Some(end) = o.read_to.take() {
                    offset = offset.max(end);
                }
            }
            {
                let mut c = lock(&clock);
                *c = (*c).max(offset);
            }
            if offset < size {
                // A failed prefetch costs nothing but the prefetch.
                let _ = next.cache(offset, cfg.size.min(size - offset));
            }
            offset += cfg.size;
        }
        if !cfg.forever {
            return;
        }
        *lock(&clock) = 0;
    }
}

impl Filter for Scan {
    fn name(&self) -> &str {
        "scan"
    }
    fn submits_below(&self) -> bool {
        true
    }
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        if let Request::Read { .. } | Request::ReadTo { .. } = req {
            let (offset, len) = req.span();
            self.note_read(offset + len);
        }
        Route::Below(req)
    }
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Scan>> {
        if let Some(why) = Scan::why_not(&**next, session) {
            eprintln!("diskit: scan: warning: {why}");
            return Ok(None);
        }
        let orders = Arc::new(Mutex::new(Orders::default()));
        let (cfg, clock, below, told) =
            (self.cfg, self.clock.clone(), next.clone(), orders.clone());
        let thread = std::thread::Builder::new()
            .name("scan".into())
            .spawn(move || scan(below, cfg, clock, told))?;
        Ok(Some(Scan {
            cfg: self.cfg,
            clock: self.clock.clone(),
            scanner: Some(Scanner {
                orders,
                thread: Some(thread),
            }),
        }))
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.note_read(offset + buf.len() as u64);
        next.read_at(buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Probe;
    use diskit_core::Capabilities;

    /// Waits (10 s at most) until `probe` was asked to cache `n` pieces.
    fn cached(probe: &Probe, n: usize) -> Vec<(u64, u64)> {
        for _ in 0..1000 {
            if lock(&probe.cached).len() >= n {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        lock(&probe.cached).clone()
    }

    fn scan_over(probe: &Arc<Probe>, params: &[(&str, &str)]) -> DeviceRef {
        let mut c = ScanConfig::default();
        for (k, v) in params {
            c.set(k, v).unwrap();
        }
        c.finish().unwrap();
        c.stack(probe.clone()).unwrap()
    }

    #[test]
    fn a_connection_caches_the_disk_in_pieces_and_the_next_goes_on() {
        const M: u64 = 1 << 20;
        let probe = Arc::new(Probe::new(4 * M + 512));
        let d = scan_over(&probe, &[("scan-size", "1M"), ("scan-ahead", "false")]);
        let view = d.connect(&Session::default()).unwrap().unwrap();
        let all = cached(&probe, 5);
        drop(view);
        let pieces = [(0, M), (M, M), (2 * M, M), (3 * M, M), (4 * M, 512)];
        assert_eq!(all, pieces);
        // The clock: the next connection starts where the last got to.
        let view = d.connect(&Session::default()).unwrap().unwrap();
        assert_eq!(cached(&probe, 6)[5], (4 * M, 512));
        drop(view);
        // Nothing for another export, or below without cache.
        let other = Session {
            export: "other".into(),
            ..Session::default()
        };
        assert!(d.connect(&other).unwrap().is_none());
        let none = Arc::new(Probe::new(M).caps(|c| Capabilities {
            can_cache: false,
            ..c
        }));
        assert!(
            scan_over(&none, &[])
                .connect(&Session::default())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn scan_size_is_a_power_of_two_within_bounds() {
        for bad in ["256", "64M", "3000"] {
            let mut c = ScanConfig::default();
            c.set("scan-size", bad).unwrap();
            assert!(c.finish().is_err(), "{bad}");
        }
        assert!(ScanConfig::default().set("scan-ahead", "maybe").is_err());
    }
}
