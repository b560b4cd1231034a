//! A few threads of a device's own that run jobs handed to them: the
//! devices that complete submitted requests elsewhere (an http source's
//! requests, librbd's completions handing read data on to a sink) run
//! the slow part there, not in the submitter's thread or a library's.

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, OnceLock};

use crate::sync::lock;

/// One job.
pub type Job = Box<dyn FnOnce() + Send>;

/// `threads` threads named `name`, started at the first job; they end
/// when the pool is dropped and the jobs sent before are done.
pub struct Workers {
    name: &'static str,
    threads: usize,
    sender: OnceLock<Mutex<SyncSender<Job>>>,
}

impl Workers {
    /// A pool of `threads` threads (at least one), none started yet.
    pub fn new(name: &'static str, threads: usize) -> Workers {
        Workers {
            name,
            threads: threads.max(1),
            sender: OnceLock::new(),
        }
    }

    /// Runs `job` on one of the threads; waits while twice as many jobs
    /// as threads are waiting already.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        let sender = self.sender.get_or_init(|| {
            let (tx, rx) = sync_channel::<Job>(self.threads * 2);
            let rx = Arc::new(Mutex::new(rx));
            for _ in 0..self.threads {
                let rx: Arc<Mutex<Receiver<Job>>> = rx.clone();
                std::thread::Builder::new()
                    .name(self.name.into())
                    .spawn(move || {
                        loop {
                            let job = lock(&rx).recv();
                            match job {
                                Ok(job) => job(),
                                Err(_) => return,
                            }
                        }
                    })
                    .expect("start a worker thread");
            }
            Mutex::new(tx)
        });
        let tx = lock(sender).clone();
        // The threads live as long as the pool's sender: a send fails
        // only after they ended, which a live pool never sees.
        let _ = tx.send(Box::new(job));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn jobs_run_on_the_pool_and_it_ends_when_dropped() {
        let done = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let pool = Workers::new("diskit-test", 3);
            for _ in 0..20 {
                let (done, tx) = (done.clone(), tx.clone());
                pool.run(move || {
                    let name = std::thread::current().name().map(str::to_string);
                    done.fetch_add(1, Ordering::SeqCst);
                    tx.send(name).unwrap();
                });
            }
        }
        drop(tx);
        let names: Vec<_> = rx.iter().collect();
        assert_eq!(names.len(), 20);
        assert!(names.iter().all(|n| n.as_deref() == Some("diskit-test")));
        assert_eq!(done.load(Ordering::SeqCst), 20);
    }
}
