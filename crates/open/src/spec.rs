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

    /// Sets every key of `child` under `prefix.` (a node given whole as
    /// this node's child: `backing`, `file`).
    pub fn nest(&mut self, prefix: &str, child: &Spec) {
        for (k, v) in &child.keys {
            self.keys.insert(format!("{prefix}.{k}"), v.clone());
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

    /// The node as QEMU names one that has no file name: `json:{...}`,
    /// nested objects for dotted keys, keys in the order QEMU's `QDict`
    /// lists them (by the bucket of their hash), values as strings.
    pub fn qemu_json_name(&self) -> String {
        format!("json:{}", self.qemu_json())
    }

    fn qemu_json(&self) -> String {
        let mut heads: Vec<&str> = Vec::new();
        for k in self.keys() {
            let head = k.split_once('.').map_or(k, |(h, _)| h);
            if !heads.contains(&head) {
                heads.push(head);
            }
        }
        heads.sort_by_key(|h| qdict_bucket(h));
        let items: Vec<String> = heads
            .iter()
            .map(|h| {
                let value = match self.keys.get(*h) {
                    Some(Value::Str(s)) => json_string(s),
                    Some(Value::Null) => "null".into(),
                    None => self.child(h).qemu_json(),
                };
                format!("{}: {value}", json_string(h))
            })
            .collect();
        format!("{{{}}}", items.join(", "))
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

/// The bucket QEMU's `QDict` keeps `key` in (its `tdb_hash` modulo 512
/// buckets), which decides the order it lists keys in.
fn qdict_bucket(key: &str) -> u32 {
    let mut v = 0x238F_13AFu32.wrapping_mul(key.len() as u32);
    for (i, b) in key.bytes().enumerate() {
        v = v.wrapping_add(u32::from(b) << ((i * 5) % 24));
    }
    1_103_515_243u32.wrapping_mul(v).wrapping_add(12345) % 512
}

/// `s` as a JSON string.
fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
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
    let text = &double_quoted(text)?;
    check_nesting(text)?;
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        if e.is_eof() {
            premature_end()
        } else {
            Error::invalid(format!(
                "Could not parse the JSON options: JSON parse error, {e}"
            ))
        }
    })?;
    let serde_json::Value::Object(map) = value else {
        return Err(Error::invalid("json: description must be a JSON object"));
    };
    let mut spec = Spec::default();
    flatten(&mut spec, "", &map)?;
    Ok(spec)
}

/// QEMU's message for a description that ends too soon.
fn premature_end() -> Error {
    Error::invalid("Could not parse the JSON options: JSON parse error, premature EOI")
}

/// QEMU's JSON takes strings in single quotes too (`{'driver':'raw'}`,
/// as QEMU itself writes filenames in messages and tests), and `\'` in
/// either kind; standard JSON takes neither. Rewrites every string in
/// double quotes, leaving the rest as it is.
fn double_quoted(text: &str) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '"' && c != '\'' {
            out.push(c);
            continue;
        }
        let quote = c;
        out.push('"');
        loop {
            match chars.next() {
                None => {
                    return Err(Error::invalid(
                        "json: description has an unterminated string",
                    ));
                }
                Some(c) if c == quote => break,
                Some('\\') => match chars.next() {
                    Some('\'') => out.push('\''),
                    Some(e) => {
                        out.push('\\');
                        out.push(e);
                    }
                    None => return Err(premature_end()),
                },
                Some('"') => out.push_str("\\\""),
                Some(c) => out.push(c),
            }
        }
        out.push('"');
    }
    Ok(out)
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
    fn nodes_without_a_file_name_are_named_as_qemu_names_them() {
        let s = parse_image_opts("driver=null-co,size=1M,read-zeroes=on").unwrap();
        assert_eq!(
            s.qemu_json_name(),
            r#"json:{"read-zeroes": "on", "driver": "null-co", "size": "1M"}"#
        );
        let s =
            parse_image_opts("driver=raw,offset=4096,file.driver=file,file.filename=r").unwrap();
        assert_eq!(
            s.qemu_json_name(),
            r#"json:{"offset": "4096", "driver": "raw", "file": {"driver": "file", "filename": "r"}}"#
        );
    }

    #[test]
    fn json_takes_qemu_single_quotes() {
        let s = parse_json(r#"{'driver':'raw','file':{'filename':'it\'s "x".raw'},"a":"b\'c"}"#)
            .unwrap();
        assert_eq!(s.get("driver"), Some("raw"));
        assert_eq!(s.get("file.filename"), Some(r#"it's "x".raw"#));
        assert_eq!(s.get("a"), Some("b'c"));
        assert!(parse_json("{'a':'b}").is_err());
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
