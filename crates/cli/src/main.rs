//! `diskit`: one command line for disk images, shaped like qemu-img's.
//!
//! Subcommands, options, human and JSON output and exit codes follow
//! qemu-img, so scripts written for qemu-img work with diskit.

mod cmd;
mod progress;
mod qjson;
mod usage;
mod util;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

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
}

/// The outcome of a command: an exit status, or an error to report.
pub type CmdResult = Result<u8, util::CliError>;

fn main() -> ExitCode {
    // Writing to a closed pipe ends the program quietly, as C tools do.
    // SAFETY: setting a signal disposition to its default has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind as K;
            if matches!(
                e.kind(),
                K::DisplayHelp | K::DisplayVersion | K::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return ExitCode::from(
                    if e.kind() == K::DisplayHelpOnMissingArgumentOrSubcommand {
                        1
                    } else {
                        0
                    },
                );
            }
            let args: Vec<String> = std::env::args().collect();
            let names: Vec<String> = Cli::command()
                .get_subcommands()
                .map(|c| c.get_name().to_string())
                .collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let sub = usage::subcommand_of(&args, &names);
            let err = usage::word(&e, sub.as_deref());
            err.print();
            return ExitCode::from(err.code);
        }
    };
    for def in &cli.object {
        if let Err(e) = diskit_open::define_object(def) {
            eprintln!("diskit: {e}");
            return ExitCode::from(1);
        }
    }
    util::set_open_policy(util::OpenPolicy {
        image_opts: cli.image_opts,
        untrusted: cli.untrusted,
    });
    let result = match cli.command {
        Command::Create(a) => cmd::create::run(a),
        Command::Info(a) => cmd::info::run(a),
        Command::Map(a) => cmd::map::run(a),
        Command::Compare(a) => cmd::compare::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Resize(a) => cmd::resize::run(a),
        Command::Measure(a) => cmd::measure::run(a),
        Command::Amend(a) => cmd::amend::run(a),
        Command::Check(a) => cmd::check::run(a),
        Command::Snapshot(a) => cmd::snapshot::run(a),
        Command::Commit(a) => cmd::commit::run(a),
        Command::Rebase(a) => cmd::rebase::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Nbdinfo(a) => cmd::nbdinfo::run(a),
        Command::Copy(a) => cmd::copy::run(a),
        Command::Dd(a) => cmd::dd::run(a),
        Command::Bitmap(a) => cmd::bitmap::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // Only the first line carries the prefix: later lines are hints,
            // or carry their own prefix (a second message).
            eprintln!("diskit: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}
