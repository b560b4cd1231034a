//! `diskit snapshot`: list, create, apply and delete the internal
//! snapshots of an image as qemu-img does, and the snapshot table as
//! qemu-img prints it (shared with `info`).

use std::path::{Path, PathBuf};

use crate::CmdResult;
use crate::util::{CliError, ForceShare, OpenPolicy, parse_source_format};
use diskit_core::size::human_size;
use diskit_core::{Error, ErrorKind, SnapshotChange, Storage};
use diskit_open::{Capability, Format, OpenOptions, SnapshotInfo};

/// Arguments of `snapshot`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// List the snapshots (the default).
    #[arg(short = 'l', long = "list", action = clap::ArgAction::Count)]
    list: u8,
    /// Apply (revert to) a snapshot.
    #[arg(short = 'a', long = "apply", value_name = "SNAPSHOT")]
    apply: Vec<String>,
    /// Create a snapshot.
    #[arg(short = 'c', long = "create", value_name = "SNAPSHOT")]
    create: Vec<String>,
    /// Delete a snapshot.
    #[arg(short = 'd', long = "delete", value_name = "SNAPSHOT")]
    delete: Vec<String>,
    #[command(flatten)]
    share: ForceShare,
    /// Quiet operation.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// The image.
    filename: PathBuf,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let ops = a.list as usize + a.apply.len() + a.create.len() + a.delete.len();
    if ops > 1 {
        return Err(CliError::usage(
            "snapshot",
            "Cannot mix '-l', '-a', '-c', '-d'",
        ));
    }
    let _ = a.quiet;
    let format = parse_source_format(a.format.as_deref(), &a.filename)?;
    let change = if let Some(name) = a.create.first() {
        Some(Change::Create(name))
    } else if let Some(name) = a.apply.first() {
        Some(Change::Apply(name))
    } else {
        a.delete.first().map(|name| Change::Delete(name))
    };
    if let Some(change) = change {
        let policy = a.share.policy(policy);
        return modify(&a.filename, format, change, &policy);
    }
    // Like qemu-img, the whole chain is opened (a missing backing file is
    // an error), and formats without snapshots list nothing.
    let img = policy.open(&a.filename, format, OpenOptions::default())?;
    let snaps = list(&img).map_err(|e| CliError::new(format!("Could not list snapshots: {e}")))?;
    if !snaps.is_empty() {
        print!("Snapshot list:\n{}", table(&snaps));
    }
    Ok(0)
}

/// The snapshots of an image as qemu-img lists them: the format's own,
/// or, for a format that keeps none, its storage's (an RBD image's
/// snapshots under raw), with what QEMU's rbd driver shows of each: the
/// name as the id too, the image's size then as the state size, no date.
pub fn list(img: &diskit_open::Image) -> diskit_core::Result<Vec<SnapshotInfo>> {
    if img.format.supports(Capability::Snapshots) {
        return img.ops.snapshots();
    }
    match img.file.snapshots() {
        Err(e) if e.kind() == ErrorKind::NotSupported => Ok(Vec::new()),
        r => Ok(r?
            .into_iter()
            .map(|(name, size)| SnapshotInfo {
                id: name.clone(),
                name,
                vm_state_size: size,
                date_sec: 0,
                date_nsec: 0,
                vm_clock_nsec: 0,
                icount: Some(0),
            })
            .collect()),
    }
}

/// A change to the snapshots of an image.
enum Change<'a> {
    Create(&'a str),
    Apply(&'a str),
    Delete(&'a str),
}

/// Creates, applies or deletes a snapshot, with qemu-img's messages.
fn modify(
    path: &Path,
    format: Option<Format>,
    change: Change<'_>,
    policy: &OpenPolicy,
) -> CmdResult {
    let img = policy.open(
        path,
        format,
        OpenOptions {
            writable: true,
            ..Default::default()
        },
    )?;
    if format.is_none() && img.format == Format::RAW {
        // qemu-img warns again when -a reopens the image below the format.
        let times = if matches!(change, Change::Apply(_)) {
            2
        } else {
            1
        };
        for _ in 0..times {
            crate::util::warn_probed_raw(path);
        }
    }
    let ops = &img.ops;
    // A format that keeps no snapshots hands the change to its storage
    // (an RBD image keeps its own), as QEMU falls back to the file node.
    let own = img.format.supports(Capability::Snapshots);
    let unsupported = |e: &Error| e.kind() == ErrorKind::NotSupported;
    let result = match change {
        Change::Create(name) => {
            let (sec, nsec) = now();
            let r = if own {
                ops.create_snapshot(name, sec, nsec)
            } else {
                img.file
                    .change_snapshot(SnapshotChange::Create(name))
                    .inspect_err(|e| {
                        if !unsupported(e) {
                            // QEMU's rbd driver says so first.
                            eprintln!("{}: failed to create snap: {e}", crate::names::prog());
                        }
                    })
            };
            r.map_err(|e| format!("Could not create snapshot '{name}': {e}"))
        }
        Change::Apply(name) => {
            let r = if own {
                ops.apply_snapshot(name)
                    .map_err(|e| format!("Failed to load snapshot: {e}"))
            } else {
                match img.file.change_snapshot(SnapshotChange::Rollback(name)) {
                    Err(e) if unsupported(&e) => {
                        Err("Block driver does not support snapshots".to_string())
                    }
                    r => r.map_err(|e| format!("Failed to load snapshot: {e}")),
                }
            };
            r.map_err(|e| format!("Could not apply snapshot '{name}': {e}"))
        }
        Change::Delete(name) => {
            let r = if own {
                ops.delete_snapshot(name).map_err(|e| e.to_string())
            } else {
                match img.file.change_snapshot(SnapshotChange::Delete(name)) {
                    Err(e) if unsupported(&e) => Err("snapshot not found".to_string()),
                    r => r.map_err(|e| format!("Failed to remove the snapshot: {e}")),
                }
            };
            r.map_err(|e| format!("Could not delete snapshot '{name}': {e}"))
        }
    };
    let closed = img.close();
    result.map_err(CliError::new)?;
    closed?;
    Ok(0)
}

/// The time now as qemu-img records it: seconds and microseconds (as
/// nanoseconds).
fn now() -> (u32, u32) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_secs() as u32, t.subsec_micros() * 1000)
}

/// The snapshot table as qemu-img prints it (`bdrv_snapshot_dump`): a
/// header line and one line per snapshot, without the "Snapshot list:"
/// title. ICOUNT is "--" when the snapshot has none.
pub fn table(snaps: &[SnapshotInfo]) -> String {
    let mut out = row(["ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"].map(String::from));
    for sn in snaps {
        out += &row([
            sn.id.clone(),
            sn.name.clone(),
            human_size(sn.vm_state_size),
            local_date(sn.date_sec),
            vm_clock(sn.vm_clock_nsec),
            sn.icount
                .map_or_else(|| "--".to_string(), |n| (n as i64).to_string()),
        ]);
    }
    out
}

/// `"%-7s %-16s %8s %19s %15s %10s\n"`, widths in bytes as C counts them.
fn row(f: [String; 6]) -> String {
    let pad = |s: &str, w: usize, left: bool| {
        let fill = " ".repeat(w.saturating_sub(s.len()));
        if left {
            format!("{s}{fill}")
        } else {
            format!("{fill}{s}")
        }
    };
    format!(
        "{} {} {} {} {} {}\n",
        pad(&f[0], 7, true),
        pad(&f[1], 16, true),
        pad(&f[2], 8, false),
        pad(&f[3], 19, false),
        pad(&f[4], 15, false),
        pad(&f[5], 10, false),
    )
}

/// The guest clock as `HHHH:MM:SS.mmm`.
pub fn vm_clock(nsec: u64) -> String {
    let secs = (nsec / 1_000_000_000) as i64;
    format!(
        "{:04}:{:02}:{:02}.{:03}",
        (secs / 3600) as i32,
        ((secs / 60) % 60) as i32,
        (secs % 60) as i32,
        ((nsec / 1_000_000) % 1000) as i32
    )
}

/// A time as `%Y-%m-%d %H:%M:%S` in the local time zone (TZ), as glib's
/// `g_date_time_new_from_unix_local` shows it.
pub fn local_date(secs: u32) -> String {
    let t = secs as libc::time_t;
    // SAFETY: an all-zero `tm` is a valid value (integers and, on glibc, a
    // null zone name pointer).
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: `t` and `tm` are valid for the call; localtime_r is the
    // thread-safe variant and only writes `tm`.
    let ok = unsafe { !libc::localtime_r(&t, &mut tm).is_null() };
    if !ok {
        return String::new();
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_and_header_like_qemu() {
        assert_eq!(vm_clock(0), "0000:00:00.000");
        assert_eq!(vm_clock(3_723_456_789_000), "0001:02:03.456");
        assert_eq!(vm_clock(u64::MAX), "5124095:34:33.709");
        assert_eq!(
            row(["ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"].map(String::from)),
            "ID      TAG               VM_SIZE                DATE        VM_CLOCK     ICOUNT\n"
        );
        // Widths count bytes, as printf does.
        assert_eq!(row(["1", "ü", "", "", "", ""].map(String::from)).len(), 81);
    }
}
