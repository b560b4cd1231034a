//! The log filter (nbdkit-log-filter): one line per request as it starts
//! and one as it ends, and a line when a connection opens and closes, in
//! nbdkit's format, so that scripts that parse nbdkit logs parse
//! diskit's.
//!
//! - `logfile=FILE`: where the lines go (created, or truncated when the
//!   filter starts).
//! - `logappend=BOOL`: append instead.
//! - `logscript=SCRIPT`: a shell script run for every line, with the
//!   line's fields as shell variables (`$act`, `$type`, `$connection`,
//!   `$id`, `$offset`, `$count`, `$return`, `$error`...).
//!
//! With neither a file nor a script the filter logs nothing. A line looks
//! like `2026-11-25 05:50:01.123456 connection=1 Read id=3 offset=0x0
//! count=0x200 ...`, then `... connection=1 ...Read id=3 return=0`. Ids
//! count the requests of each connection from 1; connections count from 1
//! for each filter. Requests made through the shared stack, outside any
//! connection (a library user, a server's own work), log without a
//! connection number. The server asks for no extents through the filter
//! before large reads, so the lines are the client's requests. Submitted
//! requests stay in flight below; their end is logged as they complete.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use diskit_core::params::shell_quote;
use diskit_core::sync::lock;
use diskit_core::{DeviceRef, Error, ErrorKind, Extent, Result, Session};

use crate::call::{Call, Op};
use crate::watch::{Outcome, Watch, Watching};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["logfile", "logappend", "logscript"];

/// The parameters, as given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogConfig {
    /// Where the lines go.
    pub file: Option<PathBuf>,
    /// Append rather than truncate.
    pub append: bool,
    /// A shell script run for every line.
    pub script: Option<String>,
}

impl Configure for LogConfig {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "logfile" => self.file = Some(PathBuf::from(value)),
            "logappend" => self.append = params::boolean("log", key, value)?,
            "logscript" => self.script = Some(value.to_string()),
            _ => return Err(unknown("log", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(Watching(Log::new(self)?), next))
    }
}

/// Which half of a logged call a line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Enter,
    Leave,
    Print,
}

/// Where lines go: shared by the filter and its connection views.
#[derive(Debug)]
struct Output {
    file: Option<Mutex<File>>,
    script: Option<String>,
    /// Connections seen.
    connections: AtomicU64,
    /// Ids of requests made outside a connection.
    unconnected: AtomicU64,
    /// Ids of connections' preconnect lines.
    preconnects: AtomicU64,
}

impl Output {
    fn line(&self, connection: Option<u64>, id: u64, act: &str, kind: Kind, args: &str) {
        if let Some(file) = &self.file {
            let mut s = timestamp(SystemTime::now());
            if let Some(c) = connection {
                let _ = write!(s, " connection={c}");
            }
            s.push(' ');
            if kind == Kind::Leave {
                s.push_str("...");
            }
            s.push_str(act);
            if id != 0 {
                let _ = write!(s, " id={id}");
            }
            if !args.is_empty() {
                s.push(' ');
                s.push_str(args);
            }
            if kind == Kind::Enter {
                s.push_str(" ...");
            }
            s.push('\n');
            // Logging is best effort: a full disk must not fail requests.
            let _ = lock(file).write_all(s.as_bytes());
        }
        if let Some(script) = &self.script {
            let mut s = format!("act={act}\n");
            if let Some(c) = connection {
                let _ = writeln!(s, "connection={c}");
            }
            let kind = match kind {
                Kind::Enter => "ENTER",
                Kind::Leave => "LEAVE",
                Kind::Print => "PRINT",
            };
            let _ = writeln!(s, "type={kind}");
            if id != 0 {
                let _ = writeln!(s, "id={id}");
            }
            s.push_str(args);
            s.push('\n');
            s.push_str(script);
            match std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(&s)
                .status()
            {
                Ok(st) if st.success() => {}
                Ok(st) => eprintln!("diskit: log: logscript: {st}"),
                Err(e) => eprintln!("diskit: log: logscript: {e}"),
            }
        }
    }
}

/// One connection's numbers.
#[derive(Debug)]
struct Connection {
    number: u64,
    ids: AtomicU64,
}

/// The filter: the shared stack's, or one connection's view of it.
#[derive(Debug)]
pub struct Log {
    out: Arc<Output>,
    conn: Option<Connection>,
}

impl Log {
    /// Opens the log file and logs that the filter is ready.
    pub fn new(config: &LogConfig) -> Result<Log> {
        let file = match &config.file {
            Some(path) => Some(Mutex::new(
                OpenOptions::new()
                    .write(true)
                    .create(true)
                    .append(config.append)
                    .truncate(!config.append)
                    .open(path)
                    .map_err(|e| {
                        Error::from(e).context(format!("log: open: {}", path.display()))
                    })?,
            )),
            None => None,
        };
        let out = Arc::new(Output {
            file,
            script: config.script.clone(),
            connections: AtomicU64::new(0),
            unconnected: AtomicU64::new(0),
            preconnects: AtomicU64::new(0),
        });
        // Requests run in parallel: nbdkit's thread model 3.
        out.line(None, 0, "Ready", Kind::Print, "thread_model=3");
        Ok(Log { out, conn: None })
    }

    fn connection(&self) -> Option<u64> {
        self.conn.as_ref().map(|c| c.number)
    }
}

/// A logged call that has started.
pub(crate) struct Entered {
    out: Arc<Output>,
    conn: Option<u64>,
    id: u64,
    act: &'static str,
    /// Where it starts (extents are logged from there).
    offset: u64,
}

/// The name nbdkit's log gives `call` and its arguments.
fn describe(call: &Call) -> (&'static str, String) {
    let Call {
        op,
        offset,
        len,
        flags,
    } = *call;
    let (fua, trim, fast) = (
        u8::from(flags.fua),
        u8::from(flags.may_trim),
        u8::from(flags.fast),
    );
    let range = format!("offset={offset:#x} count={len:#x}");
    match op {
        Op::Read => ("Read", range),
        Op::Write => ("Write", format!("{range} fua={fua}")),
        Op::Zero => ("Zero", format!("{range} trim={trim} fua={fua} fast={fast}")),
        Op::Trim => ("Trim", format!("{range} fua={fua}")),
        Op::Cache => ("Cache", range),
        Op::Extents => ("Extents", format!("{range} req_one=0")),
        Op::Flush => ("Flush", String::new()),
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        if let Some(c) = &self.conn {
            let n = c.ids.load(Ordering::Relaxed);
            self.out.line(
                Some(c.number),
                0,
                "Disconnect",
                Kind::Print,
                &format!("transactions={n}"),
            );
        }
    }
}

impl Watch for Log {
    const NAME: &'static str = "log";
    /// Requests out of range too are logged, with the refusal from below.
    const CHECKS_RANGES: bool = false;
    type Started = Entered;

    /// Logs that `call` starts.
    fn start(&self, call: &Call) -> Entered {
        let id = match &self.conn {
            Some(c) => c.ids.fetch_add(1, Ordering::Relaxed) + 1,
            None => self.out.unconnected.fetch_add(1, Ordering::Relaxed) + 1,
        };
        let (act, args) = describe(call);
        let conn = self.connection();
        self.out.line(conn, id, act, Kind::Enter, &args);
        Entered {
            out: self.out.clone(),
            conn,
            id,
            act,
            offset: call.offset,
        }
    }

    fn end(entered: Entered, outcome: Outcome<'_>) {
        let end = match outcome {
            Outcome::Done => String::from("return=0"),
            Outcome::Extents(list) => describe_extents(entered.offset, list),
            Outcome::Failed(kind) => format!("return=-1 error={}", errno_name(kind)),
        };
        let Entered {
            out, conn, id, act, ..
        } = entered;
        out.line(conn, id, act, Kind::Leave, &end);
    }

    fn connect(&self, next: &DeviceRef, session: &Session) -> Result<Option<Log>> {
        // nbdkit logs its preconnect check, which diskit's server makes
        // in its accept loop, then the connection.
        let pre = self.out.preconnects.fetch_add(1, Ordering::Relaxed) + 1;
        let ro = format!("readonly={}", u8::from(session.read_only));
        self.out.line(None, pre, "Preconnect", Kind::Enter, &ro);
        self.out
            .line(None, pre, "Preconnect", Kind::Leave, "return=0");
        let number = self.out.connections.fetch_add(1, Ordering::Relaxed) + 1;
        let mut caps = next.capabilities();
        if session.read_only {
            caps = caps.read_only();
        }
        let b = next.block_size();
        let zero = if !caps.can_write_zeroes {
            0
        } else if caps.can_zero {
            2
        } else {
            1
        };
        let args = format!(
            "export={} tls={} size={:#x} minsize={:#x} prefsize={:#x} maxsize={:#x} write={} \
             flush={} rotational={} trim={} zero={zero} fua={} extents={} cache={} fast_zero={}",
            shell_quote(&session.export),
            u8::from(session.tls),
            next.size(),
            b.minimum,
            b.preferred,
            b.maximum,
            u8::from(caps.can_write),
            u8::from(caps.can_flush),
            u8::from(caps.is_rotational),
            u8::from(caps.can_trim),
            if caps.can_fua { 2 } else { 0 },
            u8::from(caps.can_extents),
            if caps.can_cache { 2 } else { 0 },
            u8::from(caps.can_fast_zero),
        );
        self.out
            .line(Some(number), 0, "Connect", Kind::Print, &args);
        Ok(Some(Log {
            out: self.out.clone(),
            conn: Some(Connection {
                number,
                ids: AtomicU64::new(0),
            }),
        }))
    }
}

/// An extents answer as nbdkit logs it: `extents=(0x0 0x10000 "hole,zero"
/// ...) return=0`.
fn describe_extents(mut offset: u64, list: &[Extent]) -> String {
    let mut s = String::from("extents=(");
    for (i, e) in list.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        let kind = match (!e.flags.data, e.flags.zero) {
            (true, true) => "hole,zero",
            (true, false) => "hole",
            (false, true) => "zero",
            (false, false) => "",
        };
        let _ = write!(s, "{offset:#x} {:#x} \"{kind}\"", e.length);
        offset += e.length;
    }
    s.push_str(") return=0");
    s
}

/// The errno name nbdkit's log gives an error (what its server would send).
fn errno_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::PermissionDenied => "EPERM",
        ErrorKind::Io => "EIO",
        ErrorKind::OutOfMemory => "ENOMEM",
        ErrorKind::NoSpace => "ENOSPC",
        ErrorKind::Shutdown => "ESHUTDOWN",
        ErrorKind::NotSupported => "ENOTSUP",
        ErrorKind::Overflow => "EOVERFLOW",
        ErrorKind::InvalidInput | ErrorKind::NotFound => "EINVAL",
    }
}

/// `t` as `YYYY-MM-DD HH:MM:SS.uuuuuu` in UTC.
fn timestamp(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rest) = (secs / 86400, secs % 86400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02} {:02}:{:02}:{:02}.{:06}",
        rest / 3600,
        rest / 60 % 60,
        rest % 60,
        d.subsec_micros()
    )
}

/// The calendar date of a day counted from 1970-01-01 (Howard Hinnant's
/// algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Writing;
    use diskit_core::{BlockDevice, WriteFlags, ZeroFlags};
    use std::time::Duration;

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        let t = UNIX_EPOCH + Duration::from_micros(1_596_679_643_080_415);
        assert_eq!(timestamp(t), "2020-08-06 02:07:23.080415");
        assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01 00:00:00.000000");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(&timestamp(leap)[..10], "2000-02-29");
    }

    #[test]
    fn strings_are_quoted_as_nbdkit_quotes_them() {
        assert_eq!(shell_quote(""), "\"\"");
        assert_eq!(shell_quote("disk-1.img"), "disk-1.img");
        assert_eq!(shell_quote("a b"), "\"a b\"");
        assert_eq!(shell_quote("$x\"`\\"), "\"\\$x\\\"\\`\\\\\"");
    }

    #[test]
    fn connections_and_requests_are_numbered_and_logged() {
        let log = Writing::new("log", "logfile", 1 << 20);
        let dev = &log.dev;
        let session = Session {
            id: 7,
            export: "a b".into(),
            tls: false,
            read_only: true,
            ..Session::default()
        };
        let view = dev.connect(&session).unwrap().unwrap();
        view.write_at(&[1; 512], 4096, WriteFlags::FUA).unwrap();
        let mut buf = [0u8; 512];
        view.read_at(&mut buf, 4096).unwrap();
        assert_eq!(buf, [1; 512]);
        let e = view.read_at(&mut buf, 1 << 20).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        drop(view);
        let second = dev.connect(&session).unwrap().unwrap();
        second.flush().unwrap();
        drop(second);
        let text = log.text();
        let lines: Vec<&str> = text.lines().map(|l| &l[27..]).collect();
        assert_eq!(lines[0], "Ready thread_model=3");
        assert_eq!(lines[1], "Preconnect id=1 readonly=1 ...");
        assert_eq!(lines[2], "...Preconnect id=1 return=0");
        let lines = [&lines[..1], &lines[3..]].concat();
        assert!(
            lines[1]
                .starts_with("connection=1 Connect export=\"a b\" tls=0 size=0x100000 minsize=0x1"),
            "{}",
            lines[1]
        );
        assert!(lines[1].contains(" write=0 "), "{}", lines[1]);
        assert_eq!(
            &lines[2..],
            [
                "connection=1 Write id=1 offset=0x1000 count=0x200 fua=1 ...",
                "connection=1 ...Write id=1 return=0",
                "connection=1 Read id=2 offset=0x1000 count=0x200 ...",
                "connection=1 ...Read id=2 return=0",
                "connection=1 Read id=3 offset=0x100000 count=0x200 ...",
                "connection=1 ...Read id=3 return=-1 error=EINVAL",
                "connection=1 Disconnect transactions=3",
                "Preconnect id=2 readonly=1 ...",
                "...Preconnect id=2 return=0",
                lines[11],
                "connection=2 Flush id=1 ...",
                "connection=2 ...Flush id=1 return=0",
                "connection=2 Disconnect transactions=1",
            ]
        );
        assert!(
            lines[11].starts_with("connection=2 Connect "),
            "{}",
            lines[11]
        );
    }

    #[test]
    fn submitted_requests_are_logged_and_stay_in_flight_below() {
        use crate::testing::{read_request, submit, zero_request};
        let log = Writing::new("log", "logfile", 1 << 20);
        let (dev, probe) = (&*log.dev, &log.below);
        assert_eq!(dev.queue_depth(), probe.queue_depth());
        assert!(submit(dev, read_request(4096, 512)).result.is_ok());
        assert!(submit(dev, read_request(1 << 20, 512)).result.is_err());
        let trim = ZeroFlags {
            may_trim: true,
            ..ZeroFlags::default()
        };
        assert!(submit(dev, zero_request(0, 4096, trim)).result.is_ok());
        assert_eq!(probe.submitted.load(Ordering::SeqCst), 3, "sent below");
        let text = log.text();
        let lines: Vec<&str> = text.lines().map(|l| &l[27..]).collect();
        assert_eq!(
            &lines[1..],
            [
                "Read id=1 offset=0x1000 count=0x200 ...",
                "...Read id=1 return=0",
                "Read id=2 offset=0x100000 count=0x200 ...",
                "...Read id=2 return=-1 error=EINVAL",
                "Zero id=3 offset=0x0 count=0x1000 trim=1 fua=0 fast=0 ...",
                "...Zero id=3 return=0",
            ]
        );
    }

    #[test]
    fn extents_are_listed_with_their_types() {
        use diskit_core::ExtentFlags;
        let e = |length, data, zero| Extent {
            length,
            flags: ExtentFlags {
                data,
                zero,
                present: data,
                compressed: false,
            },
            depth: 0,
            host_offset: None,
        };
        assert_eq!(
            describe_extents(0x1000, &[e(0x1000, true, false), e(0x2000, false, true)]),
            "extents=(0x1000 0x1000 \"\" 0x2000 0x2000 \"hole,zero\") return=0"
        );
    }
}
