//! `-o key=value,...` option lists, as qemu-img parses them.
//!
//! Commas inside a value are doubled (`,,`); several `-o` flags merge, later
//! ones winning. Each format checks that every key is one it knows, so typos
//! are errors, not silence.

use diskit_core::size::{SizeError, parse_size_detailed};
use diskit_core::{Error, Result};

/// A boolean option value as QEMU spells it.
pub fn bool_value(name: &str, v: &str) -> Result<bool> {
    match v {
        "on" | "yes" | "true" | "y" => Ok(true),
        "off" | "no" | "false" | "n" => Ok(false),
        _ => Err(Error::invalid(format!(
            "Parameter '{name}' expects 'on' or 'off'"
        ))),
    }
}

/// A size option value, with QEMU's option parser's messages.
pub fn size_value(name: &str, v: &str) -> Result<u64> {
    parse_size_detailed(v).map_err(|e| match e {
        SizeError::Syntax => Error::invalid(format!(
            "Parameter '{name}' expects a non-negative number below 2^64\n\
             Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n\
             and exabytes, respectively."
        )),
        SizeError::Range => Error::invalid(format!(
            "Value '{v}' is out of range for parameter '{name}'"
        )),
    })
}

/// Splits QEMU option text at single commas; a doubled comma stands for a
/// comma inside an item. Empty items are kept (callers skip them).
pub fn split_items(text: &str) -> Vec<String> {
    let mut chars = text.chars().peekable();
    let mut item = String::new();
    let mut items = Vec::new();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                item.push(',');
            } else {
                items.push(std::mem::take(&mut item));
            }
        } else {
            item.push(c);
        }
    }
    items.push(item);
    items
}

/// Parsed `-o` options, in the order given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OptionList {
    items: Vec<(String, String)>,
}

impl OptionList {
    /// An empty list.
    pub fn new() -> OptionList {
        OptionList::default()
    }

    /// Parses one `-o` argument and merges it into the list.
    pub fn parse_into(&mut self, arg: &str) -> Result<()> {
        for it in split_items(arg) {
            if it.is_empty() {
                continue;
            }
            let (k, v) = match it.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                // A bare key is a boolean flag ("lazy_refcounts" = on) or "help".
                None => (
                    it.clone(),
                    if it == "help" {
                        String::new()
                    } else {
                        "on".into()
                    },
                ),
            };
            if k.is_empty() {
                return Err(Error::invalid(format!("Invalid option '{it}'")));
            }
            self.set(&k, &v);
        }
        Ok(())
    }

    /// Sets `key` to `value`, replacing an earlier value.
    pub fn set(&mut self, key: &str, value: &str) {
        self.items.retain(|(k, _)| k != key);
        self.items.push((key.to_string(), value.to_string()));
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.items
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the list asks for help (`help`, or `?` as QEMU also takes).
    pub fn wants_help(&self) -> bool {
        self.get("help").is_some() || self.get("?").is_some()
    }

    /// Whether no option was given.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The size value of `key`, if given.
    pub fn size(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|v| size_value(key, v)).transpose()
    }

    /// The boolean value of `key`, if given.
    pub fn flag(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| bool_value(key, v)).transpose()
    }

    /// The text of `key`, if given.
    pub fn text(&self, key: &str) -> Option<String> {
        self.get(key).map(str::to_string)
    }

    /// `key=value` for each of `keys` given, in the order of `keys` (what a
    /// "Formatting" line shows as given).
    pub fn given(&self, keys: &[&str]) -> Vec<(String, String)> {
        keys.iter()
            .filter_map(|k| self.get(k).map(|v| (k.to_string(), v.to_string())))
            .collect()
    }

    /// Fails naming the first key not in `known`.
    pub fn check_known(&self, known: &[&str]) -> Result<()> {
        for (k, _) in &self.items {
            if !known.contains(&k.as_str()) {
                return Err(Error::invalid(format!("Invalid parameter '{k}'")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_merges_and_escapes() {
        let mut o = OptionList::new();
        o.parse_into("preallocation=full,size=1M").unwrap();
        o.parse_into("backing_file=a,,b.img,preallocation=off")
            .unwrap();
        assert_eq!(o.get("preallocation"), Some("off"));
        assert_eq!(o.get("size"), Some("1M"));
        assert_eq!(o.get("backing_file"), Some("a,b.img"));
        assert!(o.check_known(&["size", "preallocation"]).is_err());
        assert!(
            o.check_known(&["size", "preallocation", "backing_file"])
                .is_ok()
        );
        assert!(o.parse_into("=x").is_err());
    }
}
