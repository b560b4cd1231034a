//! Parsers for filter parameter values, with nbdkit's syntax and error
//! messages that name the filter and the key.

use std::time::Duration;

use diskit_core::size::parse_size as core_parse_size;
use diskit_core::{Error, Result};

/// A size with the usual 1024-based suffixes (`512`, `64k`, `1M`, `2G`).
pub fn size(filter: &str, key: &str, value: &str) -> Result<u64> {
    core_parse_size(value)
        .map_err(|_| Error::invalid(format!("{filter}: {key}: could not parse size '{value}'")))
}

/// A size that must be non-zero and fit in 32 bits (block size parameters).
pub fn size_u32(filter: &str, key: &str, value: &str) -> Result<u32> {
    let v = size(filter, key, value)?;
    if v == 0 {
        return Err(Error::invalid(format!(
            "{filter}: parameter '{key}' must be non-zero if specified"
        )));
    }
    u32::try_from(v)
        .map_err(|_| Error::invalid(format!("{filter}: parameter '{key}' too large: {value}")))
}

pub use diskit_core::params::boolean;

/// One of a fixed set of words.
pub fn choice<T: Copy>(filter: &str, key: &str, value: &str, choices: &[(&str, T)]) -> Result<T> {
    choices
        .iter()
        .find(|(name, _)| *name == value)
        .map(|&(_, v)| v)
        .ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|c| c.0).collect();
            Error::invalid(format!(
                "{filter}: unknown {key} '{value}' (one of: {})",
                names.join(", ")
            ))
        })
}

/// The longest delay accepted (nbdkit refuses sleeps beyond INT_MAX seconds).
const MAX_DELAY_SECS: u64 = i32::MAX as u64;

/// A delay as nbdkit (1.40 and later) reads them: a decimal number of
/// seconds with an optional unit, `s`, `ms`, `us` (or `μs`) or `ns`:
/// `2`, `1.5`, `10ms`, `250us`, `1000ns`. nbdkit 1.32 knew only whole
/// seconds and whole milliseconds (`NNms`), which are a subset.
pub fn delay(filter: &str, key: &str, value: &str) -> Result<Duration> {
    let bad = |why: &str| Error::invalid(format!("{filter}: {key}: {why}: '{value}'"));
    let (number, nanos_per_unit): (&str, u128) = [
        ("ns", 1u128),
        ("us", 1_000),
        ("\u{3bc}s", 1_000),
        ("ms", 1_000_000),
        ("s", 1_000_000_000),
    ]
    .iter()
    .find_map(|&(unit, n)| value.strip_suffix(unit).map(|rest| (rest, n)))
    .unwrap_or((value, 1_000_000_000));
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty()
        || !digits(whole)
        || !digits(frac)
        || (number.contains('.') && frac.is_empty())
    {
        return Err(bad("could not parse delay"));
    }
    // Exact arithmetic in nanoseconds; digits past nanosecond precision are dropped.
    let whole: u128 = whole.parse().map_err(|_| bad("delay too large"))?;
    let mut nanos = whole
        .checked_mul(nanos_per_unit)
        .ok_or_else(|| bad("delay too large"))?;
    let mut scale = nanos_per_unit;
    for d in frac.bytes() {
        scale /= 10;
        if scale == 0 {
            break;
        }
        nanos += u128::from(d - b'0') * scale;
    }
    if nanos > u128::from(MAX_DELAY_SECS) * 1_000_000_000 {
        return Err(bad("delay too large"));
    }
    let secs = (nanos / 1_000_000_000) as u64;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_in_every_unit() {
        let d = |v: &str| delay("delay", "rdelay", v);
        assert_eq!(d("2").unwrap(), Duration::from_secs(2));
        assert_eq!(d("0").unwrap(), Duration::ZERO);
        assert_eq!(d("10ms").unwrap(), Duration::from_millis(10));
        assert_eq!(d("1s").unwrap(), Duration::from_secs(1));
        assert_eq!(d("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(d("1.2ms").unwrap(), Duration::from_micros(1200));
        assert_eq!(d("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(d("3\u{3bc}s").unwrap(), Duration::from_micros(3));
        assert_eq!(d("1000ns").unwrap(), Duration::from_micros(1));
        assert_eq!(d("0.0000000019").unwrap(), Duration::from_nanos(1));
        for bad in [
            "",
            "ms",
            "-1",
            "1.",
            ".5",
            "10xms",
            "0x10",
            "1m",
            "1 s",
            "1e3",
            "99999999999",
        ] {
            let e = d(bad).unwrap_err();
            assert!(e.to_string().contains("rdelay"), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_booleans_and_choices() {
        assert_eq!(size("f", "k", "64k").unwrap(), 65536);
        assert!(size("f", "k", "x").unwrap_err().to_string().contains("'x'"));
        assert!(size("f", "k", "-1").is_err());
        assert_eq!(
            size_u32("f", "k", "4G").unwrap_err().kind(),
            diskit_core::ErrorKind::InvalidInput
        );
        assert!(size_u32("f", "k", "0").is_err());
        assert_eq!(size_u32("f", "k", "4095M").unwrap(), 4095 << 20);
        assert!(boolean("f", "k", "ON").unwrap());
        assert!(!boolean("f", "k", "0").unwrap());
        assert!(boolean("f", "k", "maybe").is_err());
        assert_eq!(choice("f", "mode", "b", &[("a", 1), ("b", 2)]).unwrap(), 2);
        let e = choice("f", "mode", "c", &[("a", 1), ("b", 2)]).unwrap_err();
        assert!(e.to_string().contains("one of: a, b"), "{e}");
    }
}
