//! `diskit compare`: do two images have the same content?
//!
//! Exit status as qemu-img's: 0 identical, 1 different, 2 error opening an
//! image or in the arguments, 4 read error.

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::OpenPolicy;
use crate::util::{CliError, ForceShare, parse_format};
use diskit_core::zero::is_zero;
use diskit_core::{BlockDevice, Extent};
use diskit_open::OpenOptions;

/// Arguments of `compare`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Format of the first image.
    #[arg(short = 'f', long = "a-format")]
    format1: Option<String>,
    /// Format of the second image.
    #[arg(short = 'F', long = "b-format")]
    format2: Option<String>,
    /// Strict: sizes and allocation must match too.
    #[arg(short = 's', long = "strict")]
    strict: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Cache mode of both images (default writeback).
    #[arg(short = 'T', long = "cache")]
    cache: Option<String>,
    #[command(flatten)]
    share: ForceShare,
    /// First image.
    image1: PathBuf,
    /// Second image.
    image2: PathBuf,
}

const CHUNK: u64 = 1 << 20;
const SECTOR: u64 = 512;

enum Verdict {
    Same,
    Differ(String),
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let _ = a.progress;
    let policy = a.share.policy(policy);
    let cache = crate::util::cache_mode(a.cache.as_deref(), "writeback").map_err(|_| {
        CliError::new(format!(
            "Invalid source cache option: {}",
            a.cache.as_deref().unwrap_or_default()
        ))
        .code(2)
    })?;
    let open = |p: &PathBuf, f: &Option<String>| -> Result<_, CliError> {
        let fmt = parse_format(f.as_deref()).map_err(|e| e.code(2))?;
        let opts = OpenOptions {
            direct: cache.direct,
            ..OpenOptions::default()
        };
        policy.open(p, fmt, opts).map_err(|e| e.code(2))
    };
    let i1 = open(&a.image1, &a.format1)?;
    let i2 = open(&a.image2, &a.format2)?;
    let read_err =
        |e: diskit_core::Error| CliError::new(format!("Error while reading: {e}")).code(4);
    match compare(&*i1.device, &*i2.device, a.strict, a.quiet).map_err(read_err)? {
        Verdict::Same => {
            if !a.quiet {
                println!("Images are identical.");
            }
            Ok(0)
        }
        Verdict::Differ(msg) => {
            if !a.quiet {
                println!("{msg}");
            }
            Ok(1)
        }
    }
}

fn compare(
    d1: &dyn BlockDevice,
    d2: &dyn BlockDevice,
    strict: bool,
    quiet: bool,
) -> diskit_core::Result<Verdict> {
    let (s1, s2) = (d1.size(), d2.size());
    if s1 != s2 && strict {
        return Ok(Verdict::Differ("Strict mode: Image size mismatch!".into()));
    }
    let common = s1.min(s2);
    let mut b1 = vec![0u8; CHUNK as usize];
    let mut b2 = vec![0u8; CHUNK as usize];
    let mut pos = 0u64;
    while pos < common {
        let e1 = first_extent(d1, pos, common - pos)?;
        let e2 = first_extent(d2, pos, common - pos)?;
        let n = e1.length.min(e2.length).min(common - pos);
        if strict && block_status(&e1) != block_status(&e2) {
            return Ok(Verdict::Differ(format!(
                "Strict mode: Offset {pos} block status mismatch!"
            )));
        }
        if !(e1.flags.zero && e2.flags.zero) {
            let mut done = 0u64;
            while done < n {
                let m = (n - done).min(CHUNK) as usize;
                let at = pos + done;
                d1.read_at(&mut b1[..m], at)?;
                if e2.flags.zero {
                    b2[..m].fill(0);
                } else {
                    d2.read_at(&mut b2[..m], at)?;
                }
                if b1[..m] != b2[..m] {
                    let i = b1[..m]
                        .iter()
                        .zip(&b2[..m])
                        .position(|(x, y)| x != y)
                        .unwrap_or(0);
                    return Ok(mismatch(pos, at + i as u64));
                }
                done += m as u64;
            }
        }
        pos += n;
    }
    // The rest of the larger image must read as zeros: said, as qemu-img
    // says it, once the common part is found the same.
    if s1 != s2 && !quiet {
        println!("Warning: Image size mismatch!");
    }
    let longer = if s1 > s2 { d1 } else { d2 };
    while pos < longer.size() {
        let e = first_extent(longer, pos, longer.size() - pos)?;
        if !e.flags.zero {
            let mut done = 0u64;
            while done < e.length {
                let m = (e.length - done).min(CHUNK) as usize;
                longer.read_at(&mut b1[..m], pos + done)?;
                if !is_zero(&b1[..m]) {
                    let i = b1[..m].iter().position(|&x| x != 0).unwrap_or(0);
                    return Ok(mismatch(pos, pos + done + i as u64));
                }
                done += m as u64;
            }
        }
        pos += e.length;
    }
    Ok(Verdict::Same)
}

/// The message for a difference at `byte`: like qemu-img, the offset is
/// the start of the differing sector, counted from the start of the extent
/// being compared (`extent_start`).
fn mismatch(extent_start: u64, byte: u64) -> Verdict {
    let offset = extent_start + (byte - extent_start) / SECTOR * SECTOR;
    Verdict::Differ(format!("Content mismatch at offset {offset}!"))
}

/// What qemu-img's strict mode compares of two extents: the whole block
/// status (allocated in the chain, zero, data, and whether the bytes lie
/// at a plain place in a file), not only what they read as.
fn block_status(e: &Extent) -> (bool, bool, bool, bool) {
    (
        e.flags.present,
        e.flags.zero,
        e.flags.data,
        e.host_offset.is_some(),
    )
}

fn first_extent(d: &dyn BlockDevice, pos: u64, len: u64) -> diskit_core::Result<Extent> {
    // A device that answers nothing: read the rest.
    let e = diskit_core::extent::walk(d, pos, len).next_answered()?;
    Ok(e.unwrap_or_else(|| Extent::data(len)))
}
