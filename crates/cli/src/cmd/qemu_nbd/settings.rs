//! qemu-nbd's option values, read in command-line order as its getopt
//! loop reads them: each checked with qemu-nbd's message, the ones it takes
//! once refused when repeated, `--object` defined where it stands.

use crate::getopt::Found;
use crate::util::{CacheMode, CliError};
use diskit_filters::unmap::{DetectZeroes, Discard, Unmap};

/// The longest export name or description qemu-nbd takes
/// (NBD_MAX_STRING_SIZE).
const MAX_STRING: usize = 4096;
/// qemu-nbd's default handshake limit, in seconds.
const HANDSHAKE_LIMIT: u64 = 10;

/// What the options say, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--cache` (`-n`: none); writeback by default.
    pub cache: CacheMode,
    /// Whether writes are written through (`writethrough`, `directsync`).
    pub writethrough: bool,
    /// Whether `-n` or `--cache` was given.
    pub seen_cache: bool,
    /// `--aio=native`: wants the page cache bypassed.
    pub aio_native: bool,
    /// Whether `--aio` was given.
    pub seen_aio: bool,
    /// `--discard` and `--detect-zeroes`.
    pub unmap: Unmap,
    /// Whether `--discard` was given.
    pub seen_discard: bool,
    /// `-o`: where the export starts in the image.
    pub offset: u64,
    /// `-e`: clients served at once (0: any number).
    pub shared: usize,
    /// `--handshake-limit`, in seconds (0: none).
    pub handshake_limit: u64,
    /// `-l`: the internal snapshot to serve (an id or a name).
    pub load_snapshot: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cache: CacheMode::default(),
            writethrough: false,
            seen_cache: false,
            aio_native: false,
            seen_aio: false,
            unmap: Unmap::default(),
            seen_discard: false,
            offset: 0,
            shared: 1,
            handshake_limit: HANDSHAKE_LIMIT,
            load_snapshot: None,
        }
    }
}

/// A number as C's `strtoll` with base 0 reads it (`0x` hexadecimal, a
/// leading `0` octal), all of `s`, as QEMU's `qemu_strto*` insist.
fn c_number(s: &str) -> Option<i128> {
    let (negative, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (radix, digits) = if let Some(hex) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        (16, hex)
    } else if digits.len() > 1 && digits.starts_with('0') {
        (8, &digits[1..])
    } else {
        (10, digits)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let n = i128::from_str_radix(digits, radix).ok()?;
    Some(if negative { -n } else { n })
}

/// A number in `0..=max`, else `msg`.
fn bounded(value: &str, max: i128, msg: impl FnOnce() -> String) -> Result<i128, CliError> {
    match c_number(value) {
        Some(n) if (0..=max).contains(&n) => Ok(n),
        _ => Err(CliError::new(msg())),
    }
}

/// `-l`'s value: `[ID_OR_NAME]` as it is, or `snapshot.id=ID` or
/// `snapshot.name=NAME` out of `snapshot.id=ID,snapshot.name=NAME` (the
/// id, when both are given), as the opener reads them.
fn load_snapshot(value: &str) -> Result<String, CliError> {
    if !value.starts_with("snapshot.") {
        return Ok(value.to_string());
    }
    let failed = |e: diskit_core::Error| {
        CliError::new(format!("{e}\nFailed in parsing snapshot param `{value}'"))
    };
    let mut o = diskit_open::OptionList::new();
    o.parse_into(value).map_err(failed)?;
    o.check_known(&["snapshot.id", "snapshot.name"])
        .map_err(failed)?;
    let id = o.text("snapshot.id").map(|id| format!("snapshot.id={id}"));
    id.or_else(|| {
        o.text("snapshot.name")
            .map(|n| format!("snapshot.name={n}"))
    })
    .ok_or_else(|| CliError::new(format!("Failed in parsing snapshot param `{value}'")))
}

impl Settings {
    /// Reads `given` (the options in command-line order, see
    /// [`crate::getopt::options`]), defining `--object`s as they come.
    pub fn read(given: &[Found]) -> Result<Settings, CliError> {
        let mut s = Settings::default();
        for (name, value) in given {
            let v = value.as_deref().unwrap_or_default();
            s.take(name, v)?;
        }
        Ok(s)
    }

    /// Takes one option.
    fn take(&mut self, name: &str, v: &str) -> Result<(), CliError> {
        match name {
            "-n" | "--nocache" | "--cache" => {
                if self.seen_cache {
                    return Err(CliError::new("-n and --cache can only be specified once"));
                }
                self.seen_cache = true;
                let mode = if name == "--cache" { v } else { "none" };
                self.cache = CacheMode::parse(mode)
                    .ok_or_else(|| CliError::new(format!("Invalid cache mode `{mode}'")))?;
                self.writethrough = matches!(mode, "writethrough" | "directsync");
            }
            "--aio" => {
                if self.seen_aio {
                    return Err(CliError::new("--aio can only be specified once"));
                }
                self.seen_aio = true;
                if !matches!(v, "threads" | "native" | "io_uring") {
                    return Err(CliError::new(format!("Invalid aio mode '{v}'")));
                }
                self.aio_native = v == "native";
            }
            "--discard" => {
                if self.seen_discard {
                    return Err(CliError::new("--discard can only be specified once"));
                }
                self.seen_discard = true;
                self.unmap.discard = Discard::from_name(v)
                    .ok_or_else(|| CliError::new(format!("Invalid discard mode `{v}'")))?;
            }
            "--detect-zeroes" => {
                let mode = DetectZeroes::from_name(v).ok_or_else(|| {
                    CliError::new(format!(
                        "Failed to parse detect_zeroes mode: invalid parameter value: {v}"
                    ))
                })?;
                self.unmap = Unmap::new(self.unmap.discard, mode)?;
            }
            "-o" | "--offset" => {
                self.offset =
                    bounded(v, i128::from(u64::MAX), || format!("Invalid offset '{v}'"))? as u64;
            }
            "-l" | "--load-snapshot" => self.load_snapshot = Some(load_snapshot(v)?),
            "-k" | "--socket" if !v.starts_with('/') => {
                return Err(CliError::new("socket path must be absolute"));
            }
            "-e" | "--shared" => {
                self.shared = bounded(v, i128::from(i32::MAX), || {
                    format!("Invalid shared device number '{v}'")
                })? as usize;
            }
            "-x" | "--export-name" if v.len() > MAX_STRING => {
                return Err(CliError::new(format!("export name '{v}' too long")));
            }
            "-D" | "--description" if v.len() > MAX_STRING => {
                return Err(CliError::new(format!("export description '{v}' too long")));
            }
            "--handshake-limit" => {
                self.handshake_limit = bounded(v, i128::from(i32::MAX), || {
                    format!("Invalid handshake limit '{v}'")
                })? as u64;
            }
            "--object" => diskit_open::define_object(v)?,
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(opts: &[(&str, &str)]) -> Result<Settings, String> {
        let given: Vec<Found> = opts
            .iter()
            .map(|(n, v)| (n.to_string(), (!v.is_empty()).then(|| v.to_string())))
            .collect();
        Settings::read(&given).map_err(|e| e.message)
    }

    #[test]
    fn numbers_read_as_c_reads_them() {
        assert_eq!(c_number("0x10"), Some(16));
        assert_eq!(c_number("010"), Some(8));
        assert_eq!(c_number("-3"), Some(-3));
        assert_eq!(c_number("0"), Some(0));
        assert_eq!(c_number("1k"), None);
        assert_eq!(c_number(""), None);
        assert_eq!(read(&[("-e", "0x2")]).unwrap().shared, 2);
        assert_eq!(
            read(&[("-e", "-1")]).unwrap_err(),
            "Invalid shared device number '-1'"
        );
        assert_eq!(read(&[("-o", "x")]).unwrap_err(), "Invalid offset 'x'");
    }

    #[test]
    fn modes_are_checked_in_order_and_once() {
        assert_eq!(
            read(&[("-n", ""), ("--cache", "none")]).unwrap_err(),
            "-n and --cache can only be specified once"
        );
        let s = read(&[("--cache", "directsync")]).unwrap();
        assert!(s.cache.direct && s.writethrough);
        assert_eq!(
            read(&[("--cache", "bad")]).unwrap_err(),
            "Invalid cache mode `bad'"
        );
        assert!(
            read(&[("--detect-zeroes", "unmap"), ("--discard", "unmap")])
                .unwrap_err()
                .starts_with("setting detect-zeroes to unmap")
        );
        let s = read(&[("--discard", "unmap"), ("--detect-zeroes", "unmap")]).unwrap();
        assert_eq!(s.unmap.detect_zeroes, DetectZeroes::Unmap);
        assert_eq!(
            read(&[("--aio", "native"), ("--aio", "threads")]).unwrap_err(),
            "--aio can only be specified once"
        );
        assert_eq!(
            read(&[("-k", "rel")]).unwrap_err(),
            "socket path must be absolute"
        );
    }

    #[test]
    fn snapshots_are_named_either_way() {
        assert_eq!(load_snapshot("snap1").unwrap(), "snap1");
        assert_eq!(load_snapshot("snapshot.name=a").unwrap(), "snapshot.name=a");
        assert_eq!(
            load_snapshot("snapshot.id=2,snapshot.name=a").unwrap(),
            "snapshot.id=2"
        );
        assert!(load_snapshot("snapshot.colour=red").is_err());
    }
}
