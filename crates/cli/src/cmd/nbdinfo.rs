//! `diskit nbdinfo`: what an NBD server exports, as libnbd's nbdinfo shows
//! it (human and `--json`), with `--size`, `--map`, `--totals`, `--list`,
//! `--can` and `--is` (exit 0 true, 2 false).

use std::io::Write;
use std::process::{Command, Stdio};

use crate::CmdResult;
use crate::util::CliError;
use diskit_core::BlockDevice;
use diskit_nbd::client::NbdClient;
use diskit_nbd::client::command::{self, Subprocess};
use diskit_nbd::client::handshake::ExportInfo;
use diskit_nbd::client::probe::{Probe, ProbeError};
use diskit_nbd::client::tls::ClientTls;
use diskit_nbd::client::uri::{Address, NbdUri};
use diskit_nbd::proto::consts::*;

/// Arguments of `nbdinfo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// JSON output.
    #[arg(long = "json")]
    json: bool,
    /// Print only the export's size.
    #[arg(long = "size")]
    size: bool,
    /// Print the map of a metadata context (default base:allocation).
    #[arg(long = "map", num_args = 0..=1, default_missing_value = "base:allocation", require_equals = true)]
    map: Option<String>,
    /// With --map: totals per type instead of the map.
    #[arg(long = "totals")]
    totals: bool,
    /// List every export.
    #[arg(short = 'L', long = "list")]
    list: bool,
    /// Exit 0 if the export can do this (flush, fua, trim, zero, ...), 2 if not.
    #[arg(long = "can")]
    can: Option<String>,
    /// Exit 0 if the export is this (read-only, rotational), 2 if not.
    #[arg(long = "is")]
    is: Option<String>,
    /// Do not guess the content with file(1).
    #[arg(long = "no-content")]
    no_content: bool,
    /// Guess the content with file(1) (the default, but for --list).
    #[arg(long = "content", overrides_with = "no_content")]
    content: bool,
    /// The NBD URI, or `[ CMD ARGS ... ]`: a server run for the query
    /// with socket activation.
    #[arg(trailing_var_arg = true, num_args = 1.., required = true, value_name = "URI")]
    target: Vec<String>,
    /// The URI queried (of the server started, for `[ CMD ]`).
    #[arg(skip)]
    uri: String,
}

/// Resolves the target: a URI as it is, or a server started for the
/// query (kept running until the returned handle is dropped).
fn resolve(target: &[String]) -> Result<(String, Option<Subprocess>), CliError> {
    match target {
        [uri] if uri != "[" => Ok((uri.clone(), None)),
        [open, argv @ .., close] if open == "[" && close == "]" && !argv.is_empty() => {
            let sub = command::start(argv).map_err(err)?;
            let uri = format!("nbd+unix:///?socket={}", sub.socket().display());
            Ok((uri, Some(sub)))
        }
        _ => Err(CliError::new(
            "nbdinfo: expected one NBD URI or [ CMD ARGS ... ]",
        )),
    }
}

fn err(e: diskit_core::Error) -> CliError {
    CliError::new(format!("nbdinfo: {e}"))
}

/// Everything shown about one export.
struct Export {
    name: String,
    /// "oldstyle", "newstyle" or "newstyle-fixed".
    protocol: &'static str,
    /// Whether the connection was encrypted.
    tls: bool,
    info: ExportInfo,
    structured: bool,
    contexts: Vec<String>,
    content: Option<String>,
    uri: String,
}

/// libnbd's URI for an export (nbdinfo prints it).
fn export_uri(u: &NbdUri, export: &str) -> String {
    let s = if u.tls { "s" } else { "" };
    match &u.address {
        Address::Unix(path) => format!("nbd{s}+unix:///{export}?socket={path}"),
        Address::Tcp { host, port } => format!("nbd{s}://{host}:{port}/{export}"),
    }
}

/// Connects and greets (TLS started when the URI asks), in libnbd's
/// words for a server that cannot be reached.
fn open(u: &NbdUri, tls: Option<&ClientTls>) -> Result<Probe, CliError> {
    Probe::connect(u, tls).map_err(|e| match e {
        ProbeError::Connect(e) => {
            CliError::new(format!("nbdinfo: nbd_connect_uri: connect: {}", e.detail()))
        }
        ProbeError::Talk(e) => err(e),
    })
}

/// Connects and negotiates up to GO on `export`, listing its contexts.
fn inspect(u: &NbdUri, tls: Option<&ClientTls>, export: &str) -> Result<Export, CliError> {
    let r = open(u, tls)?.inspect(export).map_err(err)?;
    Ok(Export {
        name: r.name,
        protocol: r.protocol,
        tls: r.tls,
        info: r.info,
        structured: r.structured,
        contexts: r.contexts,
        content: None,
        uri: export_uri(u, export),
    })
}

/// What file(1) says of the first bytes, as nbdinfo's content line.
fn content(uri: &str) -> Option<String> {
    let c = NbdClient::connect(uri).ok()?;
    let n = c.size().min(1 << 20) as usize;
    let mut buf = vec![0u8; n];
    c.read_at(&mut buf, 0).ok()?;
    let mut child = Command::new("file")
        .args(["-b", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    // file may stop reading early: a broken pipe is fine.
    let _ = stdin.write_all(&buf);
    drop(stdin);
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(text.lines().next()?.trim().to_string())
}

/// libnbd's human size: exact multiples of 1024 get a suffix.
fn human(n: u64) -> String {
    let mut v = n;
    let mut i = 0;
    const UNITS: [&str; 7] = ["", "K", "M", "G", "T", "P", "E"];
    while v != 0 && v.is_multiple_of(1024) && i < 6 {
        v /= 1024;
        i += 1;
    }
    format!("{v}{}", UNITS[i])
}

/// The boolean facts nbdinfo lists, in its order.
fn facts(flags: u16, structured: bool) -> Vec<(&'static str, bool)> {
    let f = |b: u16| flags & b != 0;
    vec![
        ("is_rotational", f(TFLAG_ROTATIONAL)),
        ("is_read_only", f(TFLAG_READ_ONLY)),
        ("can_cache", f(TFLAG_SEND_CACHE)),
        ("can_df", structured && f(TFLAG_SEND_DF)),
        ("can_fast_zero", f(TFLAG_SEND_FAST_ZERO)),
        ("can_flush", f(TFLAG_SEND_FLUSH)),
        ("can_fua", f(TFLAG_SEND_FUA)),
        ("can_multi_conn", f(TFLAG_CAN_MULTI_CONN)),
        ("can_trim", f(TFLAG_SEND_TRIM)),
        ("can_zero", f(TFLAG_SEND_WRITE_ZEROES)),
    ]
}

fn protocol_line(e: &Export) -> String {
    format!(
        "protocol: {} {} TLS, using {} packets\n",
        e.protocol,
        if e.tls { "with" } else { "without" },
        if e.structured { "structured" } else { "simple" }
    )
}

fn print_human(e: &Export) -> String {
    let mut o = format!("export=\"{}\":\n", e.name);
    if let Some(d) = &e.info.description {
        o += &format!("\tdescription: {d}\n");
    }
    let size = e.info.size;
    let h = human(size);
    if h == size.to_string() {
        o += &format!("\texport-size: {size}\n");
    } else {
        o += &format!("\texport-size: {size} ({h})\n");
    }
    if let Some(c) = &e.content {
        o += &format!("\tcontent: {c}\n");
    }
    o += &format!("\turi: {}\n", e.uri);
    if !e.contexts.is_empty() {
        o += "\tcontexts:\n";
        for c in &e.contexts {
            o += &format!("\t\t{c}\n");
        }
    }
    for (k, v) in facts(e.info.flags, e.structured) {
        o += &format!("\t{k}: {v}\n");
    }
    if let Some((min, pref, max)) = e.info.block_size {
        o += &format!(
            "\tblock_size_minimum: {min}\n\tblock_size_preferred: {pref}\n\tblock_size_maximum: {max}\n"
        );
    }
    o
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o += "\\\"",
            '\\' => o += "\\\\",
            c if (c as u32) < 0x20 => o += &format!("\\u{:04x}", c as u32),
            c => o.push(c),
        }
    }
    o + "\""
}

fn print_json_export(e: &Export) -> String {
    let mut lines = vec![format!("\t\"export-name\": {}", json_str(&e.name))];
    if let Some(d) = &e.info.description {
        lines.push(format!("\t\"description\": {}", json_str(d)));
    }
    if let Some(c) = &e.content {
        lines.push(format!("\t\"content\": {}", json_str(c)));
    }
    lines.push(format!("\t\"uri\": {}", json_str(&e.uri)));
    if !e.contexts.is_empty() {
        let items: Vec<String> = e
            .contexts
            .iter()
            .map(|c| format!("\t\t{}", json_str(c)))
            .collect();
        lines.push(format!("\t\"contexts\": [\n{}\n\t]", items.join(",\n")));
    }
    for (k, v) in facts(e.info.flags, e.structured) {
        lines.push(format!("\t\"{k}\": {v}"));
    }
    if let Some((min, pref, max)) = e.info.block_size {
        lines.push(format!("\t\"block_size_minimum\": {min}"));
        lines.push(format!("\t\"block_size_preferred\": {pref}"));
        lines.push(format!("\t\"block_size_maximum\": {max}"));
    }
    lines.push(format!("\t\"export-size\": {}", e.info.size));
    lines.push(format!(
        "\t\"export-size-str\": {}",
        json_str(&human(e.info.size))
    ));
    format!("\t{{\n{}\n\t}}", lines.join(",\n"))
}

fn print_json(exports: &[Export]) -> String {
    let structured = exports.first().is_some_and(|e| e.structured);
    let protocol = exports.first().map_or("newstyle-fixed", |e| e.protocol);
    let tls = exports.first().is_some_and(|e| e.tls);
    let body: Vec<String> = exports.iter().map(print_json_export).collect();
    format!(
        "{{\n\"protocol\": \"{protocol}\",\n\"TLS\": {tls},\n\"structured\": {structured},\n\"exports\": [\n{} ]\n}}\n",
        body.join(",\n")
    )
}

/// How nbdinfo describes a state of `context`.
fn describe(context: &str, flags: u32) -> String {
    match context {
        "base:allocation" => match flags {
            0 => "data".into(),
            1 => "hole".into(),
            2 => "zero".into(),
            3 => "hole,zero".into(),
            _ => format!("{flags}"),
        },
        "qemu:allocation-depth" => match flags {
            0 => "absent".into(),
            1 => "local".into(),
            n => format!("backing depth {n}"),
        },
        c if c.starts_with("qemu:dirty-bitmap:") => match flags {
            0 => "clean".into(),
            1 => "dirty".into(),
            _ => format!("{flags}"),
        },
        _ => String::new(),
    }
}

fn map(a: &Args, context: &str) -> CmdResult {
    let c = NbdClient::connect_with(&a.uri, &[context]).map_err(err)?;
    let size = c.size();
    let mut runs: Vec<(u64, u64, u32)> = Vec::new();
    let mut pos = 0;
    while pos < size {
        let got = c.block_status(context, pos, size - pos).map_err(err)?;
        for (len, flags) in got {
            match runs.last_mut() {
                Some(last) if last.2 == flags && last.0 + last.1 == pos => last.1 += len,
                _ => runs.push((pos, len, flags)),
            }
            pos += len;
        }
    }
    let mut out = String::new();
    if a.totals {
        let mut types: Vec<u32> = runs.iter().map(|r| r.2).collect();
        types.sort_unstable();
        types.dedup();
        let totals: Vec<(u32, u64)> = types
            .iter()
            .map(|&t| (t, runs.iter().filter(|r| r.2 == t).map(|r| r.1).sum()))
            .collect();
        let pct = |n: u64| {
            if size == 0 {
                0.0
            } else {
                n as f64 * 100.0 / size as f64
            }
        };
        if a.json {
            let items: Vec<String> = totals
                .iter()
                .map(|&(t, n)| {
                    format!(
                        "{{ \"size\": {n}, \"percent\": {}, \"type\": {t}, \"description\": {} }}",
                        json_number(pct(n)),
                        json_str(&describe(context, t))
                    )
                })
                .collect();
            out = format!("[\n{}\n]\n", items.join(",\n"));
        } else {
            for (t, n) in totals {
                out += &format!("{n:>10} {:>5.1}% {t:>3} {}\n", pct(n), describe(context, t));
            }
        }
    } else if a.json {
        let items: Vec<String> = runs
            .iter()
            .map(|&(o, l, t)| {
                format!(
                    "{{ \"offset\": {o}, \"length\": {l}, \"type\": {t}, \"description\": {}}}",
                    json_str(&describe(context, t))
                )
            })
            .collect();
        out = format!("[\n{}\n]\n", items.join(",\n"));
    } else {
        for (o, l, t) in runs {
            out += &format!("{o:>10}  {l:>10}  {t:>3}  {}\n", describe(context, t));
        }
    }
    print!("{out}");
    let _ = c.close();
    Ok(0)
}

/// A percentage as nbdinfo's JSON prints it (an integer when whole).
fn json_number(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{}", v as u64)
    } else {
        format!("{v}")
    }
}

/// `--can X` / `--is X`: the flag it asks about.
/// What `--can` or `--is` asks (libnbd takes the same words for both,
/// in any case).
enum Fact {
    /// connect, read: true once connected.
    Connected,
    /// Structured replies negotiated.
    Structured,
    /// TLS negotiated.
    Tls,
    /// A transmission flag, or its negation (write: not read-only).
    Flag(u16, bool),
}

fn fact(what: &str) -> Result<Fact, CliError> {
    let w = what.to_ascii_lowercase();
    Ok(match w.as_str() {
        "connect" | "read" => Fact::Connected,
        "tls" => Fact::Tls,
        "sr" | "structured" | "structured reply" | "structured-reply" | "structured_reply"
        | "structured replies" | "structured-replies" | "structured_replies" => Fact::Structured,
        "readonly" | "read-only" | "read_only" => Fact::Flag(TFLAG_READ_ONLY, true),
        "write" => Fact::Flag(TFLAG_READ_ONLY, false),
        "rotational" => Fact::Flag(TFLAG_ROTATIONAL, true),
        "cache" => Fact::Flag(TFLAG_SEND_CACHE, true),
        "df" => Fact::Flag(TFLAG_SEND_DF, true),
        "fastzero" | "fast-zero" | "fast_zero" => Fact::Flag(TFLAG_SEND_FAST_ZERO, true),
        "flush" => Fact::Flag(TFLAG_SEND_FLUSH, true),
        "fua" => Fact::Flag(TFLAG_SEND_FUA, true),
        "multiconn" | "multi-conn" | "multi_conn" => Fact::Flag(TFLAG_CAN_MULTI_CONN, true),
        "trim" => Fact::Flag(TFLAG_SEND_TRIM, true),
        "zero" => Fact::Flag(TFLAG_SEND_WRITE_ZEROES, true),
        _ => {
            return Err(CliError::new(format!(
                "nbdinfo: unknown --can or --is option: {what}"
            )));
        }
    })
}

/// Runs `nbdinfo`.
pub fn run(mut a: Args) -> CmdResult {
    let (uri, _server) = resolve(&a.target)?;
    a.uri = uri;
    let u = NbdUri::parse(&a.uri).map_err(err)?;
    let tls = ClientTls::for_uri(&u).map_err(err)?;
    let modes = [
        a.size,
        a.map.is_some(),
        a.list,
        a.can.is_some(),
        a.is.is_some(),
    ];
    if modes.iter().filter(|&&m| m).count() > 1 {
        return Err(CliError::new(
            "nbdinfo: --size, --map, --list, --can and --is cannot be combined",
        ));
    }
    if let Some(ctx) = &a.map {
        return map(&a, ctx);
    }
    if a.size {
        let c = NbdClient::connect(&a.uri).map_err(err)?;
        println!("{}", c.size());
        let _ = c.close();
        return Ok(0);
    }
    if let Some(what) = a.can.as_deref().or(a.is.as_deref()) {
        let fact = fact(what)?;
        let c = NbdClient::connect(&a.uri).map_err(err)?;
        let yes = match fact {
            Fact::Connected => true,
            Fact::Structured => c.structured_replies(),
            Fact::Tls => u.tls,
            Fact::Flag(flag, set) => (c.flags() & flag != 0) == set,
        };
        let _ = c.close();
        return Ok(if yes { 0 } else { 2 });
    }
    let names = if a.list {
        let list = open(&u, tls.as_ref())?.list_exports().map_err(err)?;
        list.into_iter().map(|(n, _)| n).collect()
    } else {
        vec![u.export.clone()]
    };
    let mut exports = Vec::new();
    for name in names {
        let mut e = inspect(&u, tls.as_ref(), &name)?;
        if a.content || (!a.list && !a.no_content) {
            e.content = content(&a.uri);
        }
        exports.push(e);
    }
    let out = if a.json {
        print_json(&exports)
    } else {
        let mut o = exports.first().map(protocol_line).unwrap_or_default();
        for e in &exports {
            o += &print_human(e);
        }
        o
    };
    print!("{out}");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes_as_libnbd() {
        assert_eq!(human(0), "0");
        assert_eq!(human(1000), "1000");
        assert_eq!(human(1536), "1536");
        assert_eq!(human(1 << 20), "1M");
        assert_eq!(human(3 << 30), "3G");
        assert_eq!(human((1 << 30) + 1), "1073741825");
    }
}
