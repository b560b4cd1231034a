//! getopt's argument permutation, for the commands whose positional
//! arguments clap would otherwise swallow options into.
//!
//! The C tools diskit stands in for parse with `getopt_long`, which moves
//! options found after the positional arguments in front of them:
//! `nbdcopy IN OUT --flush` and `nbdinfo URI --json` work there. diskit's
//! `copy` and `nbdinfo` keep their positional words verbatim (a server
//! command in `[ ... ]` has options of its own), so before clap parses
//! them, [`permute`] does what getopt does: options (with their separate
//! values) first, then `--`, then the positional words in order. `--`
//! still ends the options, and the words of a `[ CMD ARGS ... ]` stay
//! together, options included.

use std::ffi::OsString;

/// How an option word of a command takes its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Takes {
    /// A flag: no value.
    Nothing,
    /// A value, in the same word (`--x=V`, `-xV`) or the next one.
    Value,
    /// An optional value, only in the same word (`--progress[=FD]`).
    Attached,
}

/// How the option named `long` (without dashes) or `short` of `cmd`
/// takes a value; `None` for an option `cmd` does not have.
fn takes(cmd: &clap::Command, long: Option<&str>, short: Option<char>) -> Option<Takes> {
    let arg = cmd.get_arguments().find(|a| {
        let by_long = long.is_some_and(|l| {
            a.get_long() == Some(l) || a.get_all_aliases().is_some_and(|v| v.contains(&l))
        });
        let by_short = short.is_some_and(|s| {
            a.get_short() == Some(s) || a.get_all_short_aliases().is_some_and(|v| v.contains(&s))
        });
        by_long || by_short
    })?;
    if !arg.get_action().takes_values() {
        return Some(Takes::Nothing);
    }
    let optional = arg.get_num_args().is_some_and(|n| n.min_values() == 0);
    Some(if optional && arg.is_require_equals_set() {
        Takes::Attached
    } else {
        Takes::Value
    })
}

/// How many words (1 or 2) the option word `w` of `cmd` spans.
fn option_words(cmd: &clap::Command, w: &str) -> usize {
    if let Some(long) = w.strip_prefix("--") {
        if long.contains('=') {
            return 1;
        }
        return match takes(cmd, Some(long), None) {
            Some(Takes::Value) => 2,
            _ => 1,
        };
    }
    // A cluster of short options: the first that takes a value takes the
    // rest of the word, or the next word when nothing is left.
    let shorts: Vec<char> = w.chars().skip(1).collect();
    for (i, c) in shorts.iter().enumerate() {
        match takes(cmd, None, Some(*c)) {
            Some(Takes::Value) => return if i + 1 == shorts.len() { 2 } else { 1 },
            Some(Takes::Attached) => return 1,
            Some(Takes::Nothing) => {}
            // An unknown option: clap names it.
            None => return 1,
        }
    }
    1
}

/// Whether `w` is an option word (not `-`, the standard streams).
fn is_option(w: &str) -> bool {
    w.starts_with('-') && w.len() > 1
}

/// Reorders the arguments of `cmd` (the words after its name) as getopt
/// does: every option before the positional words, which follow a `--`.
/// With `brackets`, a `[ ... ]` group is one run of positional words.
pub fn permute(cmd: &clap::Command, args: &[OsString], brackets: bool) -> Vec<OsString> {
    let mut options = Vec::new();
    let mut positionals = Vec::new();
    let mut dangling = None;
    let mut i = 0;
    while i < args.len() {
        let word = &args[i];
        let Some(w) = word.to_str() else {
            positionals.push(word.clone());
            i += 1;
            continue;
        };
        if w == "--" {
            positionals.extend(args[i + 1..].iter().cloned());
            break;
        }
        if brackets && w == "[" {
            let end = args[i..]
                .iter()
                .position(|x| x == "]")
                .map_or(args.len(), |p| i + p + 1);
            positionals.extend(args[i..end].iter().cloned());
            i = end;
            continue;
        }
        if is_option(w) {
            let want = option_words(cmd, w);
            if i + want > args.len() {
                // The last word wants a value that is not there: it stays
                // last, so that clap reports the missing value as getopt
                // does (after a `--` it would take that as its value).
                dangling = Some(word.clone());
                break;
            }
            options.extend(args[i..i + want].iter().cloned());
            i += want;
        } else {
            positionals.push(word.clone());
            i += 1;
        }
    }
    match dangling {
        Some(last) => {
            options.extend(positionals);
            options.push(last);
        }
        None if !positionals.is_empty() => {
            options.push("--".into());
            options.extend(positionals);
        }
        None => {}
    }
    options
}

/// One option found by [`options`]: its name as written (`--filter`,
/// `-D`; a cluster of short options gives one entry each) and its value.
pub type Found = (String, Option<String>);

/// The options of a command line of `cmd`, in order, as getopt would see
/// them (before `--`, outside `[ ... ]` when `brackets`), each with its
/// value; the positional words are left out.
pub fn options(cmd: &clap::Command, args: &[OsString], brackets: bool) -> Vec<Found> {
    let permuted = permute(cmd, args, brackets);
    let words: Vec<String> = permuted
        .iter()
        .take_while(|w| *w != "--")
        .map(|w| w.to_string_lossy().into_owned())
        .collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if !is_option(w) {
            // A positional word before an option left without its value.
            i += 1;
            continue;
        }
        let n = option_words(cmd, w);
        let next = (n == 2).then(|| words.get(i + 1).cloned()).flatten();
        if let Some(long) = w.strip_prefix("--") {
            match long.split_once('=') {
                Some((name, value)) => found.push((format!("--{name}"), Some(value.to_string()))),
                None => found.push((w.clone(), next)),
            }
        } else {
            let shorts: Vec<char> = w.chars().skip(1).collect();
            for (j, c) in shorts.iter().enumerate() {
                if matches!(
                    takes(cmd, None, Some(*c)),
                    Some(Takes::Value | Takes::Attached)
                ) {
                    let rest: String = shorts[j + 1..].iter().collect();
                    let value = if rest.is_empty() {
                        next.clone()
                    } else {
                        Some(rest)
                    };
                    found.push((format!("-{c}"), value));
                    break;
                }
                found.push((format!("-{c}"), None));
            }
        }
        i += n;
    }
    found
}

/// Every long option (`long`) or short option of `cmd`, aliases
/// included, as nbdkit's and libnbd's `--long-options` and
/// `--short-options` list them for shell completion; `extra` are added
/// (options handled before clap parses).
pub fn list(cmd: &clap::Command, long: bool, extra: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut add = |s: String| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    for a in cmd.get_arguments().filter(|a| !a.is_positional()) {
        if long {
            for l in a
                .get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
            {
                add(format!("--{l}"));
            }
        } else {
            for c in a
                .get_short()
                .into_iter()
                .chain(a.get_all_short_aliases().unwrap_or_default())
            {
                add(format!("-{c}"));
            }
        }
    }
    for e in extra {
        if e.starts_with("--") == long {
            add(e.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd() -> clap::Command {
        clap::Command::new("t")
            .arg(
                clap::Arg::new("flush")
                    .long("flush")
                    .action(clap::ArgAction::SetTrue),
            )
            .arg(clap::Arg::new("requests").short('R').long("requests"))
            .arg(
                clap::Arg::new("progress")
                    .short('p')
                    .long("progress")
                    .num_args(0..=1)
                    .require_equals(true),
            )
            .arg(
                clap::Arg::new("v")
                    .short('v')
                    .action(clap::ArgAction::SetTrue),
            )
            .arg(clap::Arg::new("sides").num_args(1..).trailing_var_arg(true))
    }

    fn run(words: &[&str], brackets: bool) -> Vec<String> {
        let args: Vec<OsString> = words.iter().map(OsString::from).collect();
        permute(&cmd(), &args, brackets)
            .into_iter()
            .map(|w| w.into_string().unwrap())
            .collect()
    }

    #[test]
    fn options_after_positionals_move_in_front() {
        assert_eq!(
            run(
                &["a", "b", "--requests", "64", "--flush", "-p", "-vR8"],
                false
            ),
            ["--requests", "64", "--flush", "-p", "-vR8", "--", "a", "b"]
        );
        assert_eq!(
            run(&["a", "-R", "4", "b", "--progress=3"], false),
            ["-R", "4", "--progress=3", "--", "a", "b"]
        );
    }

    #[test]
    fn double_dash_and_brackets_keep_their_words() {
        assert_eq!(
            run(&["--flush", "--", "-", "--x"], false),
            ["--flush", "--", "-", "--x"]
        );
        assert_eq!(
            run(
                &["[", "qemu-nbd", "-f", "qcow2", "x", "]", "null:", "-v"],
                true
            ),
            [
                "-v", "--", "[", "qemu-nbd", "-f", "qcow2", "x", "]", "null:"
            ]
        );
        assert_eq!(run(&["--flush"], false), ["--flush"]);
        assert_eq!(run(&["a", "--requests"], false), ["a", "--requests"]);
    }

    #[test]
    fn options_are_found_with_their_values() {
        let args: Vec<OsString> = ["x", "--requests=3", "-vR", "5", "--flush", "y"]
            .iter()
            .map(OsString::from)
            .collect();
        let found = options(&cmd(), &args, false);
        let want: Vec<Found> = vec![
            ("--requests".into(), Some("3".into())),
            ("-v".into(), None),
            ("-R".into(), Some("5".into())),
            ("--flush".into(), None),
        ];
        assert_eq!(found, want);
    }
}
