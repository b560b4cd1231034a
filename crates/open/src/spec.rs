//! What to open, as QEMU describes a block node: a flat map of dotted keys
//! (`driver`, `file.driver`, `file.filename`, `l2-cache-size`, ...).
//!
//! Three spellings reach the same map: a plain name (a path or a protocol
//! URI), `json:{...}` (nested objects flattened to dotted keys, as QEMU's
//! `qdict_flatten` does) and qemu-img's `--image-opts` (`key=value,...`,
//! with `,,` for a comma in a value).

use std::collections::BTreeMap;

use diskit_core::{Error, Result};

/// Objects in `json:` nested deeper than this are refused.
pub const MAX_JSON_DEPTH: usize = 8;

/// The longest description accepted (a hostile caller must not make us
/// hold or walk gigabytes).
pub const MAX_SPEC_BYTES: usize = 64 << 10;

/// A value of the map: a string, or JSON `null` (as in `"backing": null`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A value; numbers and booleans are kept in their JSON spelling.
    Str(String),
    /// `null`: "none", where a key allows it.
    Null,
}

/// A block node description: dotted keys to values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spec {
    keys: BTreeMap<String, Value>,
}

impl Spec {
    /// The value of `key`, when set to a string.
    pub fn get(&self, key: &str) -> Option<&str> {
        match self.keys.get(key) {
            Some(Value::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// Whether `key` is set to `null`.
    pub fn is_null(&self, key: &str) -> bool {
        matches!(self.keys.get(key), Some(Value::Null))
    }

    /// Whether `key` is set at all.
    pub fn has(&self, key: &str) -> bool {
        self.keys.contains_key(key)
    }

    /// Sets `key`.
    pub fn set(&mut self, key: &str, value: Value) {
        self.keys.insert(key.to_string(), value);
    }

    /// The keys under `prefix.` with the prefix taken off.
    pub fn child(&self, prefix: &str) -> Spec {
        let dotted = format!("{prefix}.");
        Spec {
            keys: self
                .keys
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(&dotted)?.to_string(), v.clone())))
                .collect(),
        }
    }

    /// Whether no key is set.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Every key.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Refuses any key of this node (children under `children.` aside)
    /// that is not in `known`, naming it and the driver in QEMU's words.
    pub fn check_keys(
        &self,
        node: NodeKind,
        driver: &str,
        known: &[&str],
        children: &[&str],
    ) -> Result<()> {
        for k in self.keys() {
            let child = k
                .split_once('.')
                .is_some_and(|(head, _)| children.contains(&head));
            if !child && !known.contains(&k) {
                return Err(Error::invalid(match node {
                    NodeKind::Format => {
                        format!("Block format '{driver}' does not support the option '{k}'")
                    }
                    NodeKind::Protocol => {
                        format!("Block protocol '{driver}' doesn't support the option '{k}'")
                    }
                }));
            }
        }
        Ok(())
    }
}

/// Which kind of node a description is, for QEMU's wording of errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// A format node (`qcow2`, `raw`, `luks`, ...).
    Format,
    /// A protocol node (`file`, `nbd`, ...).
    Protocol,
}

/// Parses the text after `json:` into a spec.
pub fn parse_json(text: &str) -> Result<Spec> {
    if text.len() > MAX_SPEC_BYTES {
        return Err(Error::invalid("json: description is too long"));
    }
    check_nesting(text)?;
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Error::invalid(format!("Could not parse the json: description: {e}")))?;
    let serde_json::Value::Object(map) = value else {
        return Err(Error::invalid("json: description must be a JSON object"));
    };
    let mut spec = Spec::default();
    flatten(&mut spec, "", &map)?;
    Ok(spec)
}

/// Refuses nesting deeper than [`MAX_JSON_DEPTH`] before the JSON parser
/// recurses into it.
fn check_nesting(text: &str) -> Result<()> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for b in text.bytes() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > MAX_JSON_DEPTH {
                    return Err(Error::invalid(format!(
                        "json: description nests deeper than {MAX_JSON_DEPTH} levels"
                    )));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

fn flatten(
    spec: &mut Spec,
    prefix: &str,
    map: &serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    for (k, v) in map {
        if k.is_empty() || k.split('.').any(str::is_empty) {
            return Err(Error::invalid(format!(
                "json: description has an invalid key '{k}'"
            )));
        }
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if spec.has(&key) {
            return Err(Error::invalid(format!(
                "json: description sets '{key}' twice"
            )));
        }
        let value = match v {
            serde_json::Value::Object(inner) => {
                flatten(spec, &key, inner)?;
                continue;
            }
            serde_json::Value::Null => Value::Null,
            serde_json::Value::String(s) => Value::Str(s.clone()),
            serde_json::Value::Bool(b) => Value::Str(if *b { "on" } else { "off" }.into()),
            serde_json::Value::Number(n) => Value::Str(n.to_string()),
            serde_json::Value::Array(_) => {
                return Err(Error::invalid(format!(
                    "Invalid parameter '{key}': lists are not supported"
                )));
            }
        };
        spec.set(&key, value);
    }
    Ok(())
}

/// Parses qemu-img's `--image-opts` text: `key=value` items separated by
/// commas, a doubled comma standing for a comma in a value; later items
/// win, as QEMU's option parser has it.
pub fn parse_image_opts(text: &str) -> Result<Spec> {
    if text.len() > MAX_SPEC_BYTES {
        return Err(Error::invalid("--image-opts description is too long"));
    }
    let mut spec = Spec::default();
    for item in diskit_formats::options::split_items(text) {
        if item.is_empty() {
            continue;
        }
        let Some((k, v)) = item.split_once('=') else {
            return Err(Error::invalid(format!(
                "Invalid parameter '{item}': expected key=value"
            )));
        };
        if k.is_empty() || k.split('.').any(str::is_empty) {
            return Err(Error::invalid(format!("Invalid parameter name '{k}'")));
        }
        spec.set(k, Value::Str(v.to_string()));
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_flattens_nested_objects() {
        let s = parse_json(
            r#"{"driver":"qcow2","file":{"driver":"file","filename":"/x,y"},"l2-cache-size":1048576,"backing":null,"cache":{"direct":true}}"#,
        )
        .unwrap();
        assert_eq!(s.get("driver"), Some("qcow2"));
        assert_eq!(s.get("file.filename"), Some("/x,y"));
        assert_eq!(s.get("l2-cache-size"), Some("1048576"));
        assert_eq!(s.get("cache.direct"), Some("on"));
        assert!(s.is_null("backing"));
        assert_eq!(s.child("file").get("driver"), Some("file"));
    }

    #[test]
    fn json_refuses_bad_input() {
        for bad in [
            "",
            "[1]",
            "{",
            r#"{"a":[1]}"#,
            r#"{"a":{"b":{"c":{"d":{"e":{"f":{"g":{"h":{"i":{}}}}}}}}}}"#,
            r#"{"a.b":1,"a":{"b":2}}"#,
        ] {
            assert!(parse_json(bad).is_err(), "{bad}");
        }
        let deep = "[".repeat(10_000);
        let e = parse_json(&deep).unwrap_err();
        assert!(e.to_string().contains("nests deeper"), "{e}");
    }

    #[test]
    fn image_opts_items_and_escaped_commas() {
        let s = parse_image_opts("driver=qcow2,file.filename=a,,b,file.driver=file,driver=raw")
            .unwrap();
        assert_eq!(s.get("driver"), Some("raw"));
        assert_eq!(s.get("file.filename"), Some("a,b"));
        assert!(parse_image_opts("driver").is_err());
        assert!(parse_image_opts("file..x=1").is_err());
        assert!(parse_image_opts("=1").is_err());
    }

    #[test]
    fn unknown_keys_are_named() {
        let s = parse_image_opts("driver=raw,bogus=1,file.x=2").unwrap();
        let e = s
            .check_keys(NodeKind::Format, "raw", &["driver"], &["file"])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Block format 'raw' does not support the option 'bogus'"
        );
    }
}
