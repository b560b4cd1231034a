//! nbdkit's introspection, which callers (virt-v2v, libguestfs) run
//! before they start a server and read back: `--dump-config`,
//! `--dump-plugin`, `PLUGIN --version`, `PLUGIN --help`,
//! `--long-options` and `--short-options`.
//!
//! These are looked for before clap parses the command line, since they
//! print something and exit whatever else it holds (a plugin's required
//! arguments may be missing).

use std::ffi::OsString;
use std::path::PathBuf;

use super::plugin;
use crate::CmdResult;
use crate::getopt;
use crate::names::{DISKIT_VERSION, NBDKIT_VERSION};
use crate::util::CliError;

/// The options handled here, for `--long-options` and `--short-options`.
const EXTRA: &[&str] = &[
    "--dump-config",
    "--dump-plugin",
    "--help",
    "--version",
    "-V",
];

/// Handles an introspection option of a `serve` (`nbdkit`, when
/// `as_nbdkit`: `--help` too; `diskit serve --help` is clap's) command
/// line `args`; `None` when it has none.
pub fn handle(cmd: &clap::Command, args: &[OsString], as_nbdkit: bool) -> Option<CmdResult> {
    let found = getopt::options(cmd, args, false);
    let has = |names: &[&str]| found.iter().any(|(n, _)| names.contains(&n.as_str()));
    let print_list = |long| {
        for o in getopt::list(cmd, long, EXTRA) {
            println!("{o}");
        }
        Ok(0)
    };
    if has(&["--long-options"]) {
        return Some(print_list(true));
    }
    if has(&["--short-options"]) {
        return Some(print_list(false));
    }
    if has(&["--dump-config"]) {
        print!("{}", dump_config());
        return Some(Ok(0));
    }
    let filters: Vec<String> = found
        .iter()
        .filter(|(n, _)| n == "--filter")
        .filter_map(|(_, v)| v.clone())
        .collect();
    let permuted = getopt::permute(cmd, args, false);
    let plugin = permuted
        .iter()
        .skip_while(|w| *w != "--")
        .nth(1)
        .map(|p| p.to_string_lossy().into_owned());
    if as_nbdkit && has(&["--help", "-h"]) {
        return Some(help(cmd, plugin.as_deref()));
    }
    if has(&["--version", "-V"]) {
        return Some(version(plugin.as_deref(), &filters));
    }
    if has(&["--dump-plugin"]) {
        return Some(dump_plugin(plugin.as_deref(), &filters));
    }
    None
}

/// The directory diskit is installed under (`PREFIX` of `PREFIX/bin/diskit`).
fn prefix(exe: &std::path::Path) -> PathBuf {
    exe.parent()
        .and_then(|bin| bin.parent())
        .map_or_else(|| PathBuf::from("/usr/local"), PathBuf::from)
}

/// This program's path (the diskit binary, whichever name ran it).
fn exe() -> PathBuf {
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("diskit"))
}

/// `--dump-config`: nbdkit's keys, with diskit's values. The plugins and
/// filters are built in; their directories are where an installation
/// would keep loadable ones.
pub fn dump_config() -> String {
    let exe = exe();
    let prefix = prefix(&exe);
    let bindir = exe
        .parent()
        .map_or_else(|| prefix.join("bin"), PathBuf::from);
    let libdir = prefix.join("lib");
    let os = match std::env::consts::OS {
        "linux" => "linux-gnu",
        other => other,
    };
    let (major, minor) = {
        let mut parts = NBDKIT_VERSION.split('.');
        (parts.next().unwrap_or("1"), parts.next().unwrap_or("0"))
    };
    let lines = [
        ("binary", exe.display().to_string()),
        ("bindir", bindir.display().to_string()),
        ("exit_with_parent", "yes".to_string()),
        (
            "filterdir",
            libdir.join("nbdkit/filters").display().to_string(),
        ),
        ("host_cpu", std::env::consts::ARCH.to_string()),
        ("host_os", os.to_string()),
        ("libdir", libdir.display().to_string()),
        ("mandir", prefix.join("share/man").display().to_string()),
        ("name", "nbdkit".to_string()),
        (
            "plugindir",
            libdir.join("nbdkit/plugins").display().to_string(),
        ),
        ("root_tls_certificates_dir", "/etc/pki/nbdkit".to_string()),
        ("sbindir", bindir.display().to_string()),
        ("selinux", "yes".to_string()),
        ("sysconfdir", "/etc".to_string()),
        ("tls", "yes".to_string()),
        ("version", NBDKIT_VERSION.to_string()),
        ("version_major", major.to_string()),
        ("version_minor", minor.to_string()),
        ("zstd", "no".to_string()),
    ];
    lines.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

/// The callbacks a plugin has, as nbdkit's `has_NAME=1` lines name them:
/// all of these for a writable plugin; a read-only one lacks those that
/// write or describe ([`WRITE_CALLBACKS`]).
const CALLBACKS: &[&str] = &[
    "config",
    "config_complete",
    "config_help",
    "open",
    "close",
    "get_size",
    "can_write",
    "can_flush",
    "can_trim",
    "can_zero",
    "can_fua",
    "can_multi_conn",
    "can_extents",
    "pread",
    "pwrite",
    "flush",
    "trim",
    "zero",
    "extents",
];

/// The callbacks of [`CALLBACKS`] a read-only plugin lacks.
const WRITE_CALLBACKS: &[&str] = &[
    "can_flush",
    "can_trim",
    "can_zero",
    "can_fua",
    "can_extents",
    "pwrite",
    "flush",
    "trim",
    "zero",
    "extents",
];

/// The callbacks of the script plugins (`sh`, `eval`): nbdkit's list.
const SCRIPT_CALLBACKS: &[&str] = &[
    "load",
    "unload",
    "config",
    "config_complete",
    "config_help",
    "thread_model",
    "get_ready",
    "after_fork",
    "preconnect",
    "list_exports",
    "default_export",
    "open",
    "close",
    "export_description",
    "get_size",
    "block_size",
    "can_write",
    "can_flush",
    "is_rotational",
    "can_trim",
    "can_zero",
    "can_fast_zero",
    "can_extents",
    "can_fua",
    "can_multi_conn",
    "can_cache",
    "pread",
    "pwrite",
    "flush",
    "trim",
    "zero",
    "extents",
    "cache",
];

/// The callbacks the plugin `name` has.
fn callbacks(name: &str) -> Vec<&'static str> {
    if matches!(name, "sh" | "eval") {
        return SCRIPT_CALLBACKS.to_vec();
    }
    let read_only = matches!(name, "pattern" | "http" | "curl" | "zero");
    CALLBACKS
        .iter()
        .copied()
        .filter(|c| !(read_only && WRITE_CALLBACKS.contains(c)))
        .collect()
}

/// The filters of `--filter=`, each known to diskit.
fn check_filters(filters: &[String]) -> Result<(), CliError> {
    for f in filters {
        diskit_filters::info(f).map_err(|e| CliError::new(e.to_string()))?;
    }
    Ok(())
}

/// `PLUGIN --dump-plugin`: what nbdkit says of a plugin, for diskit's
/// built-in ones.
fn dump_plugin(name: Option<&str>, filters: &[String]) -> CmdResult {
    let Some(name) = name else {
        // nbdkit's words, without its "error:" (the prefix is written
        // here, so that it is not added).
        return Err(CliError::new(format!(
            "{}: use 'nbdkit plugin --dump-plugin' or\n\
             'nbdkit /path/to/plugin.so --dump-plugin' or\n\
             if you want to find out about the server use --dump-config",
            crate::names::prog()
        )));
    };
    check_filters(filters)?;
    let p = plugin::find(name)?;
    // eval without a thread_model snippet answers nbdkit's default.
    let model = if p.name == "eval" {
        "serialize_all_requests"
    } else {
        "parallel"
    };
    let mut out = format!(
        "path={}\nname={}\nversion={NBDKIT_VERSION}\napi_version=2\nstruct_size=384\n\
         max_thread_model=parallel\nthread_model={model}\nerrno_is_preserved=1\n",
        exe().display(),
        p.name,
    );
    // A plugin without parameters has no magic key (nbdkit's zero).
    if !p.magic.is_empty() {
        out += &format!("magic_config_key={}\n", p.magic);
    }
    for c in callbacks(p.name) {
        out += &format!("has_{c}=1\n");
    }
    // The script plugins take nbdkit 1.34's exit statuses 4-8 (scripts
    // look for this line before they use them).
    if matches!(p.name, "sh" | "eval") {
        out += "max_known_status=8\n";
    }
    for line in plugin::dump_lines(p.name)? {
        out += &format!("{line}\n");
    }
    print!("{out}");
    Ok(0)
}

/// `[PLUGIN] --version`: nbdkit's version, then each filter's and the
/// plugin's (all built in, so all the same).
fn version(name: Option<&str>, filters: &[String]) -> CmdResult {
    check_filters(filters)?;
    if let Some(name) = name {
        plugin::find(name)?;
    }
    let mut out = format!("nbdkit {NBDKIT_VERSION} (diskit {DISKIT_VERSION})\n");
    for f in filters.iter().map(String::as_str).chain(name) {
        out += &format!("{f} {NBDKIT_VERSION}\n");
    }
    print!("{out}");
    Ok(0)
}

/// `[PLUGIN] --help`: the server's options, then the plugin's own help.
fn help(cmd: &clap::Command, name: Option<&str>) -> CmdResult {
    let mut out = cmd.clone().render_help().to_string();
    if let Some(name) = name {
        let p = plugin::find(name)?;
        out += &format!("\nplugin: {}\n{}\n", p.name, p.help);
    }
    print!("{out}");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_config_has_nbdkits_version_keys() {
        let c = dump_config();
        assert!(c.contains(&format!("version={NBDKIT_VERSION}\n")));
        assert!(c.contains("version_major=1\n"));
        assert!(c.contains("root_tls_certificates_dir=/etc/pki/nbdkit\n"));
    }
}
