//! JSON printed the way QEMU prints it, so that output compares equal to
//! qemu-img's byte for byte: four-space indents, empty containers opened and
//! closed on separate lines, and object keys in the order QEMU's QDict
//! iterates them (see [`qdict_order`]). Also QEMU's human dump of the same
//! objects (`dump_qdict`), used for "Format specific information".

use std::fmt::Write;

use diskit_open::InfoValue;

/// A JSON value with ordered object keys.
#[derive(Debug, Clone, PartialEq)]
pub enum QJson {
    /// `true` / `false`.
    Bool(bool),
    /// An unsigned integer.
    UInt(u64),
    /// A signed integer (QAPI `int` fields, printed as C's `PRId64`).
    Int(i64),
    /// A string.
    Str(String),
    /// An array.
    List(Vec<QJson>),
    /// An object, keys in insertion order (insert in QAPI schema order:
    /// it decides ties in QEMU's key order).
    Dict(Vec<(String, QJson)>),
}

impl From<&InfoValue> for QJson {
    /// A format's information as JSON, keys in the same order.
    fn from(v: &InfoValue) -> QJson {
        match v {
            InfoValue::Str(s) => QJson::Str(s.clone()),
            InfoValue::UInt(n) => QJson::UInt(*n),
            InfoValue::Int(n) => QJson::Int(*n),
            InfoValue::Bool(b) => QJson::Bool(*b),
            InfoValue::List(l) => QJson::List(l.iter().map(QJson::from).collect()),
            InfoValue::Dict(d) => {
                QJson::Dict(d.iter().map(|(k, v)| (k.clone(), QJson::from(v))).collect())
            }
        }
    }
}

impl QJson {
    /// An empty object.
    pub fn dict() -> QJson {
        QJson::Dict(Vec::new())
    }

    /// Adds a key to an object (builder style).
    pub fn with(mut self, key: &str, value: QJson) -> QJson {
        if let QJson::Dict(items) = &mut self {
            items.push((key.to_string(), value));
        }
        self
    }

    /// Pretty-prints as qemu's `qobject_to_json_pretty`, keys in QDict order.
    pub fn pretty(&self) -> String {
        let mut out = String::new();
        self.write_pretty(&mut out, 0);
        out
    }

    fn write_pretty(&self, out: &mut String, level: usize) {
        let pad = |out: &mut String, l: usize| out.push_str(&" ".repeat(l * 4));
        match self {
            QJson::List(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    pad(out, level + 1);
                    v.write_pretty(out, level + 1);
                }
                out.push('\n');
                pad(out, level);
                out.push(']');
            }
            QJson::Dict(items) => {
                out.push('{');
                for (i, (k, v)) in qdict_order(items).enumerate() {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    pad(out, level + 1);
                    write_str(out, k);
                    out.push_str(": ");
                    v.write_pretty(out, level + 1);
                }
                out.push('\n');
                pad(out, level);
                out.push('}');
            }
            scalar => scalar.write_compact(out),
        }
    }

    /// Prints on one line, with qemu's spacing (`{"a": 1, "b": 2}`), keys
    /// in insertion order (callers order them by hand, as qemu-img map does).
    pub fn write_compact(&self, out: &mut String) {
        match self {
            QJson::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            QJson::UInt(n) => {
                let _ = write!(out, "{n}");
            }
            QJson::Int(n) => {
                let _ = write!(out, "{n}");
            }
            QJson::Str(s) => write_str(out, s),
            QJson::List(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.write_compact(out);
                }
                out.push(']');
            }
            QJson::Dict(items) => {
                out.push('{');
                for (i, (k, v)) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_str(out, k);
                    out.push_str(": ");
                    v.write_compact(out);
                }
                out.push('}');
            }
        }
    }

    /// QEMU's human dump of an object (`dump_qobject` in block/qapi.c):
    /// `key: value` lines, dashes in keys shown as spaces, list items as
    /// `[i]:`, nested containers indented four more spaces. `indentation`
    /// is the level of the object's own lines.
    pub fn dump_human(&self, indentation: usize) -> String {
        let mut out = String::new();
        self.dump_into(&mut out, indentation);
        out
    }

    fn dump_into(&self, out: &mut String, level: usize) {
        let entry = |out: &mut String, label: &str, v: &QJson| {
            let composite = matches!(v, QJson::List(_) | QJson::Dict(_));
            out.push_str(&" ".repeat(level * 4));
            out.push_str(label);
            out.push(':');
            out.push(if composite { '\n' } else { ' ' });
            v.dump_into(out, level + 1);
            if !composite {
                out.push('\n');
            }
        };
        match self {
            QJson::Dict(items) => {
                for (k, v) in qdict_order(items) {
                    entry(out, &k.replace('-', " "), v);
                }
            }
            QJson::List(items) => {
                for (i, v) in items.iter().enumerate() {
                    entry(out, &format!("[{i}]"), v);
                }
            }
            QJson::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            QJson::UInt(n) => {
                let _ = write!(out, "{n}");
            }
            QJson::Int(n) => {
                let _ = write!(out, "{n}");
            }
            QJson::Str(s) => out.push_str(s),
        }
    }
}

/// QEMU's QDict hash (`tdb_hash` in qobject/qdict.c), modulo its 512
/// buckets.
fn qdict_bucket(key: &str) -> u32 {
    let bytes = key.as_bytes();
    let mut value = 0x238F_13AFu32.wrapping_mul(bytes.len() as u32);
    for (i, &b) in bytes.iter().enumerate() {
        value = value.wrapping_add((b as u32) << ((i * 5) % 24));
    }
    1_103_515_243u32.wrapping_mul(value).wrapping_add(12345) % 512
}

/// The entries of an object in the order a QDict iterates them: by hash
/// bucket, and within a bucket the most recently inserted key first.
pub fn qdict_order(items: &[(String, QJson)]) -> impl Iterator<Item = &(String, QJson)> {
    let mut order: Vec<(u32, std::cmp::Reverse<usize>)> = items
        .iter()
        .enumerate()
        .map(|(i, (k, _))| (qdict_bucket(k), std::cmp::Reverse(i)))
        .collect();
    order.sort_unstable();
    order
        .into_iter()
        .map(move |(_, std::cmp::Reverse(i))| &items[i])
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            // Control characters and everything outside ASCII as \uXXXX
            // (upper-case hex, UTF-16 surrogates), as QEMU writes them.
            c if (c as u32) < 0x20 || (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04X}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretty_matches_qemu_layout() {
        let v = QJson::dict()
            .with("children", QJson::List(vec![]))
            .with("format", QJson::UInt(1))
            .with("data", QJson::dict());
        assert_eq!(
            v.pretty(),
            "{\n    \"children\": [\n    ],\n    \"format\": 1,\n    \"data\": {\n    }\n}"
        );
    }

    #[test]
    fn buckets_are_qemus() {
        // Observed with qemu-img 10 (bucket numbers from QEMU's tdb_hash).
        for (k, b) in [
            ("children", 206),
            ("snapshots", 263),
            ("backing-filename-format", 206),
            ("virtual-size", 309),
            ("filename", 313),
            ("cluster-size", 316),
            ("format", 337),
            ("actual-size", 351),
            ("format-specific", 354),
            ("full-backing-filename", 360),
            ("backing-filename", 475),
            ("dirty-flag", 501),
        ] {
            assert_eq!(qdict_bucket(k), b, "{k}");
        }
    }

    #[test]
    fn keys_come_out_in_qdict_order() {
        // Inserted in QAPI schema order (BlockNodeInfo, then children);
        // the order is the one qemu-img 10 prints.
        let keys = [
            "filename",
            "format",
            "dirty-flag",
            "actual-size",
            "virtual-size",
            "cluster-size",
            "backing-filename",
            "full-backing-filename",
            "backing-filename-format",
            "snapshots",
            "format-specific",
            "children",
        ];
        let mut v = QJson::dict();
        for k in keys {
            v = v.with(k, QJson::Bool(true));
        }
        let QJson::Dict(items) = &v else {
            unreachable!()
        };
        let order: Vec<&str> = qdict_order(items).map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            order,
            [
                "children",
                "backing-filename-format",
                "snapshots",
                "virtual-size",
                "filename",
                "cluster-size",
                "format",
                "actual-size",
                "format-specific",
                "full-backing-filename",
                "backing-filename",
                "dirty-flag",
            ]
        );
        // Compact output keeps insertion order.
        let mut compact = String::new();
        v.write_compact(&mut compact);
        assert!(compact.starts_with("{\"filename\": true, \"format\""));
    }

    #[test]
    fn human_dump_is_qemus() {
        let v = QJson::dict()
            .with("compat", QJson::Str("1.1".into()))
            .with("lazy-refcounts", QJson::Bool(false))
            .with(
                "bitmaps",
                QJson::List(vec![
                    QJson::dict()
                        .with("name", QJson::Str("b".into()))
                        .with("granularity", QJson::UInt(65536))
                        .with("flags", QJson::List(vec![QJson::Str("auto".into())])),
                    QJson::dict()
                        .with("name", QJson::Str("c".into()))
                        .with("granularity", QJson::Int(-1))
                        .with("flags", QJson::List(vec![])),
                ]),
            );
        assert_eq!(
            v.dump_human(1),
            "    compat: 1.1\n    lazy refcounts: false\n    bitmaps:\n        [0]:\n            \
             flags:\n                [0]: auto\n            name: b\n            \
             granularity: 65536\n        [1]:\n            flags:\n            name: c\n            \
             granularity: -1\n"
        );
    }
}
