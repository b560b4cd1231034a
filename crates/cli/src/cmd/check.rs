//! `diskit check`: verify (and repair) an image's metadata, as qemu-img check.

use crate::CmdResult;
use crate::qjson::QJson;
use crate::util::OpenPolicy;
use crate::util::{CliError, ForceShare, ReportArgs};
use diskit_open::{Capability, CheckReport, Repair, probe_format};

/// Arguments of `check`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    image: ReportArgs,
    /// Repair: leaks or all.
    #[arg(short = 'r', long = "repair")]
    repair: Option<String>,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Cache mode of the image (accepted for compatibility).
    #[arg(short = 'T', long = "cache")]
    cache: Option<String>,
    #[command(flatten)]
    share: ForceShare,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let json = a.image.json("check")?;
    let repair = match a.repair.as_deref() {
        None => Repair::None,
        Some("leaks") => Repair::Leaks,
        Some("all") => Repair::All,
        Some(_) => {
            return Err(CliError::usage(
                "check",
                "Unknown option value for -r (expecting 'leaks' or 'all')",
            ));
        }
    };
    let _ = a.cache;
    let name = a.image.filename.display().to_string();
    let format = a.image.format()?;
    // An --image-opts or json: description names the file and maybe the
    // format (a key-secret in it is not needed: check reads metadata).
    let (described, file) = diskit_open::open_described_storage(
        crate::util::name_of(&a.image.filename)?,
        policy.image_opts,
        repair != Repair::None,
    )
    .map_err(|e| CliError::new(format!("Could not open '{name}': {e}")))?;
    let format = match format.or(described) {
        Some(f) => f,
        None => probe_format(&*file, &name)
            .map_err(|e| CliError::new(format!("Could not open '{name}': {e}")))?,
    };
    // QEMU's image locks, as for any open of the image: a reader that
    // lets no one write the qcow2 under it, a writer with -r; -U reads
    // without them.
    if repair != Repair::None || !a.share.given() {
        let (perm, unshare) = diskit_core::storage::lock::for_image(
            repair != Repair::None,
            format == diskit_open::Format::QCOW2,
        );
        file.lock_image(perm, unshare)
            .map_err(|e| CliError::new(format!("Could not open '{name}': {e}")))?;
    }
    if !format.supports(Capability::Check) {
        return Err(CliError {
            message: "This image format does not support checks".into(),
            code: 63,
        });
    }
    // A format that checks the files the image names (vmdk extents) has
    // the image opened, and locked, by each run instead.
    let file = (!format.driver().check_opens_image()).then_some(file);
    // One run of the check, with or without repairs.
    let run = |repair: Repair| -> Result<CheckReport, CliError> {
        let r = if let Some(file) = &file {
            format.driver().check(file, repair)
        } else {
            // The format checks the files the image names too (vmdk
            // extents): the image is opened, without its backing file.
            let img = policy.open(
                &a.image.filename,
                Some(format),
                diskit_open::OpenOptions {
                    no_backing: true,
                    force_share: a.share.given(),
                    ..Default::default()
                },
            )?;
            img.ops.check(repair)
        };
        r.map_err(|e| {
            // A format that checks but cannot repair says so as qemu-img does.
            if e.detail() == "This image format does not support checks" {
                CliError {
                    message: e.detail().to_string(),
                    code: 63,
                }
            } else {
                CliError::new(format!("Could not open '{name}': {e}"))
            }
        })
    };
    let mut r = run(repair)?;
    for m in &r.messages {
        eprintln!("{m}");
    }
    // What was repaired is checked again, as qemu-img does: that run's
    // findings are the result, with the repairs of the first.
    let repaired = r.failed.is_none() && r.corruptions_fixed + r.leaks_fixed > 0;
    if repaired {
        let mut again = run(Repair::None)?;
        for m in &again.messages {
            eprintln!("{m}");
        }
        again.corruptions_fixed = r.corruptions_fixed;
        again.leaks_fixed = r.leaks_fixed;
        r = again;
    }
    if let Some(why) = &r.failed {
        return Err(CliError::new(why.clone()));
    }
    if json {
        println!("{}", report_json(&r, &name, format.name()).pretty());
    } else if !a.quiet {
        print!("{}", report_human(&r, repaired));
    }
    Ok(if r.check_errors > 0 {
        1
    } else if r.corruptions > 0 {
        2
    } else if r.leaks > 0 {
        3
    } else {
        0
    })
}

fn report_json(r: &CheckReport, name: &str, format: &str) -> QJson {
    let mut v = QJson::dict();
    let opt = |v: QJson, key: &str, n: u64| {
        if n > 0 {
            v.with(key, QJson::UInt(n))
        } else {
            v
        }
    };
    v = opt(v, "image-end-offset", r.image_end_offset);
    v = opt(v, "compressed-clusters", r.compressed_clusters);
    v = opt(v, "total-clusters", r.total_clusters);
    v = opt(v, "corruptions", r.corruptions);
    v = opt(v, "corruptions-fixed", r.corruptions_fixed);
    v = v.with("check-errors", QJson::UInt(r.check_errors));
    v = opt(v, "leaks", r.leaks);
    v = opt(v, "leaks-fixed", r.leaks_fixed);
    v = opt(v, "allocated-clusters", r.allocated_clusters);
    v = v
        .with("filename", QJson::Str(name.to_string()))
        .with("format", QJson::Str(format.into()));
    opt(v, "fragmented-clusters", r.fragmented_clusters)
}

fn report_human(r: &CheckReport, repaired: bool) -> String {
    let mut s = String::new();
    if repaired {
        s.push_str(&format!(
            "The following inconsistencies were found and repaired:\n\n    {} leaked clusters\n    {} corruptions\n\nDouble checking the fixed image now...\n",
            r.leaks_fixed, r.corruptions_fixed
        ));
    }
    if r.corruptions == 0 && r.leaks == 0 && r.check_errors == 0 {
        s.push_str("No errors were found on the image.\n");
    } else {
        if r.corruptions > 0 {
            s.push_str(&format!(
                "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n",
                r.corruptions
            ));
        }
        if r.leaks > 0 {
            s.push_str(&format!(
                "\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n",
                r.leaks
            ));
        }
        if r.check_errors > 0 {
            s.push_str(&format!(
                "\n{} internal errors have occurred during the check.\n",
                r.check_errors
            ));
        }
    }
    if r.total_clusters != 0 && r.allocated_clusters != 0 {
        let pct = |a: u64, b: u64| {
            if b == 0 {
                0.0
            } else {
                a as f64 * 100.0 / b as f64
            }
        };
        s.push_str(&format!(
            "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters\n",
            r.allocated_clusters,
            r.total_clusters,
            pct(r.allocated_clusters, r.total_clusters),
            pct(r.fragmented_clusters, r.allocated_clusters),
            pct(r.compressed_clusters, r.allocated_clusters),
        ));
    }
    if r.image_end_offset > 0 {
        s.push_str(&format!("Image end offset: {}\n", r.image_end_offset));
    }
    s
}
