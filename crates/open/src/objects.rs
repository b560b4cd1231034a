//! qemu-img's and qemu-nbd's `--object` definitions, as `key=value` lists
//! or JSON objects: secrets (kept by the formats' crypto, which reads
//! them), TLS credentials (`tls-creds-x509`, `tls-creds-psk`), which an
//! nbd node names with `tls-creds=ID`, and authorization objects
//! (`authz-*`, kept by [`crate::authz`]), which `--tls-authz=ID` names.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{OnceLock, RwLock};

use diskit_core::{Error, Result};
use diskit_formats::options::split_items;

/// Which kind of key a TLS credentials object holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsKind {
    /// X.509 certificates (`ca-cert.pem`, `client-cert.pem`,
    /// `client-key.pem` or `server-*.pem` in `dir`).
    X509,
    /// Pre-shared keys (`keys.psk` in `dir`).
    Psk,
}

/// Which end of a connection the credentials are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// The end that connects.
    Client,
    /// The end that listens.
    Server,
}

/// One `tls-creds-x509` or `tls-creds-psk` object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsCreds {
    /// Certificates or pre-shared keys.
    pub kind: TlsKind,
    /// Which end they are for.
    pub endpoint: Endpoint,
    /// The directory holding the files.
    pub dir: PathBuf,
    /// Whether the peer's certificate is checked (X.509; QEMU's default:
    /// on).
    pub verify_peer: bool,
    /// The PSK identity a client sends (QEMU's default: `qemu`).
    pub username: String,
}

impl TlsCreds {
    /// The key file of PSK credentials, as QEMU names it.
    pub fn psk_file(&self) -> PathBuf {
        self.dir.join("keys.psk")
    }
}

fn tls_objects() -> &'static RwLock<HashMap<String, TlsCreds>> {
    static OBJECTS: OnceLock<RwLock<HashMap<String, TlsCreds>>> = OnceLock::new();
    OBJECTS.get_or_init(Default::default)
}

/// The TLS credentials called `id`, with QEMU's messages when there are
/// none, or when they are for the other end.
pub fn tls_creds(id: &str, endpoint: Endpoint) -> Result<TlsCreds> {
    let creds = tls_objects()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(id)
        .cloned()
        .ok_or_else(|| Error::invalid(format!("No TLS credentials with id '{id}'")))?;
    if creds.endpoint != endpoint {
        let end = match endpoint {
            Endpoint::Client => "client",
            Endpoint::Server => "server",
        };
        return Err(Error::invalid(format!(
            "Expected TLS credentials for a {end} endpoint"
        )));
    }
    Ok(creds)
}

/// Defines what one `--object` argument describes: a `secret`, a
/// `tls-creds-x509`, a `tls-creds-psk` or an `authz-*` object, as
/// `key=value` items or (starting with `{`) a JSON object; another type
/// is refused by name.
pub fn define_object(text: &str) -> Result<()> {
    if text.trim_start().starts_with('{') {
        return define_json(text);
    }
    let parts = split_items(text);
    let qom_type = match parts.first().map(|p| p.split_once('=')) {
        Some(Some(("qom-type", v))) => v.to_string(),
        Some(None) => parts[0].clone(),
        _ => parts
            .iter()
            .find_map(|p| p.strip_prefix("qom-type="))
            .ok_or_else(|| Error::invalid("Parameter 'qom-type' is missing"))?
            .to_string(),
    };
    let kind = match qom_type.as_str() {
        "tls-creds-x509" => Some(TlsKind::X509),
        "tls-creds-psk" => Some(TlsKind::Psk),
        t if crate::authz::is_authz_type(t) => None,
        _ => return diskit_formats::crypto::secret::define_object(text),
    };
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for p in &parts {
        match p.split_once('=') {
            Some(("qom-type", _)) => {}
            Some(kv) => keys.push(kv),
            None if *p == qom_type => {}
            None => {
                return Err(Error::invalid(format!(
                    "Invalid parameter '{p}' in --object (expected key=value)"
                )));
            }
        }
    }
    let Some(kind) = kind else {
        return crate::authz::define_from_items(&qom_type, &keys);
    };
    let allowed: &[&str] = match kind {
        TlsKind::X509 => &[
            "id",
            "endpoint",
            "dir",
            "verify-peer",
            "priority",
            "sanity-check",
            "passwordid",
        ],
        TlsKind::Psk => &[
            "id",
            "endpoint",
            "dir",
            "verify-peer",
            "priority",
            "username",
        ],
    };
    if let Some((k, _)) = keys.iter().find(|(k, _)| !allowed.contains(k)) {
        return Err(Error::invalid(format!(
            "Property '{qom_type}.{k}' not found"
        )));
    }
    let get = |k: &str| {
        keys.iter()
            .rev()
            .find(|(key, _)| *key == k)
            .map(|(_, v)| *v)
    };
    let id = get("id").ok_or_else(|| Error::invalid("Parameter 'id' is missing"))?;
    let endpoint = match get("endpoint").unwrap_or("client") {
        "client" => Endpoint::Client,
        "server" => Endpoint::Server,
        other => {
            return Err(Error::invalid(format!(
                "Parameter 'endpoint' does not accept value '{other}'"
            )));
        }
    };
    let verify_peer = match get("verify-peer") {
        None => true,
        Some(v) => diskit_formats::options::bool_value("verify-peer", v)?,
    };
    if get("passwordid").is_some() {
        return Err(Error::unsupported(format!(
            "{qom_type} '{id}': encrypted private keys (passwordid=) are not supported"
        )));
    }
    let dir = PathBuf::from(get("dir").unwrap_or("/etc/pki/qemu"));
    let creds = TlsCreds {
        kind,
        endpoint,
        dir,
        verify_peer,
        username: get("username").unwrap_or("qemu").to_string(),
    };
    let mut objects = diskit_core::sync::write(tls_objects());
    if objects.contains_key(id) {
        return Err(Error::invalid(format!(
            "attempt to add duplicate property '{id}' to object (type 'container')"
        )));
    }
    objects.insert(id.to_string(), creds);
    Ok(())
}

/// Defines the object a JSON `--object` describes: authorization objects
/// take it as it is (their rules are a JSON array); the others are
/// written back as `key=value` items.
fn define_json(text: &str) -> Result<()> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Error::invalid(format!("--object: JSON parse error, {e}")))?;
    let serde_json::Value::Object(mut props) = value else {
        return Err(Error::invalid("--object: expected a JSON object"));
    };
    let qom_type = match props.remove("qom-type") {
        Some(serde_json::Value::String(t)) => t,
        Some(_) => {
            return Err(Error::invalid(
                "Invalid parameter type for 'qom-type', expected: string",
            ));
        }
        None => return Err(Error::invalid("Parameter 'qom-type' is missing")),
    };
    if crate::authz::is_authz_type(&qom_type) {
        return crate::authz::define(&qom_type, &props);
    }
    let mut items = vec![qom_type];
    for (k, v) in &props {
        let v = match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Bool(b) => if *b { "on" } else { "off" }.to_string(),
            serde_json::Value::Number(n) => n.to_string(),
            _ => {
                return Err(Error::invalid(format!(
                    "Invalid parameter type for '{k}', expected: string"
                )));
            }
        };
        items.push(format!("{k}={}", v.replace(',', ",,")));
    }
    define_object(&items.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_objects_are_defined_and_found() {
        define_object("tls-creds-x509,id=t-x,endpoint=client,dir=/p,verify-peer=off").unwrap();
        let c = tls_creds("t-x", Endpoint::Client).unwrap();
        assert_eq!(c.kind, TlsKind::X509);
        assert!(!c.verify_peer);
        define_object("qom-type=tls-creds-psk,id=t-p,dir=/k").unwrap();
        let c = tls_creds("t-p", Endpoint::Client).unwrap();
        assert_eq!(c.psk_file(), PathBuf::from("/k/keys.psk"));
        assert_eq!(c.username, "qemu");
        let e = tls_creds("t-p", Endpoint::Server).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Expected TLS credentials for a server endpoint"
        );
        let e = tls_creds("none", Endpoint::Client).unwrap_err();
        assert_eq!(e.to_string(), "No TLS credentials with id 'none'");
        assert!(define_object("tls-creds-x509,id=t-x").is_err());
        assert!(define_object("tls-creds-psk,id=t-q,colour=red").is_err());
        assert!(define_object("tls-creds-psk,id=t-r,endpoint=middle").is_err());
        define_object("secret,id=t-s,data=x").unwrap();
        define_object(
            r#"{"qom-type":"tls-creds-psk","id":"t-j","dir":"/a,b","verify-peer":false}"#,
        )
        .unwrap();
        let c = tls_creds("t-j", Endpoint::Client).unwrap();
        assert_eq!(c.dir, PathBuf::from("/a,b"));
        assert!(!c.verify_peer);
        define_object(
            r#"{"qom-type":"authz-list","id":"t-az","rules":[{"match":"CN=*","policy":"allow","format":"glob"}]}"#,
        )
        .unwrap();
        let a = crate::authz::authorizer("t-az");
        assert!(a.is_allowed("CN=x").unwrap());
        assert!(!a.is_allowed("O=x").unwrap());
        define_object("authz-simple,id=t-as,identity=CN=a,,O=b").unwrap();
        assert!(
            crate::authz::authorizer("t-as")
                .is_allowed("CN=a,O=b")
                .unwrap()
        );
    }
}
