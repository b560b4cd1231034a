//! Protocols: the table of ways to reach storage (QEMU's protocol drivers).
//!
//! One table of sources, with two faces each. QEMU's face: the driver
//! name a description gives (`file`, `host_device`, `null-co`, `nbd`,
//! `http`), the prefixes by which a plain name selects it (`null-co://`,
//! `file:`, `nbd+unix://`), its keys and the function that opens it, for
//! `info`, `convert`, `copy` and every other command. nbdkit's face: the
//! plugins that serve it with nbdkit's keys (`diskit serve file|nbd|
//! http|curl|null|memory|pattern|zero|ones|full|random|
//! sparse-random|data|split|partitioning|tmpdisk|sh|eval|ssh|python|rbd|s3`). And how an
//! image is made on
//! it. A new source is one module and one row here.

use std::sync::Arc;

use diskit_backends::{FileDevice, NullDevice};
pub use diskit_core::StorageOptions;
use diskit_core::storage::has_protocol;
use diskit_core::{Error, Result, StorageRef};
use diskit_formats::options::{bool_value, size_value};

use crate::plugin::{self, Plugin, PluginOpen};
use crate::spec::{NodeKind, Spec};

/// A protocol driver.
#[derive(Debug)]
pub struct Protocol {
    /// The driver name (`file.driver=` in a spec).
    pub name: &'static str,
    /// Name prefixes that select it (the whole name is its `filename`).
    pub prefixes: &'static [&'static str],
    /// The keys its node takes besides `driver`.
    pub keys: &'static [&'static str],
    /// Whether its names are local paths (the trust gate checks them).
    pub local: bool,
    /// Whether its requests travel over a network, where each waits for a
    /// round trip and keeping many in flight pays.
    pub network: bool,
    /// Opens the storage a node describes (QEMU's face: a name or a
    /// description selects it); `None` for sources only nbdkit's face
    /// reaches.
    pub open: Option<fn(&Spec, StorageOptions) -> Result<StorageRef>>,
    /// How a new image is made on it.
    pub made: Made,
    /// nbdkit's face: the plugins that serve it (`diskit serve NAME`).
    pub plugins: &'static [Plugin],
}

impl Protocol {
    /// A source only nbdkit's face reaches (`diskit serve NAME`), named
    /// after its first plugin: no QEMU name or description opens it, and
    /// no image is made on it.
    const fn served_only(plugins: &'static [Plugin]) -> Protocol {
        Protocol {
            name: plugins[0].name,
            prefixes: &[],
            keys: &[],
            local: false,
            network: false,
            open: None,
            made: Made::Never,
            plugins,
        }
    }
}

/// How a protocol makes the storage of a new image.
#[derive(Debug, Clone, Copy)]
pub enum Made {
    /// A new file (or an existing one emptied, or a block device taken over).
    NewFile,
    /// Existing storage of its own size is taken over (QEMU's fallback for
    /// protocols that cannot create: the NBD export must be there).
    Existing,
    /// Never: no image is made on it.
    Never,
    /// Made by the source itself (an RBD image, an S3 object), empty, and
    /// removed by it if the creation fails.
    New {
        /// Makes the storage called by the name, empty and writable, for
        /// an image of about the size given (S3 sizes its parts by it).
        create: fn(&str, u64) -> Result<StorageRef>,
        /// Removes it.
        remove: fn(&str) -> Result<()>,
        /// Makes storage that creation made and no open took since (`create`
        /// alone) what it will be (an S3 object is there once its upload
        /// completes).
        finish: fn(&str) -> Result<()>,
    },
}

/// Every protocol, the local file first (the one a plain path selects).
pub const PROTOCOLS: &[Protocol] = &[
    Protocol {
        name: "file",
        prefixes: &["file:"],
        keys: &["filename"],
        local: true,
        network: false,
        open: Some(open_file),
        made: Made::NewFile,
        plugins: &[Plugin {
            name: "file",
            magic: "file",
            magic_required: true,
            keys: &["file"],
            lists: &[],
            aliases: &[],
            variables: false,
            help: "a file or block device (file=PATH)",
            open: PluginOpen::Source(plugin::open_file),
        }],
    },
    Protocol {
        name: "host_device",
        prefixes: &["host_device:"],
        keys: &["filename"],
        local: true,
        network: false,
        open: Some(open_file),
        made: Made::NewFile,
        plugins: &[],
    },
    Protocol {
        name: "nbd",
        prefixes: &["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"],
        keys: NBD_KEYS,
        local: false,
        network: true,
        open: Some(open_nbd),
        made: Made::Existing,
        plugins: &[Plugin {
            name: "nbd",
            magic: "uri",
            magic_required: false,
            keys: crate::nbd_plugin::KEYS,
            lists: &["arg"],
            aliases: &[],
            variables: false,
            help: "proxies another NBD server, as nbdkit's nbd plugin \
                   ([uri=]NBD_URI | socket=PATH | hostname=HOST [port=PORT] | \
                   command=PROGRAM [arg=ARG]... | socket-fd=FD; [export=NAME] \
                   [retry=N] [shared=BOOL] [tls=off|require] [tls-certificates=DIR] \
                   [tls-verify=BOOL] [tls-username=NAME] [tls-psk=FILE])",
            open: PluginOpen::Source(crate::nbd_plugin::open),
        }],
    },
    Protocol {
        name: "http",
        prefixes: &["http://"],
        keys: HTTP_KEYS,
        local: false,
        network: true,
        open: Some(open_http),
        made: Made::Never,
        plugins: &[
            Plugin {
                name: "http",
                magic: "url",
                magic_required: true,
                keys: diskit_http::PLUGIN_KEYS,
                lists: &["header"],
                aliases: &[],
                variables: false,
                help: "an http:// or https:// URL, read-only, by range requests over a \
                       pool of connections (url=URL [cainfo=FILE] [capath=DIR] [sslverify=BOOL] \
                       [user=NAME] [password=PASSWORD|+FILE] [header='NAME: VALUE']... \
                       [cookie=C|+FILE] [user-agent=UA] [timeout=SECS] [followlocation=BOOL] \
                       [connections=N] [retries=N])",
                open: PluginOpen::Source(plugin::open_http),
            },
            Plugin {
                name: "curl",
                magic: "url",
                magic_required: true,
                keys: diskit_http::PLUGIN_KEYS,
                lists: &["header"],
                aliases: &[],
                variables: false,
                help: "the http plugin under nbdkit's name for it",
                open: PluginOpen::Source(plugin::open_http),
            },
        ],
    },
    Protocol {
        name: "https",
        prefixes: &["https://"],
        keys: HTTP_KEYS,
        local: false,
        network: true,
        open: Some(open_http),
        made: Made::Never,
        plugins: &[],
    },
    Protocol {
        name: "null-co",
        prefixes: &["null-co://"],
        keys: &["filename", "size", "read-zeroes"],
        local: false,
        network: false,
        open: Some(open_null),
        made: Made::Never,
        plugins: &[Plugin {
            name: "null",
            magic: "size",
            magic_required: false,
            keys: &["size"],
            lists: &[],
            aliases: &[],
            variables: false,
            help: "reads zeros, discards writes (size=SIZE, default 0 as in nbdkit)",
            open: PluginOpen::Source(plugin::open_null),
        }],
    },
    Protocol::served_only(&[Plugin::sized(
        "memory",
        "a sparse RAM disk (size=SIZE)",
        plugin::open_memory,
    )]),
    Protocol::served_only(&[Plugin::sized(
        "pattern",
        "read-only test data: each 8-byte word holds its offset (size=SIZE)",
        plugin::open_pattern,
    )]),
    Protocol::served_only(&[Plugin {
        name: "zero",
        magic: "",
        magic_required: false,
        keys: &[],
        lists: &[],
        aliases: &[],
        variables: false,
        help: "a read-only disk of no bytes (no parameters)",
        open: PluginOpen::Source(crate::synthetic::open_zero),
    }]),
    Protocol::served_only(&[Plugin {
        name: "ones",
        magic: "size",
        magic_required: false,
        keys: &["size", "byte"],
        lists: &[],
        aliases: &[],
        variables: false,
        help: "every byte 0xff, or byte=N; writes are dropped ([size=]SIZE (default 0) [byte=N])",
        open: PluginOpen::Source(crate::synthetic::open_ones),
    }]),
    Protocol::served_only(&[Plugin::sized(
        "full",
        "reads as zeros, every write fails with ENOSPC (size=SIZE)",
        crate::synthetic::open_full,
    )]),
    Protocol::served_only(&[Plugin {
        name: "random",
        magic: "size",
        magic_required: false,
        keys: &["size", "seed"],
        lists: &[],
        aliases: &[],
        variables: false,
        help: "random bytes, nbdkit's for the same seed; writes must match them \
               ([size=]SIZE [seed=N (default: the time)])",
        open: PluginOpen::Source(crate::synthetic::open_random),
    }]),
    Protocol::served_only(&[Plugin {
        name: "sparse-random",
        magic: "size",
        magic_required: false,
        keys: &["size", "seed", "percent", "runlength", "random-content"],
        lists: &[],
        aliases: &[],
        variables: false,
        help: "a disk shaped like a VM's, runs of data between holes, nbdkit's layout and \
               bytes for the same seed ([size=]SIZE [seed=N] [percent=10] \
               [runlength=16777216] [random-content=BOOL])",
        open: PluginOpen::Source(crate::synthetic::open_sparse_random),
    }]),
    Protocol::served_only(&[Plugin {
        name: "data",
        magic: "data",
        magic_required: false,
        keys: crate::synthetic::DATA_KEYS,
        lists: &[],
        aliases: &[],
        variables: true,
        help: "a RAM disk starting with the bytes given, laid out (and its holes \
               reported) as nbdkit's ([data=]'EXPRESSION' | raw=BYTES | base64=TEXT \
               [size=SIZE] [NAME=EXPRESSION: for $NAME]; the expressions: bytes, \
               @OFFSET @+N @-N @^ALIGN, le16:/be16:/le32:/be32:/le64:/be64:WORD, \
               \"STRING\", <FILE, <(SCRIPT), ( ... ), EXPR*N, EXPR[N:M], \
               EXPR -> \\NAME, \\NAME, $VAR, # comments)",
        open: PluginOpen::Source(crate::synthetic::open_data),
    }]),
    Protocol::served_only(&[Plugin {
        name: "split",
        magic: "file",
        magic_required: true,
        keys: &["file"],
        lists: &["file"],
        aliases: &[],
        variables: false,
        help: "several files end to end as one disk ([file=]FILE...)",
        open: PluginOpen::Source(crate::synthetic::open_split),
    }]),
    Protocol::served_only(&[Plugin {
        name: "partitioning",
        magic: "file",
        magic_required: true,
        keys: &["file", "partition-type", "alignment", "mbr-id", "type-guid"],
        lists: &[],
        aliases: &[],
        variables: false,
        help: "files as the partitions of a disk with a made-up MBR or GPT, laid out as \
               nbdkit's ([file=]FILE... [partition-type=mbr|gpt]; before the files they \
               apply to: [alignment=SIZE (1M)] [mbr-id=ID|default (0x83)] \
               [type-guid=GUID|default])",
        open: PluginOpen::InOrder(crate::synthetic::open_partitioning),
    }]),
    Protocol::served_only(&[Plugin {
        name: "tmpdisk",
        magic: "size",
        magic_required: true,
        keys: crate::synthetic::TMPDISK_KEYS,
        lists: &[],
        aliases: &[],
        variables: true,
        help: "a new disk for each client, with a filesystem made by mkfs, gone when the \
               client goes ([size=]SIZE [type=ext4|xfs|vfat|...] [label=LABEL] \
               [command=SHELL COMMAND making $disk of $size] [NAME=VALUE: a shell \
               variable for the command])",
        open: PluginOpen::Source(crate::synthetic::open_tmpdisk),
    }]),
    Protocol::served_only(&[Plugin {
        name: "sh",
        magic: "script",
        magic_required: true,
        keys: &["script"],
        lists: &[],
        aliases: &[],
        variables: true,
        help: "a script answers each request, nbdkit's sh-plugin protocol: `SCRIPT METHOD \
               ARGS...`, exit 0 done, 1 error (an errno name on stderr), 2 missing, 3 false \
               ([script=]SCRIPT|- [KEY=VALUE...: the script's config method])",
        open: PluginOpen::InOrder(crate::scripts::open_sh),
    }]),
    Protocol::served_only(&[Plugin {
        name: "eval",
        magic: "",
        magic_required: false,
        keys: crate::scripts::EVAL_METHODS,
        lists: &[],
        aliases: &[],
        variables: true,
        help: "a shell snippet per method, nbdkit's sh-plugin protocol (get_size='SCRIPT' \
               pread='SCRIPT' [pwrite= zero= trim= flush= extents= can_*= open= close= \
               thread_model= missing= ...] [KEY=VALUE...: the config method])",
        open: PluginOpen::InOrder(crate::scripts::open_eval),
    }]),
    Protocol::served_only(&[Plugin {
        name: "ssh",
        magic: "path",
        magic_required: false,
        keys: crate::ssh::KEYS,
        lists: &[],
        aliases: &[],
        variables: false,
        help: "a file on another machine over SSH (SFTP), through libssh, as nbdkit's ssh \
               plugin (host=HOST [path=]PATH [port=PORT] [user=USER] [password=PASSWORD|+FILE|-FD] \
               [identity=KEYFILE...] [known-hosts=FILE] [verify-remote-host=BOOL] [config=FILE] \
               [timeout=SECS] [compression=BOOL] [create=true create-size=SIZE [create-mode=MODE]])",
        open: PluginOpen::InOrder(crate::ssh::open_plugin),
    }]),
    #[cfg(feature = "python")]
    Protocol::served_only(&[Plugin {
        name: "python",
        magic: "script",
        magic_required: true,
        keys: &["script"],
        lists: &[],
        aliases: &[],
        variables: true,
        help: "a Python script written for nbdkit's python plugin (API 1 or 2), run \
               unmodified on embedded CPython, from libdiskit_python.so (script=SCRIPT.py [key=value]...: the \
               others go to the script's config(key, value), in order)",
        open: PluginOpen::InOrder(crate::scripts::open_python),
    }]),
    Protocol {
        name: "rbd",
        prefixes: &["rbd:"],
        keys: crate::rbd::KEYS,
        local: false,
        network: true,
        open: Some(crate::rbd::open),
        made: Made::New {
            create: crate::rbd::create,
            remove: crate::rbd::remove,
            finish: crate::rbd::finish,
        },
        plugins: &[Plugin {
            name: "rbd",
            magic: "image",
            magic_required: true,
            keys: crate::rbd::PLUGIN_KEYS,
            lists: &[],
            aliases: &[],
            variables: false,
            help: "a Ceph RBD image, through librbd (image=POOL[/NAMESPACE]/IMAGE \
                   [snap=SNAPSHOT: read-only] [conf=CEPH.CONF] [id=USER])",
            open: PluginOpen::Source(crate::rbd::open_plugin),
        }],
    },
    Protocol {
        name: "s3",
        prefixes: &[diskit_s3::PREFIX],
        keys: crate::s3::KEYS,
        local: false,
        network: true,
        open: Some(crate::s3::open),
        made: Made::New {
            create: crate::s3::create,
            remove: crate::s3::remove,
            finish: crate::s3::finish,
        },
        plugins: &[Plugin {
            name: "s3",
            magic: "key",
            magic_required: true,
            keys: crate::s3::PLUGIN_KEYS,
            lists: &[],
            aliases: crate::s3::PLUGIN_ALIASES,
            variables: false,
            help: "S3 objects, as nbdkit's S3 plugin serves them (bucket=BUCKET key=KEY \
                   [endpoint-url=URL] [access-key=] [secret-key=] [session-token=] \
                   [region=] [profile=]: the object KEY, read-only; with size=SIZE \
                   object-size=SIZE: a disk over objects KEY/%016x, read-write)",
            open: PluginOpen::Source(crate::s3::open_plugin),
        }],
    },
];

/// The protocol driver called `name` (QEMU's face: one a description
/// can name).
pub fn by_name(name: &str) -> Option<&'static Protocol> {
    PROTOCOLS
        .iter()
        .find(|p| p.name == name && p.open.is_some())
}

/// The protocol a plain name selects: by prefix, else the local file.
/// A name with an unknown `scheme:` is refused, as QEMU refuses it (a file
/// whose name has a colon is reached as `./name` or `file:name`).
pub fn for_name(name: &str) -> Result<&'static Protocol> {
    if let Some(p) = PROTOCOLS
        .iter()
        .find(|p| p.prefixes.iter().any(|pre| name.starts_with(pre)))
    {
        return Ok(p);
    }
    if has_protocol(name) {
        let scheme = &name[..name.find(':').unwrap_or(0)];
        return Err(Error::invalid(format!("Unknown protocol '{scheme}'")));
    }
    Ok(&PROTOCOLS[0])
}

/// The path a local file's name stands for: without the `file:` or
/// `host_device:` that may select its protocol (`file:a:b` is `a:b`).
pub fn local_path(name: &str) -> &str {
    name.strip_prefix("file:")
        .or_else(|| name.strip_prefix("host_device:"))
        .unwrap_or(name)
}

/// Opens the storage a protocol node describes, refusing keys it does not
/// take.
pub fn open(proto: &Protocol, node: &Spec, mode: StorageOptions) -> Result<StorageRef> {
    node.check_keys(
        NodeKind::Protocol,
        proto.name,
        &with_driver(proto.keys),
        &[],
    )?;
    let open = proto
        .open
        .ok_or_else(|| Error::invalid(format!("Unknown protocol driver '{}'", proto.name)))?;
    open(node, mode)
}

fn with_driver(keys: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec!["driver"];
    v.extend_from_slice(keys);
    v
}

fn filename(node: &Spec, driver: &str) -> Result<String> {
    node.get("filename").map(str::to_string).ok_or_else(|| {
        Error::invalid(format!(
            "Parameter 'filename' is required for driver '{driver}'"
        ))
    })
}

fn open_file(node: &Spec, mode: StorageOptions) -> Result<StorageRef> {
    let name = filename(node, "file")?;
    Ok(Arc::new(FileDevice::open(local_path(&name), mode)?))
}

/// The keys of QEMU's nbd driver that diskit takes: a URI
/// (`filename`), or the server's address by structure (`server.*`, or
/// the older `path`, `host` and `port`) with `export`; and
/// `x-dirty-bitmap`, a metadata context reported as the allocation.
const NBD_KEYS: &[&str] = &[
    "filename",
    "server.type",
    "server.path",
    "server.host",
    "server.port",
    "path",
    "host",
    "port",
    "export",
    "x-dirty-bitmap",
    "tls-creds",
    "tls-hostname",
];

/// An NBD export, by URI or by structure.
fn open_nbd(node: &Spec, mode: StorageOptions) -> Result<StorageRef> {
    use diskit_nbd::client::NbdClient;
    let mut uri = nbd_address(node)?;
    if let Some(id) = node.get("tls-creds") {
        with_tls_creds(&mut uri, id, node.get("tls-hostname"))?;
    } else if node.has("tls-hostname") {
        return Err(Error::invalid("tls-hostname is set but tls-creds is not"));
    }
    Ok(Arc::new(match node.get("x-dirty-bitmap") {
        Some(context) => NbdClient::connect_reporting(uri, context)?,
        None if mode.connections > 1 => NbdClient::connect_multi_to(uri, mode.connections)?,
        None => NbdClient::connect_to(uri, &[diskit_nbd::client::BASE_ALLOCATION])?,
    }))
}

/// Sets up `uri` for the TLS credentials object `id` (`--object
/// tls-creds-x509|tls-creds-psk,...`), as QEMU's nbd driver uses it: the
/// certificates or keys in its directory, the peer checked as it says,
/// the name checked `tls-hostname` (by default the TCP host).
pub fn with_tls_creds(
    uri: &mut diskit_nbd::client::uri::NbdUri,
    id: &str,
    hostname: Option<&str>,
) -> Result<()> {
    use crate::objects::{Endpoint, TlsKind, tls_creds};
    let creds = tls_creds(id, Endpoint::Client)?;
    uri.tls = true;
    uri.tls_hostname = hostname.map(str::to_string);
    match creds.kind {
        TlsKind::X509 => {
            uri.tls_certificates = Some(creds.dir.display().to_string());
            uri.tls_verify_peer = Some(creds.verify_peer);
        }
        TlsKind::Psk => {
            uri.tls_psk_file = Some(creds.psk_file().display().to_string());
            uri.user = Some(creds.username);
        }
    }
    Ok(())
}

/// Where an nbd node's export is, read as QEMU's nbd driver reads its
/// options (with its messages).
fn nbd_address(node: &Spec) -> Result<diskit_nbd::client::uri::NbdUri> {
    use diskit_nbd::client::uri::{Address, DEFAULT_PORT, NbdUri};
    let server = ["server.type", "server.path", "server.host", "server.port"]
        .iter()
        .any(|k| node.has(k));
    let legacy = ["path", "host", "port"].iter().any(|k| node.has(k));
    if let Some(uri) = node.get("filename") {
        if server || legacy || node.has("export") {
            return Err(Error::invalid(
                "host/port/export/path and a file name may not be used at the same time",
            ));
        }
        return NbdUri::parse(uri);
    }
    let export = node.get("export").unwrap_or("");
    let port = |v: Option<&str>| -> Result<u16> {
        match v {
            None => Ok(DEFAULT_PORT),
            Some(p) => p
                .parse()
                .map_err(|_| Error::invalid(format!("Parameter 'port' expects a port, not '{p}'"))),
        }
    };
    let address = if server {
        if legacy {
            return Err(Error::invalid(
                "Cannot use 'server' and path/host/port at the same time",
            ));
        }
        let missing = |k: &str| Error::invalid(format!("Parameter '{k}' is missing"));
        let unexpected = |k: &str| Error::invalid(format!("Parameter '{k}' is unexpected"));
        match node.get("server.type") {
            Some("unix") => {
                if let Some(k) = ["server.host", "server.port"].iter().find(|k| node.has(k)) {
                    return Err(unexpected(&k["server.".len()..]));
                }
                Address::Unix(
                    node.get("server.path")
                        .ok_or_else(|| missing("path"))?
                        .into(),
                )
            }
            Some("inet") => {
                if node.has("server.path") {
                    return Err(unexpected("path"));
                }
                Address::Tcp {
                    host: node
                        .get("server.host")
                        .ok_or_else(|| missing("host"))?
                        .into(),
                    port: port(Some(
                        node.get("server.port").ok_or_else(|| missing("port"))?,
                    ))?,
                }
            }
            Some(other) => {
                return Err(Error::invalid(format!(
                    "Parameter 'type' does not accept value '{other}'"
                )));
            }
            None => return Err(missing("type")),
        }
    } else if let Some(path) = node.get("path") {
        if node.has("host") || node.has("port") {
            return Err(Error::invalid(
                "path and host may not be used at the same time",
            ));
        }
        Address::Unix(path.into())
    } else if let Some(host) = node.get("host") {
        Address::Tcp {
            host: host.into(),
            port: port(node.get("port"))?,
        }
    } else {
        return Err(Error::invalid("NBD server address missing"));
    };
    Ok(NbdUri::plain(address, export))
}

/// The keys of QEMU's http and https drivers that diskit takes.
const HTTP_KEYS: &[&str] = &[
    "filename",
    "url",
    "sslverify",
    "cookie",
    "timeout",
    "username",
];

/// A URL (read-only), as QEMU's curl drivers: `url` (or the whole name),
/// `sslverify`, `cookie`, `timeout` (seconds), `username`.
fn open_http(node: &Spec, mode: StorageOptions) -> Result<StorageRef> {
    let url = match node.get("url") {
        Some(u) => u.to_string(),
        None => filename(node, "http")?,
    };
    let mut opts = diskit_http::HttpOptions::default();
    for (key, ours) in [
        ("sslverify", "sslverify"),
        ("cookie", "cookie"),
        ("timeout", "timeout"),
        ("username", "user"),
    ] {
        if let Some(v) = node.get(key) {
            opts.set(ours, v)?;
        }
    }
    if mode.connections > 0 {
        opts.connections = (mode.connections * 4).clamp(4, 64);
    }
    Ok(Arc::new(diskit_http::HttpDevice::open(&url, &opts)?))
}

/// QEMU's null-co: `size` (default 1 GiB) and `read-zeroes` (default off:
/// its contents are reported unknown, though diskit reads zeros anyway).
fn open_null(node: &Spec, _mode: StorageOptions) -> Result<StorageRef> {
    let size = match node.get("size") {
        Some(s) => size_value("size", s)?,
        None => 1 << 30,
    };
    let zeroes = match node.get("read-zeroes") {
        Some(v) => bool_value("read-zeroes", v)?,
        None => false,
    };
    let dev = if zeroes {
        NullDevice::new(size)
    } else {
        NullDevice::unknown_contents(size)
    };
    // QEMU names it null-co:// only while nothing but its name is set.
    let plain = node
        .keys()
        .all(|k| k == "driver" || (k == "filename" && node.get(k) == Some("null-co://")));
    Ok(Arc::new(if plain {
        dev
    } else {
        let mut named = node.clone();
        if !named.has("driver") {
            named.set("driver", crate::spec::Value::Str("null-co".into()));
        }
        dev.named(named.qemu_json_name())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_select_protocols() {
        assert_eq!(for_name("/a/b.img").unwrap().name, "file");
        assert_eq!(for_name("./a:b").unwrap().name, "file");
        assert_eq!(for_name("file:a:b").unwrap().name, "file");
        assert_eq!(for_name("null-co://").unwrap().name, "null-co");
        assert_eq!(for_name("http://h/x").unwrap().name, "http");
        assert_eq!(for_name("https://h/x").unwrap().name, "https");
        assert_eq!(for_name("s3://b/k").unwrap().name, "s3");
        let e = for_name("gopher://x").unwrap_err();
        assert!(e.to_string().contains("'gopher'"), "{e}");
    }
}
