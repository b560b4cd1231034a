//! Ends connections whose server stops answering: a connection with
//! requests in flight that hears nothing from its server for the reply
//! timeout is shut down, and its requests fail with an error saying so,
//! instead of waiting forever. An idle connection (nothing in flight) is
//! never timed out.
//!
//! One thread for the whole process looks at every connection once a
//! second (more often for short timeouts). The timeout is 300 seconds, long
//! enough for a flush of a large cache on slow storage;
//! `DISKIT_NBD_TIMEOUT=SECONDS` (or [`set_timeout`]) changes it, and 0
//! turns it off.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use diskit_core::sync::lock;

/// The default reply timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// What the watchdog needs of a connection.
pub(crate) trait Watched: Send + Sync {
    /// Whether requests are waiting for replies.
    fn busy(&self) -> bool;
    /// Milliseconds since [`epoch`] at the last sign of life: a reply
    /// from the server, or the first request after an idle spell.
    fn last_heard(&self) -> u64;
    /// Ends the connection with `why` as its requests' error.
    fn time_out(&self, why: String);
}

/// A timestamp source shared by the connections and the watchdog.
pub(crate) fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// A clock cell a connection updates on each sign of life.
#[derive(Debug)]
pub(crate) struct Heard(AtomicU64);

impl Heard {
    /// Now.
    pub(crate) fn new() -> Heard {
        Heard(AtomicU64::new(now_ms()))
    }

    /// Records a sign of life now.
    pub(crate) fn touch(&self) {
        self.0.store(now_ms(), Ordering::Relaxed);
    }

    /// The last sign of life.
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The timeout in milliseconds; [`UNSET`] until first asked for, 0 for none.
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(UNSET);
const UNSET: u64 = u64::MAX;

/// The reply timeout: what [`set_timeout`] set, else `DISKIT_NBD_TIMEOUT`
/// seconds (0: none), else 300 s.
pub fn timeout() -> Option<Duration> {
    let mut ms = TIMEOUT_MS.load(Ordering::Relaxed);
    if ms == UNSET {
        let from_env = from_env();
        ms = from_env.map_or(0, |d| d.as_millis().max(1) as u64);
        // A concurrent set_timeout wins.
        ms = match TIMEOUT_MS.compare_exchange(UNSET, ms, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => ms,
            Err(current) => current,
        };
    }
    (ms != 0).then(|| Duration::from_millis(ms))
}

/// Sets the reply timeout for every connection of the process (`None`:
/// wait for ever), overriding `DISKIT_NBD_TIMEOUT`.
pub fn set_timeout(limit: Option<Duration>) {
    let ms = limit.map_or(0, |d| d.as_millis().max(1) as u64);
    TIMEOUT_MS.store(ms, Ordering::Relaxed);
}

fn from_env() -> Option<Duration> {
    match std::env::var("DISKIT_NBD_TIMEOUT") {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(0.0) => None,
            Ok(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
            _ => {
                eprintln!(
                    "diskit: DISKIT_NBD_TIMEOUT={v}: not a number of seconds; \
                     using {} s",
                    DEFAULT_TIMEOUT.as_secs()
                );
                Some(DEFAULT_TIMEOUT)
            }
        },
        Err(_) => Some(DEFAULT_TIMEOUT),
    }
}

static WATCHED: Mutex<Vec<Weak<dyn Watched>>> = Mutex::new(Vec::new());

/// Puts `conn` under watch (nothing happens without a timeout). The
/// watchdog forgets it when it is dropped.
pub(crate) fn watch(conn: Weak<dyn Watched>) {
    if timeout().is_none() {
        return;
    }
    lock(&WATCHED).push(conn);
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("nbd-client-watchdog".into())
            .spawn(|| {
                loop {
                    let limit = timeout();
                    let tick = limit.map_or(Duration::from_secs(1), |l| {
                        (l / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
                    });
                    std::thread::sleep(tick);
                    if let Some(limit) = limit {
                        check(limit);
                    }
                }
            });
    });
}

/// One look at every connection.
fn check(limit: Duration) {
    let live: Vec<Arc<dyn Watched>> = {
        let mut w = lock(&WATCHED);
        w.retain(|c| c.strong_count() > 0);
        w.iter().filter_map(Weak::upgrade).collect()
    };
    let now = now_ms();
    let limit_ms = limit.as_millis() as u64;
    for c in live {
        if c.busy() && now.saturating_sub(c.last_heard()) >= limit_ms {
            c.time_out(format!(
                "the NBD server sent nothing for {} with requests in flight \
                 (DISKIT_NBD_TIMEOUT sets the limit, in seconds)",
                describe(limit)
            ));
        }
    }
}

fn describe(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.3} s", d.as_secs_f64())
    }
}
