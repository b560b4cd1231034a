//! RBD image names as QEMU spells them:
//! `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP][:KEY=VALUE[:KEY=VALUE...]]`, a
//! backslash escaping the next character (`\:` in a value). `id=` is the
//! Ceph user, `conf=` the configuration file; every other key is a Ceph
//! option (`mon_host`, `keyring`, `auth_supported`, ...), as QEMU passes
//! it to librados.

use diskit_core::{Error, Result};

/// Where an RBD image is and how to reach its cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RbdName {
    /// The pool.
    pub pool: String,
    /// The namespace in the pool, if any.
    pub namespace: Option<String>,
    /// The image.
    pub image: String,
    /// A snapshot to read instead of the image's head.
    pub snapshot: Option<String>,
    /// The Ceph user (`id=`, QEMU's `user`), without `client.`.
    pub user: Option<String>,
    /// The configuration file (`conf=`); Ceph's default search without.
    pub conf: Option<String>,
    /// Further Ceph options, in order.
    pub options: Vec<(String, String)>,
}

/// The text up to the first `delim` not escaped by a backslash, and the
/// rest after it (`None` when there is no such `delim`).
fn next_token(s: &str, delim: char) -> (&str, Option<&str>) {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == delim {
            return (&s[..i], Some(&s[i + c.len_utf8()..]));
        }
    }
    (s, None)
}

/// `s` with its escaping backslashes taken out.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl RbdName {
    /// Parses QEMU's `rbd:` name.
    pub fn parse(name: &str) -> Result<RbdName> {
        let rest = name
            .strip_prefix("rbd:")
            .ok_or_else(|| Error::invalid("File name must start with 'rbd:'"))?;
        let (pool, rest) = next_token(rest, '/');
        let Some(rest) = rest else {
            return Err(Error::invalid("Pool name is required"));
        };
        let mut out = RbdName {
            pool: unescape(pool),
            ..RbdName::default()
        };
        let (image, rest) = if next_token(rest, '@').1.is_some() {
            let (image, after) = next_token(rest, '@');
            let (snap, after) = next_token(after.unwrap_or(""), ':');
            out.snapshot = Some(unescape(snap));
            (image, after)
        } else {
            next_token(rest, ':')
        };
        let image = match next_token(image, '/') {
            (ns, Some(image)) => {
                out.namespace = Some(unescape(ns));
                image
            }
            (image, None) => image,
        };
        out.image = unescape(image);
        if out.pool.is_empty() {
            return Err(Error::invalid("Pool name is required"));
        }
        if out.image.is_empty() {
            return Err(Error::invalid("Image name is required"));
        }
        let mut rest = rest;
        while let Some(r) = rest {
            let (pair, after) = next_token(r, ':');
            rest = after;
            let (key, value) = next_token(pair, '=');
            let Some(value) = value else {
                return Err(Error::invalid(format!(
                    "conf option {} has no value",
                    unescape(key)
                )));
            };
            let (key, value) = (unescape(key), unescape(value));
            match key.as_str() {
                "id" => out.user = Some(value),
                "conf" => out.conf = Some(value),
                _ => out.options.push((key, value)),
            }
        }
        Ok(out)
    }

    /// QEMU's canonical name of the image (what `info` shows).
    pub fn canonical(&self) -> String {
        // Names escape what separates them; option values only ':'.
        let escaped = |s: &str, special: &[char]| {
            s.chars()
                .flat_map(|c| {
                    let escape = c == '\\' || special.contains(&c);
                    escape.then_some('\\').into_iter().chain(std::iter::once(c))
                })
                .collect::<String>()
        };
        let esc = |s: &str| escaped(s, &[':', '@', '/']);
        let mut out = format!("rbd:{}/", esc(&self.pool));
        if let Some(ns) = &self.namespace {
            out += &format!("{}/", esc(ns));
        }
        out += &esc(&self.image);
        if let Some(s) = &self.snapshot {
            out += &format!("@{}", esc(s));
        }
        if let Some(c) = &self.conf {
            out += &format!(":conf={}", escaped(c, &[':', '@']));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_names_parse() {
        let n = RbdName::parse("rbd:pool/img").unwrap();
        assert_eq!((n.pool.as_str(), n.image.as_str()), ("pool", "img"));
        let n = RbdName::parse(
            r"rbd:p/ns/img@snap:conf=/etc/ceph/a\:b.conf:id=admin:mon_host=127.0.0.1\:6789",
        )
        .unwrap();
        assert_eq!(n.namespace.as_deref(), Some("ns"));
        assert_eq!(n.image, "img");
        assert_eq!(n.snapshot.as_deref(), Some("snap"));
        assert_eq!(n.conf.as_deref(), Some("/etc/ceph/a:b.conf"));
        assert_eq!(n.user.as_deref(), Some("admin"));
        assert_eq!(
            n.options,
            vec![("mon_host".to_string(), "127.0.0.1:6789".to_string())]
        );
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/img",
            "rbd:p/",
            "rbd:p/i:key",
            "x:p/i",
        ] {
            assert!(RbdName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn canonical_names_read_back() {
        for n in [r"rbd:p/img", r"rbd:p/ns/i\:x@s1:conf=/c"] {
            assert_eq!(RbdName::parse(n).unwrap().canonical(), n);
        }
    }
}
