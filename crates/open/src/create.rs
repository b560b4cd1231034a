//! New images wherever a name says: the creation targets of `create`,
//! `convert` and `dd`, through the protocol table. A local file is made
//! (and removed again if the creation fails, never one that was there
//! before); existing storage that cannot be made (an NBD export) is taken
//! over as QEMU's fallback does, opened for writing, and zeroed whole (as
//! a new file reads), so that no old bytes show through as metadata.

use std::path::PathBuf;

use diskit_core::{Error, Result, StorageRef, ZeroFlags};
use diskit_formats::creation::NewFiles;
use diskit_formats::{Creation, Format, OptionList};

use crate::protocol::{self, Made, StorageOptions};
use crate::spec::{Spec, Value};

/// What a creation made, to take back if a later step fails.
pub enum Undo {
    /// A local file that was not there before.
    File(PathBuf),
    /// Storage a source made (an RBD image), removed by its row's function.
    Storage {
        /// Its name.
        name: String,
        /// Removes it.
        remove: fn(&str) -> Result<()>,
    },
}

impl Undo {
    /// Takes it back (best effort: the error that led here is the one to
    /// report).
    pub fn undo(self) {
        match self {
            Undo::File(p) => {
                let _ = std::fs::remove_file(p);
            }
            Undo::Storage { name, remove } => {
                let _ = remove(&name);
            }
        }
    }
}

/// The storage a new image and the files it names are made on, by name.
pub struct Targets {
    name: String,
    /// About how large the new image will be (0 when unknown).
    size_hint: u64,
    made: Vec<Undo>,
}

impl Targets {
    /// Targets for a new image called `name`.
    pub fn new(name: &str) -> Targets {
        Targets {
            name: name.to_string(),
            size_hint: 0,
            made: Vec::new(),
        }
    }

    /// Targets for a new image called `name` of about `size` bytes.
    pub fn sized(name: &str, size: Option<u64>) -> Targets {
        Targets {
            size_hint: size.unwrap_or(0),
            ..Targets::new(name)
        }
    }

    /// Removes what was made (never what was there before).
    pub fn remove_made(&mut self) {
        for u in self.made.drain(..).rev() {
            u.undo();
        }
    }

    /// Runs `make` with these targets; if it fails, removes what it made.
    fn run<T>(&mut self, make: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let r = make(self);
        if r.is_err() {
            self.remove_made();
        }
        r
    }
}

impl NewFiles for Targets {
    fn name(&self) -> &str {
        &self.name
    }

    fn make(&mut self, name: &str) -> Result<StorageRef> {
        let proto = protocol::for_name(name)?;
        match proto.made {
            Made::NewFile => {
                let path = protocol::local_path(name);
                let (storage, made) =
                    diskit_formats::creation::new_file(std::path::Path::new(path))?;
                self.made.extend(made.map(Undo::File));
                Ok(storage)
            }
            Made::New { create, remove, .. } => {
                let storage = create(name, self.size_hint)?;
                self.made.push(Undo::Storage {
                    name: name.to_string(),
                    remove,
                });
                Ok(storage)
            }
            Made::Existing => {
                let mut node = Spec::default();
                node.set("filename", Value::Str(name.to_string()));
                let mode = StorageOptions {
                    writable: true,
                    ..Default::default()
                };
                let storage = protocol::open(proto, &node, mode).map_err(|e| {
                    Error::new(
                        e.kind(),
                        format!(
                            "Protocol driver '{}' does not support creating new images, so an \
                             existing image must be selected as the target; however, opening \
                             the given target as an existing image failed: {e}",
                            proto.name
                        ),
                    )
                })?;
                // Formats make an image on a new file, whose space reads as
                // zeros where they wrote nothing (the grain tables of a
                // vmdk, a vhdx's BAT). An export keeps what it held: all of
                // it is zeroed first, fast where the server can (QEMU only
                // zeroes the first sector, and its formats then read the
                // old bytes as metadata).
                let size = storage.size();
                if size > 0 {
                    let fast = ZeroFlags {
                        may_trim: true,
                        fast: true,
                        ..Default::default()
                    };
                    if storage.write_zeroes(0, size, fast).is_err() {
                        storage.write_zeroes(
                            0,
                            size,
                            ZeroFlags {
                                may_trim: true,
                                ..Default::default()
                            },
                        )?;
                    }
                }
                Ok(storage)
            }
            Made::Never => Err(never_made(proto)),
        }
    }
}

/// Checks that an image can be made on what `name` names at all (before
/// anything is said or done about it), in QEMU's words when not.
pub fn check_target(name: &str) -> Result<()> {
    let proto = protocol::for_name(name)?;
    match proto.made {
        Made::Never => Err(never_made(proto)),
        _ => Ok(()),
    }
}

fn never_made(proto: &protocol::Protocol) -> Error {
    Error::unsupported(format!(
        "Protocol driver '{}' does not support image creation",
        proto.name
    ))
}

/// Creates a new image of `format` called `name`, of `size` bytes (or the
/// size in `options`); returns the size and what was made (which a caller
/// that fails later takes back: `convert`).
pub fn create_image(
    name: &str,
    format: Format,
    size: Option<u64>,
    options: &OptionList,
) -> Result<(u64, Vec<Undo>)> {
    let mut targets = Targets::sized(name, size);
    let size = targets.run(|t| format.driver().create(t, size, options))?;
    Ok((size, targets.made))
}

/// Makes the image `new` plans, called `name`, and finishes it: storage
/// that is there only once closed (an S3 object) is complete on return.
pub fn create_planned(name: &str, new: &dyn Creation) -> Result<()> {
    let mut targets = Targets::sized(name, new.size());
    targets.run(|t| new.create(t))?;
    if let Made::New { finish, .. } = protocol::for_name(name)?.made {
        targets.run(|_| finish(name))?;
    }
    Ok(())
}
