//! Values of nbdkit-style `key=value` parameters, read as nbdkit reads
//! them, for the filters and the plugins alike.

use crate::error::{Error, Result};

/// A boolean as nbdkit reads them: 1/true/t/yes/y/on or
/// 0/false/f/no/n/off, any case; `who` (a filter or plugin) and `key` name
/// it in the message.
pub fn boolean(who: &str, key: &str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" | "on" => Ok(true),
        "0" | "false" | "f" | "no" | "n" | "off" => Ok(false),
        _ => Err(Error::invalid(format!(
            "{who}: {key}: could not decipher boolean '{value}'"
        ))),
    }
}

/// The integer at the start of `s` as C's `strtoll(s, &end, 0)` (and
/// `sscanf`'s `%i`) read it: blanks skipped, a sign, then `0x` hexadecimal,
/// a leading `0` octal, or decimal; a value beyond 64 bits is clamped, as
/// strtoll clamps it. Returns the value, how many bytes were read
/// (blanks included), and whether it was clamped; `None` when no digit
/// starts it.
pub fn c_integer_prefix(s: &str) -> Option<(i128, usize, bool)> {
    let b = s.as_bytes();
    let mut i = 0;
    while b
        .get(i)
        .is_some_and(|c| c.is_ascii_whitespace() || *c == 0x0b)
    {
        i += 1;
    }
    let negative = match b.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let hex_digit_follows = b.get(i + 2).is_some_and(u8::is_ascii_hexdigit);
    let radix = if b.get(i) == Some(&b'0') && matches!(b.get(i + 1), Some(b'x' | b'X')) {
        if hex_digit_follows {
            i += 2;
            16
        } else {
            // "0x" with no hex digit after it is the number 0, then "x".
            return Some((0, i + 1, false));
        }
    } else if b.get(i) == Some(&b'0') {
        8
    } else {
        10
    };
    let start = i;
    let mut value: i128 = 0;
    let mut clamped = false;
    while let Some(d) = b.get(i).and_then(|c| (*c as char).to_digit(radix)) {
        value = value * radix as i128 + d as i128;
        if value > u64::MAX as i128 {
            value = u64::MAX as i128 + 1;
            clamped = true;
        }
        i += 1;
    }
    if i == start {
        return None;
    }
    Some((if negative { -value } else { value }, i, clamped))
}

/// An unsigned number as nbdkit's `nbdkit_parse_uint*_t` read it (C's
/// base 0: decimal, `0x` hexadecimal, `0` octal; the whole value), at
/// most `max`, with nbdkit's messages; `what` names it in them.
pub fn nbdkit_unsigned(what: &str, value: &str, max: u64) -> Result<u64> {
    let t = value.trim_start_matches(|c: char| c.is_ascii_whitespace() || c == '\x0b');
    if t.starts_with('-') {
        return Err(Error::invalid(format!(
            "{what}: negative numbers are not allowed"
        )));
    }
    let Some((n, used, clamped)) = c_integer_prefix(value) else {
        return Err(Error::invalid(format!(
            "{what}: empty string where we expected a number"
        )));
    };
    if clamped || n > max as i128 {
        return Err(Error::new(
            crate::ErrorKind::Overflow,
            format!("{what}: could not parse number: \"{value}\": Numerical result out of range"),
        ));
    }
    if used != value.len() {
        return Err(Error::invalid(format!(
            "{what}: could not parse number: \"{value}\": trailing garbage"
        )));
    }
    Ok(n as u64)
}

/// `s` as nbdkit quotes strings for the shell (its log lines, tmpdisk's
/// variables): as is when every character is safe in a shell word, else
/// in double quotes with `$`, `` ` ``, `\` and `"` escaped.
pub fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || ".-_=,:/".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        return s.to_string();
    }
    let mut q = String::from("\"");
    for c in s.chars() {
        if matches!(c, '$' | '`' | '\\' | '"') {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q
}

/// A secret as nbdkit's plugins take one (`password=`, `cookie=`): the
/// value itself, `+FILE` (the file's text without its last newline) or
/// `-FD` (read from that inherited descriptor, as `+/dev/fd/FD`); `-`, a
/// prompt on the terminal, is refused (a server has none to ask on).
pub fn secret(who: &str, key: &str, value: &str) -> Result<String> {
    if value == "-" {
        return Err(Error::invalid(format!(
            "{who}: {key}=- (asking on the terminal) is not supported: use {key}=+FILE"
        )));
    }
    let path = match (value.strip_prefix('+'), value.strip_prefix('-')) {
        (Some(path), _) => path.to_string(),
        (_, Some(fd)) if fd.parse::<u32>().is_ok() => {
            if fd.parse::<u32>().is_ok_and(|n| n <= 2) {
                return Err(Error::invalid(format!(
                    "{who}: cannot use {key} -FD for stdin/stdout/stderr"
                )));
            }
            format!("/dev/fd/{fd}")
        }
        _ => return Ok(value.to_string()),
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::from(e).context(format!("{who}: {key}: {path}")))?;
    Ok(text.strip_suffix('\n').unwrap_or(&text).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_as_values_files_or_descriptors() {
        let f = std::env::temp_dir().join(format!("diskit-secret-{}", std::process::id()));
        std::fs::write(&f, "s3cret\n").unwrap();
        assert_eq!(secret("p", "password", "plain").unwrap(), "plain");
        let plus = format!("+{}", f.display());
        assert_eq!(secret("p", "password", &plus).unwrap(), "s3cret");
        assert!(secret("p", "password", "-").is_err());
        assert!(secret("p", "password", "-1").is_err());
        assert!(secret("p", "password", "+/nonexistent/pw").is_err());
        std::fs::remove_file(&f).unwrap();
    }

    #[test]
    fn c_integers_read_as_strtoll_reads_them() {
        assert_eq!(c_integer_prefix("42 rest"), Some((42, 2, false)));
        assert_eq!(c_integer_prefix("  0x1fe)"), Some((0x1fe, 7, false)));
        assert_eq!(c_integer_prefix("017"), Some((15, 3, false)));
        assert_eq!(
            c_integer_prefix("08"),
            Some((0, 1, false)),
            "octal stops at 8"
        );
        assert_eq!(c_integer_prefix("0xg"), Some((0, 1, false)));
        assert_eq!(c_integer_prefix("-5"), Some((-5, 2, false)));
        assert_eq!(c_integer_prefix("x"), None);
        assert_eq!(c_integer_prefix(""), None);
        assert!(c_integer_prefix("99999999999999999999999").unwrap().2);
    }

    #[test]
    fn nbdkit_unsigned_messages() {
        assert_eq!(
            nbdkit_unsigned("seed", "0x10", u32::MAX as u64).unwrap(),
            16
        );
        let e = |v: &str, max: u64| nbdkit_unsigned("byte", v, max).unwrap_err().to_string();
        assert!(e("256", 255).contains("Numerical result out of range"));
        assert!(e("-1", 255).contains("negative numbers are not allowed"));
        assert!(e("", 255).contains("empty string"));
        assert!(e("1x", 255).contains("trailing garbage"));
    }
}
