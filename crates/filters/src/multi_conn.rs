//! The multi-conn filter (nbdkit-multi-conn-filter): advertises, emulates
//! or hides NBD's multi-conn (a flush on one connection is seen by all),
//! and saves flushes that nothing made necessary.
//!
//! - `multi-conn-mode=auto` (default): `plugin` when the device below
//!   advertises multi-conn, `emulate` otherwise. `emulate`: advertise it
//!   and make it true, by passing every flush (and every FUA request, as
//!   a write then a flush) to every connection of the group below.
//!   `plugin`: advertise what the device below does. `disable`: never
//!   advertise it. `unsafe`: always advertise it, with no emulation.
//! - `multi-conn-track-dirty=connection` (default, also `conn`): a
//!   connection that neither wrote since its last flush nor read since
//!   another connection's write is not flushed; `fast`: flushes are
//!   skipped while no connection wrote since the last flush; `off`: every
//!   flush passes.
//! - `multi-conn-exportname=BOOL` (also `multi-conn-export-name`): group
//!   connections by export name, so that emulated flushes reach only the
//!   connections to the same export (default: one group).
//!
//! Emulation needs a device below that can flush: a connection to one
//! that cannot is refused, as nbdkit refuses it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Error, Filter, Result, Session, WriteFlags, ZeroFlags,
};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &[
    "multi-conn-mode",
    "multi-conn-track-dirty",
    "multi-conn-exportname",
    "multi-conn-export-name",
];

/// `multi-conn-mode=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// `plugin` if the device below has multi-conn, else `emulate`.
    #[default]
    Auto,
    /// Flush every connection on a flush.
    Emulate,
    /// What the device below says.
    Plugin,
    /// Advertise multi-conn without making it true.
    Unsafe,
    /// Never advertise it.
    Disable,
}

/// `multi-conn-track-dirty=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Track {
    /// Per connection.
    #[default]
    Connection,
    /// One flag for all connections.
    Fast,
    /// Every flush passes.
    Off,
}

/// The parameters, as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MultiConnConfig {
    /// The mode.
    pub mode: Mode,
    /// The dirty tracking.
    pub track: Track,
    /// Group connections by export name.
    pub by_name: bool,
}

impl Configure for MultiConnConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "multi-conn-mode" => {
                self.mode = params::choice(
                    "multi-conn",
                    key,
                    value,
                    &[
                        ("auto", Mode::Auto),
                        ("emulate", Mode::Emulate),
                        ("plugin", Mode::Plugin),
                        ("unsafe", Mode::Unsafe),
                        ("disable", Mode::Disable),
                    ],
                )?
            }
            "multi-conn-track-dirty" => {
                self.track = params::choice(
                    "multi-conn",
                    key,
                    value,
                    &[
                        ("connection", Track::Connection),
                        ("conn", Track::Connection),
                        ("fast", Track::Fast),
                        ("off", Track::Off),
                    ],
                )?
            }
            "multi-conn-exportname" | "multi-conn-export-name" => {
                self.by_name = params::boolean("multi-conn", key, value)?
            }
            _ => return Err(unknown("multi-conn", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(MultiConn::new(*self), next))
    }
}

/// A connection wrote since it was last flushed.
const WROTE: u8 = 1;
/// A connection read since it was last flushed.
const READ: u8 = 2;

/// One connection, as its group knows it.
struct Member {
    /// The connection's view of the device below.
    next: DeviceRef,
    dirty: AtomicU8,
}

/// The connections that see each other's flushes.
#[derive(Default)]
struct Group {
    members: Mutex<Vec<Arc<Member>>>,
    /// Some connection wrote since the last flush.
    dirty: AtomicBool,
}

/// The groups, by export name (one unnamed group without
/// `multi-conn-exportname`).
#[derive(Default)]
struct Groups(Mutex<HashMap<String, Arc<Group>>>);

/// A connection's place in its group.
struct Joined {
    key: String,
    group: Arc<Group>,
    me: Arc<Member>,
}

/// The filter: the shared stack's, or one connection's view of it.
pub struct MultiConn {
    config: MultiConnConfig,
    groups: Arc<Groups>,
    joined: Option<Joined>,
}

impl std::fmt::Debug for MultiConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiConn")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl MultiConn {
    /// The filter with no connection yet.
    pub fn new(config: MultiConnConfig) -> MultiConn {
        MultiConn {
            config,
            groups: Arc::default(),
            joined: None,
        }
    }

    /// The mode in effect over `next`.
    fn mode(&self, next: &dyn BlockDevice) -> Mode {
        match self.config.mode {
            Mode::Auto if next.capabilities().can_multi_conn => Mode::Plugin,
            Mode::Auto => Mode::Emulate,
            m => m,
        }
    }

    fn mark(&self, write: bool) {
        let Some(j) = &self.joined else { return };
        match self.config.track {
            Track::Connection => {
                j.me.dirty
                    .fetch_or(if write { WROTE } else { READ }, Ordering::Relaxed);
                if write {
                    j.group.dirty.store(true, Ordering::Relaxed);
                }
            }
            Track::Fast => {
                if write {
                    j.group.dirty.store(true, Ordering::Relaxed);
                }
            }
            Track::Off => {}
        }
    }

    /// Runs a write-like request: in emulation a FUA request is the
    /// request, then a flush of every connection.
    fn write_like(
        &self,
        next: &dyn BlockDevice,
        fua: bool,
        run: impl FnOnce(bool) -> Result<()>,
    ) -> Result<()> {
        let emulate = fua && self.mode(next) == Mode::Emulate;
        if !fua || emulate {
            self.mark(true);
        }
        run(fua && !emulate)?;
        if emulate {
            self.flush(next)?;
        }
        Ok(())
    }
}

impl Drop for MultiConn {
    fn drop(&mut self) {
        let Some(j) = self.joined.take() else { return };
        let mut groups = lock(&self.groups.0);
        let mut members = lock(&j.group.members);
        members.retain(|m| !Arc::ptr_eq(m, &j.me));
        if members.is_empty() {
            groups.remove(&j.key);
        }
    }
}

impl Filter for MultiConn {
    fn name(&self) -> &str {
        "multi-conn"
    }
    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<MultiConn>> {
        if self.mode(&**next) == Mode::Emulate && !next.capabilities().can_flush {
            return Err(Error::invalid(
                "multi-conn: emulating multi-conn requires working flush",
            ));
        }
        let key = if self.config.by_name {
            session.export.clone()
        } else {
            String::new()
        };
        let me = Arc::new(Member {
            next: next.clone(),
            dirty: AtomicU8::new(0),
        });
        let group = {
            let mut groups = lock(&self.groups.0);
            let group = groups.entry(key.clone()).or_default().clone();
            lock(&group.members).push(me.clone());
            group
        };
        Ok(Some(MultiConn {
            config: self.config,
            groups: self.groups.clone(),
            joined: Some(Joined { key, group, me }),
        }))
    }
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        let caps = next.capabilities();
        let can_multi_conn = match self.mode(next) {
            Mode::Emulate | Mode::Unsafe => true,
            Mode::Plugin | Mode::Auto => caps.can_multi_conn,
            Mode::Disable => false,
        };
        Capabilities {
            can_multi_conn,
            ..caps
        }
    }
    fn read_at(&self, next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.mark(false);
        next.read_at(buf, offset)
    }
    fn cache(&self, next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.mark(false);
        next.cache(offset, len)
    }
    fn write_at(
        &self,
        next: &dyn BlockDevice,
        buf: &[u8],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.write_like(next, flags.fua, |fua| {
            next.write_at(buf, offset, WriteFlags { fua })
        })
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        self.write_like(next, flags.fua, |fua| {
            next.write_zeroes(offset, len, ZeroFlags { fua, ..flags })
        })
    }
    fn trim(&self, next: &dyn BlockDevice, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.write_like(next, flags.fua, |fua| {
            next.trim(offset, len, WriteFlags { fua })
        })
    }
    fn flush(&self, next: &dyn BlockDevice) -> Result<()> {
        let track = self.config.track;
        let Some(j) = &self.joined else {
            // Outside any connection: flush below, and every connection
            // when emulating.
            next.flush()?;
            if self.mode(next) == Mode::Emulate {
                for g in lock(&self.groups.0).values() {
                    for m in lock(&g.members).iter() {
                        m.next.flush()?;
                    }
                }
            }
            return Ok(());
        };
        if self.mode(next) == Mode::Emulate {
            let members = lock(&j.group.members);
            let group_dirty = j.group.dirty.load(Ordering::Relaxed);
            for m in members.iter() {
                let dirty = m.dirty.load(Ordering::Relaxed);
                if track == Track::Off
                    || (group_dirty && (track == Track::Fast || dirty & READ != 0))
                    || dirty & WROTE != 0
                {
                    m.next.flush()?;
                    m.dirty.store(0, Ordering::Relaxed);
                }
            }
            j.group.dirty.store(false, Ordering::Relaxed);
            return Ok(());
        }
        if track != Track::Off && !j.group.dirty.load(Ordering::Relaxed) {
            return Ok(());
        }
        next.flush()?;
        match track {
            Track::Connection if next.capabilities().can_multi_conn => {
                for m in lock(&j.group.members).iter() {
                    m.dirty.store(0, Ordering::Relaxed);
                }
                j.group.dirty.store(false, Ordering::Relaxed);
            }
            Track::Connection => j.me.dirty.store(0, Ordering::Relaxed),
            Track::Fast => j.group.dirty.store(false, Ordering::Relaxed),
            Track::Off => {}
        }
        Ok(())
    }
    fn reads_unchanged(&self) -> bool {
        // Reads only mark the connection; a view that skips the mark
        // would let a flush be skipped that a read made necessary.
        self.config.track == Track::Off
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Probe, kv};
    use diskit_core::Filtered;

    type Stack = Arc<Filtered<MultiConn>>;

    fn setup(params: &[(&str, &str)], multi_conn: bool) -> (Arc<Probe>, DeviceRef) {
        let (below, stack) = setup_stack(params, multi_conn);
        (below, stack)
    }

    fn setup_stack(params: &[(&str, &str)], multi_conn: bool) -> (Arc<Probe>, Stack) {
        let config = MultiConnConfig::from_params(&kv(params)).unwrap();
        // Memory that flushes, with or without multi-conn.
        let below = Arc::new(Probe::new(1 << 20).caps(|c| Capabilities {
            can_flush: true,
            can_multi_conn: multi_conn,
            ..c
        }));
        let dev = Arc::new(Filtered::new(
            MultiConn::new(config),
            below.clone() as DeviceRef,
        ));
        (below, dev)
    }

    fn conn(dev: &DeviceRef, export: &str) -> DeviceRef {
        let s = Session {
            export: export.into(),
            ..Session::default()
        };
        dev.connect(&s).unwrap().unwrap()
    }

    #[test]
    fn emulation_flushes_every_dirty_connection() {
        let (below, stack) = setup_stack(&[("multi-conn-mode", "emulate")], true);
        let dev: DeviceRef = stack.clone();
        assert!(dev.capabilities().can_multi_conn);
        let (a, b, c) = (conn(&dev, ""), conn(&dev, ""), conn(&dev, ""));
        a.write_at(&[1; 512], 0, WriteFlags::NONE).unwrap();
        let mut buf = [0u8; 512];
        b.read_at(&mut buf, 0).unwrap();
        // a wrote, b read since: both flushed; c did nothing.
        c.flush().unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 2);
        // All clean now.
        c.flush().unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 2);
        // A FUA write is a write and a flush of the connections.
        b.write_at(&[2; 512], 0, WriteFlags::FUA).unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 3);
        assert_eq!(lock(&stack.filter().groups.0).len(), 1);
        drop((a, b, c));
        assert!(lock(&stack.filter().groups.0).is_empty());
    }

    #[test]
    fn auto_is_plugin_over_multi_conn_and_emulate_otherwise() {
        let (below, dev) = setup(&[], true);
        assert!(dev.capabilities().can_multi_conn);
        let a = conn(&dev, "");
        // Clean: the flush is saved.
        a.flush().unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 0);
        a.write_at(&[1; 512], 0, WriteFlags::NONE).unwrap();
        a.flush().unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 1);

        let (below, dev) = setup(&[("multi-conn-track-dirty", "off")], false);
        assert!(dev.capabilities().can_multi_conn);
        let (a, _b) = (conn(&dev, ""), conn(&dev, ""));
        a.flush().unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 2);

        let (_, dev) = setup(&[("multi-conn-mode", "disable")], true);
        assert!(!dev.capabilities().can_multi_conn);
        let (_, dev) = setup(&[("multi-conn-mode", "unsafe")], false);
        assert!(dev.capabilities().can_multi_conn);
        let (_, dev) = setup(&[("multi-conn-mode", "plugin")], false);
        assert!(!dev.capabilities().can_multi_conn);
    }

    #[test]
    fn groups_by_export_name_when_asked() {
        let (below, dev) = setup(
            &[
                ("multi-conn-mode", "emulate"),
                ("multi-conn-exportname", "true"),
                ("multi-conn-track-dirty", "off"),
            ],
            false,
        );
        let (a, _b, _c) = (conn(&dev, "x"), conn(&dev, "x"), conn(&dev, "y"));
        a.flush().unwrap();
        assert_eq!(below.flushes.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn emulation_needs_flush_and_bad_parameters_are_named() {
        let config = MultiConnConfig::default();
        // Memory has nothing to flush.
        let mem: DeviceRef = Arc::new(diskit_backends::MemoryDevice::new(4096));
        assert!(!mem.capabilities().can_flush);
        let dev: DeviceRef = Arc::new(Filtered::new(
            MultiConn::new(MultiConnConfig {
                mode: Mode::Emulate,
                ..config
            }),
            mem,
        ));
        let e = dev.connect(&Session::default()).err().unwrap();
        assert!(e.to_string().contains("requires working flush"), "{e}");
        let e =
            MultiConnConfig::from_params(&[("multi-conn-mode".into(), "x".into())]).unwrap_err();
        assert!(e.to_string().contains("multi-conn-mode"), "{e}");
    }
}
