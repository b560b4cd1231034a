//! Sizes as qemu-img reads and writes them.
//!
//! [`parse_size`] accepts what qemu's `qemu_strtosz` accepts: a decimal
//! number, optionally with a fraction when a suffix follows, and one of the
//! 1024-based suffixes `B K M G T P E` (any case). [`human_size`] prints
//! sizes the way qemu-img info does ("10 MiB", "1.5 GiB", "0.977 KiB").

use crate::error::{Error, Result};

/// Parses a size with an optional suffix; a bare number is in bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    parse_size_with_default(s, 1)
}

/// Parses a size whose bare numbers are in units of `default_unit` bytes.
pub fn parse_size_with_default(s: &str, default_unit: u64) -> Result<u64> {
    let bad = || Error::invalid(format!("invalid size '{s}'"));
    let t = s.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    if num.is_empty() || num.starts_with('.') {
        return Err(bad());
    }
    let unit: u64 = match suffix {
        "" => default_unit,
        "b" | "B" => 1,
        "k" | "K" => 1 << 10,
        "m" | "M" => 1 << 20,
        "g" | "G" => 1 << 30,
        "t" | "T" => 1 << 40,
        "p" | "P" => 1 << 50,
        "e" | "E" => 1 << 60,
        _ => return Err(bad()),
    };
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (num, None),
    };
    if frac_part.is_some_and(|f| f.contains('.')) {
        return Err(bad());
    }
    let int: u64 = int_part.parse().map_err(|_| bad())?;
    let mut total = int.checked_mul(unit).ok_or_else(bad)?;
    if let Some(frac) = frac_part {
        // qemu accepts a fraction only with a suffix (bytes are whole).
        if unit == 1 && !frac.chars().all(|c| c == '0') {
            return Err(bad());
        }
        if !frac.is_empty() {
            let f: f64 = format!("0.{frac}").parse().map_err(|_| bad())?;
            let extra = (f * unit as f64).round();
            total = total.checked_add(extra as u64).ok_or_else(bad)?;
        }
    }
    if total > i64::MAX as u64 {
        return Err(bad());
    }
    Ok(total)
}

/// Formats a size as qemu's `size_to_str`: three significant digits and a
/// binary unit, switching unit from 1000 of the smaller one.
pub fn human_size(val: u64) -> String {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    // frexp(val / (1000/1024)) exponent, then (e - 1) / 10.
    let scaled = val as f64 / (1000.0 / 1024.0);
    let exp = if scaled == 0.0 {
        0
    } else {
        scaled.log2().floor() as i32 + 1
    };
    let i = ((exp - 1).max(0) / 10).min(6) as usize;
    let div = (1u64 << (i * 10)) as f64;
    format!("{} {}B", format_g3(val as f64 / div), SUFFIXES[i])
}

/// C's `%0.3g`: three significant digits, trailing zeros removed.
fn format_g3(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let exp = v.abs().log10().floor() as i32;
    // Round to 3 significant digits first: rounding can bump the exponent.
    let rounded = {
        let factor = 10f64.powi(2 - exp);
        (v * factor).round() / factor
    };
    let exp = if rounded == 0.0 {
        exp
    } else {
        rounded.abs().log10().floor() as i32
    };
    if !(-4..3).contains(&exp) {
        let mantissa = rounded / 10f64.powi(exp);
        let m = trim_zeros(format!("{:.2}", mantissa));
        return format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let decimals = (2 - exp).max(0) as usize;
    trim_zeros(format!("{rounded:.decimals$}"))
}

fn trim_zeros(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
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
        for bad in ["", "abc", "-1", "1KiB", "1.5", "8E", "1x", ".5G", "1..5G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats_like_size_to_str() {
        assert_eq!(human_size(0), "0 B");
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
