//! Sizes as qemu-img reads and writes them.
//!
//! [`parse_size`] accepts what qemu's `qemu_strtosz` accepts: a decimal
//! number, optionally with a fraction when a suffix follows, and one of the
//! 1024-based suffixes `B K M G T P E` (any case). [`human_size`] prints
//! sizes the way qemu-img info does ("10 MiB", "1.5 GiB", "0.977 KiB").

use crate::error::{Error, Result};

/// Why a size did not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeError {
    /// Not a size at all ("abc", "1KiB", "1.5" without a suffix).
    Syntax,
    /// A size, but negative or beyond `i64::MAX` bytes.
    Range,
}

impl From<SizeError> for Error {
    fn from(e: SizeError) -> Error {
        match e {
            SizeError::Syntax => Error::invalid("invalid size"),
            SizeError::Range => Error::new(crate::ErrorKind::Overflow, "size out of range"),
        }
    }
}

/// Parses a size with an optional suffix; a bare number is in bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    Ok(parse_size_detailed(s)?)
}

/// Parses a size exactly as qemu's `qemu_strtosz` followed by qemu-img's
/// range check (0 to `i64::MAX`): decimal with optional leading blanks and
/// `+`, or `0x` hex (no fraction, no suffix); a fraction needs a suffix
/// larger than bytes and rounds to nearest; one suffix of `BKMGTPE` in any
/// case and nothing after it.
pub fn parse_size_detailed(s: &str) -> std::result::Result<u64, SizeError> {
    let t = s.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (negative, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    if let Some(hex) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        let digits_end = hex
            .find(|c: char| !c.is_ascii_hexdigit())
            .unwrap_or(hex.len());
        if digits_end == 0 || digits_end != hex.len() {
            return Err(SizeError::Syntax);
        }
        let v = u64::from_str_radix(hex, 16).map_err(|_| SizeError::Range)?;
        return range_check(v, negative);
    }
    let int_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (int_str, rest) = t.split_at(int_end);
    let (frac_str, rest) = match rest.strip_prefix('.') {
        Some(r) => {
            let e = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
            (Some(&r[..e]), &r[e..])
        }
        None => (None, rest),
    };
    if int_str.is_empty() && frac_str.is_none_or(|f| f.is_empty()) {
        return Err(SizeError::Syntax);
    }
    let mut chars = rest.chars();
    let unit_shift = match chars.next().map(|c| c.to_ascii_uppercase()) {
        None => 0,
        Some('B') => 0,
        Some('K') => 10,
        Some('M') => 20,
        Some('G') => 30,
        Some('T') => 40,
        Some('P') => 50,
        Some('E') => 60,
        Some(_) => return Err(SizeError::Syntax),
    };
    if chars.next().is_some() {
        return Err(SizeError::Syntax);
    }
    // A fraction needs a unit larger than a byte.
    if frac_str.is_some() && unit_shift == 0 {
        return Err(SizeError::Syntax);
    }
    // strtoull overflowing is a range error, unless characters follow it.
    let int_overflow = if rest.is_empty() {
        SizeError::Range
    } else {
        SizeError::Syntax
    };
    let int: u128 = if int_str.is_empty() {
        0
    } else {
        int_str.parse().map_err(|_| int_overflow)?
    };
    if int > u64::MAX as u128 {
        return Err(int_overflow);
    }
    if negative {
        return Err(if rest.is_empty() {
            SizeError::Range
        } else {
            SizeError::Syntax
        });
    }
    let mut total: u128 = int << unit_shift;
    if let Some(f) = frac_str.filter(|f| !f.is_empty()) {
        // Exact decimal fraction times the unit, rounded to nearest (half
        // up). Eighteen digits are finer than a byte of an exabyte and keep
        // the product inside u128.
        let digits = &f[..f.len().min(18)];
        let scale = 10u128.pow(digits.len() as u32);
        let num: u128 = digits.parse().map_err(|_| SizeError::Syntax)?;
        let unit = 1u128 << unit_shift;
        let extra = (num * unit + scale / 2) / scale;
        total += extra;
    }
    if total > u64::MAX as u128 {
        return Err(SizeError::Range);
    }
    range_check(total as u64, false)
}

fn range_check(v: u64, negative: bool) -> std::result::Result<u64, SizeError> {
    if negative || v > i64::MAX as u64 {
        Err(SizeError::Range)
    } else {
        Ok(v)
    }
}

/// Formats a size as qemu's `size_to_str`: three significant digits and a
/// binary unit, switching unit from 1000 of the smaller one.
pub fn human_size(val: u64) -> String {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let scaled = val as f64 / (1000.0 / 1024.0);
    // frexp's exponent: scaled = m × 2^e with m in [0.5, 1).
    let e = if val == 0 {
        0
    } else {
        ((scaled.to_bits() >> 52) & 0x7ff) as i32 - 1022
    };
    let i = ((e - 1) / 10).clamp(0, 6) as usize;
    let div = (1u64 << (i * 10)) as f64;
    format!("{} {}B", format_g3(val as f64 / div), SUFFIXES[i])
}

/// C's `%0.3g`: three significant digits, trailing zeros removed. Rust's
/// formatting rounds the exact binary value, ties to even, as glibc does.
fn format_g3(v: f64) -> String {
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if v == 0.0 {
        return "0".into();
    }
    let sci = format!("{v:.2e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..3).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{}e{sign}{:02}", trim(mantissa.to_string()), exp.abs());
    }
    trim(format!("{v:.*}", (2 - exp) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qemu_sizes() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("1k").unwrap(), 1024);
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("10M").unwrap(), 10 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("2b").unwrap(), 2);
        assert_eq!(parse_size("1E").unwrap(), 1 << 60);
        assert_eq!(parse_size("0x100").unwrap(), 256);
        assert_eq!(parse_size("010").unwrap(), 10);
        assert_eq!(parse_size(".5k").unwrap(), 512);
        assert_eq!(parse_size("5.k").unwrap(), 5120);
        assert_eq!(parse_size("1.1k").unwrap(), 1126);
        assert_eq!(parse_size("1.9999k").unwrap(), 2048);
        assert_eq!(parse_size("3.3G").unwrap(), 3543348019);
        assert_eq!(parse_size(" +1M").unwrap(), 1 << 20);
        for bad in [
            "", "abc", "1KiB", "1.5", "1.5B", "1x", "1..5G", "1Gb", "1e3", "0x10k", "1M ", "-1k",
            "2K3",
        ] {
            assert_eq!(parse_size_detailed(bad), Err(SizeError::Syntax), "{bad}");
        }
        assert_eq!(
            parse_size_detailed("99999999999999999999k"),
            Err(SizeError::Syntax)
        );
        for big in [
            "-1",
            "8E",
            "100E",
            "9223372036854775808",
            "99999999999999999999",
        ] {
            assert_eq!(parse_size_detailed(big), Err(SizeError::Range), "{big}");
        }
    }

    #[test]
    fn formats_like_size_to_str() {
        assert_eq!(human_size(0), "0 B");
        // Ties round to even, as glibc's %0.3g: 197120 B is 192.5 KiB.
        assert_eq!(human_size(197_120), "192 KiB");
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1000), "0.977 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(69632), "68 KiB");
        assert_eq!(human_size(10 << 20), "10 MiB");
        assert_eq!(human_size(1 << 30), "1 GiB");
        assert_eq!(human_size(1_500_000_000), "1.4 GiB");
        assert_eq!(human_size(1023 << 20), "0.999 GiB");
    }
}
