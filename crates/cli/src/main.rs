//! `diskit`: one command line for disk images, shaped like qemu-img's.
//!
//! Subcommands, options, human and JSON output and exit codes follow
//! qemu-img, so scripts written for qemu-img work with diskit. Run under
//! the name `qemu-img`, `qemu-nbd`, `nbdkit`, `nbdcopy` or `nbdinfo` (a link), it
//! takes that tool's command line (see [`names`]).

mod cmd;
mod generate;
mod getopt;
mod names;
mod progress;
mod qjson;
mod usage;
mod util;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Args as _, CommandFactory, FromArgMatches, Parser, Subcommand};
use names::Tool;

/// diskit: virtual disk images and the Network Block Device protocol.
#[derive(Parser, Debug)]
#[command(name = "diskit", version, about, disable_help_subcommand = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Read image names as qemu-img's --image-opts descriptions
    /// (driver=qcow2,file.driver=file,file.filename=...).
    #[arg(long = "image-opts", global = true)]
    image_opts: bool,
    /// Treat images as untrusted: the files they name (backing files, data
    /// files) must be regular files inside the image's directory.
    #[arg(long = "untrusted", global = true)]
    untrusted: bool,
    /// Defines an object, as qemu-img's --object: secret,id=ID,data=TEXT
    /// or secret,id=ID,file=PATH (format=raw|base64), referred to by
    /// key-secret=ID and encrypt.key-secret=ID. Repeatable.
    #[arg(long = "object", global = true, value_name = "OBJECTDEF")]
    object: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create a new image.
    Create(cmd::create::Args),
    /// Show information about an image.
    Info(cmd::info::Args),
    /// Show the allocation map of an image.
    Map(cmd::map::Args),
    /// Compare the contents of two images.
    Compare(cmd::compare::Args),
    /// Convert (copy) images, any format to any format.
    Convert(cmd::convert::Args),
    /// Change the size of an image.
    Resize(cmd::resize::Args),
    /// Compute the size needed for an image.
    Measure(cmd::measure::Args),
    /// Change the options of an existing image.
    Amend(cmd::amend::Args),
    /// Check (and repair) an image's metadata.
    Check(cmd::check::Args),
    /// Write an image's data into its backing file.
    Commit(cmd::commit::Args),
    /// Change the backing file of an image.
    Rebase(cmd::rebase::Args),
    /// List, create, apply or delete internal snapshots.
    Snapshot(cmd::snapshot::Args),
    /// Serve a device or image over NBD (nbdkit-style command line).
    Serve(cmd::serve::Args),
    /// Serve an image over NBD with qemu-nbd's command line.
    QemuNbd(Box<cmd::qemu_nbd::Args>),
    /// Show what an NBD server exports (libnbd's nbdinfo).
    Nbdinfo(cmd::nbdinfo::Args),
    /// Copy between files, devices, pipes and NBD servers (libnbd's nbdcopy).
    Copy(cmd::copy::Args),
    /// Copy an image block by block into a new one (qemu-img dd).
    Dd(cmd::dd::Args),
    /// Add, remove, clear, enable, disable or merge persistent bitmaps.
    Bitmap(cmd::bitmap::Args),
    /// Time a run of reads or writes (qemu-img bench).
    Bench(cmd::bench::Args),
    /// Print the blkhash checksum of an image's guest data (as blksum).
    Checksum(cmd::checksum::Args),
    /// libnbd's NBD shell (nbdsh's command line) over diskit's Python client.
    #[command(disable_help_flag = true)]
    Nbdsh(cmd::nbdsh::Args),
    /// Show an NBD export or an image as a file through FUSE (libnbd's nbdfuse).
    Fuse(cmd::fuse::Args),
}

/// The outcome of a command: an exit status, or an error to report.
pub type CmdResult = Result<u8, util::CliError>;

/// diskit's subcommands that are not qemu-img's.
const NOT_QEMU_IMG: [&str; 7] = [
    "serve", "qemu-nbd", "nbdinfo", "copy", "checksum", "nbdsh", "fuse",
];

/// The command line of `tool` when it has subcommands (diskit, qemu-img):
/// getopt's conventions on top of the derived one (a repeated option
/// is taken, the last one winning where it does not accumulate).
pub fn multi_command(tool: Tool) -> clap::Command {
    let mut c = Cli::command()
        .name(tool.name())
        .bin_name(tool.name())
        // A global setting: every subcommand takes it.
        .args_override_self(true)
        .mut_subcommand("serve", cmd::serve::command);
    if tool == Tool::QemuImg {
        c = c
            .version(tool.version())
            .about("qemu-img's command line, run by diskit");
        for name in NOT_QEMU_IMG {
            c = c.mut_subcommand(name, |s| s.hide(true));
        }
    }
    c
}

/// The command line of a single-command name (`qemu-nbd`, `nbdkit`,
/// `nbdcopy`, `nbdinfo`, `nbdfuse`) running diskit's subcommand `sub`.
pub fn single_command(tool: Tool, sub: &str) -> clap::Command {
    let base = clap::Command::new(tool.name())
        .version(tool.version())
        .args_override_self(true);
    // About after the arguments: the derive sets the Args struct's own.
    match sub {
        "serve" => cmd::serve::command(cmd::serve::Args::augment_args(base))
            .about("An NBD server with nbdkit's command line, run by diskit"),
        "qemu-nbd" => cmd::qemu_nbd::Args::augment_args(base)
            .about("An NBD server with qemu-nbd's command line, run by diskit"),
        "copy" => cmd::copy::Args::augment_args(base)
            .about("Copy to and from an NBD server (nbdcopy's command line), run by diskit"),
        "fuse" => cmd::fuse::Args::augment_args(base)
            .about("Mount an NBD server as a virtual file (nbdfuse's command line), run by diskit"),
        _ => cmd::nbdinfo::Args::augment_args(base)
            .about("Show what an NBD server exports (nbdinfo's command line), run by diskit"),
    }
}

/// The arguments of subcommand `sub` as clap is to see them: `copy` and
/// `nbdinfo` keep their positional words verbatim, so options after them
/// are moved in front, as getopt does.
fn reorder(cmd: &clap::Command, sub: &str, args: &[OsString]) -> Vec<OsString> {
    match sub {
        "copy" | "nbdinfo" => getopt::permute(cmd, args, true),
        // qemu-img 10's dd and qemu-nbd take their options after the
        // operands too.
        "dd" | "qemu-nbd" => getopt::permute(cmd, args, false),
        _ => args.to_vec(),
    }
}

fn main() -> ExitCode {
    // Writing to a closed pipe ends the program quietly, as C tools do.
    // SAFETY: setting a signal disposition to its default has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let argv: Vec<OsString> = std::env::args_os().collect();
    let tool = Tool::from_argv0(argv.first().map(OsString::as_os_str));
    names::set(tool);
    if tool == Tool::Diskit
        && let Some(code) = generate::run_if_asked(&argv)
    {
        return ExitCode::from(code);
    }
    let code = match tool.subcommand() {
        Some(sub) => run_single(tool, sub, &argv[1..]),
        None => run_multi(tool, &argv),
    };
    ExitCode::from(code)
}

/// Prints a clap error as the tool run as prints usage errors; the exit
/// status.
fn parse_failed(e: &clap::Error, sub: Option<&str>) -> u8 {
    use clap::error::ErrorKind as K;
    match e.kind() {
        K::DisplayHelp | K::DisplayVersion => {
            let _ = e.print();
            0
        }
        K::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            1
        }
        _ => {
            let err = usage::word(e, sub);
            err.print();
            err.code
        }
    }
}

/// Answers the options that print something about the tool and exit
/// (whatever else the command line holds) of `serve` (nbdkit's, see
/// [`cmd::serve::introspect`]), `copy` and `nbdinfo` (`--version`,
/// `--long-options`, `--short-options`), whether run under the tool's
/// name (`as_name`) or as a diskit subcommand; `None` for other lines.
fn introspect(sub: &str, cmd: &clap::Command, args: &[OsString], as_name: bool) -> Option<u8> {
    if sub == "serve" {
        return cmd::serve::introspect::handle(cmd, args, as_name).map(finish);
    }
    if sub == "qemu-nbd" {
        // clap answers --help; --version is qemu-nbd's line under either name.
        let found = getopt::options(cmd, args, false);
        found.iter().find(|(n, _)| n == "--version" || n == "-V")?;
        println!("qemu-nbd {}", Tool::QemuNbd.version());
        return Some(0);
    }
    let tool = match sub {
        "copy" => Tool::Nbdcopy,
        "nbdinfo" => Tool::Nbdinfo,
        "fuse" => Tool::Nbdfuse,
        _ => return None,
    };
    let found = getopt::options(cmd, args, true);
    let (name, _) = found.iter().find(|(n, _)| {
        ["--long-options", "--short-options", "--version", "-V"].contains(&n.as_str())
    })?;
    if name == "--version" || name == "-V" {
        println!("{} {}", tool.name(), tool.version());
        return Some(0);
    }
    let extra = ["--help", "--version", "-V"];
    for o in getopt::list(cmd, name == "--long-options", &extra) {
        println!("{o}");
    }
    Some(0)
}

/// Runs `qemu-nbd`, `nbdkit`, `nbdcopy`, `nbdinfo` or `nbdfuse`: diskit's subcommand
/// `sub` with the words after the program name.
fn run_single(tool: Tool, sub: &str, args: &[OsString]) -> u8 {
    let cmd = single_command(tool, sub);
    if let Some(code) = introspect(sub, &cmd, args, true) {
        return code;
    }
    let words = std::iter::once(OsString::from(tool.name()))
        .chain(reorder(&cmd, sub, args))
        .collect::<Vec<_>>();
    // qemu-nbd's options in order, for its in-order checks.
    let given = if sub == "qemu-nbd" {
        getopt::options(&cmd, args, false)
    } else {
        Vec::new()
    };
    let matches = match cmd.try_get_matches_from(words) {
        Ok(m) => m,
        Err(e) => return parse_failed(&e, Some(sub)),
    };
    let result = match sub {
        // nbdkit has no --untrusted or --image-opts: the default policy.
        "serve" => cmd::serve::Args::from_arg_matches(&matches)
            .map(|a| cmd::serve::run(a, util::OpenPolicy::default())),
        // qemu-nbd has no --untrusted either.
        "qemu-nbd" => cmd::qemu_nbd::Args::from_arg_matches(&matches)
            .map(|a| cmd::qemu_nbd::run(a, &given, util::OpenPolicy::default())),
        "copy" => cmd::copy::Args::from_arg_matches(&matches).map(cmd::copy::run),
        "fuse" => cmd::fuse::Args::from_arg_matches(&matches)
            .map(|a| cmd::fuse::run(a, util::OpenPolicy::default())),
        _ => cmd::nbdinfo::Args::from_arg_matches(&matches).map(cmd::nbdinfo::run),
    };
    match result {
        Ok(r) => finish(r),
        Err(e) => parse_failed(&e, Some(sub)),
    }
}

/// Where the subcommand is among diskit's (or qemu-img's) arguments: the
/// first word that is neither an option nor --object's value.
fn subcommand_index(argv: &[OsString]) -> Option<usize> {
    let mut i = 1;
    while i < argv.len() {
        let w = argv[i].to_string_lossy();
        if w == "--object" {
            i += 2;
        } else if w.starts_with('-') {
            i += 1;
        } else {
            return Some(i);
        }
    }
    None
}

/// Runs `diskit SUBCOMMAND ...` or `qemu-img SUBCOMMAND ...`.
fn run_multi(tool: Tool, argv: &[OsString]) -> u8 {
    let cmd = multi_command(tool);
    if tool == Tool::QemuImg && argv.len() < 2 {
        eprintln!("qemu-img: Not enough arguments");
        eprintln!("{}", names::hint(None));
        return 1;
    }
    let index = subcommand_index(argv);
    let sub = index.map(|i| argv[i].to_string_lossy().into_owned());
    // The subcommand usage errors name, when it is one.
    let named = sub.clone().filter(|s| cmd.find_subcommand(s).is_some());
    let mut words = argv.to_vec();
    // qemu-nbd's options in order, for its in-order checks.
    let mut given = Vec::new();
    if let (Some(i), Some(s)) = (index, sub.as_deref()) {
        if tool == Tool::QemuImg && NOT_QEMU_IMG.contains(&s) {
            eprintln!("{}: Command not found: {s}", tool.name());
            eprintln!("{}", names::hint(None));
            return 1;
        }
        if let Some(sc) = cmd.find_subcommand(s) {
            let rest = &argv[i + 1..];
            if let Some(code) = introspect(s, sc, rest, false) {
                return code;
            }
            words.truncate(i + 1);
            words.extend(reorder(sc, s, rest));
            if s == "qemu-nbd" {
                given = getopt::options(sc, rest, false);
            }
        }
    }
    let matches = match cmd.try_get_matches_from(words) {
        Ok(m) => m,
        Err(e) => return parse_failed(&e, named.as_deref()),
    };
    if let Some(code) = image_opts_with_format(&matches) {
        names::print_error("--image-opts and --format are mutually exclusive");
        return code;
    }
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => return parse_failed(&e, named.as_deref()),
    };
    // qemu-nbd defines its --object options itself, in order among its
    // other options.
    let objects = match cli.command {
        Command::QemuNbd(_) => &[][..],
        _ => &cli.object[..],
    };
    for def in objects {
        if let Err(e) = diskit_open::define_object(def) {
            names::print_error(&e.to_string());
            return 1;
        }
    }
    let policy = util::OpenPolicy {
        image_opts: cli.image_opts,
        untrusted: cli.untrusted,
        force_share: false,
    };
    finish(match cli.command {
        Command::Create(a) => cmd::create::run(a),
        Command::Info(a) => cmd::info::run(a, policy),
        Command::Map(a) => cmd::map::run(a, policy),
        Command::Compare(a) => cmd::compare::run(a, policy),
        Command::Convert(a) => cmd::convert::run(a, policy),
        Command::Resize(a) => cmd::resize::run(a, policy),
        Command::Measure(a) => cmd::measure::run(a, policy),
        Command::Amend(a) => cmd::amend::run(a, policy),
        Command::Check(a) => cmd::check::run(a, policy),
        Command::Snapshot(a) => cmd::snapshot::run(a, policy),
        Command::Commit(a) => cmd::commit::run(a, policy),
        Command::Rebase(a) => cmd::rebase::run(a, policy),
        Command::Serve(a) => cmd::serve::run(a, policy),
        Command::QemuNbd(a) => cmd::qemu_nbd::run(*a, &given, policy),
        Command::Nbdinfo(a) => cmd::nbdinfo::run(a),
        Command::Copy(a) => cmd::copy::run(a),
        Command::Dd(a) => cmd::dd::run(a, policy),
        Command::Bitmap(a) => cmd::bitmap::run(a, policy),
        Command::Bench(a) => cmd::bench::run(a, policy),
        Command::Checksum(a) => cmd::checksum::run(a, policy),
        Command::Nbdsh(a) => cmd::nbdsh::run(a),
        Command::Fuse(a) => cmd::fuse::run(a, policy),
    })
}

/// Whether a subcommand was given `--image-opts` and a source format too
/// (`-f`, compare's `-F`), which qemu-img refuses before anything else
/// (resize and dd parse their words first, as qemu-img does): the exit
/// status to refuse it with (compare's errors exit 2).
fn image_opts_with_format(m: &clap::ArgMatches) -> Option<u8> {
    let (name, sub) = m.subcommand()?;
    if matches!(
        name,
        "resize" | "dd" | "create" | "serve" | "qemu-nbd" | "copy" | "nbdinfo"
    ) {
        return None;
    }
    let image_opts = sub.ids().any(|id| id == "image_opts") && sub.get_flag("image_opts");
    let format = sub
        .ids()
        .any(|id| matches!(id.as_str(), "format" | "format1" | "format2"));
    (image_opts && format).then_some(if name == "compare" { 2 } else { 1 })
}

/// The exit status of a command's outcome, its error printed.
fn finish(result: CmdResult) -> u8 {
    match result {
        Ok(code) => code,
        Err(e) => {
            names::print_error(&e.message);
            e.code
        }
    }
}
