//! Usage errors against qemu-img's: the same words for a missing file name
//! or an unknown option, the subcommand named in the hint, the same exit
//! status.

mod common;

use common::*;

/// Runs `TOOL ARGS` and gives (message with the program's name taken
/// out, exit status).
fn run(tool: &str, args: &[&str]) -> (String, i32) {
    let program = if tool == "diskit" {
        diskit_bin()
    } else {
        "qemu-img".into()
    };
    let o = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap();
    let text = stderr(&o)
        .replace("qemu-img", "PROG")
        .replace("diskit", "PROG");
    (text, o.status.code().unwrap_or(-1))
}

#[test]
fn missing_file_names_are_named_as_qemu_img_names_them() {
    for sub in [
        "info", "check", "map", "compare", "convert", "create", "resize", "commit", "rebase",
        "snapshot", "bench", "dd", "bitmap", "measure",
    ] {
        let (ours, our_rc) = run("diskit", &[sub]);
        let (theirs, their_rc) = run("qemu-img", &[sub]);
        // The first line is qemu-img's; diskit always adds the hint, which
        // qemu-img leaves out for some subcommands.
        assert_eq!(
            ours.lines().next(),
            theirs.lines().next(),
            "{sub} with no arguments"
        );
        assert!(
            ours.contains(&format!("Try 'PROG {sub} --help' for more info")),
            "{sub}: {ours}"
        );
        assert_eq!(our_rc, their_rc, "{sub} exit status");
    }
}

#[test]
fn unknown_options_are_named_with_the_subcommand_help() {
    let (ours, rc) = run("diskit", &["info", "--bogus", "x.img"]);
    assert_eq!(rc, 1);
    assert_contains(&ours, "unrecognized option '--bogus'");
    assert_contains(&ours, "Try 'PROG info --help' for more info");
}

#[test]
fn a_missing_option_value_names_the_option() {
    let (ours, rc) = run("diskit", &["info", "-f"]);
    assert_eq!(rc, 1);
    // getopt's words, as qemu-img's: the short spelling as typed, or
    // the long one.
    assert_contains(&ours, "option requires an argument -- 'f'");
    let (ours, _) = run("diskit", &["info", "--format"]);
    assert_contains(&ours, "option '--format' requires an argument");
    assert_contains(&ours, "Try 'PROG info --help'");
}

#[test]
fn missing_arguments_of_other_subcommands_are_named() {
    for (sub, expect) in [
        ("copy", "source and a destination"),
        ("serve", "plugin name"),
        ("nbdinfo", "NBD URI"),
    ] {
        let (ours, rc) = run("diskit", &[sub]);
        assert_eq!(rc, 1, "{sub}");
        assert!(ours.contains(expect), "{sub}: {ours}");
        assert_contains(&ours, &format!("Try 'PROG {sub} --help'"));
    }
    let (ours, rc) = run("diskit", &["frobnicate"]);
    assert_eq!(rc, 1);
    assert_contains(&ours, "frobnicate");
}
