//! `diskit bitmap`: qemu-img bitmap — add, remove, clear, enable, disable
//! and merge an image's persistent dirty bitmaps. The operations run in
//! the order given; if one fails, nothing is stored (qemu-img stores
//! those before it).

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, OpenPolicy, parse_format, parse_size_arg, parse_source_format};
use diskit_open::{BitmapEdit, OpenOptions};

/// Arguments of `bitmap`, parsed in order by [`parse`] (the order of the
/// operations matters, which clap's derive does not keep).
#[derive(clap::Args, Debug)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// (--merge SOURCE | --add | --remove | --clear | --enable | --disable)...
    /// [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] FILENAME BITMAP
    #[arg(num_args = 0.., allow_hyphen_values = true, trailing_var_arg = true)]
    args: Vec<String>,
}

/// An operation as given.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Add,
    Remove,
    Clear,
    Enable,
    Disable,
    Merge(String),
}

/// The command line, parsed.
#[derive(Debug, Default, PartialEq, Eq)]
struct Parsed {
    ops: Vec<Op>,
    format: Option<String>,
    granularity: Option<String>,
    source_file: Option<String>,
    source_format: Option<String>,
    /// `--image-opts`: FILENAME is a description.
    image_opts: bool,
    /// `--object` definitions, in order.
    objects: Vec<String>,
    positional: Vec<String>,
}

const USAGE: &str = "qemu-img-style usage: diskit bitmap (--merge SOURCE | --add | --remove | \
    --clear | --enable | --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] \
    [-f FMT] FILENAME BITMAP";

fn parse(args: &[String]) -> Result<Parsed, CliError> {
    let mut p = Parsed::default();
    let mut i = 0;
    let value = |i: &mut usize, name: &str, inline: Option<&str>| -> Result<String, CliError> {
        if let Some(v) = inline {
            return Ok(v.to_string());
        }
        *i += 1;
        args.get(*i)
            .cloned()
            .ok_or_else(|| CliError::new(format!("option requires an argument -- '{name}'")))
    };
    while i < args.len() {
        let a = &args[i];
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v)),
            _ => (a.as_str(), None),
        };
        match flag {
            "--add" => p.ops.push(Op::Add),
            "--remove" => p.ops.push(Op::Remove),
            "--clear" => p.ops.push(Op::Clear),
            "--enable" => p.ops.push(Op::Enable),
            "--disable" => p.ops.push(Op::Disable),
            "--merge" => {
                let v = value(&mut i, "merge", inline)?;
                p.ops.push(Op::Merge(v));
            }
            "--format" => p.format = Some(value(&mut i, "format", inline)?),
            "--granularity" => p.granularity = Some(value(&mut i, "granularity", inline)?),
            "--source-file" => p.source_file = Some(value(&mut i, "source-file", inline)?),
            "--source-format" => p.source_format = Some(value(&mut i, "source-format", inline)?),
            "--image-opts" => p.image_opts = true,
            "--object" => p.objects.push(value(&mut i, "object", inline)?),
            "-h" | "--help" => {
                return Err(CliError::new(USAGE).code(0));
            }
            _ if a.len() >= 2 && a.starts_with('-') && !a.starts_with("--") => {
                let (name, rest) = (&a[1..2], &a[2..]);
                let inline = (!rest.is_empty()).then_some(rest);
                let v = value(&mut i, name, inline)?;
                match name {
                    "f" => p.format = Some(v),
                    "g" => p.granularity = Some(v),
                    "b" => p.source_file = Some(v),
                    "F" => p.source_format = Some(v),
                    _ => return Err(CliError::new(format!("invalid option -- '{name}'"))),
                }
            }
            _ if a.starts_with("--") => {
                return Err(CliError::new(format!("unrecognized option '{a}'")));
            }
            _ => p.positional.push(a.clone()),
        }
        i += 1;
    }
    Ok(p)
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let p = match parse(&a.args) {
        Err(e) if e.code == 0 => {
            println!("{}", e.message);
            return Ok(0);
        }
        r => r?,
    };
    // The global options qemu-img bitmap takes among its own.
    for def in &p.objects {
        diskit_open::define_object(def).map_err(|e| CliError::new(e.to_string()))?;
    }
    if p.ops.is_empty() {
        return Err(CliError::usage(
            "bitmap",
            "Need at least one of --add, --remove, --clear, --enable, --disable, or --merge",
        ));
    }
    if p.granularity.is_some() && !p.ops.contains(&Op::Add) {
        return Err(CliError::new("granularity only supported with --add"));
    }
    let merging = p.ops.iter().any(|o| matches!(o, Op::Merge(_)));
    if p.source_file.is_some() && !merging {
        return Err(CliError::new(
            "Merge bitmap source file only supported with --merge",
        ));
    }
    if p.source_format.is_some() && p.source_file.is_none() {
        return Err(CliError::new("--merge -F requires -b to specify source"));
    }
    let [file, name] = &p.positional[..] else {
        return Err(CliError::new("Expecting filename and bitmap name"));
    };
    let granularity = match &p.granularity {
        Some(g) => Some(
            parse_size_arg(g, "granularity")
                .map_err(|_| CliError::new(format!("Invalid granularity specified: '{g}'")))?,
        ),
        None => None,
    };
    let path = PathBuf::from(file);
    let format = parse_source_format(p.format.as_deref(), &path)?;
    let opts = OpenOptions {
        writable: true,
        ..OpenOptions::default()
    };
    let image_opts = p.image_opts || policy.image_opts;
    let image = policy
        .open_name_as(&path, format, opts, image_opts)
        .map_err(|e| CliError::new(format!("Could not open '{}': {e}", path.display())))?;
    // The merge sources: bitmaps of this image, or of -b's.
    let source_image = match &p.source_file {
        Some(f) => {
            let sp = PathBuf::from(f);
            let sf = match &p.source_format {
                Some(fmt) => parse_format(Some(fmt))?,
                None => parse_source_format(None, &sp)?,
            };
            // Only the image's own bitmaps are read: its backing file is
            // not opened (qemu-img's BDRV_O_NO_BACKING), so an overlay of
            // the target merges into it.
            let opts = OpenOptions {
                no_backing: true,
                ..OpenOptions::default()
            };
            Some(policy.open(&sp, sf, opts)?)
        }
        None => None,
    };
    let mut edits = Vec::new();
    for op in &p.ops {
        let n = name.clone();
        edits.push(match op {
            Op::Add => BitmapEdit::Add {
                name: n,
                granularity,
            },
            Op::Remove => BitmapEdit::Remove(n),
            Op::Clear => BitmapEdit::Clear(n),
            Op::Enable => BitmapEdit::Enable(n),
            Op::Disable => BitmapEdit::Disable(n),
            Op::Merge(src) => {
                let from = source_image.as_ref().unwrap_or(&image);
                let list = from
                    .ops
                    .bitmaps()
                    .map_err(|e| CliError::new(e.to_string()))?;
                let info = list.iter().find(|b| &b.name == src).ok_or_else(|| {
                    CliError::new(format!(
                        "Operation merge on bitmap {n} failed: Dirty bitmap '{src}' not found"
                    ))
                })?;
                let bits = from
                    .ops
                    .bitmap_bits(info)
                    .map_err(|e| CliError::new(e.to_string()))?;
                BitmapEdit::Merge { name: n, bits }
            }
        });
    }
    drop(source_image);
    image
        .ops
        .edit_bitmaps(edits)
        .map_err(|e| CliError::new(e.to_string()))?;
    image.close().map_err(|e| CliError::new(e.to_string()))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: &[&str]) -> Result<Parsed, CliError> {
        parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn operations_keep_their_order() {
        let r = p(&[
            "--add",
            "-g",
            "128k",
            "--disable",
            "--merge=x",
            "f.qcow2",
            "b",
        ])
        .unwrap();
        assert_eq!(r.ops, vec![Op::Add, Op::Disable, Op::Merge("x".into())]);
        assert_eq!(r.granularity.as_deref(), Some("128k"));
        assert_eq!(r.positional, vec!["f.qcow2", "b"]);
        let r = p(&["--merge", "y", "-bsrc.qcow2", "-Fqcow2", "f", "b"]).unwrap();
        assert_eq!(r.source_file.as_deref(), Some("src.qcow2"));
        assert_eq!(r.source_format.as_deref(), Some("qcow2"));
        assert!(p(&["-z", "x"]).is_err());
        assert!(p(&["--merge"]).is_err());
    }
}
