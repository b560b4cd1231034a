//! A temporary qcow2 overlay over an image, as QEMU's `snapshot=on`
//! (qemu-nbd's `-s`): writes go to a new qcow2 file whose backing is the
//! image, which is opened read-only and never written. The file is made
//! in `$TMPDIR` (else `/var/tmp`, as QEMU) and removed as soon as it is
//! open, so that nothing is left behind however the process ends.

use std::path::PathBuf;

use diskit_core::{Error, Result};

use crate::spec::{Spec, Value};
use crate::{Chain, Format, Image, OpenOptions, OptionList};

/// Where QEMU makes temporary images when `$TMPDIR` is not set.
const DEFAULT_TMPDIR: &str = "/var/tmp";

/// Opens the image `spec` describes (shown as `display`) read-only under
/// a new temporary qcow2 overlay of its size, opened writable with `opts`
/// otherwise; the overlay is the image returned, the image its backing.
pub(crate) fn open(spec: &Spec, display: &str, opts: &OpenOptions) -> Result<Image> {
    let read_only = OpenOptions {
        writable: false,
        ..opts.clone()
    };
    // Opened once alone: its errors are the image's, and its size and
    // format make the overlay.
    let base = Chain::new(&read_only).open(spec, display, &read_only)?;
    let (size, format) = (base.virtual_size(), base.format);
    drop(base);

    let dir = std::env::var_os("TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_TMPDIR));
    let file = tempfile::Builder::new()
        .prefix("vl.")
        .tempfile_in(&dir)
        .map_err(|e| {
            Error::from(e).context(format!(
                "Could not create a temporary overlay in {}",
                dir.display()
            ))
        })?;
    let path = file.path().to_string_lossy().into_owned();
    // The name recorded is for whoever looks at the file meanwhile; the
    // backing opened is the description below.
    let mut options = OptionList::new();
    options.set("backing_file", display);
    options.set("backing_fmt", format.name());
    crate::create::create_image(&path, Format::QCOW2, Some(size), &options)?;

    let mut top = Spec::default();
    top.set("driver", Value::Str(Format::QCOW2.name().to_string()));
    top.set("file.driver", Value::Str("file".to_string()));
    top.set("file.filename", Value::Str(path.clone()));
    let mut below = spec.clone();
    if below.get("driver").is_none() {
        below.set("driver", Value::Str(format.name().to_string()));
    }
    top.nest("backing", &below);
    let writable = OpenOptions {
        writable: true,
        writable_backing_depth: 0,
        ..opts.clone()
    };
    let img = Chain::new(&writable).open(&top, &path, &writable);
    // Removed now, open or not: the open file lives on until closed.
    drop(file);
    img
}
