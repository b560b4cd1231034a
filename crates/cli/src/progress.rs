//! Progress display for long operations (`-p`).
//!
//! On a terminal: a live bar with percentage, rate and time left. Otherwise
//! qemu-img's lines, `    (xx.xx/100%)` each ended by a carriage return.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use diskit_copy::Progress;

/// A thread that prints progress until stopped.
pub struct ProgressPrinter {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressPrinter {
    /// Starts printing `progress` to standard output, as qemu-img does.
    pub fn start(progress: Arc<Progress>) -> ProgressPrinter {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let tty = std::io::stdout().is_terminal();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let mut last_line = String::new();
            let mut last_pct = -1.0f64;
            loop {
                let finished = s.load(Ordering::Relaxed);
                let (done, total) = progress.get();
                let pct = if total == 0 {
                    100.0
                } else {
                    done as f64 * 100.0 / total as f64
                };
                let mut out = std::io::stdout().lock();
                if tty {
                    let _ = write!(out, "\r{}", bar(pct, done, total, started.elapsed()));
                } else {
                    let line = format!("    ({pct:.2}/100%)\r");
                    if line != last_line && (pct - last_pct >= 1.0 || finished) {
                        let _ = write!(out, "{line}");
                        last_line = line;
                        last_pct = pct;
                    }
                }
                let _ = out.flush();
                if finished {
                    let _ = writeln!(out);
                    return;
                }
                drop(out);
                std::thread::sleep(Duration::from_millis(if tty { 100 } else { 50 }));
            }
        });
        ProgressPrinter {
            stop,
            thread: Some(thread),
        }
    }

    /// Prints the final state and stops.
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ProgressPrinter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn bar(pct: f64, done: u64, total: u64, elapsed: Duration) -> String {
    const WIDTH: usize = 30;
    let filled = ((pct / 100.0) * WIDTH as f64) as usize;
    let secs = elapsed.as_secs_f64().max(1e-3);
    let rate = done as f64 / secs;
    let eta = if rate > 0.0 && total > done {
        (total - done) as f64 / rate
    } else {
        0.0
    };
    format!(
        "[{}{}] {pct:6.2}% {:>10}/s ETA {:02}:{:02}",
        "#".repeat(filled.min(WIDTH)),
        " ".repeat(WIDTH - filled.min(WIDTH)),
        diskit_core::size::human_size(rate as u64),
        (eta as u64) / 60,
        (eta as u64) % 60
    )
}
