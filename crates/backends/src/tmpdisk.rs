//! nbdkit's tmpdisk plugin: every client gets a disk of its own, new and
//! empty but for a filesystem, made by a shell command (by default
//! nbdkit's: `mkfs -t $type` over a sparse file of `$size` bytes) and
//! gone when the client goes. The command runs as nbdkit runs it: in
//! `sh`, after `disk=` (where to make it), `size=` and the plugin's other
//! parameters as shell variables, with stdin and stdout on /dev/null; the
//! disk is made in a new private directory under `$TMPDIR` (/var/tmp by
//! default) and unlinked once open.
//!
//! One disk is made when the server starts (its size is the export's, and
//! a command that fails is reported then); the first client takes it, the
//! others get new ones, which must have the same size.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use diskit_core::params::shell_quote;
use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Error, Result, Session, StorageOptions, WriteFlags,
};

use crate::FileDevice;

/// nbdkit's default command (its `default-command.sh.in`).
pub const DEFAULT_COMMAND: &str = r#"type="${type:-ext4}"

labelopt='-L'

case "$type" in
    ext?)
        extra='-F' ;;
    *fat|msdos)
        extra='-I' ;;
    ntfs)
        extra='-Q -F'
        labelopt='-n' ;;
    xfs)
        extra='-f' ;;
esac

truncate -s $size "$disk"

if [ "x$label" = "x" ]; then
    mkfs -t "$type" $extra "$disk"
else
    mkfs -t "$type" $extra $labelopt "$label" "$disk"
fi
"#;

/// How the disks are made.
#[derive(Debug, Clone)]
pub struct TmpDiskSpec {
    /// `size=`: the size asked for (the command decides the real one).
    pub size: u64,
    /// The shell command that makes `$disk`.
    pub command: String,
    /// The other parameters, as shell variables, in order.
    pub variables: Vec<(String, String)>,
    /// Where the disks are made: `$TMPDIR`, else /var/tmp.
    pub tmpdir: PathBuf,
}

impl TmpDiskSpec {
    /// The script nbdkit gives `sh` for a disk at `disk`.
    fn script(&self, disk: &str) -> String {
        let mut s = format!(
            "exec </dev/null >/dev/null\ndisk={}\nsize={}\n\n",
            shell_quote(disk),
            self.size
        );
        for (k, v) in &self.variables {
            s += &format!("{}={}\n", shell_quote(k), shell_quote(v));
        }
        s.push('\n');
        s += &self.command;
        s
    }

    /// Makes a disk, opened for writing unless `readonly`.
    fn make(&self, readonly: bool) -> Result<TmpDiskFile> {
        let dir = tempfile::Builder::new()
            .prefix("tmpdisk")
            .tempdir_in(&self.tmpdir)
            .map_err(|e| Error::from(e).context(self.tmpdir.display().to_string()))?;
        let disk = dir.path().join("disk");
        let status = Command::new("/bin/sh")
            .arg("-c")
            .arg(self.script(&disk.to_string_lossy()))
            .stdin(Stdio::null())
            .status()
            .map_err(|e| Error::from(e).context("failed to execute command"))?;
        if let Some(code) = status.code().filter(|c| *c != 0) {
            return Err(Error::io(format!("command exited with code {code}")));
        }
        if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&status) {
            return Err(Error::io(format!("command killed by signal {sig}")));
        }
        let opts = StorageOptions {
            writable: !readonly,
            ..StorageOptions::default()
        };
        let file = FileDevice::open(&disk, opts).map_err(|e| {
            Error::new(
                e.kind(),
                format!("open: {}: {}", disk.display(), e.detail()),
            )
        })?;
        // Held open: the name and the directory can go.
        let _ = std::fs::remove_file(&disk);
        drop(dir);
        Ok(TmpDiskFile {
            file,
            writable: !readonly,
        })
    }
}

/// One client's disk: a file nobody else sees, offered as nbdkit offers
/// it (flush and FUA accepted and ignored, since the disk dies with the
/// connection; trim punches holes; everything reported as data).
pub struct TmpDiskFile {
    file: FileDevice,
    writable: bool,
}

impl BlockDevice for TmpDiskFile {
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn capabilities(&self) -> Capabilities {
        let w = self.writable;
        Capabilities {
            can_flush: w,
            can_fua: w,
            can_trim: w,
            ..crate::zeroes_by_writing(w)
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        self.file.write_at(buf, offset, WriteFlags::NONE)
    }
    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        self.file.trim(offset, len, WriteFlags::NONE)
    }
    fn describe(&self) -> String {
        "tmpdisk".into()
    }
}

/// The plugin's device: the disk made at start-up, for the first client,
/// and the recipe for the others'.
pub struct TmpDisk {
    spec: TmpDiskSpec,
    readonly: bool,
    first: TmpDiskFile,
    first_taken: Mutex<bool>,
}

impl TmpDisk {
    /// Makes the first disk, to know the size and that the command works.
    pub fn new(spec: TmpDiskSpec, readonly: bool) -> Result<TmpDisk> {
        let first = spec.make(readonly)?;
        Ok(TmpDisk {
            spec,
            readonly,
            first,
            first_taken: Mutex::new(false),
        })
    }
}

impl BlockDevice for TmpDisk {
    fn size(&self) -> u64 {
        self.first.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.first.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.first.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.first.write_at(buf, offset, flags)
    }
    fn trim(&self, offset: u64, len: u64, flags: WriteFlags) -> Result<()> {
        self.first.trim(offset, len, flags)
    }
    fn describe(&self) -> String {
        "tmpdisk".into()
    }
    fn connect(&self, _session: &Session) -> Result<Option<DeviceRef>> {
        let mut taken = lock(&self.first_taken);
        if !*taken {
            // The shared device is the first disk: the client uses it.
            *taken = true;
            return Ok(None);
        }
        drop(taken);
        let disk = self.spec.make(self.readonly)?;
        if disk.size() != self.size() {
            return Err(Error::io(format!(
                "tmpdisk: the command made a disk of {} bytes, the first was {}",
                disk.size(),
                self.size()
            )));
        }
        Ok(Some(std::sync::Arc::new(disk)))
    }
}
