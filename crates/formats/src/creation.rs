//! A new image being planned (`create`): a format's creation options,
//! parsed from `-o` by its driver
//! ([`FormatDriver::parse_create`](crate::FormatDriver::parse_create)),
//! completed from the command line, shown, then made.

use std::path::Path;

use diskit_core::{Result, StorageRef};

use crate::OptionList;

/// The creation options of one format, parsed and open to the values the
/// command line adds (size, backing file).
pub trait Creation {
    /// The virtual size, if given.
    fn size(&self) -> Option<u64>;

    /// Sets the virtual size (from the size argument or the backing file).
    fn set_size(&mut self, size: u64);

    /// The backing file, if given.
    fn backing_file(&self) -> Option<&str> {
        None
    }

    /// The backing file's format, if given.
    fn backing_format(&self) -> Option<&str> {
        None
    }

    /// Sets the backing file (formats without one ignore it: check
    /// [`Capability::BackingFile`](crate::image_ops::Capability::BackingFile)).
    fn set_backing_file(&mut self, name: &str) {
        let _ = name;
    }

    /// Sets the backing file's format.
    fn set_backing_format(&mut self, name: &str) {
        let _ = name;
    }

    /// The options of qemu-img's "Formatting" line, after `fmt=NAME`
    /// (each with its leading space).
    fn summary(&self) -> String;

    /// Makes the image where `target` says, through it.
    fn create(&self, target: &mut dyn NewFiles) -> Result<()>;
}

/// Where a new image is made: the storage for it, and for the files it
/// names (vmdk extents, a qcow2 data file), each made empty and writable
/// when asked for. Whoever gives out the target removes what it made if
/// the creation fails (never what was there before), as QEMU does.
pub trait NewFiles {
    /// The name the new image was given.
    fn name(&self) -> &str;

    /// Makes the storage called `name` (the image's own name, or the name
    /// of a file it names) empty, writable and locked as a new image's:
    /// a new file, or existing storage taken over (a block device, an NBD
    /// export).
    fn make(&mut self, name: &str) -> Result<StorageRef>;

    /// Makes the image's own storage.
    fn make_image(&mut self) -> Result<StorageRef> {
        let name = self.name().to_string();
        self.make(&name)
    }
}

/// New images as local files, by path: [`NewFiles`] for tools and tests
/// that make images on the local file system only (the opener's targets
/// reach every storage).
pub struct LocalFiles {
    name: String,
    made: Vec<std::path::PathBuf>,
}

impl LocalFiles {
    /// A target for the image at `path`.
    pub fn new(path: &Path) -> LocalFiles {
        LocalFiles {
            name: path.display().to_string(),
            made: Vec::new(),
        }
    }

    /// Runs `make` on this target; if it fails, removes the files made.
    pub fn run<T>(mut self, make: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let r = make(&mut self);
        if r.is_err() {
            for p in &self.made {
                let _ = std::fs::remove_file(p);
            }
        }
        r
    }
}

impl NewFiles for LocalFiles {
    fn name(&self) -> &str {
        &self.name
    }

    fn make(&mut self, name: &str) -> Result<StorageRef> {
        let (storage, made) = new_file(Path::new(name))?;
        self.made.extend(made);
        Ok(storage)
    }
}

/// Makes the local file at `path` empty and writable, with QEMU's creation
/// locks held and never over a source of the running command
/// (`FileDevice::create`); returns it, and its path when it was not there
/// before (what a failed creation removes).
pub fn new_file(path: &Path) -> Result<(StorageRef, Option<std::path::PathBuf>)> {
    let existed = path.exists();
    let dev = diskit_backends::FileDevice::create(path, 0, diskit_backends::Preallocation::Off)?;
    Ok((
        std::sync::Arc::new(dev),
        (!existed).then(|| path.to_path_buf()),
    ))
}

/// Makes the image's own storage through `target` and writes it with
/// `write`, flushed: the usual body of a format's creation.
pub fn make_image(
    target: &mut dyn NewFiles,
    write: impl FnOnce(&dyn diskit_core::Storage) -> Result<()>,
) -> Result<()> {
    let storage = target.make_image()?;
    write(&*storage)?;
    storage.flush()
}

/// What the command line completes in a new image of any format: the
/// virtual size, and the backing file and its format (for formats that
/// take one), kept once here for every format's plan ([`Planned`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Basics {
    /// The virtual size, if given.
    pub size: Option<u64>,
    /// The backing file, if given.
    pub backing_file: Option<String>,
    /// The backing file's format, if given.
    pub backing_fmt: Option<String>,
}

impl Basics {
    /// `size`, `backing_file` and `backing_fmt` from `-o` (the format has
    /// checked which keys it takes).
    pub fn parse(options: &OptionList) -> Result<Basics> {
        Ok(Basics {
            size: options.size("size")?,
            backing_file: options.text("backing_file"),
            backing_fmt: options.text("backing_fmt"),
        })
    }

    /// The "Formatting" line's ` backing_file=` and ` backing_fmt=`, for
    /// what is given.
    pub fn backing_summary(&self) -> String {
        let mut out = String::new();
        if let Some(b) = &self.backing_file {
            out += &format!(" backing_file={b}");
        }
        if let Some(f) = &self.backing_fmt {
            out += &format!(" backing_fmt={f}");
        }
        out
    }
}

/// A format's own creation options, which [`Planned`] makes a
/// [`Creation`] of.
pub trait FormatOptions {
    /// The "Formatting" line's options after the size (each with its
    /// leading space), in the format's order.
    fn summary(&self, basics: &Basics) -> String;

    /// Makes an image of `size` bytes with these options where `target`
    /// says.
    fn make(&self, target: &mut dyn NewFiles, size: u64, basics: &Basics) -> Result<()>;
}

/// A new image planned: the [`Basics`] and a format's own options.
pub struct Planned<O> {
    /// The size and backing file.
    pub basics: Basics,
    /// The format's own options.
    pub opts: O,
}

impl<O: FormatOptions + 'static> Planned<O> {
    /// The plan of `opts`, parsed from `options`, which give the basics
    /// too.
    pub fn new(options: &OptionList, opts: O) -> Result<Planned<O>> {
        Ok(Planned {
            basics: Basics::parse(options)?,
            opts,
        })
    }

    /// [`new`](Self::new), as the driver's
    /// [`parse_create`](crate::FormatDriver::parse_create) returns it.
    pub fn boxed(options: &OptionList, opts: O) -> Result<Box<dyn Creation>> {
        Ok(Box::new(Planned::new(options, opts)?))
    }
}

impl<O: FormatOptions> Creation for Planned<O> {
    fn size(&self) -> Option<u64> {
        self.basics.size
    }

    fn set_size(&mut self, size: u64) {
        self.basics.size = Some(size);
    }

    fn backing_file(&self) -> Option<&str> {
        self.basics.backing_file.as_deref()
    }

    fn backing_format(&self) -> Option<&str> {
        self.basics.backing_fmt.as_deref()
    }

    fn set_backing_file(&mut self, name: &str) {
        self.basics.backing_file = Some(name.to_string());
    }

    fn set_backing_format(&mut self, name: &str) {
        self.basics.backing_fmt = Some(name.to_string());
    }

    fn summary(&self) -> String {
        let mut out = String::new();
        if let Some(s) = self.basics.size {
            out += &format!(" size={s}");
        }
        out + &self.opts.summary(&self.basics)
    }

    fn create(&self, target: &mut dyn NewFiles) -> Result<()> {
        let size = crate::driver::one_size(None, self.basics.size)?;
        self.opts.make(target, size, &self.basics)
    }
}

/// The "Formatting" line's ` key=value` for each option given.
pub fn given_summary(given: &[(String, String)]) -> String {
    given.iter().map(|(k, v)| format!(" {k}={v}")).collect()
}

/// The file protocol's creation options, as `-o help` lists them.
const FILE_OPTIONS: &[&str] = &[
    "extent_size_hint=<size> - Extent size hint for the image file, 0 to disable",
    "nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)",
    "preallocation=<str>    - Preallocation mode (allowed values: off, falloc, full)",
];

/// The key of an option line (`key=<type> - text`).
fn key(line: &str) -> &str {
    line.split('=').next().unwrap_or(line)
}

/// The creation options a format offers, as `-o help` lists them (lines
/// `key=<type> - text`): their keys, with the file protocol's, are the
/// `-o` keys the format takes.
pub struct Offered(pub &'static [&'static str]);

impl Offered {
    /// Fails naming the first key of `options` the format does not take.
    pub fn check(&self, options: &OptionList) -> Result<()> {
        let keys: Vec<&str> = self.0.iter().chain(FILE_OPTIONS).map(|l| key(l)).collect();
        options.check_known(&keys)
    }

    /// `create -o help` as qemu-img prints it for `format`: with a file
    /// name given, the format's lines merged with the file protocol's
    /// (the format's winning where both have a key), in order of key;
    /// without, the format's alone, and a hint.
    pub fn help(&self, format: &str, with_file: bool) -> String {
        let own = self.0;
        let mut lines = own.to_vec();
        if with_file {
            let theirs = FILE_OPTIONS
                .iter()
                .filter(|f| !own.iter().any(|o| key(o) == key(f)));
            lines.extend(theirs);
        }
        lines.sort_by_key(|l| key(l));
        let mut out = if with_file {
            "Supported options:\n".to_string()
        } else {
            format!("Supported {format} options:\n")
        };
        for line in lines {
            out += &format!("  {line}\n");
        }
        if !with_file {
            out += "\nThe protocol level may support further options.\n\
                    Specify the target filename to include those options.\n";
        }
        out
    }
}
