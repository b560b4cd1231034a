//! Usage errors worded as qemu-img words them.
//!
//! clap finds what is wrong with a command line; this module says it the
//! way qemu-img does (scripts match on some of these lines): the
//! subcommand named in the prefix, what is missing or wrong named, and a
//! pointer to the subcommand's `--help`.

use clap::error::{ContextKind, ContextValue, ErrorKind};

use crate::names::{self, Tool};

/// The lines to print for a usage error, and the exit status.
pub struct UsageError {
    /// The message, without the program prefix.
    pub message: String,
    /// The subcommand, when one was recognised (for the prefix and hint).
    pub subcommand: Option<String>,
    /// The exit status.
    pub code: u8,
    /// Whether it is getopt's complaint about an unknown option.
    pub getopt: bool,
}

impl UsageError {
    /// Prints the error as the tool run as prints its usage errors (the
    /// program name from [`names`]): qemu-img names the subcommand in
    /// getopt's complaints about options (`qemu-img info: unrecognized
    /// option '--x'`).
    pub fn print(&self) {
        let prog = names::prog();
        let message = names::strip_os_error(&self.message);
        match (&self.subcommand, names::current()) {
            (Some(sub), Tool::QemuImg) if self.getopt => eprintln!("{prog} {sub}: {message}"),
            _ => eprintln!("{prog}: {message}"),
        }
        eprintln!("{}", names::hint(self.subcommand.as_deref()));
    }
}

/// What qemu-img says when a subcommand's file names are missing.
fn missing_files_message(sub: &str) -> Option<&'static str> {
    Some(match sub {
        "info" | "check" | "map" | "commit" | "rebase" | "snapshot" | "bench" | "amend"
        | "checksum" => "Expecting one image file name",
        "compare" => "Expecting two image file names",
        "convert" => "Must specify image file name",
        "create" => "Expecting image file name",
        "resize" => "Expecting image file name and size",
        "copy" => "Expecting a source and a destination (SOURCE DESTINATION)",
        "nbdinfo" => "Expecting an NBD URI (or a server command in [ ])",
        "serve" => "Expecting a plugin name, or an image file",
        "fuse" => {
            "Expecting MOUNTPOINT and a URI, an image, or a mode ([ CMD ], --fd, --tcp, --unix)"
        }
        _ => return None,
    })
}

/// The argument names a clap error carries for `kind`, as clap shows them
/// (`<FILENAME>`, `--size <SIZE>`).
fn context_strings(e: &clap::Error, kind: ContextKind) -> Vec<String> {
    match e.get(kind) {
        Some(ContextValue::Strings(v)) => v.clone(),
        Some(ContextValue::String(s)) => vec![s.clone()],
        _ => Vec::new(),
    }
}

/// Whether a clap argument name is a positional one (`<FILENAME>`).
fn is_positional(name: &str) -> bool {
    name.starts_with('<') || name.starts_with('[')
}

/// Words a clap parse error for `sub` (None: no subcommand recognised).
pub fn word(e: &clap::Error, sub: Option<&str>) -> UsageError {
    // qemu-img exits 1 on every usage error (compare's 2 is for errors
    // met while comparing).
    let code = 1;
    let message = match e.kind() {
        ErrorKind::MissingRequiredArgument => {
            let missing = context_strings(e, ContextKind::InvalidArg);
            let files_only = !missing.is_empty() && missing.iter().all(|m| is_positional(m));
            match sub.and_then(missing_files_message) {
                Some(_) if files_only && names::current() == Tool::Nbdkit => {
                    "no plugins given on the command line.".to_string()
                }
                Some(m) if files_only => m.to_string(),
                _ if missing.is_empty() => "a required argument is missing".to_string(),
                _ => format!("missing required argument: {}", missing.join(", ")),
            }
        }
        ErrorKind::MissingSubcommand => "Not enough arguments (expecting a subcommand)".to_string(),
        ErrorKind::InvalidSubcommand => {
            let name = context_strings(e, ContextKind::InvalidSubcommand);
            format!("Command not found: {}", name.join(" "))
        }
        ErrorKind::UnknownArgument => {
            let name = context_strings(e, ContextKind::InvalidArg);
            let name = name.first().map(String::as_str).unwrap_or("?");
            let short = name.strip_prefix('-').filter(|c| c.chars().count() == 1);
            if let Some(c) = short.filter(|c| *c != "-") {
                // getopt's words for a short option.
                format!("invalid option -- '{c}'")
            } else if name.starts_with('-') {
                format!("unrecognized option '{name}'")
            } else {
                format!("unexpected argument '{name}'")
            }
        }
        ErrorKind::InvalidValue if e.get(ContextKind::InvalidValue).is_some() => {
            let arg = context_strings(e, ContextKind::InvalidArg);
            let value = context_strings(e, ContextKind::InvalidValue);
            let arg = arg.first().map(String::as_str).unwrap_or("?");
            match value.first().map(String::as_str) {
                Some("") | None => missing_value(arg),
                Some(v) => {
                    let valid = context_strings(e, ContextKind::ValidValue);
                    if valid.is_empty() {
                        format!("invalid value '{v}' for '{arg}'")
                    } else {
                        format!(
                            "invalid value '{v}' for '{arg}' (expected one of: {})",
                            valid.join(", ")
                        )
                    }
                }
            }
        }
        _ => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        }
    };
    let getopt = e.kind() == ErrorKind::UnknownArgument
        && (message.starts_with("unrecognized") || message.starts_with("invalid option"));
    UsageError {
        message,
        subcommand: sub.map(str::to_string),
        code,
        getopt,
    }
}

/// getopt's words for an option left without its value: the short
/// spelling when that is what was typed (the last argument), else the
/// long one (clap names the long one, with its value placeholder).
fn missing_value(arg: &str) -> String {
    let last = std::env::args().next_back().unwrap_or_default();
    match last.strip_prefix('-') {
        Some(short) if short.len() == 1 && short != "-" => {
            format!("option requires an argument -- '{short}'")
        }
        _ => {
            let name = arg.split(' ').next().unwrap_or(arg);
            format!("option '{name}' requires an argument")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positional_names_are_recognised() {
        assert!(is_positional("<FILENAME>"));
        assert!(!is_positional("--size <SIZE>"));
    }
}
