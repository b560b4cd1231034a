//! nbdkit's options that callers pass and that change nothing diskit
//! does differently, or that it refuses clearly: `-D`, `--selinux-label`,
//! `-n`/`-o`, `--log`, `-4`/`-6`, and nbdkit's other spellings of
//! `serve`'s options (`--no-fork`, `--stdin`, `--export`, `--ip-addr`).

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use crate::util::CliError;

/// Where nbdkit's `--log` sends messages.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTo {
    /// Standard error (diskit's only log).
    Stderr,
    /// The system log: refused, diskit does not write to it.
    Syslog,
    /// Nowhere.
    Null,
}

/// nbdkit's options with no other home in `serve`.
#[derive(clap::Args, Debug, Default)]
pub struct NbdkitArgs {
    /// nbdkit debug flag NAME.FLAG=N (accepted, and ignored: diskit has
    /// no such flags). Repeatable.
    #[arg(short = 'D', long = "debug", value_name = "NAME.FLAG=N")]
    debug: Vec<String>,
    /// SELinux label for the listening socket (set when SELinux is on).
    #[arg(long = "selinux-label", value_name = "LABEL")]
    selinux_label: Option<String>,
    /// Speak the fixed newstyle protocol (the only one served).
    #[arg(
        short = 'n',
        long = "newstyle",
        alias = "new-style",
        overrides_with = "oldstyle"
    )]
    newstyle: bool,
    /// Speak the oldstyle protocol: refused, diskit serves newstyle only.
    #[arg(
        short = 'o',
        long = "oldstyle",
        alias = "old-style",
        overrides_with = "newstyle"
    )]
    oldstyle: bool,
    /// Send messages to stderr or nowhere (null); syslog is refused.
    #[arg(long = "log", value_enum, value_name = "stderr|syslog|null")]
    log: Option<LogTo>,
    /// Listen on IPv4 only (the default without -i).
    #[arg(short = '4', long = "ipv4-only", overrides_with = "ipv6_only")]
    ipv4_only: bool,
    /// Listen on IPv6 only (on :: without -i).
    #[arg(short = '6', long = "ipv6-only", overrides_with = "ipv4_only")]
    ipv6_only: bool,
}

/// Adds nbdkit's other spellings of `serve`'s own options to its command.
pub fn aliases(cmd: clap::Command) -> clap::Command {
    cmd.mut_arg("foreground", |a| a.alias("no-fork"))
        .mut_arg("single", |a| a.alias("stdin"))
        .mut_arg("exportname", |a| a.alias("export"))
        .mut_arg("ipaddr", |a| a.alias("ip-addr"))
}

/// Whether `flag` is nbdkit's NAME.FLAG=N, N a number.
fn is_debug_flag(flag: &str) -> bool {
    flag.split_once('=').is_some_and(|(name, n)| {
        name.split_once('.')
            .is_some_and(|(a, b)| !a.is_empty() && !b.is_empty())
            && n.parse::<i64>().is_ok()
    })
}

impl NbdkitArgs {
    /// Checks the options against each other and against `ipaddr`.
    pub fn check(&self, ipaddr: Option<IpAddr>) -> Result<(), CliError> {
        if self.debug.iter().any(|f| !is_debug_flag(f)) {
            // nbdkit's words, without "error:" (the prefix is written here).
            return Err(CliError::new(format!(
                "{}: -D (Debug Flag) must have the format NAME.FLAG=N",
                crate::names::prog()
            )));
        }
        if self.oldstyle {
            return Err(CliError::new(
                "-o (--oldstyle): diskit serves the fixed newstyle protocol only (-n)",
            ));
        }
        if self.log == Some(LogTo::Syslog) {
            return Err(CliError::new(
                "--log=syslog: diskit logs to stderr (--log=stderr) or nowhere (--log=null)",
            ));
        }
        match ipaddr {
            Some(IpAddr::V6(a)) if self.ipv4_only => Err(CliError::new(format!(
                "-4 (--ipv4-only): {a} is an IPv6 address"
            ))),
            Some(IpAddr::V4(a)) if self.ipv6_only => Err(CliError::new(format!(
                "-6 (--ipv6-only): {a} is an IPv4 address"
            ))),
            _ => Ok(()),
        }
    }

    /// The address to listen on without -i: every IPv6 address under -6,
    /// else every IPv4 address.
    pub fn default_addr(&self) -> IpAddr {
        if self.ipv6_only {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        }
    }

    /// `--log=null`: standard error goes to /dev/null from here on.
    pub fn apply_log(&self) -> Result<(), CliError> {
        if self.log != Some(LogTo::Null) {
            return Ok(());
        }
        let null = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map_err(|e| CliError::new(format!("--log=null: /dev/null: {e}")))?;
        let _ = std::io::stderr().flush();
        // SAFETY: both descriptors are open; dup2 replaces descriptor 2.
        let r = unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 2) };
        if r < 0 {
            return Err(CliError::new(format!(
                "--log=null: dup2: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// `--selinux-label`: see [`label_sockets`].
    pub fn label_sockets(&self) -> Result<SocketLabel, CliError> {
        label_sockets(self.selinux_label.as_deref())
    }
}

/// `--selinux-label` (nbdkit's and qemu-nbd's): labels the sockets this
/// thread creates until the guard drops, as setsockcreatecon does; nothing
/// when SELinux is off (nothing then checks labels).
pub fn label_sockets(label: Option<&str>) -> Result<SocketLabel, CliError> {
    let Some(label) = label else {
        return Ok(SocketLabel(false));
    };
    if !Path::new("/sys/fs/selinux/enforce").exists() {
        return Ok(SocketLabel(false));
    }
    set_sockcreate(label.as_bytes())
        .map_err(|e| CliError::new(format!("setsockcreatecon: {label}: {e}")))?;
    Ok(SocketLabel(true))
}

/// Writes the label for sockets this thread creates (empty: the default).
fn set_sockcreate(label: &[u8]) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/thread-self/attr/sockcreate")?
        .write_all(label)
}

/// Sockets created while this lives carry `--selinux-label`'s label.
pub struct SocketLabel(bool);

impl Drop for SocketLabel {
    fn drop(&mut self) {
        if self.0 {
            // Best effort: later sockets (clients' connections to a
            // proxied server) would keep the label, which is harmless.
            let _ = set_sockcreate(b"");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_flags_have_nbdkits_format() {
        assert!(is_debug_flag("nbdkit.backend.datapath=0"));
        assert!(is_debug_flag("file.zero=1"));
        assert!(!is_debug_flag("file"));
        assert!(!is_debug_flag("file=1"));
        assert!(!is_debug_flag("a.b=x"));
    }

    #[test]
    fn address_families_are_checked() {
        let a = NbdkitArgs {
            ipv6_only: true,
            ..NbdkitArgs::default()
        };
        assert!(a.check(Some("127.0.0.1".parse().unwrap())).is_err());
        assert!(a.check(Some("::1".parse().unwrap())).is_ok());
        assert!(a.default_addr().is_ipv6());
    }
}
