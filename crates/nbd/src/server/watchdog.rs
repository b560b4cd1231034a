//! A deadline on the handshake: a client that has not picked an export
//! after the timeout (a slow-loris client trickling option bytes, or one
//! that never speaks) gets its socket shut down, which ends the blocked
//! handshake read and frees the connection's thread.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use diskit_core::sync;

/// Cuts a connection off from another thread (shuts its socket down).
pub type Cutoff = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    disarmed: bool,
    fired: bool,
}

/// A running deadline; [`Watchdog::disarm`] stops it.
pub struct Watchdog {
    state: Arc<(Mutex<State>, Condvar)>,
}

impl Watchdog {
    /// Calls `cutoff` after `timeout` unless disarmed first. The timer is
    /// a small thread that ends as soon as the watchdog is disarmed.
    pub fn start(timeout: Duration, cutoff: Cutoff) -> Watchdog {
        let state = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let s = state.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-handshake-timer".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                let (lock, cv) = &*s;
                let guard = sync::lock(lock);
                let (mut st, _) = cv
                    .wait_timeout_while(guard, timeout, |st| !st.disarmed)
                    .unwrap_or_else(|p| p.into_inner());
                if !st.disarmed {
                    st.fired = true;
                    drop(st);
                    cutoff();
                }
            });
        if let Err(e) = spawned {
            // Without a timer the connection is served without a deadline.
            super::log_line!("diskit: cannot start a handshake timer: {e}");
        }
        Watchdog { state }
    }

    /// Stops the timer; returns whether it fired (the connection was cut off).
    pub fn disarm(self) -> bool {
        let (lock, cv) = &*self.state;
        let mut st = sync::lock(lock);
        st.disarmed = true;
        cv.notify_all();
        st.fired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    #[test]
    fn fires_after_the_timeout_unless_disarmed() {
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        let w = Watchdog::start(
            Duration::from_millis(50),
            Box::new(move || c.store(true, Ordering::SeqCst)),
        );
        let start = Instant::now();
        while !cut.load(Ordering::SeqCst) {
            assert!(start.elapsed() < Duration::from_secs(10), "never fired");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(w.disarm());

        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        let w = Watchdog::start(
            Duration::from_millis(50),
            Box::new(move || c.store(true, Ordering::SeqCst)),
        );
        assert!(!w.disarm());
        std::thread::sleep(Duration::from_millis(150));
        assert!(!cut.load(Ordering::SeqCst), "fired after disarm");
    }
}
