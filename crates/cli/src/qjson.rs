//! JSON printed the way QEMU prints it, so that output compares equal to
//! qemu-img's byte for byte: keys in insertion order, four-space indents,
//! and empty containers opened and closed on separate lines.

use std::fmt::Write;

/// A JSON value with ordered object keys.
#[derive(Debug, Clone, PartialEq)]
pub enum QJson {
    /// `true` / `false`.
    Bool(bool),
    /// An unsigned integer.
    UInt(u64),
    /// A string.
    Str(String),
    /// An array.
    List(Vec<QJson>),
    /// An object with keys in order.
    Dict(Vec<(String, QJson)>),
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

    /// Pretty-prints as qemu's `qobject_to_json_pretty`.
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
                for (i, (k, v)) in items.iter().enumerate() {
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

    /// Prints on one line, with qemu's spacing (`{"a": 1, "b": 2}`).
    pub fn write_compact(&self, out: &mut String) {
        match self {
            QJson::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            QJson::UInt(n) => {
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
            .with("a", QJson::UInt(1))
            .with("d", QJson::dict());
        assert_eq!(
            v.pretty(),
            "{\n    \"children\": [\n    ],\n    \"a\": 1,\n    \"d\": {\n    }\n}"
        );
    }
}
