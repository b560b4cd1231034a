//! What qemu-nbd serves: the image, opened through the one opener as its
//! options say (format, `--image-opts`, read-only, cache mode, `-s`'s
//! temporary overlay, `-l`'s internal snapshot), with the layers QEMU puts
//! over it (`-o`'s offset, `--discard` and `--detect-zeroes`, writes
//! through the cache with `writethrough` and `directsync`).

use std::path::Path;
use std::sync::Arc;

use super::settings::Settings;
use crate::util::{CliError, OpenPolicy};
use diskit_core::DeviceRef;
use diskit_filters::FilterSpec;
use diskit_filters::unmap::Discard;
use diskit_nbd::server::ExportBitmap;
use diskit_open::{Format, OpenOptions};

/// The served device and what the export says of it.
pub struct Served {
    /// The top of the stack: served, and closed when the server stops.
    pub device: DeviceRef,
    /// Whether the export is read-only (`-r`, `-l`).
    pub read_only: bool,
    /// The minimum block size QEMU advertises: 512 over a raw image whose
    /// format was probed (QEMU's probed raw node aligns requests to
    /// sectors), else 1.
    pub minimum: u32,
    /// The persistent dirty bitmaps served (`-B`), found in the image or
    /// down its backing chain.
    pub bitmaps: Vec<Arc<ExportBitmap>>,
}

/// What opening `file` needs from the command line.
pub struct Request<'a> {
    /// The image's name (or `--image-opts` description).
    pub file: &'a str,
    /// `-f`.
    pub format: Option<&'a str>,
    /// `--image-opts`.
    pub image_opts: bool,
    /// `-r`.
    pub read_only: bool,
    /// `-B` names, in command-line order.
    pub bitmaps: &'a [String],
    /// `-s`.
    pub snapshot: bool,
}

/// qemu-nbd's message for an image that does not open.
fn open_failed(file: &str, e: impl std::fmt::Display) -> CliError {
    CliError::new(format!("Failed to blk_new_open '{file}': {e}"))
}

/// Opens what `r` names under the settings `s`, the image through
/// `policy` (`--untrusted` under diskit's own name).
pub fn open(r: &Request<'_>, s: &Settings, policy: &OpenPolicy) -> Result<Served, CliError> {
    if r.image_opts && r.format.is_some() {
        return Err(CliError::new("--image-opts and -f are mutually exclusive"));
    }
    let format = r
        .format
        .map(|f| {
            Format::from_name(f).map_err(|_| open_failed(r.file, format!("Unknown driver '{f}'")))
        })
        .transpose()?;
    if s.aio_native && !s.cache.direct {
        return Err(open_failed(
            r.file,
            "aio=native was specified, but it requires cache.direct=on, which was not specified.",
        ));
    }
    let read_only = r.read_only || s.load_snapshot.is_some();
    let opts = OpenOptions {
        writable: !read_only,
        direct: s.cache.direct,
        no_flush: s.cache.no_flush,
        snapshot: s.load_snapshot.clone(),
        temporary_overlay: r.snapshot,
        // --discard=ignore (the default): nothing the image maps is freed
        // while served, so reads may be spliced from its file.
        keep_allocations: s.unmap.discard == Discard::Ignore,
        ..policy.options()
    };
    let img = policy
        .open_name_as(Path::new(r.file), format, opts, r.image_opts)
        .map_err(|e| {
            if s.load_snapshot.is_some() && e.to_string().ends_with("Can't find snapshot") {
                CliError::new("Failed to load snapshot: Can't find snapshot")
            } else {
                open_failed(r.file, e)
            }
        })?;
    // Under -s the image is the overlay's backing.
    let base = if r.snapshot {
        img.backing.as_deref().unwrap_or(&img)
    } else {
        &img
    };
    // qemu-nbd keeps its -B names last first: it checks, and lists, the
    // last one given first.
    let names: Vec<String> = r.bitmaps.iter().rev().cloned().collect();
    let bitmaps = diskit_open::export_bitmaps::for_export(&img, &names).map_err(|e| {
        let _ = img.device.close();
        CliError::new(e.to_string())
    })?;
    let probed_raw = format.is_none() && !r.image_opts && base.format == Format::RAW;
    if probed_raw {
        crate::util::warn_probed_raw(Path::new(r.file));
    }
    let mut filters = Vec::new();
    if s.offset > 0 {
        filters.push(filter("offset", &[("offset", &s.offset.to_string())])?);
    }
    if s.writethrough && !read_only {
        filters.push(filter("fua", &[("fuamode", "force")])?);
    }
    let device = diskit_filters::stack(&filters, img.device.clone(), read_only)
        .map_err(|e| CliError::new(e.to_string()))?;
    Ok(Served {
        device: s.unmap.stack(device),
        read_only,
        minimum: if probed_raw && !r.snapshot { 512 } else { 1 },
        bitmaps,
    })
}

/// The filter `name` with `params`.
fn filter(name: &str, params: &[(&str, &str)]) -> Result<FilterSpec, CliError> {
    let params: Vec<(String, String)> = params
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    FilterSpec::parse(name, &params).map_err(|e| CliError::new(e.to_string()))
}
