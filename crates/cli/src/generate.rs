//! Manual pages and shell completions, generated from the command
//! definitions for every name diskit answers to.
//!
//! `diskit --generate=man DIR` writes `diskit.1`, `diskit-SUBCOMMAND.1`,
//! `qemu-img.1`, `qemu-img-SUBCOMMAND.1`, `qemu-nbd.1`, `nbdkit.1`, `nbdcopy.1` and
//! `nbdinfo.1`; `diskit --generate=completions DIR` writes bash, zsh and
//! fish completions for each name (`DIR/bash/NAME`, `DIR/zsh/_NAME`,
//! `DIR/fish/NAME.fish`). Hidden (scripts/install runs it): the first
//! argument is checked before anything else, so normal start-up pays one
//! string comparison.

use std::ffi::OsString;
use std::path::Path;

use clap_complete::Shell;

use crate::names::Tool;

/// The command definition of each name.
fn commands() -> Vec<(Tool, clap::Command)> {
    Tool::ALL
        .into_iter()
        .map(|t| {
            let cmd = match t.subcommand() {
                Some(sub) => crate::single_command(t, sub),
                None => crate::multi_command(t),
            };
            // A manual page's title holds one line of version.
            let version = t.version();
            let first = version.lines().next().unwrap_or_default();
            let first = first.strip_prefix("version ").unwrap_or(first).to_string();
            (t, cmd.version(first))
        })
        .collect()
}

/// Writes the manual pages into `dir`.
fn man(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (_, cmd) in commands() {
        clap_mangen::generate_to(cmd, dir)?;
    }
    Ok(())
}

/// Writes bash, zsh and fish completions into `dir`.
fn completions(dir: &Path) -> std::io::Result<()> {
    for (shell, sub) in [
        (Shell::Bash, "bash"),
        (Shell::Zsh, "zsh"),
        (Shell::Fish, "fish"),
    ] {
        let out = dir.join(sub);
        std::fs::create_dir_all(&out)?;
        for (tool, mut cmd) in commands() {
            let path = clap_complete::generate_to(shell, &mut cmd, tool.name(), &out)?;
            // bash-completion looks completions up by the command's name.
            if shell == Shell::Bash {
                std::fs::rename(&path, out.join(tool.name()))?;
            }
        }
    }
    Ok(())
}

/// Runs `diskit --generate=WHAT DIR` when that is the command line; the
/// exit status, or `None` for any other command line.
pub fn run_if_asked(argv: &[OsString]) -> Option<u8> {
    let what = argv.get(1)?.to_str()?.strip_prefix("--generate=")?;
    let Some(dir) = argv.get(2).filter(|_| argv.len() == 3) else {
        eprintln!("diskit: usage: diskit --generate=man|completions DIR");
        return Some(1);
    };
    let dir = Path::new(dir);
    let r = match what {
        "man" => man(dir),
        "completions" => completions(dir),
        other => {
            eprintln!("diskit: --generate: expected man or completions, not '{other}'");
            return Some(1);
        }
    };
    Some(match r {
        Ok(()) => 0,
        Err(e) => {
            crate::names::print_error(&format!("--generate={what}: {}: {e}", dir.display()));
            1
        }
    })
}
