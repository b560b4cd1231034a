//! The script: run once as `__main__` in the embedded interpreter, its
//! callbacks looked up by name at each call (as nbdkit does, so a script
//! may rebind them), their exceptions turned into errors.

use std::sync::OnceLock;

use diskit_core::{Error, ErrorKind, Result};
use pyo3::BoundObject;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule, PyTuple};

use crate::module;

/// A loaded script.
pub(crate) struct Script {
    /// Its path as given (in messages, as nbdkit names it).
    pub path: String,
    /// `__main__`, where it ran.
    main: Py<PyModule>,
    /// Its `API_VERSION` (1 when it has none, as in nbdkit).
    pub api: u32,
}

/// The highest `API_VERSION` a script may ask for.
pub(crate) const MAX_API: i64 = 2;

/// The one interpreter of the process, started on first use with the
/// `nbdkit` module importable.
pub(crate) fn interpreter() -> Result<()> {
    static STARTED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            Python::initialize();
            Python::attach(|py| module::install(py).map_err(|e| e.to_string()))
        })
        .clone()
        .map_err(|e| Error::io(format!("python: cannot set up the nbdkit module: {e}")))
}

impl Script {
    /// Runs the script at `path` and checks what nbdkit checks: the
    /// required callbacks and the API version.
    pub fn load(path: &str) -> Result<Script> {
        interpreter()?;
        let source = std::fs::read_to_string(path).map_err(|e| {
            let e = Error::from(e);
            Error::new(
                e.kind(),
                format!("{path}: cannot open file: {}", e.detail()),
            )
        })?;
        Python::attach(|py| {
            let main = py
                .import("__main__")
                .map_err(|e| Error::io(format!("{path}: cannot find __main__ module: {e}")))?;
            run(py, &main, path, &source).map_err(|e| {
                Error::invalid(format!(
                    "{path}: error running this script: {}",
                    one_line(py, &e)
                ))
            })?;
            let script = Script {
                path: path.to_string(),
                main: main.unbind(),
                api: 1,
            };
            if ["open", "get_size", "pread"]
                .iter()
                .any(|c| script.callback(py, c).is_none())
            {
                return Err(Error::invalid(format!(
                    "{path}: one of the required callbacks 'open', 'get_size' or 'pread' \
                     is not defined by this Python script.  nbdkit requires these callbacks."
                )));
            }
            let api = match script.main.bind(py).getattr("API_VERSION") {
                Err(_) => 1,
                Ok(v) => v.extract::<i64>().unwrap_or(0),
            };
            if !(1..=MAX_API).contains(&api) {
                return Err(Error::invalid(format!(
                    "{path}: API_VERSION requested unknown version: {api}.  \
                     This plugin supports API versions between 1 and {MAX_API}."
                )));
            }
            Ok(Script {
                api: api as u32,
                ..script
            })
        })
    }

    /// The callable `name` of the script, if it defines one.
    pub fn callback<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyAny>> {
        self.main
            .bind(py)
            .getattr(name)
            .ok()
            .filter(|f| f.is_callable())
    }

    /// Whether the script defines the callable `name`.
    pub fn defines(&self, py: Python<'_>, name: &str) -> bool {
        self.callback(py, name).is_some()
    }

    /// Calls `name` with `args`; an exception becomes an error of the
    /// errno the script set with `nbdkit.set_error` (EIO if none), its
    /// message nbdkit's: the script, the callback and the traceback. A
    /// script without the callback gets `missing`.
    pub fn call<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        args: impl IntoPyObject<'py, Target = PyTuple>,
    ) -> Result<Bound<'py, PyAny>> {
        let Some(f) = self.callback(py, name) else {
            return Err(Error::unsupported(format!("{name} not implemented")));
        };
        let args = args
            .into_pyobject(py)
            .map_err(|e| self.error(py, name, &e.into()))?
            .into_bound();
        module::clear_errno();
        f.call1(args).map_err(|e| self.error(py, name, &e))
    }

    /// The error for exception `e` raised by callback `name`.
    pub fn error(&self, py: Python<'_>, name: &str, e: &PyErr) -> Error {
        let kind = match module::errno() {
            0 => ErrorKind::Io,
            n => ErrorKind::from_errno(n),
        };
        Error::new(
            kind,
            format!("{}: {name}: error: {}", self.path, traceback(py, e)),
        )
    }
}

/// Runs `source` in `main` as PyRun_SimpleFile does: `__file__` set while
/// it runs, tracebacks naming `path`.
fn run(py: Python<'_>, main: &Bound<'_, PyModule>, path: &str, source: &str) -> PyResult<()> {
    let globals: Bound<'_, PyDict> = main.dict();
    globals.set_item("__file__", path)?;
    let builtins = py.import("builtins")?;
    let code = builtins.getattr("compile")?.call1((source, path, "exec"))?;
    let r = builtins.getattr("exec")?.call1((code, &globals));
    let _ = globals.del_item("__file__");
    r.map(drop)
}

/// The exception on one line: `SyntaxError: expected ':' (bad.py, line
/// 4)`, `NameError: name 'x' is not defined`.
fn one_line(py: Python<'_>, e: &PyErr) -> String {
    let value = e.value(py);
    let name = e
        .get_type(py)
        .name()
        .map_or_else(|_| "Exception".to_string(), |n| n.to_string());
    let text = value.str().map(|s| s.to_string()).unwrap_or_default();
    let mut line = if text.is_empty() {
        name
    } else {
        format!("{name}: {text}")
    };
    // A SyntaxError's str() already names the file and line; other
    // exceptions name the script line they came from.
    if let Some(tb) = e.traceback(py)
        && !e.is_instance_of::<pyo3::exceptions::PySyntaxError>(py)
    {
        let mut last = tb;
        while let Some(next) = last
            .getattr("tb_next")
            .ok()
            .and_then(|n| n.cast_into::<pyo3::types::PyTraceback>().ok())
        {
            last = next;
        }
        if let Ok(n) = last.getattr("tb_lineno").and_then(|n| n.extract::<u64>()) {
            line.push_str(&format!(" (line {n})"));
        }
    }
    line.replace('\n', " ")
}

/// The exception as Python prints it (traceback.format_exception), or its
/// text when that fails.
fn traceback(py: Python<'_>, e: &PyErr) -> String {
    let formatted = (|| -> PyResult<String> {
        let lines = py
            .import("traceback")?
            .getattr("format_exception")?
            .call1((e.get_type(py), e.value(py), e.traceback(py)))?;
        let joined: String = py
            .import("builtins")?
            .getattr("str")?
            .getattr("join")?
            .call1(("", lines))?
            .extract()?;
        Ok(joined)
    })();
    formatted
        .unwrap_or_else(|_| e.value(py).to_string())
        .trim_end()
        .to_string()
}
