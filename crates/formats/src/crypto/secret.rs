//! Secrets, as QEMU's `--object secret,id=ID,data=...|file=...` defines
//! them, and the process-wide table that `key-secret=ID` options refer to.
//!
//! A secret's bytes are wiped when its last holder drops it, and never
//! shown: `Debug` prints the length only.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use base64::Engine as _;
use diskit_core::{Error, ErrorKind, Result};
use zeroize::Zeroizing;

/// The bytes of a secret (a passphrase).
#[derive(Clone)]
pub struct Secret(Arc<Zeroizing<Vec<u8>>>);

impl Secret {
    /// A secret holding `bytes`.
    pub fn new(bytes: Vec<u8>) -> Secret {
        Secret(Arc::new(Zeroizing::new(bytes)))
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

/// The secrets defined for this process, by id.
#[derive(Default)]
pub struct Secrets {
    by_id: RwLock<HashMap<String, Secret>>,
}

static GLOBAL: std::sync::OnceLock<Secrets> = std::sync::OnceLock::new();

impl Secrets {
    /// The process-wide table (`--object` defines into it).
    pub fn global() -> &'static Secrets {
        GLOBAL.get_or_init(Secrets::default)
    }

    /// Defines secret `id`; an id already defined is an error, as in QEMU.
    pub fn insert(&self, id: &str, secret: Secret) -> Result<()> {
        let mut map = diskit_core::sync::write(&self.by_id);
        if map.contains_key(id) {
            return Err(Error::invalid(format!(
                "attempt to add duplicate property '{id}' to object (type 'container')"
            )));
        }
        map.insert(id.to_string(), secret);
        Ok(())
    }

    /// The secret `id`, with QEMU's message when there is none.
    pub fn get(&self, id: &str) -> Result<Secret> {
        diskit_core::sync::read(&self.by_id)
            .get(id)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("No secret with id '{id}'")))
    }
}

/// Defines what one `--object` argument describes. Only `secret` objects
/// are known; another type is refused by name.
pub fn define_object(text: &str) -> Result<()> {
    let parts = crate::options::split_items(text);
    let mut qom_type = None;
    let mut keys: Vec<(String, String)> = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        match p.split_once('=') {
            Some(("qom-type", v)) => qom_type = Some(v.to_string()),
            Some((k, v)) => keys.push((k.to_string(), v.to_string())),
            None if i == 0 => qom_type = Some(p.clone()),
            None => {
                return Err(Error::invalid(format!(
                    "Invalid parameter '{p}' in --object (expected key=value)"
                )));
            }
        }
    }
    let qom_type = qom_type.ok_or_else(|| Error::invalid("Parameter 'qom-type' is missing"))?;
    if qom_type != "secret" {
        return Err(Error::invalid(format!(
            "Invalid object type '{qom_type}' (diskit knows: secret)"
        )));
    }
    let get = |k: &str| {
        keys.iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    };
    for (k, _) in &keys {
        if !matches!(
            k.as_str(),
            "id" | "data" | "file" | "format" | "keyid" | "iv"
        ) {
            return Err(Error::invalid(format!("Property 'secret.{k}' not found")));
        }
    }
    let id = get("id").ok_or_else(|| Error::invalid("Parameter 'id' is missing"))?;
    if get("keyid").is_some() || get("iv").is_some() {
        return Err(Error::new(
            ErrorKind::NotSupported,
            format!(
                "secret '{id}': secrets encrypted with another secret (keyid=, iv=) are not supported"
            ),
        ));
    }
    let raw = match (get("data"), get("file")) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(format!(
                "secret '{id}': 'data' and 'file' are mutually exclusive"
            )));
        }
        (Some(d), None) => Zeroizing::new(d.as_bytes().to_vec()),
        (None, Some(f)) => Zeroizing::new(
            std::fs::read(f).map_err(|e| Error::from(e).context(format!("Unable to read {f}")))?,
        ),
        (None, None) => {
            return Err(Error::invalid(format!(
                "secret '{id}': Either 'file' or 'data' must be provided"
            )));
        }
    };
    let bytes = match get("format").unwrap_or("raw") {
        "raw" => raw.to_vec(),
        "base64" => {
            let text = std::str::from_utf8(&raw)
                .map_err(|_| Error::invalid(format!("secret '{id}': invalid base64 data")))?;
            base64::engine::general_purpose::STANDARD
                .decode(text.trim())
                .map_err(|_| Error::invalid(format!("secret '{id}': invalid base64 data")))?
        }
        other => {
            return Err(Error::invalid(format!(
                "Parameter 'format' does not accept value '{other}'"
            )));
        }
    };
    Secrets::global().insert(id, Secret::new(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_define_secrets() {
        define_object("secret,id=t-raw,data=pass,,word").unwrap();
        assert_eq!(
            Secrets::global().get("t-raw").unwrap().bytes(),
            b"pass,word"
        );
        define_object("secret,id=t-b64,data=MTIzNDU2,format=base64").unwrap();
        assert_eq!(Secrets::global().get("t-b64").unwrap().bytes(), b"123456");
        assert!(define_object("secret,id=t-raw,data=x").is_err());
        assert!(define_object("secret,id=t-none").is_err());
        assert!(define_object("throttle-group,id=t1").is_err());
        assert!(define_object("secret,id=t-bad,data=x,colour=red").is_err());
        let e = Secrets::global().get("nope").unwrap_err();
        assert_eq!(e.to_string(), "No secret with id 'nope'");
        assert_eq!(
            format!("{:?}", Secret::new(b"abc".to_vec())),
            "Secret(3 bytes)"
        );
    }
}
