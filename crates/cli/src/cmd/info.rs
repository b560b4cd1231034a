//! `diskit info`: what an image is, as `qemu-img info` shows it.
//!
//! Each image is opened on its own, without its backing file (as qemu-img
//! does, so a missing backing file does not stop `info`); with
//! `--backing-chain` the backing files are then opened one by one by the
//! names the images give. Collecting ([`Node::collect`]) is kept apart from
//! printing ([`Node::json`], [`Node::human`]).

use std::collections::HashSet;
use std::path::Path;

use crate::CmdResult;
use crate::cmd::snapshot;
use crate::qjson::QJson;
use crate::util::OpenPolicy;
use crate::util::{CliError, ForceShare, ReportArgs};
use diskit_core::size::human_size;
use diskit_core::{BlockDevice, NodeInfo, Storage};
use diskit_open::{Format, FormatInfo, Image, OpenOptions, SnapshotInfo};

/// Arguments of `info`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    image: ReportArgs,
    /// Show every image of the backing chain.
    #[arg(short = 'b', long = "backing-chain")]
    backing_chain: bool,
    #[command(flatten)]
    share: ForceShare,
}

pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    let json = a.image.json("info")?;
    let mut format = a.image.format()?;
    let policy = a.share.policy(policy);
    let mut nodes = Vec::new();
    let mut seen = HashSet::new();
    let mut next = Some(a.image.filename.display().to_string());
    // The first name is read as the command line says (--image-opts or
    // not); the backing files below by the names the images give.
    let mut image_opts = policy.image_opts;
    while let Some(name) = next.take() {
        // Loops are caught by name, as qemu-img does.
        if !seen.insert(name.clone()) {
            return Err(CliError::new(format!(
                "Backing file '{name}' creates an infinite loop."
            )));
        }
        let node = Node::collect(&name, format, image_opts, &policy)?;
        image_opts = false;
        if a.backing_chain
            && let Some(refused) = node.refused()
        {
            return Err(CliError::new(refused));
        }
        if a.backing_chain
            && let Some(q) = &node.specific
        {
            next = q.full_backing_filename.clone();
            format = match &q.info.backing_format {
                Some(f) => Some(Format::from_name(f).map_err(|_| {
                    CliError::new(format!(
                        "Could not open '{}': Unknown driver '{f}'",
                        next.as_deref().unwrap_or_default()
                    ))
                })?),
                None => None,
            };
        }
        nodes.push(node);
    }
    if json {
        let mut list: Vec<QJson> = nodes.iter().map(Node::json).collect();
        let v = if a.backing_chain {
            QJson::List(list)
        } else {
            list.remove(0)
        };
        println!("{}", v.pretty());
    } else {
        let blocks: Vec<String> = nodes.iter().map(Node::human).collect();
        print!("{}", blocks.join("\n"));
    }
    Ok(0)
}

/// What `info` reports about one image.
struct Node {
    image: Image,
    /// The name shown (as given, or as the image above names it).
    filename: String,
    /// Bytes allocated to the image file (None: unknown, as for a network export).
    actual: Option<u64>,
    specific: Option<Specific>,
    /// With `--untrusted`: the files the image names and what the gate
    /// says of each (none of them opened).
    implied: Option<Vec<diskit_open::Audited>>,
    /// The snapshots its storage keeps, under a format that keeps none
    /// (an RBD image's under raw).
    storage_snapshots: Vec<SnapshotInfo>,
}

/// What the image's format adds.
struct Specific {
    info: FormatInfo,
    /// The backing file's name resolved against the image's.
    full_backing_filename: Option<String>,
}

/// Opens one image without its backing file (nor any file it names).
fn open_node(
    path: &Path,
    format: Option<Format>,
    image_opts: bool,
    policy: &OpenPolicy,
) -> Result<Image, CliError> {
    let opts = OpenOptions {
        metadata_only: true,
        no_backing: true,
        ..Default::default()
    };
    policy
        .open_name_as(path, format, opts, image_opts)
        .map_err(|e| CliError::new(format!("Could not open '{}': {e}", path.display())))
}

/// The name of a backing file as QEMU resolves it against the image's
/// name: as is when absolute (or with a protocol prefix), otherwise after
/// the image's directory as written (`sub/../base.raw`).
fn full_backing_filename(image: &str, backing: &str) -> String {
    let protocol = backing
        .find(':')
        .is_some_and(|c| backing.find('/').is_none_or(|s| c < s));
    if backing.starts_with('/') || protocol {
        return backing.to_string();
    }
    let dir = image.rfind('/').map_or("", |i| &image[..=i]);
    format!("{dir}{backing}")
}

impl Node {
    fn collect(
        name: &str,
        format: Option<Format>,
        image_opts: bool,
        policy: &OpenPolicy,
    ) -> Result<Node, CliError> {
        let path = Path::new(name);
        let image = open_node(path, format, image_opts, policy)?;
        let specific = Specific::collect(name, &image)?;
        // The disk size counts the files the image keeps its data in too
        // (vmdk extents), once per extent as QEMU counts them.
        let mut actual = image.file.allocated_bytes();
        let own = image.file.location().to_string();
        for c in specific.iter().flat_map(|q| &q.info.children) {
            if c.filename != own {
                actual = actual.zip(c.actual).map(|(a, b)| a + b);
            }
        }
        // QEMU names a network node by its canonical URI, a file as given
        // (by its filename in an --image-opts or json: description).
        let described = image_opts || name.starts_with("json:");
        let filename = if Self::local(&image) && !described {
            name.to_string()
        } else {
            image.file.location().to_string()
        };
        let implied = policy.untrusted.then(|| diskit_open::audit(&image));
        let storage_snapshots = if specific.is_none() {
            snapshot::list(&image)
                .map_err(|e| CliError::new(format!("Could not open '{name}': {e}")))?
        } else {
            Vec::new()
        };
        Ok(Node {
            image,
            filename,
            actual,
            specific,
            implied,
            storage_snapshots,
        })
    }

    /// Whether the image sits on a local file (QEMU's file-posix node, with
    /// its extra info: dirty flag, format-specific block).
    fn local(image: &Image) -> bool {
        matches!(image.file.protocol(), "file" | "host_device")
    }

    /// What the storage tells of itself, when the format is raw, which
    /// answers QEMU's questions about the node by asking its file (no
    /// other format does).
    fn raw_storage_info(&self) -> Option<NodeInfo> {
        (self.image.driver == "raw")
            .then(|| self.image.file.node_info())
            .flatten()
    }

    /// Bytes allocated, as `info` shows them.
    fn actual_human(&self) -> String {
        self.actual
            .map_or_else(|| "unavailable".to_string(), human_size)
    }

    /// Why the untrusted gate refuses a file this image names, if it does.
    fn refused(&self) -> Option<String> {
        self.implied.as_ref()?.iter().find_map(|f| {
            let r = f.refusal?;
            Some(format!(
                "refusing {} '{}' of untrusted image '{}': {}",
                f.named.role.name(),
                f.named.name,
                self.filename,
                r.rule()
            ))
        })
    }

    /// `implied-files`: diskit's addition with `--untrusted`.
    fn implied_json(&self, v: QJson) -> QJson {
        let Some(list) = &self.implied else {
            return v;
        };
        let items = list
            .iter()
            .map(|f| {
                let mut d = QJson::dict()
                    .with("role", QJson::Str(f.named.role.name().into()))
                    .with("name", QJson::Str(f.named.name.clone()))
                    .with("filename", QJson::Str(f.resolved.clone()))
                    .with("allowed", QJson::Bool(f.refusal.is_none()));
                if let Some(fmt) = &f.named.format {
                    d = d.with("format", QJson::Str(fmt.clone()));
                }
                if let Some(r) = f.refusal {
                    d = d.with("refusal", QJson::Str(r.rule().into()));
                }
                d
            })
            .collect();
        v.with("implied-files", QJson::List(items))
    }

    /// Whether the image is its protocol node itself (`-f host_device`):
    /// QEMU shows that node alone, with no child.
    fn protocol_node(&self) -> bool {
        self.image.driver == self.image.file.protocol()
    }

    /// The QAPI BlockGraphInfo object (keys inserted in schema order).
    fn json(&self) -> QJson {
        let img = &self.image;
        if self.protocol_node() {
            return file_node_json(
                &self.filename,
                img.file.protocol(),
                img.file.node_info().as_ref(),
                self.actual,
                self.file_length(),
            );
        }
        let mut v = QJson::dict()
            .with("filename", QJson::Str(self.filename.clone()))
            .with("format", QJson::Str(img.driver.into()));
        // QEMU knows the dirty flag only of formats that report one and,
        // under raw (which asks its file), of storage that tells it.
        let storage = self.raw_storage_info();
        let driver_info = match &self.specific {
            Some(q) => q.info.driver_info,
            None => storage.is_some(),
        };
        if driver_info {
            v = v.with(
                "dirty-flag",
                QJson::Bool(self.specific.as_ref().is_some_and(|q| q.info.dirty)),
            );
        }
        if let Some(a) = self.actual {
            v = v.with("actual-size", QJson::UInt(a));
        }
        v = v.with("virtual-size", QJson::UInt(img.virtual_size()));
        if let Some(cs) = storage.and_then(|n| n.cluster_size) {
            v = v.with("cluster-size", QJson::UInt(cs));
        }
        if !self.storage_snapshots.is_empty() {
            v = v.with(
                "snapshots",
                QJson::List(self.storage_snapshots.iter().map(snapshot_json).collect()),
            );
        }
        if let Some(q) = &self.specific {
            v = q.json_fields(v);
        }
        v = self.implied_json(v);
        // QEMU lists the children last first.
        let mut children: Vec<QJson> = self
            .children()
            .iter()
            .rev()
            .map(|c| {
                QJson::dict().with("name", QJson::Str(c.name.clone())).with(
                    "info",
                    file_node_json(
                        &c.filename,
                        c.protocol,
                        child_node(c.protocol).as_ref(),
                        c.actual,
                        c.length,
                    ),
                )
            })
            .collect();
        children.push(
            QJson::dict()
                .with("name", QJson::Str("file".into()))
                .with("info", self.file_json()),
        );
        v.with("children", QJson::List(children))
    }

    /// The image's other files (vmdk extents), as child nodes.
    fn children(&self) -> &[diskit_open::ChildFile] {
        self.specific
            .as_ref()
            .map_or(&[], |q| q.info.children.as_slice())
    }

    /// The length of the image file as QEMU's file driver reports it: in
    /// whole 512-byte sectors.
    fn file_length(&self) -> u64 {
        self.image.file.size().div_ceil(512) * 512
    }

    /// The protocol node under the image.
    fn file_json(&self) -> QJson {
        let own = if self.children().is_empty() {
            self.actual
        } else {
            self.image.file.allocated_bytes()
        };
        file_node_json(
            &self.filename,
            self.image.file.protocol(),
            self.image.file.node_info().as_ref(),
            own,
            self.file_length(),
        )
    }

    /// qemu-img's human block (`bdrv_node_info_dump` and the child node).
    fn human(&self) -> String {
        let img = &self.image;
        let name = &self.filename;
        let size = img.virtual_size();
        let mut out = format!(
            "image: {name}\nfile format: {}\nvirtual size: {} ({size} bytes)\ndisk size: {}\n",
            img.driver,
            human_size(size),
            self.actual_human(),
        );
        if let Some(cs) = self.raw_storage_info().and_then(|n| n.cluster_size) {
            out += &format!("cluster_size: {cs}\n");
        }
        if !self.storage_snapshots.is_empty() {
            out += "Snapshot list:\n";
            out += &snapshot::table(&self.storage_snapshots);
        }
        if let Some(q) = &self.specific {
            out += &q.human();
        }
        for f in self.implied.iter().flatten() {
            out += &format!(
                "implied {}: {} ({})\n",
                f.named.role.name(),
                f.resolved,
                f.refusal.map_or("allowed", |r| r.rule())
            );
        }
        if self.protocol_node() {
            return out;
        }
        // QEMU lists the children last first.
        for c in self.children().iter().rev() {
            out += &child_node_human(
                &c.name,
                &c.filename,
                c.protocol,
                child_node(c.protocol).as_ref(),
                c.actual,
                c.length,
            );
        }
        let own = if self.children().is_empty() {
            self.actual
        } else {
            self.image.file.allocated_bytes()
        };
        out += &child_node_human(
            "file",
            name,
            self.image.file.protocol(),
            self.image.file.node_info().as_ref(),
            own,
            self.file_length(),
        );
        out
    }
}

/// A protocol node (a file under an image) as QEMU's JSON shows it;
/// `length` in bytes, shown in whole sectors. QEMU shows the dirty flag
/// and the rest of `node`'s fields only of storage that tells them.
fn file_node_json(
    filename: &str,
    protocol: &str,
    node: Option<&NodeInfo>,
    actual: Option<u64>,
    length: u64,
) -> QJson {
    let mut v = QJson::dict()
        .with("filename", QJson::Str(filename.to_string()))
        .with("format", QJson::Str(protocol.into()));
    if node.is_some() {
        v = v.with("dirty-flag", QJson::Bool(false));
    }
    if let Some(a) = actual {
        v = v.with("actual-size", QJson::UInt(a));
    }
    v = v.with("virtual-size", QJson::UInt(length.div_ceil(512) * 512));
    if let Some(cs) = node.and_then(|n| n.cluster_size) {
        v = v.with("cluster-size", QJson::UInt(cs));
    }
    if let Some((kind, fields)) = node.and_then(|n| n.specific.as_ref()) {
        let data = fields.iter().fold(QJson::dict(), |d, (k, val)| {
            d.with(k, QJson::Str(val.clone()))
        });
        v = v.with(
            "format-specific",
            QJson::dict()
                .with("type", QJson::Str((*kind).into()))
                .with("data", data),
        );
    }
    v.with("children", QJson::List(vec![]))
}

/// A protocol node in qemu-img's human output.
fn child_node_human(
    child: &str,
    filename: &str,
    protocol: &str,
    node: Option<&NodeInfo>,
    actual: Option<u64>,
    length: u64,
) -> String {
    let length = length.div_ceil(512) * 512;
    let mut out = format!(
        "Child node '/{child}':\n    filename: {filename}\n    protocol type: {protocol}\n    \
         file length: {} ({length} bytes)\n    disk size: {}\n",
        human_size(length),
        actual.map_or_else(|| "unavailable".to_string(), human_size),
    );
    if let Some(cs) = node.and_then(|n| n.cluster_size) {
        out += &format!("    cluster_size: {cs}\n");
    }
    // QEMU leaves out a format-specific block with no data.
    if let Some((_, fields)) = node.and_then(|n| n.specific.as_ref())
        && !fields.is_empty()
    {
        out += "    Format specific information:\n";
        for (k, val) in fields {
            out += &format!("        {}: {val}\n", k.replace('-', " "));
        }
    }
    out
}

/// What QEMU knows of a child file's node: a local file's, or nothing.
fn child_node(protocol: &str) -> Option<NodeInfo> {
    matches!(protocol, "file" | "host_device").then(NodeInfo::local_file)
}

impl Specific {
    fn collect(name: &str, image: &Image) -> Result<Option<Specific>, CliError> {
        let info = image
            .ops
            .info()
            .map_err(|e| CliError::new(format!("Could not open '{name}': {e}")))?;
        let Some(info) = info else {
            return Ok(None);
        };
        for w in &info.warnings {
            eprintln!("{}: warning: {w}", crate::names::prog());
        }
        Ok(Some(Specific {
            full_backing_filename: info
                .backing_filename
                .as_deref()
                .map(|b| full_backing_filename(name, b)),
            info,
        }))
    }

    /// Adds the format's fields of BlockNodeInfo, in schema order.
    fn json_fields(&self, mut v: QJson) -> QJson {
        let info = &self.info;
        if let Some(cs) = info.cluster_size {
            v = v.with("cluster-size", QJson::UInt(cs));
        }
        if info.encrypted {
            v = v.with("encrypted", QJson::Bool(true));
        }
        if let Some(b) = &info.backing_filename {
            v = v.with("backing-filename", QJson::Str(b.clone()));
        }
        if let Some(b) = &self.full_backing_filename {
            v = v.with("full-backing-filename", QJson::Str(b.clone()));
        }
        if let Some(f) = &info.backing_format {
            v = v.with("backing-filename-format", QJson::Str(f.clone()));
        }
        if !info.snapshots.is_empty() {
            v = v.with(
                "snapshots",
                QJson::List(info.snapshots.iter().map(snapshot_json).collect()),
            );
        }
        if info.specific_type.is_empty() {
            // Formats with nothing specific (vdi, vpc) show no section.
            return v;
        }
        v.with(
            "format-specific",
            QJson::dict()
                .with("type", QJson::Str(info.specific_type.into()))
                .with("data", QJson::from(&info.specific)),
        )
    }

    fn human(&self) -> String {
        let info = &self.info;
        let mut out = String::new();
        if info.encrypted {
            out += "encrypted: yes\n";
        }
        if let Some(cs) = info.cluster_size {
            out += &format!("cluster_size: {cs}\n");
        }
        if info.dirty {
            out += "cleanly shut down: no\n";
        }
        if let Some(b) = &info.backing_filename {
            out += &format!("backing file: {b}");
            match &self.full_backing_filename {
                Some(full) if full != b => out += &format!(" (actual path: {full})"),
                _ => {}
            }
            out.push('\n');
            if let Some(f) = &info.backing_format {
                out += &format!("backing file format: {f}\n");
            }
        }
        if !info.snapshots.is_empty() {
            out += "Snapshot list:\n";
            out += &snapshot::table(&info.snapshots);
        }
        if !info.specific_type.is_empty() {
            out += "Format specific information:\n";
            out += &QJson::from(&info.specific).dump_human(1);
        }
        out
    }
}

/// One QAPI SnapshotInfo (keys in schema order; QAPI `int`s are signed).
fn snapshot_json(sn: &SnapshotInfo) -> QJson {
    let v = QJson::dict()
        .with("id", QJson::Str(sn.id.clone()))
        .with("name", QJson::Str(sn.name.clone()))
        .with("vm-state-size", QJson::Int(sn.vm_state_size as i64))
        .with("date-sec", QJson::Int(sn.date_sec as i64))
        .with("date-nsec", QJson::Int(sn.date_nsec as i64))
        .with(
            "vm-clock-sec",
            QJson::Int((sn.vm_clock_nsec / 1_000_000_000) as i64),
        )
        .with(
            "vm-clock-nsec",
            QJson::Int((sn.vm_clock_nsec % 1_000_000_000) as i64),
        );
    match sn.icount {
        Some(n) => v.with("icount", QJson::Int(n as i64)),
        None => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_like_qemu() {
        for (v, s) in [
            (0, "0 B"),
            (1, "1 B"),
            (999, "999 B"),
            (1000, "0.977 KiB"),
            (197_120, "192 KiB"),
            (721_408, "704 KiB"),
            (328_192, "320 KiB"),
            (1_023_488, "1e+03 KiB"),
            (193 * 1024 + 512, "194 KiB"),
            (1 << 30, "1 GiB"),
            (1_638_912, "1.56 MiB"),
            (u64::MAX, "16 EiB"),
        ] {
            assert_eq!(human_size(v), s, "{v}");
        }
    }

    #[test]
    fn backing_names_resolve_like_qemu() {
        assert_eq!(full_backing_filename("top.qcow2", "b.raw"), "b.raw");
        assert_eq!(
            full_backing_filename("sub/mid.qcow2", "../b.raw"),
            "sub/../b.raw"
        );
        assert_eq!(
            full_backing_filename("/x/y/t.qcow2", "/abs.raw"),
            "/abs.raw"
        );
        assert_eq!(full_backing_filename("/x/t.qcow2", "z/b"), "/x/z/b");
        assert_eq!(full_backing_filename("d/t.qcow2", "nbd://h/x"), "nbd://h/x");
        assert_eq!(full_backing_filename("d/t.qcow2", "a/b:c"), "d/a/b:c");
    }
}
