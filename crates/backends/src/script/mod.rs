//! nbdkit's script plugins: `sh` (one executable answers every method:
//! `script METHOD ARGS...`) and `eval` (a shell snippet per method, given
//! on the command line). Both speak nbdkit's sh-plugin protocol (see
//! [`run`]) and are served through [`crate::callbacks::CallbackDevice`].
//!
//! Each script call is a new process, as nbdkit makes it; the script keeps
//! its state in the directory `$tmpdir`, made at start-up and removed at
//! exit. The script's thread model is its `thread_model` answer
//! (`serialize_all_requests` when it gives none).

pub mod run;

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use diskit_core::size::parse_size;
use diskit_core::{BlockSizeLimits, Error, ErrorKind, ExportEntry, Result, ZeroFlags};

use crate::callbacks::{Callbacks, Can, EXTENT_HOLE, EXTENT_ZERO, Support, ThreadModel};
use run::{Answer, Status};

/// The methods nbdkit's eval plugin takes as keys.
pub const EVAL_METHODS: &[&str] = &[
    "after_fork",
    "cache",
    "can_cache",
    "can_extents",
    "can_fast_zero",
    "can_flush",
    "can_fua",
    "can_multi_conn",
    "can_trim",
    "can_write",
    "can_zero",
    "close",
    "config",
    "config_complete",
    "default_export",
    "dump_plugin",
    "export_description",
    "extents",
    "flush",
    "get_ready",
    "get_size",
    "is_rotational",
    "list_exports",
    "missing",
    "open",
    "pread",
    "preconnect",
    "pwrite",
    "thread_model",
    "trim",
    "unload",
    "zero",
];

/// Where a method's script is.
enum Scripts {
    /// nbdkit's sh plugin: one script for everything.
    One(PathBuf),
    /// nbdkit's eval plugin: a script per method given, `missing` for the
    /// others.
    PerMethod(BTreeMap<String, PathBuf>),
}

/// A script plugin, configured and ready.
pub struct ScriptPlugin {
    scripts: Scripts,
    tmpdir: tempfile::TempDir,
    model: ThreadModel,
    /// "sh" or "eval", for messages about the plugin itself.
    plugin: &'static str,
}

impl ScriptPlugin {
    /// nbdkit's sh plugin: `script` (a file, or `-` for a script read from
    /// standard input), then the script's own parameters in command-line
    /// order; a bare value (key `script`) goes to the script's magic
    /// config key.
    pub fn sh(script: &str, params: &[(String, String)]) -> Result<ScriptPlugin> {
        let tmpdir = make_tmpdir()?;
        let path = if script == "-" {
            inline_script(tmpdir.path())?
        } else {
            fs::canonicalize(script).map_err(|e| {
                let e = Error::from(e);
                Error::new(e.kind(), format!("realpath: {script}: {}", e.detail()))
            })?
        };
        let mut p = ScriptPlugin {
            scripts: Scripts::One(path),
            tmpdir,
            model: ThreadModel::SerializeAllRequests,
            plugin: "sh",
        };
        p.expect_done_or_missing("load", &[])?;
        let magic = match p.call("magic_config_key", &[], b"")? {
            a if a.status == Status::Done => Some(a.text()),
            a => p.not_false("magic_config_key", &a).map(|_| None)?,
        };
        for (k, v) in params {
            let key = if k == "script" {
                magic.as_deref().ok_or_else(|| {
                    Error::invalid(format!(
                        "{}: expecting key=value on the command line but got: {v}",
                        p.script_name("config")
                    ))
                })?
            } else {
                k
            };
            let a = p.call("config", &[key, v], b"")?;
            if a.status == Status::Missing {
                return Err(Error::invalid(format!(
                    "{}: this plugin does not need command line configuration",
                    p.script_name("config")
                )));
            }
            p.not_false("config", &a)?;
        }
        p.get_ready()?;
        Ok(p)
    }

    /// nbdkit's eval plugin: `METHOD=SCRIPT` for each method given, any
    /// other key a parameter for the `config` method, in command-line
    /// order.
    pub fn eval(params: &[(String, String)]) -> Result<ScriptPlugin> {
        let tmpdir = make_tmpdir()?;
        let mut methods = BTreeMap::new();
        methods.insert(
            "missing".to_string(),
            write_script(tmpdir.path(), "missing", "exit 2")?,
        );
        let mut given = std::collections::BTreeSet::new();
        let mut p = ScriptPlugin {
            scripts: Scripts::PerMethod(methods),
            tmpdir,
            model: ThreadModel::SerializeAllRequests,
            plugin: "eval",
        };
        for (k, v) in params {
            if EVAL_METHODS.contains(&k.as_str()) {
                if !given.insert(k.clone()) {
                    return Err(Error::invalid(format!(
                        "method {k} defined more than once on the command line"
                    )));
                }
                p.add_method(k, v)?;
                continue;
            }
            let a = p.call("config", &[k, v], b"")?;
            if a.status == Status::Missing {
                return Err(Error::invalid(format!(
                    "{}: callback '{k}' is unknown, and there is no 'config' callback to \
                     handle it",
                    p.script_name("config")
                )));
            }
            p.not_false("config", &a)?;
        }
        // The can_* answers nbdkit's server would give a C plugin with
        // these methods.
        for (method, can, body) in [
            ("pwrite", "can_write", "exit 0"),
            ("flush", "can_flush", "exit 0"),
            ("trim", "can_trim", "exit 0"),
            ("zero", "can_zero", "exit 0"),
            ("extents", "can_extents", "exit 0"),
            ("cache", "can_cache", "echo native"),
        ] {
            if given.contains(method) && !given.contains(can) {
                p.add_method(can, body)?;
            }
        }
        p.get_ready()?;
        Ok(p)
    }

    fn add_method(&mut self, method: &str, body: &str) -> Result<()> {
        let path = write_script(self.tmpdir.path(), method, body)?;
        if let Scripts::PerMethod(m) = &mut self.scripts {
            m.insert(method.to_string(), path);
        }
        Ok(())
    }

    /// `config_complete`, `thread_model`, `get_ready` and `after_fork`, as
    /// nbdkit calls them before it serves (diskit does not fork: the
    /// script's after-fork set-up runs here).
    fn get_ready(&mut self) -> Result<()> {
        self.expect_done_or_missing("config_complete", &[])?;
        let a = self.call("thread_model", &[], b"")?;
        self.model = match a.status {
            Status::Done => {
                ThreadModel::parse(a.text().trim()).unwrap_or(ThreadModel::SerializeAllRequests)
            }
            Status::Missing => ThreadModel::SerializeAllRequests,
            Status::False => return Err(self.unexpected_false("thread_model")),
        };
        self.expect_done_or_missing("get_ready", &[])?;
        self.expect_done_or_missing("after_fork", &[])
    }

    /// The script that answers `method`.
    fn script_for(&self, method: &str) -> &Path {
        match &self.scripts {
            Scripts::One(p) => p,
            Scripts::PerMethod(m) => m.get(method).unwrap_or_else(|| &m["missing"]),
        }
    }

    fn script_name(&self, method: &str) -> String {
        self.script_for(method).display().to_string()
    }

    /// Calls `method` with `args`, `input` on its standard input.
    fn call(&self, method: &str, args: &[&str], input: &[u8]) -> Result<Answer> {
        let mut argv = Vec::with_capacity(args.len() + 1);
        argv.push(method);
        argv.extend_from_slice(args);
        run::call(self.script_for(method), &argv, input, self.tmpdir.path())
    }

    fn unexpected_false(&self, method: &str) -> Error {
        Error::io(format!(
            "{}: {method} method returned unexpected code (3/false)",
            self.script_name(method)
        ))
    }

    /// An answer other than false.
    fn not_false(&self, method: &str, a: &Answer) -> Result<()> {
        if a.status == Status::False {
            Err(self.unexpected_false(method))
        } else {
            Ok(())
        }
    }

    fn expect_done_or_missing(&self, method: &str, args: &[&str]) -> Result<()> {
        let a = self.call(method, args, b"")?;
        self.not_false(method, &a)
    }

    /// A method the plugin needs: its answer when done.
    fn required(&self, method: &str, args: &[&str]) -> Result<Answer> {
        let a = self.call(method, args, b"")?;
        match a.status {
            Status::Done => Ok(a),
            Status::Missing => Err(Error::io(format!(
                "{}: the {method} method is required",
                self.script_name(method)
            ))),
            Status::False => Err(self.unexpected_false(method)),
        }
    }

    /// A `none`/`emulate`/`native` answer.
    fn support(&self, method: &str, h: &str) -> Result<Option<Support>> {
        let a = self.call(method, &[h], b"")?;
        match a.status {
            Status::Done => {
                let t = a.text();
                Support::parse(&t).map(Some).ok_or_else(|| {
                    Error::io(format!(
                        "{}: could not parse output from {method} method: {t}",
                        self.script_name(method)
                    ))
                })
            }
            Status::Missing => Ok(None),
            Status::False => Err(self.unexpected_false(method)),
        }
    }

    /// A request that may be missing (then nothing is done).
    fn optional_request(&self, method: &str, args: &[&str], input: &[u8]) -> Result<Status> {
        let a = self.call(method, args, input)?;
        self.not_false(method, &a)?;
        Ok(a.status)
    }
}

impl Drop for ScriptPlugin {
    fn drop(&mut self) {
        // Errors of unload are ignored, as nbdkit ignores them.
        let _ = self.call("unload", &[], b"");
    }
}

/// nbdkit's flags words: `fua`, `may_trim`, `fast`, comma-separated.
fn flags_word(fua: bool, may_trim: bool, fast: bool) -> String {
    [(fua, "fua"), (may_trim, "may_trim"), (fast, "fast")]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, w)| *w)
        .collect::<Vec<_>>()
        .join(",")
}

/// A size as nbdkit's `nbdkit_parse_size` reads it.
fn size_of(who: &str, method: &str, text: &str) -> Result<u64> {
    parse_size(text.trim()).map_err(|_| {
        Error::io(format!(
            "{who}: could not parse output from {method} method: {text}"
        ))
    })
}

impl Callbacks for ScriptPlugin {
    type Handle = String;

    fn name(&self) -> String {
        self.plugin.to_string()
    }
    fn thread_model(&self) -> ThreadModel {
        self.model
    }
    fn open(&self, readonly: bool, export: &str, tls: bool) -> Result<String> {
        let a = self.call("open", &[bool_word(readonly), export, bool_word(tls)], b"")?;
        match a.status {
            Status::Done => Ok(a.text()),
            Status::Missing => Ok(String::new()),
            Status::False => Err(self.unexpected_false("open")),
        }
    }
    fn close(&self, h: &String) {
        let _ = self.call("close", &[h], b"");
    }
    fn get_size(&self, h: &String) -> Result<u64> {
        let t = self.required("get_size", &[h])?.text();
        size_of(&self.script_name("get_size"), "get_size", &t)
    }
    fn block_size(&self, h: &String) -> Result<Option<BlockSizeLimits>> {
        let a = self.call("block_size", &[h], b"")?;
        match a.status {
            Status::Done => {}
            Status::Missing => return Ok(None),
            Status::False => return Err(self.unexpected_false("block_size")),
        }
        let t = a.text();
        let sizes: Vec<u32> = t
            .split_ascii_whitespace()
            .take(3)
            .map(|w| parse_size(w).ok().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<_>>()
            .filter(|v: &Vec<u32>| v.len() == 3)
            .ok_or_else(|| {
                Error::io(format!(
                    "{}: block_size method cannot be parsed",
                    self.script_name("block_size")
                ))
            })?;
        Ok(Some(BlockSizeLimits {
            minimum: sizes[0],
            preferred: sizes[1],
            maximum: sizes[2],
        }))
    }
    fn can(&self, h: &String, what: Can) -> Result<Option<bool>> {
        Ok(match self.call(what.method(), &[h], b"")?.status {
            Status::Done => Some(true),
            Status::False => Some(false),
            Status::Missing => None,
        })
    }
    fn can_fua(&self, h: &String) -> Result<Option<Support>> {
        self.support("can_fua", h)
    }
    fn can_cache(&self, h: &String) -> Result<Option<Support>> {
        self.support("can_cache", h)
    }
    fn pread(&self, h: &String, buf: &mut [u8], offset: u64) -> Result<()> {
        let (count, at) = (buf.len().to_string(), offset.to_string());
        let a = self.required("pread", &[h, &count, &at])?;
        if a.out.len() != buf.len() {
            return Err(Error::io(format!(
                "{}: incorrect amount of data read: expecting {} bytes but received {} \
                 bytes from the script",
                self.script_name("pread"),
                buf.len(),
                a.out.len()
            )));
        }
        buf.copy_from_slice(&a.out);
        Ok(())
    }
    fn pwrite(&self, h: &String, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let (count, at) = (buf.len().to_string(), offset.to_string());
        let flags = flags_word(fua, false, false);
        match self.optional_request("pwrite", &[h, &count, &at, &flags], buf)? {
            Status::Missing => Err(Error::io("pwrite not implemented")),
            _ => Ok(()),
        }
    }
    fn flush(&self, h: &String) -> Result<()> {
        self.optional_request("flush", &[h], b"").map(|_| ())
    }
    fn trim(&self, h: &String, offset: u64, len: u64, fua: bool) -> Result<()> {
        let (count, at) = (len.to_string(), offset.to_string());
        let flags = flags_word(fua, false, false);
        self.optional_request("trim", &[h, &count, &at, &flags], b"")
            .map(|_| ())
    }
    fn zero(&self, h: &String, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let (count, at) = (len.to_string(), offset.to_string());
        let words = flags_word(flags.fua, flags.may_trim, flags.fast);
        match self.optional_request("zero", &[h, &count, &at, &words], b"")? {
            // The server writes zeros instead.
            Status::Missing => Err(Error::from_kind(ErrorKind::NotSupported)),
            _ => Ok(()),
        }
    }
    fn extents(
        &self,
        h: &String,
        offset: u64,
        len: u64,
        req_one: bool,
    ) -> Result<Vec<(u64, u64, u32)>> {
        let (count, at) = (len.to_string(), offset.to_string());
        let flags = if req_one { "req_one" } else { "" };
        let text = self.required("extents", &[h, &count, &at, flags])?.text();
        let who = self.script_name("extents");
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| parse_extent(&who, l))
            .collect()
    }
    fn cache(&self, h: &String, offset: u64, len: u64) -> Result<()> {
        let (count, at) = (len.to_string(), offset.to_string());
        self.optional_request("cache", &[h, &count, &at], b"")
            .map(|_| ())
    }
    fn list_exports(&self, readonly: bool, tls: bool) -> Result<Option<Vec<ExportEntry>>> {
        let a = self.call("list_exports", &[bool_word(readonly), bool_word(tls)], b"")?;
        match a.status {
            Status::Done => Ok(Some(parse_exports(&String::from_utf8_lossy(&a.out)))),
            Status::Missing => Ok(None),
            Status::False => Err(self.unexpected_false("list_exports")),
        }
    }
    fn default_export(&self, readonly: bool, tls: bool) -> Result<Option<String>> {
        let a = self.call(
            "default_export",
            &[bool_word(readonly), bool_word(tls)],
            b"",
        )?;
        match a.status {
            Status::Done => {
                // Any of list_exports' forms: the first name listed.
                let out = String::from_utf8_lossy(&a.out);
                let rest = ["INTERLEAVED\n", "NAMES+DESCRIPTIONS\n", "NAMES\n"]
                    .iter()
                    .find_map(|m| out.strip_prefix(m))
                    .unwrap_or(&out);
                Ok(Some(rest.split('\n').next().unwrap_or("").to_string()))
            }
            Status::Missing => Ok(None),
            Status::False => Err(self.unexpected_false("default_export")),
        }
    }
    fn preconnect(&self, readonly: bool) -> Result<()> {
        let a = self.call("preconnect", &[bool_word(readonly)], b"")?;
        self.not_false("preconnect", &a)
    }
    fn export_description(&self, h: &String) -> Result<Option<String>> {
        let a = self.call("export_description", &[h], b"")?;
        match a.status {
            Status::Done => Ok(Some(a.text())),
            Status::Missing => Ok(None),
            Status::False => Err(self.unexpected_false("export_description")),
        }
    }
}

/// A `list_exports` answer, in the form its first line names (nbdkit's
/// sh-plugin protocol): `INTERLEAVED` (a name line, then its description
/// line), `NAMES+DESCRIPTIONS` (the names, then as many descriptions), or
/// `NAMES` (also assumed when the first line names no form): one name per
/// line. Only whole lines (ending in a newline) count as names; a
/// description line without one is empty, as nbdkit reads them.
fn parse_exports(out: &str) -> Vec<ExportEntry> {
    // The lines that end in a newline.
    let whole = |s: &str| -> Vec<String> {
        let mut v: Vec<String> = s.split('\n').map(str::to_string).collect();
        v.pop();
        v
    };
    if let Some(rest) = out.strip_prefix("INTERLEAVED\n") {
        return whole(rest)
            .chunks(2)
            .map(|pair| {
                ExportEntry::new(
                    pair[0].clone(),
                    Some(pair.get(1).cloned().unwrap_or_default()),
                )
            })
            .collect();
    }
    if let Some(rest) = out.strip_prefix("NAMES+DESCRIPTIONS\n") {
        let lines = whole(rest);
        let half = lines.len().div_ceil(2);
        return (0..half)
            .map(|i| {
                let desc = lines.get(half + i).cloned().unwrap_or_default();
                ExportEntry::new(lines[i].clone(), Some(desc))
            })
            .collect();
    }
    let rest = out.strip_prefix("NAMES\n").unwrap_or(out);
    whole(rest)
        .into_iter()
        .map(|n| ExportEntry::new(n, None))
        .collect()
}

fn bool_word(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

/// One line of an `extents` answer: `OFFSET LENGTH [TYPE]`, TYPE a number
/// or words containing `hole` and `zero`.
fn parse_extent(who: &str, line: &str) -> Result<(u64, u64, u32)> {
    let bad = || Error::io(format!("{who}: extents: cannot parse {line}"));
    let mut words = line.split([' ', '\t']).filter(|w| !w.is_empty());
    let offset = parse_size(words.next().ok_or_else(bad)?).map_err(|_| bad())?;
    let length = parse_size(words.next().ok_or_else(bad)?).map_err(|_| bad())?;
    let kind = match words.next() {
        None => 0,
        Some(w) => w.parse::<u32>().unwrap_or_else(|_| {
            let hole = if w.contains("hole") { EXTENT_HOLE } else { 0 };
            let zero = if w.contains("zero") { EXTENT_ZERO } else { 0 };
            hole | zero
        }),
    };
    Ok((offset, length, kind))
}

/// The directory the script keeps its state in (`$tmpdir`).
fn make_tmpdir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("nbdkit")
        .tempdir_in(std::env::temp_dir())
        .map_err(|e| Error::io(format!("mkdtemp: {}: {e}", std::env::temp_dir().display())))
}

/// A method's snippet as an executable file in `dir`, as nbdkit's eval
/// plugin writes it (no shebang: it runs under /bin/sh).
fn write_script(dir: &Path, method: &str, body: &str) -> Result<PathBuf> {
    if method.contains(['.', '/']) {
        return Err(Error::invalid(format!("method name {method} is invalid")));
    }
    let path = dir.join(method);
    let mut text = body.to_string();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    let _ = fs::remove_file(&path);
    fs::write(&path, text).map_err(|e| Error::io(format!("fopen: {}: {e}", path.display())))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o500))
        .map_err(|e| Error::io(format!("fchmod: {}: {e}", path.display())))?;
    Ok(path)
}

/// `sh -`: the script read from standard input.
fn inline_script(dir: &Path) -> Result<PathBuf> {
    let mut body = Vec::new();
    std::io::stdin()
        .read_to_end(&mut body)
        .map_err(|_| Error::io("sh: failed to copy inline script to temporary file"))?;
    let path = dir.join("inline-script.sh");
    fs::write(&path, &body)
        .and_then(|()| fs::set_permissions(&path, fs::Permissions::from_mode(0o500)))
        .map_err(|_| Error::io("sh: failed to copy inline script to temporary file"))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_lines_take_numbers_or_words() {
        assert_eq!(parse_extent("s", "0 1M").unwrap(), (0, 1 << 20, 0));
        assert_eq!(
            parse_extent("s", "1M\t9M hole,zero").unwrap(),
            (1 << 20, 9 << 20, 3)
        );
        assert_eq!(parse_extent("s", "0 512 2").unwrap(), (0, 512, 2));
        assert!(parse_extent("s", "x 1").is_err());
        assert!(parse_extent("s", "0").is_err());
    }

    #[test]
    fn export_lists_read_in_each_form() {
        let names = |v: Vec<ExportEntry>| {
            v.into_iter()
                .map(|e| (e.name, e.description))
                .collect::<Vec<_>>()
        };
        let s = |x: &str| x.to_string();
        assert_eq!(
            names(parse_exports("a\nb\nunfinished")),
            [(s("a"), None), (s("b"), None)]
        );
        assert_eq!(names(parse_exports("NAMES\nx\n")), [(s("x"), None)]);
        assert_eq!(
            names(parse_exports("INTERLEAVED\na\nfirst\nb\nsecond\n")),
            [(s("a"), Some(s("first"))), (s("b"), Some(s("second")))]
        );
        assert_eq!(
            names(parse_exports("NAMES+DESCRIPTIONS\na\nb\nfirst\nsecond\n")),
            [(s("a"), Some(s("first"))), (s("b"), Some(s("second")))]
        );
        assert!(parse_exports("").is_empty());
    }

    #[test]
    fn flags_words_are_nbdkit_s() {
        assert_eq!(flags_word(false, false, false), "");
        assert_eq!(flags_word(true, true, true), "fua,may_trim,fast");
        assert_eq!(flags_word(false, true, false), "may_trim");
    }
}
