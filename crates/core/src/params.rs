//! Values of nbdkit-style `key=value` parameters, read as nbdkit reads
//! them, for the filters and the plugins alike.

use crate::error::{Error, Result};

/// A boolean as nbdkit reads them: 1/true/yes/on or 0/false/no/off, any
/// case; `who` (a filter or plugin) and `key` name it in the message.
pub fn boolean(who: &str, key: &str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::invalid(format!(
            "{who}: {key}: could not decipher boolean '{value}'"
        ))),
    }
}
