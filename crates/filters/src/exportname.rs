//! The exportname filter (nbdkit-exportname-filter): changes the export
//! names a client is shown and may ask for, and their descriptions.
//!
//! - `default-export=NAME`: the export `""` stands for (what a client
//!   asking for the default export opens, and what listings show for it);
//! - `exportname-list=keep|error|empty|defaultonly|explicit`: what a
//!   listing (NBD_OPT_LIST) shows: the layer below's list (the default), an
//!   error, nothing, the default export alone, or the `exportname=` names;
//! - `exportname=NAME` (repeatable): the explicit names;
//! - `exportname-strict=true`: only the explicit names may be opened (and
//!   `""` only when it is one of them);
//! - `exportdesc=keep|none|fixed:TEXT|script:SCRIPT`: descriptions as below,
//!   none, one text for every export, or what a shell script prints with
//!   `$name` set to the export's name.
//!
//! Reads, writes and every other request pass through untouched.

use std::io::Read;
use std::process::{Command, Stdio};

use diskit_core::params::{boolean, shell_quote};
use diskit_core::{
    BlockDevice, DeviceRef, Error, ErrorKind, ExportEntry, ExportQuery, Filter, Result, Session,
};

use crate::params;
use crate::registry::{Configure, over, unknown};

/// The keys the filter takes (nbdkit also takes each with underscores).
pub const KEYS: &[&str] = &[
    "default-export",
    "default_export",
    "exportname-list",
    "exportname_list",
    "exportname-strict",
    "exportname_strict",
    "exportname",
    "exportdesc",
];

/// The longest description a script may give (the NBD protocol's longest
/// string); the rest is dropped.
const MAX_DESCRIPTION: u64 = 4096;

/// What a listing shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ListMode {
    /// The layer below's list.
    #[default]
    Keep,
    /// An error: listing is refused.
    Error,
    /// An empty list.
    Empty,
    /// The default export alone, by its canonical name.
    DefaultOnly,
    /// The `exportname=` names.
    Explicit,
}

/// Where descriptions come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Describe {
    /// From the layer below.
    #[default]
    Keep,
    /// Nowhere: no export has one.
    None,
    /// One text for every export.
    Fixed(String),
    /// What a shell script prints, with `$name` set.
    Script(String),
}

/// The filter's configuration (and, for a connection, the name it opened).
#[derive(Debug, Clone, Default)]
pub struct Exportname {
    /// `default-export=`.
    pub default_export: Option<String>,
    /// `exportname-list=`.
    pub list: ListMode,
    /// `exportname-strict=`.
    pub strict: bool,
    /// `exportname=`, in order.
    pub names: Vec<String>,
    /// `exportdesc=`.
    pub describe: Describe,
    /// The export a connection opened (a connection's copy only).
    opened: Option<String>,
}

impl Configure for Exportname {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "default-export" | "default_export" => self.default_export = Some(value.to_string()),
            "exportname-list" | "exportname_list" => {
                self.list = params::choice(
                    "exportname",
                    "exportname-list",
                    value,
                    &[
                        ("keep", ListMode::Keep),
                        ("error", ListMode::Error),
                        ("empty", ListMode::Empty),
                        ("defaultonly", ListMode::DefaultOnly),
                        ("default-only", ListMode::DefaultOnly),
                        ("explicit", ListMode::Explicit),
                    ],
                )?
            }
            "exportname-strict" | "exportname_strict" => {
                self.strict = boolean("exportname", key, value)?
            }
            "exportname" => self.names.push(value.to_string()),
            "exportdesc" => {
                self.describe = if value == "keep" {
                    Describe::Keep
                } else if value == "none" {
                    Describe::None
                } else if let Some(text) = value.strip_prefix("fixed:") {
                    Describe::Fixed(text.to_string())
                } else if let Some(script) = value.strip_prefix("script:") {
                    Describe::Script(script.to_string())
                } else {
                    return Err(Error::invalid(format!(
                        "exportname: unrecognized exportdesc mode: {value}"
                    )));
                }
            }
            _ => return Err(unknown("exportname", key)),
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(self.clone(), next))
    }
}

impl Exportname {
    /// The description of export `name`, given `below`'s.
    fn description(&self, name: &str, below: Option<String>) -> Option<String> {
        match &self.describe {
            Describe::Keep => below,
            Describe::None => None,
            Describe::Fixed(text) => Some(text.clone()),
            Describe::Script(script) => run_script(name, script),
        }
    }
}

/// What `script` prints with `$name` set to `name` (one last newline
/// dropped); `None` when it cannot run.
fn run_script(name: &str, script: &str) -> Option<String> {
    let text = format!("export name; name={}\n{script}\n", shell_quote(name));
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(text)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    let mut out = Vec::new();
    let read = child
        .stdout
        .take()?
        .take(MAX_DESCRIPTION)
        .read_to_end(&mut out);
    // The script's status does not matter, only what it printed.
    let _ = child.wait();
    read.ok()?;
    if out.last() == Some(&b'\n') {
        out.pop();
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

impl Filter for Exportname {
    fn name(&self) -> &str {
        "exportname"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn submits_below(&self) -> bool {
        true
    }

    fn list_exports(
        &self,
        next: &dyn BlockDevice,
        query: &ExportQuery,
    ) -> Result<Option<Vec<ExportEntry>>> {
        let source = match self.list {
            ListMode::Keep => match next.list_exports(query)? {
                Some(list) => list,
                // The layer below lists its own default export.
                None => vec![ExportEntry::new(
                    next.default_export(query)?.unwrap_or_default(),
                    None,
                )],
            },
            ListMode::Error => {
                return Err(Error::new(
                    ErrorKind::PermissionDenied,
                    "export list restricted by policy",
                ));
            }
            ListMode::Empty => return Ok(Some(Vec::new())),
            ListMode::DefaultOnly => {
                let name = self.default_export(next, query)?.unwrap_or_default();
                return Ok(Some(vec![ExportEntry::new(name, None)]));
            }
            ListMode::Explicit => self
                .names
                .iter()
                .map(|n| ExportEntry::new(n.clone(), None))
                .collect(),
        };
        Ok(Some(
            source
                .into_iter()
                .map(|e| {
                    let description = self.description(&e.name, e.description);
                    ExportEntry::new(e.name, description)
                })
                .collect(),
        ))
    }

    fn default_export(
        &self,
        next: &dyn BlockDevice,
        query: &ExportQuery,
    ) -> Result<Option<String>> {
        if self.strict {
            // Only when "" is one of the explicit names.
            return if self.names.iter().any(String::is_empty) {
                Ok(Some(self.default_export.clone().unwrap_or_default()))
            } else {
                Err(Error::new(
                    ErrorKind::NotFound,
                    "default export (\"\") not permitted",
                ))
            };
        }
        match &self.default_export {
            Some(name) => Ok(Some(name.clone())),
            None => next.default_export(query),
        }
    }

    fn connect(&self, _next: &DeviceRef, session: &Session) -> Result<Option<Self>> {
        if self.strict && !self.names.contains(&session.export) {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("export '{}' not found", session.export),
            ));
        }
        Ok(Some(Exportname {
            opened: Some(session.export.clone()),
            ..self.clone()
        }))
    }

    fn export_description(&self, next: &dyn BlockDevice) -> Option<String> {
        let below = match self.describe {
            Describe::Keep => next.export_description(),
            _ => None,
        };
        self.description(self.opened.as_deref().unwrap_or(""), below)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::kv;

    fn filter(params: &[(&str, &str)]) -> Exportname {
        Exportname::from_params(&kv(params)).unwrap()
    }

    #[test]
    fn parameters_read_as_nbdkit_reads_them() {
        let f = filter(&[
            ("default_export", "a"),
            ("exportname-list", "default-only"),
            ("exportname-strict", "on"),
            ("exportname", "a"),
            ("exportname", ""),
            ("exportdesc", "fixed:some: text"),
        ]);
        assert_eq!(f.default_export.as_deref(), Some("a"));
        assert_eq!(f.list, ListMode::DefaultOnly);
        assert!(f.strict);
        assert_eq!(f.names, ["a", ""]);
        assert_eq!(f.describe, Describe::Fixed("some: text".into()));
        for bad in [
            ("exportname-list", "all"),
            ("exportdesc", "fixed"),
            ("exportname-strict", "maybe"),
        ] {
            assert!(Exportname::from_params(&kv(&[bad])).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn scripts_describe_exports_by_name() {
        assert_eq!(
            run_script("it's", r#"printf '%s!\n' "$name""#).as_deref(),
            Some("it's!")
        );
    }
}
