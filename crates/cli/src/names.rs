//! The names diskit answers to: `diskit`, and, through a link named so,
//! `qemu-img`, `qemu-nbd`, `nbdkit`, `nbdcopy`, `nbdinfo` and `nbdfuse`, each taking that tool's
//! command line and printing its messages under that tool's name.
//!
//! The name is argv\[0\]'s file name, read once at start-up; the
//! messages, the usage hints and the version lines follow it.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::OnceLock;

/// The version of QEMU whose qemu-img and qemu-nbd diskit reproduces.
pub const QEMU_VERSION: &str = "10.0.2";
/// The version of nbdkit whose command line `serve` reproduces.
pub const NBDKIT_VERSION: &str = "1.32.5";
/// The version of libnbd whose nbdcopy, nbdinfo and nbdfuse diskit reproduces.
pub const LIBNBD_VERSION: &str = "1.14.2";
/// diskit's own version.
pub const DISKIT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// A tool diskit stands in for, chosen by the name it is run under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// `diskit SUBCOMMAND ...`: every subcommand.
    Diskit,
    /// `qemu-img SUBCOMMAND ...`: the subcommands that are qemu-img's.
    QemuImg,
    /// `qemu-nbd [OPTIONS] FILE`: `diskit qemu-nbd`.
    QemuNbd,
    /// `nbdkit [OPTIONS] PLUGIN [ARGS]`: `diskit serve`.
    Nbdkit,
    /// `nbdcopy SOURCE DESTINATION`: `diskit copy`.
    Nbdcopy,
    /// `nbdinfo URI`: `diskit nbdinfo`.
    Nbdinfo,
    /// `nbdfuse MOUNTPOINT URI`: `diskit fuse`.
    Nbdfuse,
}

impl Tool {
    /// Every name, diskit's first.
    pub const ALL: [Tool; 7] = [
        Tool::Diskit,
        Tool::QemuImg,
        Tool::QemuNbd,
        Tool::Nbdkit,
        Tool::Nbdcopy,
        Tool::Nbdinfo,
        Tool::Nbdfuse,
    ];

    /// The tool a program name (argv\[0\]) stands for: its file name, so
    /// that `/usr/local/bin/nbdkit` is nbdkit; any other name is diskit.
    pub fn from_argv0(argv0: Option<&OsStr>) -> Tool {
        let name = argv0
            .and_then(|a| Path::new(a).file_name())
            .and_then(OsStr::to_str)
            .unwrap_or("diskit");
        Tool::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .unwrap_or(Tool::Diskit)
    }

    /// The program name.
    pub fn name(self) -> &'static str {
        match self {
            Tool::Diskit => "diskit",
            Tool::QemuImg => "qemu-img",
            Tool::QemuNbd => "qemu-nbd",
            Tool::Nbdkit => "nbdkit",
            Tool::Nbdcopy => "nbdcopy",
            Tool::Nbdinfo => "nbdinfo",
            Tool::Nbdfuse => "nbdfuse",
        }
    }

    /// The diskit subcommand a single-command name runs.
    pub fn subcommand(self) -> Option<&'static str> {
        match self {
            Tool::QemuNbd => Some("qemu-nbd"),
            Tool::Nbdkit => Some("serve"),
            Tool::Nbdcopy => Some("copy"),
            Tool::Nbdinfo => Some("nbdinfo"),
            Tool::Nbdfuse => Some("fuse"),
            Tool::Diskit | Tool::QemuImg => None,
        }
    }

    /// What `--version` prints after the program name: the upstream
    /// version whose behaviour diskit reproduces, and diskit's own
    /// (`qemu-img version 10.0.2 (diskit 0.1.0)`, as Cinder parses it;
    /// `qemu-nbd 10.0.2 (diskit 0.1.0)`, qemu-nbd's first line; libnbd's
    /// tools print a second line naming the library).
    pub fn version(self) -> String {
        let ours = format!("(diskit {DISKIT_VERSION})");
        match self {
            Tool::Diskit => DISKIT_VERSION.to_string(),
            Tool::QemuImg => format!("version {QEMU_VERSION} {ours}"),
            Tool::QemuNbd => format!("{QEMU_VERSION} {ours}"),
            Tool::Nbdkit => format!("{NBDKIT_VERSION} {ours}"),
            Tool::Nbdcopy | Tool::Nbdinfo | Tool::Nbdfuse => {
                format!("{LIBNBD_VERSION} {ours}\nlibnbd {LIBNBD_VERSION} {ours}")
            }
        }
    }
}

static TOOL: OnceLock<Tool> = OnceLock::new();

/// Records the name run under, once, before anything is printed.
pub fn set(tool: Tool) {
    let _ = TOOL.set(tool);
}

/// The tool run as (diskit until [`set`]).
pub fn current() -> Tool {
    TOOL.get().copied().unwrap_or(Tool::Diskit)
}

/// The program name messages carry.
pub fn prog() -> &'static str {
    current().name()
}

/// The line pointing to the help of subcommand `sub`, as the tool run as
/// words it.
pub fn hint(sub: Option<&str>) -> String {
    match (current(), sub) {
        (Tool::Nbdkit, _) => {
            "Use 'nbdkit --help' or read the nbdkit(1) manual page for documentation.".to_string()
        }
        // getopt's complaint is followed by this, prefixed as a message.
        (Tool::QemuNbd, _) => "qemu-nbd: Try `qemu-nbd --help' for more information.".to_string(),
        (Tool::Nbdcopy | Tool::Nbdinfo | Tool::Nbdfuse, _) | (_, None) => {
            format!("Try '{} --help' for more info", prog())
        }
        (_, Some(sub)) => format!("Try '{} {sub} --help' for more info", prog()),
    }
}

/// `text` without the " (os error N)" that Rust's io::Error adds to
/// strerror's text: C tools print the text alone.
pub fn strip_os_error(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(" (os error ") {
        let tail = &rest[i + " (os error ".len()..];
        let digits = tail.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 && tail[digits..].starts_with(')') {
            out.push_str(&rest[..i]);
            rest = &tail[digits + 1..];
        } else {
            out.push_str(&rest[..i + 1]);
            rest = &rest[i + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// Prints an error message as the tool run as prints its errors: the
/// first line prefixed with the program name (nbdkit's with `error:`
/// too), later lines (hints, second messages) as they are.
pub fn print_error(message: &str) {
    let message = strip_os_error(message);
    let prog = prog();
    // Messages that name the tool already (nbdinfo's) are not named twice.
    let own = format!("{prog}: ");
    let line = if message.starts_with(&own) {
        message
    } else if current() == Tool::Nbdkit {
        format!("{prog}: error: {message}")
    } else {
        format!("{prog}: {message}")
    };
    // A standard error that cannot be written (a full disk, a closed
    // pipe) loses the message, not the exit status: no panic.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_name_of_argv0_picks_the_tool() {
        let t = |s: &str| Tool::from_argv0(Some(OsStr::new(s)));
        assert_eq!(t("/usr/local/bin/qemu-img"), Tool::QemuImg);
        assert_eq!(t("qemu-nbd"), Tool::QemuNbd);
        assert_eq!(t("nbdkit"), Tool::Nbdkit);
        assert_eq!(t("./nbdcopy"), Tool::Nbdcopy);
        assert_eq!(t("/x/nbdinfo"), Tool::Nbdinfo);
        assert_eq!(t("nbdfuse"), Tool::Nbdfuse);
        assert_eq!(t("/x/diskit"), Tool::Diskit);
        assert_eq!(t("/x/qemu-img-old"), Tool::Diskit);
        assert_eq!(Tool::from_argv0(None), Tool::Diskit);
    }

    #[test]
    fn os_error_suffixes_are_removed() {
        assert_eq!(
            strip_os_error("a: No such file or directory (os error 2)"),
            "a: No such file or directory"
        );
        assert_eq!(strip_os_error("x (os error 13): y (os error 2)"), "x: y");
        assert_eq!(strip_os_error("kept (os error N)"), "kept (os error N)");
    }

    #[test]
    fn version_lines_match_what_callers_parse() {
        assert!(Tool::QemuImg.version().starts_with("version 10."));
        assert!(Tool::QemuNbd.version().starts_with("10."));
        assert!(Tool::Nbdkit.version().starts_with("1."));
        assert!(Tool::Nbdinfo.version().contains("\nlibnbd 1."));
    }
}
