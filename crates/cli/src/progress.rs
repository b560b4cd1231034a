//! Progress display for long operations (`-p`).
//!
//! On a terminal: a live bar with percentage, rate and time left. Otherwise
//! qemu-img's updates, `    (xx.xx/100%)` each ended by a carriage return:
//! one at the start, one whenever progress moves by more than a point, and
//! a final 100.00 followed by a newline.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use diskit_copy::Progress;

/// A thread that prints progress until stopped.
pub struct ProgressPrinter {
    stop: Arc<AtomicBool>,
    completed: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressPrinter {
    /// Starts printing `progress` to standard output, as qemu-img does.
    pub fn start(progress: Arc<Progress>) -> ProgressPrinter {
        let tty = std::io::stdout().is_terminal();
        let mut out = std::io::stdout();
        if !tty {
            let _ = write!(out, "    (0.00/100%)\r");
            let _ = out.flush();
        }
        let mut last_pct = 0.0f64;
        let period = Duration::from_millis(if tty { 100 } else { 50 });
        ProgressPrinter::spawn(progress, period, move |t| {
            if tty {
                let _ = write!(out, "\r{}", bar(t));
            } else if t.pct - last_pct > 1.0 {
                let _ = write!(out, "    ({:.2}/100%)\r", t.pct);
                last_pct = t.pct;
            }
            if t.stopping {
                if !tty && t.completed {
                    let _ = write!(out, "    (100.00/100%)\r");
                }
                let _ = writeln!(out);
            }
            let _ = out.flush();
        })
    }

    /// Calls `print` with the progress every `period`, on a thread of its
    /// own, until stopped; the last call is told it is the last.
    fn spawn(
        progress: Arc<Progress>,
        period: Duration,
        mut print: impl FnMut(&Tick) + Send + 'static,
    ) -> ProgressPrinter {
        let stop = Arc::new(AtomicBool::new(false));
        let completed = Arc::new(AtomicBool::new(false));
        let (s, c) = (stop.clone(), completed.clone());
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            loop {
                let stopping = s.load(Ordering::Relaxed);
                let completed = stopping && c.load(Ordering::Relaxed);
                let (pct, done, total) = percent(&progress, completed);
                print(&Tick {
                    pct,
                    done,
                    total,
                    elapsed: started.elapsed(),
                    stopping,
                    completed,
                });
                if stopping {
                    return;
                }
                std::thread::sleep(period);
            }
        });
        ProgressPrinter {
            stop,
            completed,
            thread: Some(thread),
        }
    }

    /// Marks the operation as completed: the final line says 100%.
    pub fn completed(&self) {
        self.completed.store(true, Ordering::Relaxed);
    }

    /// Prints the final state and stops.
    pub fn finish(mut self) {
        self.stop_thread();
    }

    fn stop_thread(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ProgressPrinter {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

/// Where `diskit copy` shows its progress (nbdcopy's `-p` and
/// `--progress=FD`).
#[derive(Debug, Clone, Copy)]
pub enum CopyProgressTo {
    /// A bar on standard error, with rate and time left on a terminal.
    Stderr,
    /// `N/100` lines on this descriptor, one each time the percentage
    /// changes, for programs to read.
    Fd(i32),
}

impl ProgressPrinter {
    /// Starts printing a copy's progress as nbdcopy does.
    pub fn start_copy(progress: Arc<Progress>, to: CopyProgressTo) -> ProgressPrinter {
        let tty = std::io::stderr().is_terminal();
        let mut last: Option<u64> = None;
        // Always 0% first, as nbdcopy starts.
        if let CopyProgressTo::Fd(fd) = to {
            write_fd(fd, b"0/100\n");
            last = Some(0);
        }
        ProgressPrinter::spawn(progress, Duration::from_millis(100), move |t| {
            let whole = t.pct as u64;
            match to {
                CopyProgressTo::Fd(fd) => {
                    if last != Some(whole) {
                        write_fd(fd, format!("{whole}/100\n").as_bytes());
                    }
                }
                CopyProgressTo::Stderr => {
                    let mut err = std::io::stderr();
                    let line = if tty { bar(t) } else { format!("{whole:3}%") };
                    if tty || last != Some(whole) {
                        let _ = write!(err, "\r{line}");
                        if t.stopping {
                            let _ = writeln!(err);
                        }
                        let _ = err.flush();
                    } else if t.stopping {
                        let _ = writeln!(err);
                    }
                }
            }
            last = Some(whole);
        })
    }
}

/// Where an operation is, as a printer's thread sees it each time it
/// wakes.
struct Tick {
    /// Percent done (100 once completed).
    pct: f64,
    /// Bytes done.
    done: u64,
    /// Bytes in all.
    total: u64,
    /// Since the printer started.
    elapsed: Duration,
    /// The printer is stopping: this is the last tick.
    stopping: bool,
    /// The operation was marked completed (on the last tick).
    completed: bool,
}

/// How far along: (percent, bytes done, total); 100 once `completed`.
fn percent(progress: &Progress, completed: bool) -> (f64, u64, u64) {
    let (done, total) = progress.get();
    let pct = if completed || total == 0 {
        100.0
    } else {
        done as f64 * 100.0 / total as f64
    };
    (pct, done, total)
}

/// Writes a progress line to a descriptor the user named; errors are
/// ignored, as nbdcopy ignores them.
fn write_fd(fd: i32, line: &[u8]) {
    // SAFETY: writes a buffer we own; the descriptor is only written to.
    unsafe {
        libc::write(fd, line.as_ptr().cast(), line.len());
    }
}

/// A terminal's bar: percent, rate and time left.
fn bar(t: &Tick) -> String {
    const WIDTH: usize = 30;
    let Tick {
        pct,
        done,
        total,
        elapsed,
        ..
    } = *t;
    let filled = (((pct / 100.0) * WIDTH as f64) as usize).min(WIDTH);
    let secs = elapsed.as_secs_f64().max(1e-3);
    let rate = done as f64 / secs;
    let eta = if rate > 0.0 && total > done {
        (total - done) as f64 / rate
    } else {
        0.0
    };
    format!(
        "[{}{}] {pct:6.2}% {:>10}/s ETA {:02}:{:02}",
        "#".repeat(filled),
        " ".repeat(WIDTH - filled),
        diskit_core::size::human_size(rate as u64),
        (eta as u64) / 60,
        (eta as u64) % 60
    )
}
