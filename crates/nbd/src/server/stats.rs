//! Request counters, kept per export and per connection.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::proto::{CMD_BLOCK_STATUS, command_name};

const KINDS: usize = CMD_BLOCK_STATUS as usize + 2;

/// Counters of requests, bytes and errors.
#[derive(Debug, Default)]
pub struct Stats {
    requests: [AtomicU64; KINDS],
    errors: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    connections: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Requests per command (index = `CMD_*`; the last slot counts unknown commands).
    pub requests: [u64; KINDS],
    /// Requests answered with an error.
    pub errors: u64,
    /// Bytes sent to clients by READ.
    pub bytes_read: u64,
    /// Bytes received from clients by WRITE.
    pub bytes_written: u64,
    /// Connections that reached transmission.
    pub connections: u64,
}

impl Stats {
    /// Counts one request of `command`; `read`/`written` are payload bytes.
    pub fn record(&self, command: u16, ok: bool, read: u64, written: u64) {
        let i = usize::from(command).min(KINDS - 1);
        self.requests[i].fetch_add(1, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
        if read > 0 {
            self.bytes_read.fetch_add(read, Relaxed);
        }
        if written > 0 {
            self.bytes_written.fetch_add(written, Relaxed);
        }
    }

    /// Counts a connection.
    pub fn connected(&self) {
        self.connections.fetch_add(1, Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: std::array::from_fn(|i| self.requests[i].load(Relaxed)),
            errors: self.errors.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            connections: self.connections.load(Relaxed),
        }
    }
}

impl StatsSnapshot {
    /// Total requests.
    pub fn total(&self) -> u64 {
        self.requests.iter().sum()
    }

    /// A one-line summary: "12 requests (read 8, write 4), 1 errors, ...".
    pub fn summary(&self) -> String {
        let mut s = format!("{} requests", self.total());
        let parts: Vec<String> = self
            .requests
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| format!("{} {n}", command_name(i as u16)))
            .collect();
        if !parts.is_empty() {
            let _ = write!(s, " ({})", parts.join(", "));
        }
        let _ = write!(
            s,
            ", {} errors, {} bytes read, {} bytes written",
            self.errors, self.bytes_read, self.bytes_written
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up() {
        let s = Stats::default();
        s.record(0, true, 512, 0);
        s.record(1, false, 0, 4096);
        s.record(99, false, 0, 0);
        let snap = s.snapshot();
        assert_eq!(snap.total(), 3);
        assert_eq!(snap.errors, 2);
        assert_eq!(snap.bytes_read, 512);
        assert_eq!(snap.requests[KINDS - 1], 1);
        assert!(
            snap.summary()
                .starts_with("3 requests (read 1, write 1, unknown 1)")
        );
    }
}
