//! `diskit dd`: qemu-img dd — copies an image, block by block, into a new
//! image of any format, with dd's `bs=`, `count=`, `skip=`, `if=` and `of=`.
//!
//! As qemu-img (and unlike dd(1)), `count` limits where reading ends,
//! counted from the start of the input, not from `skip`: `bs=4k count=10
//! skip=3` copies blocks 3 to 9. A skip past the end makes an empty image,
//! with a warning. Every block is written, zeros included, so that the new
//! image is laid out as qemu-img lays it out.

use std::path::PathBuf;

use crate::CmdResult;
use crate::util::{CliError, ForceShare, OpenPolicy, cvtnum, parse_format, parse_source_format};
use diskit_open::{Format, OpenOptions, OptionList};

/// Arguments of `dd`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Output image format (raw if absent).
    #[arg(short = 'O', long = "output-format")]
    output_format: Option<String>,
    #[command(flatten)]
    share: ForceShare,
    /// bs=BLOCK_SIZE count=BLOCKS skip=BLOCKS if=INPUT of=OUTPUT
    #[arg(num_args = 0.., allow_hyphen_values = true)]
    operands: Vec<String>,
}

/// What the operands say.
#[derive(Debug, PartialEq, Eq)]
struct Operands {
    bs: u64,
    count: Option<u64>,
    skip: Option<u64>,
    input: Option<String>,
    output: Option<String>,
}

fn parse_operands(list: &[String]) -> Result<Operands, CliError> {
    let mut o = Operands {
        bs: 512,
        count: None,
        skip: None,
        input: None,
        output: None,
    };
    for op in list {
        let Some((key, value)) = op.split_once('=') else {
            return Err(CliError::new(format!("unrecognized operand {op}")));
        };
        match key {
            "bs" => o.bs = cvtnum("bs", value, 1, i32::MAX as i128)?,
            "count" => o.count = Some(cvtnum("count", value, 0, i64::MAX as i128)?),
            "skip" => o.skip = Some(cvtnum("skip", value, 0, i64::MAX as i128)?),
            "if" => o.input = Some(value.to_string()),
            "of" => o.output = Some(value.to_string()),
            _ => return Err(CliError::new(format!("unrecognized operand {key}"))),
        }
    }
    Ok(o)
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let policy = a.share.policy(policy);
    let o = parse_operands(&a.operands)?;
    let (Some(input), Some(output)) = (&o.input, &o.output) else {
        return Err(CliError::usage(
            "dd",
            "Must specify both input and output files",
        ));
    };
    let out_format = parse_format(a.output_format.as_deref())?.unwrap_or(Format::RAW);
    let in_path = PathBuf::from(input);
    let in_format = parse_source_format(a.format.as_deref(), &in_path)?;
    // The output is never the input, by any name.
    let src = policy.open(
        &in_path,
        in_format,
        OpenOptions {
            source: true,
            ..OpenOptions::default()
        },
    )?;
    let mut size = src.device.size();
    let bs = o.bs;
    if let Some(count) = o.count
        && count <= i64::MAX as u64 / bs
        && size > count * bs
    {
        // The count wins over the input's size.
        size = count * bs;
    }
    let skip = o.skip.unwrap_or(0);
    let skip_bytes = skip.checked_mul(bs).filter(|&b| b <= size);
    let out_size = skip_bytes.map_or(0, |b| size - b);
    let out_path = PathBuf::from(output);
    diskit_open::create::create_image(output, out_format, Some(out_size), &OptionList::new())
        .map_err(|e| CliError::new(format!("{output}: error while creating output image: {e}")))?;
    let dst = policy.open(
        &out_path,
        Some(out_format),
        OpenOptions {
            writable: true,
            ..OpenOptions::default()
        },
    )?;
    let mut in_pos = match skip_bytes {
        Some(b) => b,
        None => {
            eprintln!(
                "{}: {input}: cannot skip to specified offset",
                crate::names::prog()
            );
            size
        }
    };
    // Whole blocks at a time, many per call: the bytes and their order are
    // qemu-img's, in fewer requests.
    let chunk = bs * ((1u64 << 20) / bs).max(1);
    let mut buf = vec![0u8; chunk as usize];
    let mut out_pos = 0u64;
    while in_pos < size {
        let n = chunk.min(size - in_pos) as usize;
        src.device.read_at(&mut buf[..n], in_pos).map_err(|e| {
            CliError::new(format!("error while reading from input image file: {e}"))
        })?;
        dst.device
            .write_at(&buf[..n], out_pos, diskit_core::WriteFlags::NONE)
            .map_err(|e| CliError::new(format!("error while writing to output image file: {e}")))?;
        in_pos += n as u64;
        out_pos += n as u64;
    }
    dst.device
        .flush()
        .and_then(|()| dst.close())
        .map_err(|e| CliError::new(format!("error while writing to output image file: {e}")))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(v: &[&str]) -> Result<Operands, CliError> {
        parse_operands(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn operands_read_as_qemu_img_reads_them() {
        let o = ops(&["bs=4k", "count=10", "skip=3", "if=a", "of=b", "bs=1M"]).unwrap();
        assert_eq!(o.bs, 1 << 20);
        assert_eq!((o.count, o.skip), (Some(10), Some(3)));
        assert_eq!(
            (o.input.as_deref(), o.output.as_deref()),
            (Some("a"), Some("b"))
        );
        for (bad, says) in [
            (
                "bs=0",
                "Invalid bs specified. Must be between 1 and 2147483647.",
            ),
            ("bs=foo", "Invalid bs specified: 'foo'."),
            ("bs=4G", "Must be between 1 and 2147483647."),
            ("count=-1", "Invalid count specified"),
            ("skip=1x", "Invalid skip specified: '1x'."),
            ("foo=1", "unrecognized operand foo"),
            ("ifx", "unrecognized operand ifx"),
        ] {
            let e = ops(&[bad]).unwrap_err();
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
