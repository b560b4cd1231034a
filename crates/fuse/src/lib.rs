//! A block device shown as one file in the local filesystem, through
//! FUSE, as libnbd's nbdfuse shows an NBD export: `diskit fuse` and the
//! `nbdfuse` name.
//!
//! The file reads and writes the device; fsync flushes it; fallocate's
//! punch-hole trims and zero-range zeroes. The mount is made through
//! fusermount3 (no libfuse needed) and served until it is unmounted
//! (`fusermount3 -u`), or the process is sent SIGINT, SIGTERM or SIGHUP,
//! which unmount it (and make it fail, as nbdfuse). See [`fs`] for how
//! requests reach the device.

pub mod fs;
mod pool;
mod readahead;
mod signals;
pub mod target;

use diskit_core::{DeviceRef, Error, ErrorKind, Result};
use fuser::{Config, MountOption, Session, SessionACL};

pub use fs::{FileOptions, OneFile};
pub use target::Target;

/// How the mount is made.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Where, and the file's name.
    pub target: Target,
    /// Refuse writes (also when the device cannot write).
    pub read_only: bool,
    /// Threads taking requests from the kernel (nbdfuse's `-s`: one).
    pub threads: usize,
    /// `-o` options: libfuse's `kernel_cache`, `direct_io`,
    /// `allow_other` and `allow_root` are understood here, the others
    /// are passed to the kernel (through fusermount3) as they are.
    pub fuse_options: Vec<String>,
}

/// A mounted file, not served yet.
pub struct Mounted {
    session: Session<OneFile>,
    dev: DeviceRef,
}

/// The error of a failed mount, with what was mounted on.
fn mount_error(target: &Target, e: std::io::Error) -> Error {
    Error::from(e).context(format!("mounting '{}'", target.target_path()))
}

/// Mounts `dev` as `opts` says; the kernel has seen the filesystem when
/// this returns, and requests wait for [`Mounted::serve`].
pub fn mount(dev: DeviceRef, opts: &MountOptions) -> Result<Mounted> {
    let mut file = FileOptions {
        name: opts.target.name.clone(),
        read_only: opts.read_only || !dev.capabilities().can_write,
        ..FileOptions::default()
    };
    let mut config = Config::default();
    config.n_threads = Some(opts.threads.max(1));
    config.clone_fd = opts.threads > 1;
    config
        .mount_options
        .push(MountOption::FSName("diskit".into()));
    for words in &opts.fuse_options {
        for o in words.split(',').filter(|o| !o.is_empty()) {
            match o {
                "kernel_cache" => file.keep_cache = true,
                "direct_io" => file.direct_io = true,
                "allow_other" => config.acl = SessionACL::All,
                "allow_root" => config.acl = SessionACL::RootAndOwner,
                _ => config
                    .mount_options
                    .push(MountOption::CUSTOM(o.to_string())),
            }
        }
    }
    let fs = OneFile::new(dev.clone(), file);
    let mut session = Session::new(fs, &opts.target.mountpoint, &config)
        .map_err(|e| mount_error(&opts.target, e))?;
    // From here on a signal unmounts (a caller told of the mount may
    // send one at once).
    signals::unmount_on_signals(session.unmount_callable())?;
    Ok(Mounted { session, dev })
}

impl Mounted {
    /// Serves requests until the file is unmounted, then flushes and
    /// closes the device. An unmount caused by a signal is an error
    /// (nbdfuse's words), after the device is closed all the same.
    pub fn serve(self) -> Result<()> {
        self.session
            .run()
            .map_err(|e| Error::new(ErrorKind::Io, format!("serving the mount: {e}")))?;
        if self.dev.capabilities().can_write {
            self.dev.flush()?;
        }
        self.dev.close()?;
        match signals::received() {
            Some(sig) => Err(Error::new(
                ErrorKind::Shutdown,
                format!("fuse_loop: fuse loop terminated by signal {sig}"),
            )),
            None => Ok(()),
        }
    }
}
