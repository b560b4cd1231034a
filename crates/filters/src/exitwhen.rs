//! The exitwhen filter (nbdkit-exitwhen-filter): the server stops
//! gracefully when an event occurs: it refuses new clients, and stops
//! once the clients connected have left.
//!
//! Events (any number, any of them stops it; none: the filter does
//! nothing): `exit-when-file-created=FILE`, `exit-when-file-deleted=FILE`,
//! `exit-when-pipe-closed=FD` (also `exit-when-fd-closed=`: the read end
//! of a pipe or socket, never read, is closed at the other end),
//! `exit-when-process-exits=PID` (also `exit-when-pid-exits=`: its
//! `/proc/PID/stat`, opened at once, no longer reads), and
//! `exit-when-script=COMMAND` (run by `/bin/sh -c`: exit status 88 is the
//! event, 0 not, others are logged). Events are checked when the server
//! starts (an event already there stops it at once), when a client
//! connects or leaves, and every `exit-when-poll=SECS` (60) while no
//! client is connected. As in exitlast, a client counts from its start
//! of transmission.

use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use diskit_core::params::nbdkit_unsigned;
use diskit_core::sync::lock;
use diskit_core::{BlockDevice, DeviceRef, Error, Filter, Peer, Result, ServerRef, Session};

use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "exit-when-file-created",
    "exit-when-file-deleted",
    "exit-when-pipe-closed",
    "exit-when-fd-closed",
    "exit-when-process-exits",
    "exit-when-pid-exits",
    "exit-when-script",
    "exit-when-poll",
];

/// An event that stops the server.
#[derive(Debug, Clone)]
enum Event {
    /// The file exists.
    Created(PathBuf),
    /// The file no longer exists.
    Deleted(PathBuf),
    /// The other end of this file descriptor is closed.
    PipeClosed(RawFd),
    /// The process whose `/proc/PID/stat` this is has exited.
    ProcessExits(Arc<File>),
    /// The command exits with status 88.
    Script(String),
}

impl Event {
    /// Whether the event has occurred; what fails to be checked is
    /// logged, and is not the event.
    fn occurred(&self) -> bool {
        match self {
            Event::Created(p) => p.exists(),
            Event::Deleted(p) => match p.metadata() {
                Ok(_) => false,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => true,
                Err(e) => {
                    eprintln!("diskit: exit-when-file-deleted: {}: {e}", p.display());
                    false
                }
            },
            Event::PipeClosed(fd) => pipe_closed(*fd),
            Event::ProcessExits(stat) => match stat.read_at(&mut [0u8], 0) {
                Ok(_) => false,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => true,
                Err(e) => {
                    eprintln!("diskit: exit-when-process-exits: read: {e}");
                    false
                }
            },
            Event::Script(cmd) => {
                match std::process::Command::new("/bin/sh")
                    .arg("-c")
                    .arg(cmd)
                    .status()
                {
                    Ok(st) if st.code() == Some(88) => true,
                    Ok(st) if st.success() => false,
                    Ok(st) => {
                        eprintln!("diskit: exit-when-script: {st}");
                        false
                    }
                    Err(e) => {
                        eprintln!("diskit: exit-when-script: {e}");
                        false
                    }
                }
            }
        }
    }
}

/// Whether the other end of `fd` is closed (poll says POLLHUP); a bad
/// descriptor counts, as in nbdkit, so that the mistake stops the server.
fn pipe_closed(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    if r == 1 && p.revents & libc::POLLNVAL != 0 {
        eprintln!("diskit: exit-when-pipe-closed: invalid file descriptor");
        return true;
    }
    r == 1 && p.revents & libc::POLLHUP != 0
}

/// The configuration: the events and how often to poll when idle.
#[derive(Debug, Clone)]
pub struct ExitwhenConfig {
    events: Vec<Event>,
    /// `exit-when-poll=`.
    pub poll: Duration,
}

impl Default for ExitwhenConfig {
    fn default() -> Self {
        ExitwhenConfig {
            events: Vec::new(),
            poll: Duration::from_secs(60),
        }
    }
}

impl Configure for ExitwhenConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let number = |what: &str, max: u64| {
            nbdkit_unsigned(what, value, max).map_err(|e| e.context("exitwhen"))
        };
        let event = match key {
            "exit-when-file-created" => Event::Created(absolute(value)?),
            "exit-when-file-deleted" => Event::Deleted(absolute(value)?),
            "exit-when-pipe-closed" | "exit-when-fd-closed" => {
                Event::PipeClosed(number("exit-when-pipe-closed", i32::MAX as u64)? as RawFd)
            }
            "exit-when-process-exits" | "exit-when-pid-exits" => {
                let pid = number("exit-when-process-exits", u64::MAX)?;
                let path = format!("/proc/{pid}/stat");
                let f = File::open(&path).map_err(|e| {
                    Error::from(e).context(format!("exit-when-process-exits: {path}"))
                })?;
                Event::ProcessExits(Arc::new(f))
            }
            "exit-when-script" => Event::Script(value.to_string()),
            "exit-when-poll" => {
                self.poll = Duration::from_secs(number("exit-when-poll", u32::MAX.into())?);
                return Ok(());
            }
            _ => return Err(unknown("exitwhen", key)),
        };
        self.events.push(event);
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        let shared = Arc::new(Shared {
            events: self.events.clone(),
            poll: self.poll,
            state: Mutex::default(),
            server: OnceLock::new(),
        });
        Ok(over(
            Exitwhen {
                shared,
                counted: false,
            },
            next,
        ))
    }
}

/// `path` made absolute against the current directory.
fn absolute(path: &str) -> Result<PathBuf> {
    std::path::absolute(path).map_err(|e| Error::from(e).context("exitwhen"))
}

/// What the connections share: the events, the count, the server.
struct Shared {
    events: Vec<Event>,
    poll: Duration,
    state: Mutex<State>,
    server: OnceLock<ServerRef>,
}

/// The connections open, and whether an event occurred.
#[derive(Debug, Default)]
struct State {
    connections: u64,
    exiting: bool,
}

impl Shared {
    /// Checks the events, until one occurs; whether one did.
    fn check(&self, st: &mut State) -> bool {
        if !st.exiting {
            st.exiting = self.events.iter().any(Event::occurred);
        }
        st.exiting
    }

    /// Stops the server.
    fn shutdown(&self) {
        if let Some(s) = self.server.get() {
            s.shutdown();
        }
    }
}

/// Checks the events every `poll` while no client is connected, until
/// the filter is gone.
fn poll(shared: Weak<Shared>, every: Duration) {
    loop {
        std::thread::sleep(every);
        let Some(s) = shared.upgrade() else { return };
        let mut st = lock(&s.state);
        if st.connections == 0 && s.check(&mut st) {
            drop(st);
            s.shutdown();
            return;
        }
    }
}

/// The filter; a connection's view is counted until dropped.
pub struct Exitwhen {
    shared: Arc<Shared>,
    counted: bool,
}

impl Drop for Exitwhen {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut st = lock(&self.shared.state);
        self.shared.check(&mut st);
        st.connections -= 1;
        if st.connections == 0 && st.exiting {
            drop(st);
            self.shared.shutdown();
        }
    }
}

impl Filter for Exitwhen {
    fn name(&self) -> &str {
        "exitwhen"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn submits_below(&self) -> bool {
        true
    }
    fn serving(&self, next: &dyn BlockDevice, server: &ServerRef) {
        next.serving(server);
        if self.shared.server.set(server.clone()).is_err() || self.shared.events.is_empty() {
            return;
        }
        let mut st = lock(&self.shared.state);
        if self.shared.check(&mut st) {
            drop(st);
            server.shutdown();
            return;
        }
        let (weak, every) = (Arc::downgrade(&self.shared), self.shared.poll);
        if let Err(e) = std::thread::Builder::new()
            .name("exitwhen".into())
            .spawn(move || poll(weak, every))
        {
            eprintln!("diskit: exitwhen: cannot start the polling thread: {e}");
        }
    }
    fn preconnect(&self, next: &dyn BlockDevice, peer: &Peer) -> Result<()> {
        if self.shared.check(&mut lock(&self.shared.state)) {
            return Err(Error::invalid(
                "exitwhen: nbdkit is exiting: rejecting new connection",
            ));
        }
        next.preconnect(peer)
    }
    fn connect(&self, _next: &DeviceRef, _session: &Session) -> Result<Option<Exitwhen>> {
        lock(&self.shared.state).connections += 1;
        Ok(Some(Exitwhen {
            shared: self.shared.clone(),
            counted: true,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Stops;
    use diskit_backends::MemoryDevice;

    fn device(params: &[(&str, &str)]) -> DeviceRef {
        let mut c = ExitwhenConfig::default();
        for (k, v) in params {
            c.set(k, v).unwrap();
        }
        c.stack(Arc::new(MemoryDevice::new(4096))).unwrap()
    }

    #[test]
    fn an_event_refuses_new_clients_and_stops_after_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("stop");
        let d = device(&[("exit-when-file-created", flag.to_str().unwrap())]);
        let stops = Arc::new(Stops::default());
        d.serving(&(stops.clone() as ServerRef));
        let peer = Peer::default();
        d.preconnect(&peer).unwrap();
        let a = d.connect(&Session::default()).unwrap();
        std::fs::write(&flag, "").unwrap();
        let e = d.preconnect(&peer).unwrap_err();
        assert!(e.to_string().contains("rejecting new connection"), "{e}");
        assert_eq!(stops.count(), 0);
        drop(a);
        assert_eq!(stops.count(), 1);
    }

    #[test]
    fn an_event_there_at_the_start_stops_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("gone");
        let d = device(&[
            ("exit-when-script", "exit 0"),
            ("exit-when-file-deleted", gone.to_str().unwrap()),
        ]);
        let stops = Arc::new(Stops::default());
        d.serving(&(stops.clone() as ServerRef));
        assert_eq!(stops.count(), 1);
    }

    #[test]
    fn scripts_and_bad_values() {
        let d = device(&[("exit-when-script", "exit 3"), ("exit-when-poll", "1")]);
        let stops = Arc::new(Stops::default());
        d.serving(&(stops.clone() as ServerRef));
        assert_eq!(stops.count(), 0);
        let d = device(&[("exit-when-script", "exit 88")]);
        assert!(d.preconnect(&Peer::default()).is_err());
        let mut c = ExitwhenConfig::default();
        assert!(c.set("exit-when-poll", "x").is_err());
        assert!(c.set("exit-when-process-exits", "0x7fffffff").is_err());
        assert!(c.set("exit-when-bogus", "1").is_err());
    }
}
