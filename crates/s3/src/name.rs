//! `s3://BUCKET/KEY`: the name of an object.

use diskit_core::{Error, Result};

/// An object's bucket and key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Name {
    /// The bucket.
    pub bucket: String,
    /// The key (any characters, `/` included).
    pub key: String,
}

/// The prefix of an object's name.
pub const PREFIX: &str = "s3://";

impl S3Name {
    /// Reads `s3://BUCKET/KEY`.
    pub fn parse(name: &str) -> Result<S3Name> {
        let bad = |why: String| Error::invalid(format!("'{name}': {why}"));
        let rest = name
            .strip_prefix(PREFIX)
            .ok_or_else(|| bad("not an s3://BUCKET/KEY name".into()))?;
        let (bucket, key) = rest
            .split_once('/')
            .ok_or_else(|| bad("expected s3://BUCKET/KEY".into()))?;
        S3Name::new(bucket, key).map_err(|e| bad(e.detail()))
    }

    /// The object `key` in `bucket`.
    pub fn new(bucket: &str, key: &str) -> Result<S3Name> {
        if bucket.is_empty() || bucket.contains(['/', '?', '#']) {
            return Err(Error::invalid(format!("'{bucket}' is not a bucket name")));
        }
        if key.is_empty() {
            return Err(Error::invalid("the object key is empty"));
        }
        Ok(S3Name {
            bucket: bucket.to_string(),
            key: key.to_string(),
        })
    }
}

impl std::fmt::Display for S3Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{PREFIX}{}/{}", self.bucket, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_at_the_first_slash() {
        let n = S3Name::parse("s3://images/vm/disk.qcow2").unwrap();
        assert_eq!(
            (n.bucket.as_str(), n.key.as_str()),
            ("images", "vm/disk.qcow2")
        );
        assert_eq!(n.to_string(), "s3://images/vm/disk.qcow2");
        for bad in ["s3://images", "s3://images/", "s3:///key", "http://a/b"] {
            assert!(S3Name::parse(bad).is_err(), "{bad}");
        }
    }
}
