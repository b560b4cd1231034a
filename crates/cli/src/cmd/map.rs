//! `diskit map`: where each range of the guest disk lives.

use std::io::Write;

use crate::CmdResult;
use crate::qjson::QJson;
use crate::util::{CliError, ForceShare, OpenPolicy, ReportArgs, parse_size_arg};
use diskit_core::extent;
use diskit_core::{BlockDevice, Extent};
use diskit_open::OpenOptions;

/// Arguments of `map`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    image: ReportArgs,
    /// First guest byte to map.
    #[arg(short = 's', long = "start-offset")]
    start_offset: Option<String>,
    /// How many bytes to map.
    #[arg(short = 'l', long = "max-length")]
    max_length: Option<String>,
    #[command(flatten)]
    share: ForceShare,
}

fn offset_arg(s: Option<&str>, what: &str) -> Result<Option<u64>, CliError> {
    s.map(|v| parse_size_arg(v, what)).transpose()
}

/// Merged extents of `dev` over `start..end`.
pub fn collect_extents(
    dev: &dyn BlockDevice,
    start: u64,
    end: u64,
) -> diskit_core::Result<Vec<(u64, Extent)>> {
    let merged = extent::collect(dev, start, end - start, usize::MAX)?;
    let mut out = Vec::with_capacity(merged.len());
    let mut off = start;
    for e in merged {
        out.push((off, e));
        off += e.length;
    }
    Ok(out)
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let json = a.image.json("map")?;
    let format = a.image.format()?;
    let policy = a.share.policy(policy);
    let start = offset_arg(a.start_offset.as_deref(), "start offset")?.unwrap_or(0);
    let max_len = offset_arg(a.max_length.as_deref(), "max length")?;
    let img = policy.open(&a.image.filename, format, OpenOptions::default())?;
    let size = img.virtual_size();
    let end = match max_len {
        Some(l) => start.saturating_add(l).min(size),
        None => size,
    };
    let start = start.min(end);
    let mut extents = if img.ops.reports_allocation() {
        collect_extents(&*img.device, start, end)?
    } else {
        // As qemu-img: the format says nothing of allocation, so the
        // whole range is data, with no place in the file.
        if end > start {
            vec![(start, Extent::data(end - start))]
        } else {
            Vec::new()
        }
    };
    if extents.is_empty() {
        // qemu-img describes an empty range as one empty, absent extent.
        let mut nothing = Extent::hole(0);
        nothing.flags.present = false;
        nothing.flags.zero = false;
        extents.push((start, nothing));
    }
    let chain = img.chain();
    // Data offsets point into the external data file or the extent, if
    // any; into the image's own file otherwise.
    let names = |depth: usize, start: u64| -> String {
        chain.get(depth).map_or_else(String::new, |i| {
            i.ops
                .data_file_at(start)
                .unwrap_or_else(|| i.filename.display().to_string())
        })
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = if json {
        print_json(&mut out, &extents).map(Ok)
    } else {
        print_human(&mut out, &extents, &names)
    };
    let outcome = result
        .and_then(|r| out.flush().map(|_| r))
        .map_err(|e| CliError::new(e.to_string()))?;
    outcome?;
    Ok(0)
}

fn print_json(out: &mut impl Write, extents: &[(u64, Extent)]) -> std::io::Result<()> {
    write!(out, "[")?;
    for (i, (start, e)) in extents.iter().enumerate() {
        if i > 0 {
            writeln!(out, ",")?;
        }
        let mut v = QJson::dict()
            .with("start", QJson::UInt(*start))
            .with("length", QJson::UInt(e.length))
            .with("depth", QJson::UInt(e.depth as u64))
            .with("present", QJson::Bool(e.flags.present))
            .with("zero", QJson::Bool(e.flags.zero))
            .with("data", QJson::Bool(e.flags.data))
            .with("compressed", QJson::Bool(e.flags.compressed));
        if let Some(o) = e.host_offset {
            v = v.with("offset", QJson::UInt(o));
        }
        let mut s = String::new();
        v.write_compact(&mut s);
        // qemu-img writes "{ " after the brace of each entry.
        write!(out, "{{ {}", &s[1..])?;
    }
    writeln!(out, "]")
}

fn print_human(
    out: &mut impl Write,
    extents: &[(u64, Extent)],
    names: &dyn Fn(usize, u64) -> String,
) -> std::io::Result<Result<(), CliError>> {
    writeln!(
        out,
        "{:<16}{:<16}{:<16}File",
        "Offset", "Length", "Mapped to"
    )?;
    for (start, e) in extents {
        if !e.flags.data || e.flags.zero {
            continue;
        }
        let Some(host) = e.host_offset else {
            // qemu-img stops here too: the human format cannot say where
            // compressed data lives.
            return Ok(Err(CliError::new(
                "File contains external, encrypted or compressed clusters.",
            )));
        };
        writeln!(
            out,
            "{:<15} {:<15} {:<15} {}",
            hex(*start),
            hex(e.length),
            hex(host),
            names(e.depth as usize, *start)
        )?;
    }
    Ok(Ok(()))
}

/// C's `%#x`: "0" for zero, "0x..." otherwise.
fn hex(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}
