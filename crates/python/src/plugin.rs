//! The script as nbdkit's python plugin presents it to the server: each
//! method of the plugin API is the script's callback of that name, called
//! with nbdkit's arguments (API 1 or 2), its answer checked and converted
//! as nbdkit's python plugin does. What the server does with the answers
//! (a handle per connection, the thread model's locks, FUA, zero and cache
//! emulation, the extents clipped) is diskit's callbacks layer, on the
//! other side of the plugin ABI.

use diskit_core::{Error, ErrorKind, Result};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString, PyTuple};

use crate::lend::lend;
use crate::module::{self, MODE_EMULATE, MODE_NATIVE, MODE_NONE};
use crate::script::Script;

/// nbdkit's default thread model for a script that states none.
const DEFAULT_THREAD_MODEL: i64 = module::THREAD_MODEL_SERIALIZE_ALL_REQUESTS;

/// A loaded, configured script.
pub(crate) struct PythonPlugin {
    script: Script,
    /// The thread model the script chose.
    pub model: i64,
    /// How messages name it.
    pub name: String,
}

/// One handle of the script.
pub(crate) struct Handle {
    /// What `open` returned.
    h: Py<PyAny>,
    /// The export name the client asked for (`nbdkit.export_name()`).
    export: String,
}

impl PythonPlugin {
    /// Loads the script named by the first argument (`script=PATH`), hands
    /// it the others in order (`config(key, value)`), then runs
    /// `config_complete`, `thread_model`, `get_ready` and `after_fork`
    /// (the server has forked already when it opens its plugin).
    pub fn load(args: &[(String, String)]) -> Result<PythonPlugin> {
        let Some(((_, path), rest)) = args.split_first().filter(|((k, _), _)| k == "script") else {
            return Err(Error::invalid(
                "the first parameter must be script=/path/to/python/script.py",
            ));
        };
        let script = Script::load(path)?;
        let model = Python::attach(|py| -> Result<i64> {
            let s = &script;
            for (k, v) in rest {
                if !s.defines(py, "config") {
                    return Err(Error::invalid(format!(
                        "{path}: this plugin does not need command line configuration"
                    )));
                }
                s.call(py, "config", (k, v))?;
            }
            if s.defines(py, "config_complete") {
                s.call(py, "config_complete", ())?;
            }
            let model = if s.defines(py, "thread_model") {
                s.call(py, "thread_model", ())?
                    .extract::<i64>()
                    .map_err(|e| s.error(py, "thread_model", &e))?
            } else {
                DEFAULT_THREAD_MODEL
            };
            for step in ["get_ready", "after_fork"] {
                if s.defines(py, step) {
                    s.call(py, step, ())?;
                }
            }
            if !(module::THREAD_MODEL_SERIALIZE_CONNECTIONS..=module::THREAD_MODEL_PARALLEL)
                .contains(&model)
            {
                return Err(Error::invalid(format!(
                    "{path}: thread_model: unknown thread model {model}"
                )));
            }
            Ok(model)
        })?;
        Ok(PythonPlugin {
            name: format!("python script {}", script.path),
            script,
            model,
        })
    }

    /// `--dump-plugin`'s lines of nbdkit's python plugin.
    pub fn dump() -> Result<Vec<String>> {
        crate::script::interpreter()?;
        let v = Python::attach(|py| {
            let v = py.version_info();
            format!("{}.{}.{}", v.major, v.minor, v.patch)
        });
        Ok(vec![
            format!("python_version={v}"),
            format!(
                "python_pep_384_abi_version={}",
                pyo3::ffi::PYTHON_ABI_VERSION
            ),
            format!(
                "nbdkit_python_maximum_api_version={}",
                crate::script::MAX_API
            ),
        ])
    }

    /// Runs `f` on the script, under the GIL.
    fn python<R>(&self, f: impl for<'py> FnOnce(Python<'py>, &Script) -> Result<R>) -> Result<R> {
        Python::attach(|py| f(py, &self.script))
    }

    /// Runs `f` on the script with handle `h`, under the GIL.
    fn with<R>(
        &self,
        h: &Handle,
        f: impl for<'py> FnOnce(Python<'py>, &Script, &Bound<'py, PyAny>) -> Result<R>,
    ) -> Result<R> {
        Python::attach(|py| {
            module::set_export(&h.export);
            f(py, &self.script, h.h.bind(py))
        })
    }

    /// `open(readonly)`.
    pub fn open(&self, readonly: bool, export: &str) -> Result<Handle> {
        self.python(|py, s| {
            module::set_export(export);
            let h = s.call(py, "open", (readonly,))?;
            Ok(Handle {
                h: h.unbind(),
                export: export.to_string(),
            })
        })
    }

    /// `close(h)`, if the script has it.
    pub fn close(&self, h: Handle) -> Result<()> {
        self.with(&h, |py, s, h| {
            if s.defines(py, "close") {
                s.call(py, "close", (h,))?;
            }
            Ok(())
        })
    }

    /// `get_size(h)`.
    pub fn get_size(&self, h: &Handle) -> Result<u64> {
        self.with(h, |py, s, h| {
            let n = s
                .call(py, "get_size", (h,))?
                .extract::<i64>()
                .map_err(|e| s.error(py, "get_size", &e))?;
            u64::try_from(n)
                .map_err(|_| Error::invalid(format!("{}: get_size: negative size {n}", s.path)))
        })
    }

    /// `block_size(h)`: (minimum, preferred, maximum), or none.
    pub fn block_size(&self, h: &Handle) -> Result<Option<[u32; 3]>> {
        self.with(h, |py, s, h| {
            if !s.defines(py, "block_size") {
                return Ok(None);
            }
            let (minimum, preferred, maximum) = s
                .call(py, "block_size", (h,))?
                .extract::<(u32, u32, u32)>()
                .map_err(|e| s.error(py, "block_size", &e))?;
            Ok((minimum != 0).then_some([minimum, preferred, maximum]))
        })
    }

    /// nbdkit's boolean callbacks: `method(h)` is True (nothing else
    /// counts), or, without it, whether the script defines the request
    /// it stands for; none for the others.
    pub fn can(&self, h: &Handle, method: &str) -> Result<Option<bool>> {
        let plain = match method {
            "can_write" => Some("pwrite"),
            "can_flush" => Some("flush"),
            "can_trim" => Some("trim"),
            "can_zero" => Some("zero"),
            "can_extents" => Some("extents"),
            _ => None,
        };
        self.with(h, |py, s, h| {
            if s.defines(py, method) {
                let r = s.call(py, method, (h,))?;
                return Ok(Some(r.cast::<PyBool>().is_ok_and(|b| b.is_true())));
            }
            Ok(plain.map(|p| s.defines(py, p)))
        })
    }

    /// `can_fua(h)` or `can_cache(h)`: one of the NONE, EMULATE, NATIVE
    /// constants; without the callback, EMULATE (FUA) or NATIVE (cache)
    /// when the script has `flush` or `cache`, as nbdkit's python plugin.
    pub fn mode(&self, h: &Handle, method: &str) -> Result<i64> {
        self.with(h, |py, s, h| {
            if !s.defines(py, method) {
                return Ok(match method {
                    "can_fua" if s.defines(py, "flush") => MODE_EMULATE,
                    "can_cache" if s.defines(py, "cache") => MODE_NATIVE,
                    _ => MODE_NONE,
                });
            }
            let m = s
                .call(py, method, (h,))?
                .extract::<i64>()
                .map_err(|e| s.error(py, method, &e))?;
            if !(MODE_NONE..=MODE_NATIVE).contains(&m) {
                return Err(Error::invalid(format!(
                    "{}: {method}: unknown mode {m}",
                    s.path
                )));
            }
            Ok(m)
        })
    }

    /// `pread`: API 2 fills a `memoryview` of `buf`; API 1 returns the
    /// bytes, copied.
    pub fn pread(&self, h: &Handle, buf: &mut [u8], offset: u64) -> Result<()> {
        self.with(h, |py, s, h| {
            let len = buf.len();
            if s.api == 1 {
                let r = s.call(py, "pread", (h, len, offset))?;
                let data = PyBuffer::<u8>::get(&r).map_err(|_| {
                    Error::io(format!(
                        "{}: value returned from pread does not support the buffer protocol",
                        s.path
                    ))
                })?;
                if data.item_count() < len {
                    return Err(Error::io(format!(
                        "{}: buffer returned from pread is too small",
                        s.path
                    )));
                }
                let all = data.to_vec(py).map_err(|e| s.error(py, "pread", &e))?;
                buf.copy_from_slice(&all[..len]);
                return Ok(());
            }
            // SAFETY: `buf` is ours, exclusively, for the whole call.
            unsafe {
                lend(py, buf.as_mut_ptr(), len, true, |view| {
                    s.call(py, "pread", (h, view, offset, 0u32)).map(drop)
                })
            }
            .map_err(|e| lend_failed(s, "pread", e))?
        })
    }

    /// `pwrite` with a read-only `memoryview` of `buf`.
    pub fn pwrite(&self, h: &Handle, buf: &[u8], offset: u64, flags: u32) -> Result<()> {
        self.with(h, |py, s, h| {
            // SAFETY: `buf` is ours for the whole call; the view is
            // read-only, so the cast to *mut is never written through.
            unsafe {
                lend(py, buf.as_ptr().cast_mut(), buf.len(), false, |view| {
                    if s.api == 1 {
                        s.call(py, "pwrite", (h, view, offset)).map(drop)
                    } else {
                        s.call(py, "pwrite", (h, view, offset, flags)).map(drop)
                    }
                })
            }
            .map_err(|e| lend_failed(s, "pwrite", e))?
        })
    }

    /// `zero`; EOPNOTSUPP (raised or not) asks the server to write zeros.
    pub fn zero(&self, h: &Handle, offset: u64, len: u64, flags: u32) -> Result<()> {
        self.with(h, |py, s, h| {
            let r = if s.api == 1 {
                let may_trim = flags & module::FLAG_MAY_TRIM != 0;
                s.call(py, "zero", (h, len, offset, may_trim))
            } else {
                s.call(py, "zero", (h, len, offset, flags))
            };
            if module::errno() == libc::EOPNOTSUPP {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    format!("{}: zero: not supported", s.path),
                ));
            }
            r.map(drop)
        })
    }

    /// `trim`.
    pub fn trim(&self, h: &Handle, offset: u64, len: u64, flags: u32) -> Result<()> {
        self.with(h, |py, s, h| {
            if s.api == 1 {
                s.call(py, "trim", (h, len, offset)).map(drop)
            } else {
                s.call(py, "trim", (h, len, offset, flags)).map(drop)
            }
        })
    }

    /// `flush`, if the script has it.
    pub fn flush(&self, h: &Handle) -> Result<()> {
        self.with(h, |py, s, h| {
            if !s.defines(py, "flush") {
                return Ok(());
            }
            if s.api == 1 {
                s.call(py, "flush", (h,)).map(drop)
            } else {
                s.call(py, "flush", (h, 0u32)).map(drop)
            }
        })
    }

    /// `cache`.
    pub fn cache(&self, h: &Handle, offset: u64, len: u64) -> Result<()> {
        self.with(h, |py, s, h| {
            s.call(py, "cache", (h, len, offset, 0u32)).map(drop)
        })
    }

    /// `extents(h, count, offset, flags)`: each extent the script returns
    /// to `add`, checked as nbdkit's python plugin checks them (3-tuples,
    /// contiguous, at least one); the server clips them to the request.
    pub fn extents(
        &self,
        h: &Handle,
        offset: u64,
        len: u64,
        flags: u32,
        mut add: impl FnMut(u64, u64, u32),
    ) -> Result<()> {
        // nbdkit asks with a 32-bit count.
        let count = len.min(u64::from(u32::MAX));
        self.with(h, |py, s, h| {
            let answer = s.call(py, "extents", (h, count, offset, flags))?;
            let bad =
                |what: &str| Error::io(format!("{}: extents method did not return {what}", s.path));
            let iter = answer
                .try_iter()
                .map_err(|_| bad("something which is iterable"))?;
            let mut next: Option<u64> = None;
            for item in iter {
                let item = item.map_err(|e| s.error(py, "extents", &e))?;
                let (at, len, kind) = item
                    .cast::<PyTuple>()
                    .ok()
                    .filter(|t| t.len() == 3)
                    .ok_or_else(|| bad("an iterable of 3-tuples"))?
                    .extract::<(u64, u64, u32)>()
                    .map_err(|e| s.error(py, "PyLong", &e))?;
                if next.is_some_and(|n| n != at) {
                    return Err(Error::io(format!(
                        "{}: extents: extents must be added in ascending order and must be \
                         contiguous",
                        s.path
                    )));
                }
                next = Some(at.saturating_add(len));
                add(at, len, kind);
            }
            if next.is_none() {
                return Err(Error::io(format!(
                    "{}: extents method cannot return an empty list",
                    s.path
                )));
            }
            Ok(())
        })
    }

    /// `list_exports(readonly, is_tls)`: names, or (name, description)
    /// pairs; none without the callback.
    pub fn list_exports(&self, readonly: bool, tls: bool) -> Result<Option<Vec<Listed>>> {
        self.python(|py, s| {
            if !s.defines(py, "list_exports") {
                return Ok(None);
            }
            let answer = s.call(py, "list_exports", (readonly, tls))?;
            let bad = || {
                Error::io(format!(
                    "{}: list_exports method did not return an iterable of str or \
                     (str, str) tuples",
                    s.path
                ))
            };
            let mut out = Vec::new();
            for item in answer.try_iter().map_err(|_| bad())? {
                let item = item.map_err(|e| s.error(py, "list_exports", &e))?;
                if let Ok(name) = item.extract::<String>() {
                    out.push((name, None));
                } else {
                    let (name, desc) = item.extract::<(String, String)>().map_err(|_| bad())?;
                    out.push((name, Some(desc)));
                }
            }
            Ok(Some(out))
        })
    }

    /// `preconnect(readonly)`, when the script has it: an exception
    /// refuses the client.
    pub fn preconnect(&self, readonly: bool) -> Result<()> {
        self.python(|py, s| {
            if s.defines(py, "preconnect") {
                s.call(py, "preconnect", (readonly,))?;
            }
            Ok(())
        })
    }

    /// `default_export(readonly, is_tls)`; none without the callback.
    pub fn default_export(&self, readonly: bool, tls: bool) -> Result<Option<String>> {
        self.python(|py, s| {
            if !s.defines(py, "default_export") {
                return Ok(None);
            }
            text(
                py,
                s,
                "default_export",
                s.call(py, "default_export", (readonly, tls))?,
            )
        })
    }

    /// `export_description(h)`; none without the callback.
    pub fn export_description(&self, h: &Handle) -> Result<Option<String>> {
        self.with(h, |py, s, h| {
            if !s.defines(py, "export_description") {
                return Ok(None);
            }
            text(
                py,
                s,
                "export_description",
                s.call(py, "export_description", (h,))?,
            )
        })
    }

    /// `cleanup()`, then what nbdkit's unloading of the plugin does: the
    /// script's atexit handlers run (the interpreter is not finalized)
    /// and its standard streams are flushed.
    pub fn cleanup(&self) -> Result<()> {
        self.python(|py, s| {
            if s.defines(py, "cleanup") {
                s.call(py, "cleanup", ())?;
            }
            py.import("atexit")
                .and_then(|m| m.call_method0("_run_exitfuncs"))
                .map_err(|e| s.error(py, "atexit", &e))?;
            let sys = py.import("sys").map_err(|e| s.error(py, "sys", &e))?;
            for stream in ["stdout", "stderr"] {
                let _ = sys.getattr(stream).and_then(|f| f.call_method0("flush"));
            }
            Ok(())
        })
    }
}

/// An export `list_exports` gives: its name and description, if any.
pub(crate) type Listed = (String, Option<String>);

/// A callback's answer that must be a str.
fn text(
    py: Python<'_>,
    s: &Script,
    name: &str,
    answer: Bound<'_, PyAny>,
) -> Result<Option<String>> {
    let text = answer
        .cast::<PyString>()
        .map_err(|_| Error::io(format!("{}: {name} method did not return a str", s.path)))?
        .to_str()
        .map_err(|e| s.error(py, name, &e))?
        .to_string();
    Ok(Some(text))
}

/// An error from lending a buffer (making the view failed).
fn lend_failed(s: &Script, name: &str, e: PyErr) -> Error {
    Error::io(format!("{}: {name}: cannot lend the buffer: {e}", s.path))
}
