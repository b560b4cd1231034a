//! nbdkit's plugin API as a device. A plugin written against that API
//! (a script of nbdkit's sh or eval plugin, and any other plugin that
//! answers method by method) describes itself through [`Callbacks`]: it
//! opens a handle per connection and answers size, capabilities and
//! requests for a handle. [`CallbackDevice`] is the one layer that makes a
//! [`BlockDevice`] of it, as nbdkit's server does: a handle per connection
//! ([`BlockDevice::connect`]), closed when the connection ends; the
//! capabilities asked once per handle; the plugin's thread model kept;
//! FUA emulated by a flush, write-zeroes done by writing zeros where the
//! plugin has no zero of its own, cache emulated by reading; the extents
//! a plugin gives checked and clipped to the request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use diskit_core::device::{check_range, write_zero_buffer};
use diskit_core::serving::{Hangup, Peer, Serialize, ServerRef};
use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, Error, ErrorKind, ExportEntry,
    ExportQuery, Extent, ExtentFlags, Result, Session, WriteFlags, ZeroFlags,
};

/// How many of a plugin's calls may run at once (nbdkit's thread models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThreadModel {
    /// One connection at a time.
    SerializeConnections,
    /// One request at a time, over all connections.
    SerializeAllRequests,
    /// One request at a time on each connection.
    SerializeRequests,
    /// Any number at once.
    Parallel,
}

impl ThreadModel {
    /// The model nbdkit's name spells (`-` or `_` between the words).
    pub fn parse(name: &str) -> Option<ThreadModel> {
        match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "serialize_connections" => Some(ThreadModel::SerializeConnections),
            "serialize_all_requests" => Some(ThreadModel::SerializeAllRequests),
            "serialize_requests" => Some(ThreadModel::SerializeRequests),
            "parallel" => Some(ThreadModel::Parallel),
            _ => None,
        }
    }
}

/// How a plugin handles FUA or cache requests (nbdkit's `can_fua` and
/// `can_cache` answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Not at all.
    None,
    /// By the server: a flush after the write, a read for a cache.
    Emulate,
    /// By the plugin itself.
    Native,
}

impl Support {
    /// The answer nbdkit's name spells.
    pub fn parse(name: &str) -> Option<Support> {
        match name.to_ascii_lowercase().as_str() {
            "none" => Some(Support::None),
            "emulate" => Some(Support::Emulate),
            "native" => Some(Support::Native),
            _ => None,
        }
    }
}

/// A capability nbdkit asks a plugin about with a yes or no.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Can {
    /// `can_write`.
    Write,
    /// `can_flush`.
    Flush,
    /// `can_trim`.
    Trim,
    /// `can_zero`.
    Zero,
    /// `can_fast_zero`.
    FastZero,
    /// `can_extents`.
    Extents,
    /// `can_multi_conn`.
    MultiConn,
    /// `is_rotational`.
    Rotational,
}

impl Can {
    /// The method's name.
    pub fn method(self) -> &'static str {
        match self {
            Can::Write => "can_write",
            Can::Flush => "can_flush",
            Can::Trim => "can_trim",
            Can::Zero => "can_zero",
            Can::FastZero => "can_fast_zero",
            Can::Extents => "can_extents",
            Can::MultiConn => "can_multi_conn",
            Can::Rotational => "is_rotational",
        }
    }
}

/// What a call asked of the server, as nbdkit's `nbdkit_shutdown` and
/// `nbdkit_disconnect` ask it: noted on the calling thread, carried out
/// by [`CallbackDevice`] once the call returns.
#[derive(Debug, Clone, Copy, Default)]
struct Asked {
    shutdown: bool,
    disconnect: bool,
}

thread_local! {
    static ASKED: std::cell::Cell<Asked> = const {
        std::cell::Cell::new(Asked { shutdown: false, disconnect: false })
    };
}

/// Called during a plugin call: the server is to stop (no new clients;
/// it exits once the connections end), as `nbdkit_shutdown`.
pub fn request_shutdown() {
    ASKED.with(|a| {
        a.set(Asked {
            shutdown: true,
            ..a.get()
        })
    });
}

/// Called during a plugin call: the calling connection is to be closed
/// after this request, as `nbdkit_disconnect`.
pub fn request_disconnect() {
    ASKED.with(|a| {
        a.set(Asked {
            disconnect: true,
            ..a.get()
        })
    });
}

/// nbdkit's extent types: bit 0 a hole, bit 1 reads as zeros.
pub use diskit_core::plugin_abi::{EXTENT_HOLE, EXTENT_ZERO};

/// A plugin as nbdkit's plugin API sees it, from a connection's opening to
/// its requests. Offsets and lengths are the client's, already checked
/// against the size.
pub trait Callbacks: Send + Sync + 'static {
    /// What a connection holds.
    type Handle: Send + Sync + 'static;

    /// The plugin's name, for messages.
    fn name(&self) -> String;
    /// How many calls may run at once.
    fn thread_model(&self) -> ThreadModel;
    /// Opens a handle for a connection.
    fn open(&self, readonly: bool, export: &str, tls: bool) -> Result<Self::Handle>;
    /// Closes a handle; errors are the plugin's to report.
    fn close(&self, h: &Self::Handle);
    /// The disk's size.
    fn get_size(&self, h: &Self::Handle) -> Result<u64>;
    /// Block size constraints, if the plugin has any.
    fn block_size(&self, h: &Self::Handle) -> Result<Option<BlockSizeLimits>>;
    /// A yes-or-no capability; `None` when the plugin does not say.
    fn can(&self, h: &Self::Handle, what: Can) -> Result<Option<bool>>;
    /// How FUA is handled; `None` when the plugin does not say.
    fn can_fua(&self, h: &Self::Handle) -> Result<Option<Support>>;
    /// How cache requests are handled; `None` when the plugin does not say.
    fn can_cache(&self, h: &Self::Handle) -> Result<Option<Support>>;
    /// Fills `buf` from `offset`.
    fn pread(&self, h: &Self::Handle, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Writes `buf` at `offset`.
    fn pwrite(&self, h: &Self::Handle, buf: &[u8], offset: u64, fua: bool) -> Result<()>;
    /// Makes writes durable.
    fn flush(&self, h: &Self::Handle) -> Result<()>;
    /// Discards a range.
    fn trim(&self, h: &Self::Handle, offset: u64, len: u64, fua: bool) -> Result<()>;
    /// Zeroes a range; [`ErrorKind::NotSupported`] asks the server to write
    /// zeros instead (unless the request was a fast zero).
    fn zero(&self, h: &Self::Handle, offset: u64, len: u64, flags: ZeroFlags) -> Result<()>;
    /// Extents from `offset`, `(offset, length, type)` in ascending order.
    fn extents(
        &self,
        h: &Self::Handle,
        offset: u64,
        len: u64,
        req_one: bool,
    ) -> Result<Vec<(u64, u64, u32)>>;
    /// Prefetches a range (only called for [`Support::Native`]).
    fn cache(&self, h: &Self::Handle, offset: u64, len: u64) -> Result<()>;
    /// The exports a listing shows (nbdkit's `list_exports`); `None`, the
    /// default, when the plugin does not say (the server lists its
    /// default export).
    fn list_exports(&self, readonly: bool, tls: bool) -> Result<Option<Vec<ExportEntry>>> {
        let _ = (readonly, tls);
        Ok(None)
    }
    /// The name the default export `""` stands for (nbdkit's
    /// `default_export`); `None`, the default, when the plugin does not
    /// say.
    fn default_export(&self, readonly: bool, tls: bool) -> Result<Option<String>> {
        let _ = (readonly, tls);
        Ok(None)
    }
    /// A client connects, before its handshake (nbdkit's `preconnect`):
    /// an error refuses it. Accepted by default.
    fn preconnect(&self, readonly: bool) -> Result<()> {
        let _ = readonly;
        Ok(())
    }
    /// The description of a handle's export (nbdkit's
    /// `export_description`); `None`, the default, for none.
    fn export_description(&self, h: &Self::Handle) -> Result<Option<String>> {
        let _ = h;
        Ok(None)
    }
    /// The server stops, after the export's own handle is closed
    /// (nbdkit's `cleanup`). Nothing by default.
    fn cleanup(&self) -> Result<()> {
        Ok(())
    }
}

/// What a handle said of itself once, when it was opened.
#[derive(Debug, Clone, Copy)]
struct Answers {
    size: u64,
    caps: Capabilities,
    fua: Support,
    cache: Support,
    limits: Option<BlockSizeLimits>,
}

/// One connection at a time, for [`ThreadModel::SerializeConnections`]:
/// a connection holds the turn from its opening to its end.
#[derive(Default)]
struct Turn {
    taken: Mutex<bool>,
    freed: Condvar,
}

impl Turn {
    fn take(&self) {
        let mut t = lock(&self.taken);
        while *t {
            t = self.freed.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        *t = true;
    }
    fn give_back(&self) {
        *lock(&self.taken) = false;
        self.freed.notify_one();
    }
}

/// What every handle of one plugin shares.
struct Shared<C: Callbacks> {
    plugin: C,
    model: ThreadModel,
    /// Held around every call under [`ThreadModel::SerializeAllRequests`].
    all: Mutex<()>,
    turn: Turn,
    readonly: bool,
    /// The server, once it serves the plugin (for a shutdown asked).
    server: std::sync::OnceLock<ServerRef>,
}

/// A plugin's handle as a device; [`BlockDevice::connect`] opens another
/// for each connection.
pub struct CallbackDevice<C: Callbacks> {
    shared: Arc<Shared<C>>,
    handle: C::Handle,
    answers: Answers,
    /// Held around every call under [`ThreadModel::SerializeRequests`].
    own: Mutex<()>,
    /// Whether this handle holds the connections' turn.
    has_turn: bool,
    /// Its connection's hang-up (none for the export's own handle).
    hangup: Option<Hangup>,
    /// Whether the handle is closed already.
    closed: AtomicBool,
}

impl<C: Callbacks> CallbackDevice<C> {
    /// Opens the plugin's first handle (the export's device, which answers
    /// for it before a connection opens its own), read-only when
    /// `readonly`.
    pub fn open(plugin: C, readonly: bool) -> Result<CallbackDevice<C>> {
        let model = plugin.thread_model();
        let shared = Arc::new(Shared {
            plugin,
            model,
            all: Mutex::new(()),
            turn: Turn::default(),
            readonly,
            server: std::sync::OnceLock::new(),
        });
        CallbackDevice::with_handle(shared, "", false, false, false, None)
    }

    fn with_handle(
        shared: Arc<Shared<C>>,
        export: &str,
        readonly: bool,
        tls: bool,
        has_turn: bool,
        hangup: Option<Hangup>,
    ) -> Result<CallbackDevice<C>> {
        let readonly = readonly || shared.readonly;
        let handle = {
            let _all = serialize_all(&shared);
            shared.plugin.open(readonly, export, tls)?
        };
        let answers = {
            let _all = serialize_all(&shared);
            match ask(&shared.plugin, &handle, readonly) {
                Ok(a) => a,
                Err(e) => {
                    shared.plugin.close(&handle);
                    return Err(e);
                }
            }
        };
        Ok(CallbackDevice {
            shared,
            handle,
            answers,
            own: Mutex::new(()),
            has_turn,
            hangup,
            closed: AtomicBool::new(false),
        })
    }

    /// Closes the plugin's handle, once.
    fn close_handle(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _all = serialize_all(&self.shared);
        self.shared.plugin.close(&self.handle);
    }

    /// Runs one call under the plugin's thread model.
    fn call<T>(&self, f: impl FnOnce(&C, &C::Handle) -> Result<T>) -> Result<T> {
        let r = {
            let _all = serialize_all(&self.shared);
            let _own =
                (self.shared.model <= ThreadModel::SerializeRequests).then(|| lock(&self.own));
            f(&self.shared.plugin, &self.handle)
        };
        let asked = ASKED.with(|a| a.replace(Asked::default()));
        if asked.shutdown
            && let Some(server) = self.shared.server.get()
        {
            server.shutdown();
        }
        if asked.disconnect
            && let Some(h) = &self.hangup
        {
            h.raise();
        }
        r
    }
}

/// The plugin-wide lock, when the thread model asks for it.
fn serialize_all<C: Callbacks>(shared: &Shared<C>) -> Option<std::sync::MutexGuard<'_, ()>> {
    (shared.model <= ThreadModel::SerializeAllRequests).then(|| lock(&shared.all))
}

/// Asks a new handle what nbdkit's server asks: the size and every
/// capability, with the server's defaults for what the plugin leaves out.
fn ask<C: Callbacks>(p: &C, h: &C::Handle, readonly: bool) -> Result<Answers> {
    let size = p.get_size(h)?;
    let can = |what| p.can(h, what).map(|a| a.unwrap_or(false));
    let can_write = !readonly && can(Can::Write)?;
    let can_flush = can(Can::Flush)?;
    let can_zero = can_write && can(Can::Zero)?;
    let can_fast_zero = can_write
        && match p.can(h, Can::FastZero)? {
            Some(v) => v,
            // A plugin with no zero of its own fails fast zeroes at once.
            None => !can_zero,
        };
    let fua = match p.can_fua(h)? {
        Some(f) => f,
        None if can_flush => Support::Emulate,
        None => Support::None,
    };
    let cache = p.can_cache(h)?.unwrap_or(Support::None);
    let caps = Capabilities {
        can_write,
        can_flush,
        can_fua: can_write && fua != Support::None,
        can_trim: can_write && can(Can::Trim)?,
        can_write_zeroes: can_write,
        can_zero,
        can_fast_zero,
        can_extents: can(Can::Extents)?,
        can_multi_conn: can(Can::MultiConn)?,
        can_cache: cache != Support::None,
        is_rotational: can(Can::Rotational)?,
    };
    Ok(Answers {
        size,
        caps,
        fua,
        cache,
        limits: p.block_size(h)?,
    })
}

impl<C: Callbacks> Drop for CallbackDevice<C> {
    fn drop(&mut self) {
        self.close_handle();
        if self.has_turn {
            self.shared.turn.give_back();
        }
    }
}

impl<C: Callbacks> BlockDevice for CallbackDevice<C> {
    fn size(&self) -> u64 {
        self.answers.size
    }
    fn capabilities(&self) -> Capabilities {
        self.answers.caps
    }
    fn block_size(&self) -> BlockSizeLimits {
        self.answers.limits.unwrap_or_default()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.call(|p, h| p.pread(h, buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        if !self.answers.caps.can_write {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "device is read-only",
            ));
        }
        let native = flags.fua && self.answers.fua == Support::Native;
        self.call(|p, h| p.pwrite(h, buf, offset, native))?;
        self.emulated_fua(flags.fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        check_range(self.size(), offset, len)?;
        if !self.answers.caps.can_write {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "device is read-only",
            ));
        }
        if self.answers.caps.can_zero {
            let native = ZeroFlags {
                fua: flags.fua && self.answers.fua == Support::Native,
                ..flags
            };
            match self.call(|p, h| p.zero(h, offset, len, native)) {
                Ok(()) => return self.emulated_fua(flags.fua),
                Err(e) if e.kind() == ErrorKind::NotSupported && !flags.fast => {}
                Err(e) => return Err(e),
            }
        }
        if flags.fast {
            return Err(Error::from_kind(ErrorKind::NotSupported));
        }
        write_zero_buffer(self, offset, len, flags.fua)
    }
    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        check_range(self.size(), offset, len)?;
        if !self.answers.caps.can_trim {
            return self.emulated_fua(flags.fua);
        }
        let native = flags.fua && self.answers.fua == Support::Native;
        self.call(|p, h| p.trim(h, offset, len, native))?;
        self.emulated_fua(flags.fua)
    }
    fn flush(&self) -> Result<()> {
        if !self.answers.caps.can_flush {
            return Ok(());
        }
        self.call(|p, h| p.flush(h))
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size(), offset, len)?;
        match self.answers.cache {
            Support::None => Ok(()),
            Support::Native => self.call(|p, h| p.cache(h, offset, len)),
            Support::Emulate => {
                let mut buf = vec![0u8; len.min(1 << 20) as usize];
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(buf.len() as u64) as usize;
                    self.read_at(&mut buf[..n], at)?;
                    at += n as u64;
                }
                Ok(())
            }
        }
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size(), offset, len)?;
        if !self.answers.caps.can_extents {
            return Ok(vec![Extent::data(len)]);
        }
        let given = self.call(|p, h| p.extents(h, offset, len, false))?;
        clip_extents(&self.shared.plugin.name(), &given, offset, len)
    }
    fn extents_before_reads(&self) -> bool {
        // Each is a call into the plugin, which nbdkit never makes unasked
        // (and which a plugin may count).
        false
    }
    fn describe(&self) -> String {
        self.shared.plugin.name()
    }
    fn close(&self) -> Result<()> {
        // The export's own handle, then the plugin (nbdkit's close and
        // cleanup when the server stops).
        self.close_handle();
        let _all = serialize_all(&self.shared);
        self.shared.plugin.cleanup()
    }
    fn serving(&self, server: &ServerRef) {
        let _ = self.shared.server.set(server.clone());
    }
    fn preconnect(&self, _peer: &Peer) -> Result<()> {
        let _all = serialize_all(&self.shared);
        self.shared.plugin.preconnect(self.shared.readonly)
    }
    fn serialize(&self) -> Serialize {
        // The server runs no more at once than the plugin takes: one
        // connection at a time is held before its handshake (as nbdkit
        // holds it), one request at a time runs on the connection's own
        // thread, without a hop to a worker that would wait for the lock.
        match self.shared.model {
            ThreadModel::SerializeConnections => Serialize::Connections,
            ThreadModel::SerializeAllRequests | ThreadModel::SerializeRequests => {
                Serialize::Requests
            }
            ThreadModel::Parallel => Serialize::Parallel,
        }
    }
    fn list_exports(&self, query: &ExportQuery) -> Result<Option<Vec<ExportEntry>>> {
        let _all = serialize_all(&self.shared);
        self.shared.plugin.list_exports(query.read_only, query.tls)
    }
    fn default_export(&self, query: &ExportQuery) -> Result<Option<String>> {
        let _all = serialize_all(&self.shared);
        self.shared
            .plugin
            .default_export(query.read_only, query.tls)
    }
    fn export_description(&self) -> Option<String> {
        // nbdkit sends no description when the call fails.
        self.call(|p, h| p.export_description(h)).ok().flatten()
    }
    fn connect(&self, session: &Session) -> Result<Option<DeviceRef>> {
        let turn = self.shared.model == ThreadModel::SerializeConnections;
        if turn {
            self.shared.turn.take();
        }
        match CallbackDevice::with_handle(
            self.shared.clone(),
            &session.export,
            session.read_only,
            session.tls,
            turn,
            Some(session.hangup.clone()),
        ) {
            Ok(d) => Ok(Some(Arc::new(d))),
            Err(e) => {
                if turn {
                    self.shared.turn.give_back();
                }
                Err(e)
            }
        }
    }
}

impl<C: Callbacks> CallbackDevice<C> {
    /// The flush that makes a write FUA where the plugin does not.
    fn emulated_fua(&self, fua: bool) -> Result<()> {
        if fua && self.answers.fua == Support::Emulate {
            self.call(|p, h| p.flush(h))
        } else {
            Ok(())
        }
    }
}

/// The extents a plugin gave, as nbdkit's server takes them: ascending and
/// contiguous, those before `offset` dropped, the last cut at the end of
/// the request, and at least one that covers `offset`.
pub fn clip_extents(
    who: &str,
    given: &[(u64, u64, u32)],
    offset: u64,
    len: u64,
) -> Result<Vec<Extent>> {
    let end = offset + len;
    let mut out: Vec<Extent> = Vec::new();
    let mut next = offset;
    for &(start, length, kind) in given {
        let stop = start.saturating_add(length);
        // Before the request, or covered already.
        if length == 0 || stop <= next {
            continue;
        }
        if start > next {
            return Err(Error::io(format!(
                "{who}: extents: the extent at {start} does not follow the one before \
                 (expected {next})"
            )));
        }
        let from = next;
        let to = stop.min(end);
        let flags = ExtentFlags {
            zero: kind & EXTENT_ZERO != 0,
            data: kind & EXTENT_HOLE == 0,
            present: true,
            compressed: false,
        };
        let e = Extent {
            length: to - from,
            flags,
            depth: 0,
            host_offset: None,
        };
        match out.last_mut() {
            Some(last) if last.flags == flags => last.length += e.length,
            _ => out.push(e),
        }
        next = to;
        if next >= end {
            break;
        }
    }
    if out.is_empty() {
        return Err(Error::io(format!(
            "{who}: extents: the plugin gave no extent covering offset {offset}"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_clipped_to_the_request() {
        let e = clip_extents("p", &[(0, 4096, 0), (4096, 8192, 3)], 1024, 8192).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].length, 3072);
        assert!(e[0].flags.data);
        assert_eq!(e[1].length, 5120);
        assert!(e[1].flags.zero && !e[1].flags.data);
        assert!(clip_extents("p", &[(0, 100, 0), (200, 100, 0)], 0, 300).is_err());
        assert!(clip_extents("p", &[(0, 100, 0)], 100, 100).is_err());
        assert!(clip_extents("p", &[], 0, 100).is_err());
    }

    #[test]
    fn thread_models_and_support_read_nbdkit_s_names() {
        assert_eq!(ThreadModel::parse("Parallel"), Some(ThreadModel::Parallel));
        assert_eq!(
            ThreadModel::parse("serialize-all-requests"),
            Some(ThreadModel::SerializeAllRequests)
        );
        assert_eq!(ThreadModel::parse("x"), None);
        assert_eq!(Support::parse("NATIVE"), Some(Support::Native));
    }
}
