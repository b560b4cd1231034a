//! Where an S3 store is and who asks it: the endpoint, region and
//! credentials, found as the AWS tools find them (the environment, then
//! the profile in `~/.aws/credentials` and `~/.aws/config`), with what a
//! name's keys say first.

use std::collections::HashMap;
use std::path::PathBuf;

use diskit_core::{Error, Result};

/// Access keys.
#[derive(Clone, PartialEq, Eq)]
pub struct Keys {
    /// The access key id.
    pub access_key: String,
    /// The secret access key.
    pub secret_key: String,
    /// The session token of temporary credentials.
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

/// What the caller sets, each overriding what the environment and the
/// profile say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct S3Options {
    /// The endpoint URL of an S3-compatible store (radosgw, MinIO):
    /// reached with path-style addressing.
    pub endpoint_url: Option<String>,
    /// The region.
    pub region: Option<String>,
    /// The access key id.
    pub access_key: Option<String>,
    /// The secret access key.
    pub secret_key: Option<String>,
    /// The session token.
    pub session_token: Option<String>,
    /// The profile of the shared files (else `AWS_PROFILE`, else `default`).
    pub profile: Option<String>,
    /// Requests in flight at once, and connections kept open.
    pub connections: usize,
    /// Tries after the first for a request that may pass.
    pub retries: u32,
}

impl S3Options {
    /// The defaults: 16 connections, 5 retries, the rest from the
    /// environment.
    pub fn new() -> S3Options {
        S3Options {
            connections: 16,
            retries: 5,
            ..Default::default()
        }
    }
}

/// The settings found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The endpoint URL; `None` for AWS itself (virtual-host addressing).
    pub endpoint_url: Option<String>,
    /// The region (`us-east-1` when nothing says).
    pub region: String,
    /// The keys; `None` for anonymous requests.
    pub keys: Option<Keys>,
}

/// A source of the environment's variables (the process's, or a test's).
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process's environment, with empty values as unset.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Settings {
    /// Finds the settings as the AWS CLI does: `opts`, then the
    /// environment (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`,
    /// `AWS_REGION`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), then the profile
    /// (`AWS_PROFILE`, default `default`) in the credentials file
    /// (`AWS_SHARED_CREDENTIALS_FILE`, default `~/.aws/credentials`) and the
    /// config file (`AWS_CONFIG_FILE`, default `~/.aws/config`). A profile
    /// named in `opts` comes before the environment's keys, as `--profile`
    /// does.
    pub fn find(opts: &S3Options, env: Env<'_>) -> Result<Settings> {
        let profile_name = opts
            .profile
            .clone()
            .or_else(|| env("AWS_PROFILE"))
            .unwrap_or_else(|| "default".into());
        let home = env("HOME").map(PathBuf::from);
        let file = |var: &str, name: &str| {
            env(var)
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
        };
        let credentials = read_ini(file("AWS_SHARED_CREDENTIALS_FILE", "credentials"))?;
        let config = read_ini(file("AWS_CONFIG_FILE", "config"))?;
        // The credentials file names sections by the profile; the config
        // file says `profile NAME`, but `default` as it is.
        let empty = HashMap::new();
        let in_credentials = credentials.get(&profile_name).unwrap_or(&empty);
        let in_config = config
            .get(&format!("profile {profile_name}"))
            .or_else(|| {
                (profile_name == "default")
                    .then(|| config.get("default"))
                    .flatten()
            })
            .unwrap_or(&empty);
        if opts.profile.is_some() && in_credentials.is_empty() && in_config.is_empty() {
            return Err(Error::invalid(format!(
                "s3: the profile '{profile_name}' could not be found"
            )));
        }
        let from_profile = |key: &str| {
            in_credentials
                .get(key)
                .or_else(|| in_config.get(key))
                .cloned()
        };

        let endpoint_url = opts
            .endpoint_url
            .clone()
            .or_else(|| env("AWS_ENDPOINT_URL_S3"))
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| from_profile("endpoint_url"));
        let region = opts
            .region
            .clone()
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .or_else(|| from_profile("region"))
            .unwrap_or_else(|| "us-east-1".into());

        let given = match (&opts.access_key, &opts.secret_key) {
            (Some(a), Some(s)) => Some(Keys {
                access_key: a.clone(),
                secret_key: s.clone(),
                session_token: opts.session_token.clone(),
            }),
            (None, None) => None,
            _ => {
                return Err(Error::invalid(
                    "s3: an access key and a secret key go together",
                ));
            }
        };
        let from_env = || match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
            (Some(a), Some(s)) => Some(Keys {
                access_key: a,
                secret_key: s,
                session_token: env("AWS_SESSION_TOKEN"),
            }),
            _ => None,
        };
        let from_files = || match (
            from_profile("aws_access_key_id"),
            from_profile("aws_secret_access_key"),
        ) {
            (Some(a), Some(s)) => Some(Keys {
                access_key: a,
                secret_key: s,
                session_token: from_profile("aws_session_token"),
            }),
            _ => None,
        };
        let keys = if opts.profile.is_some() {
            given.or_else(from_files).or_else(from_env)
        } else {
            given.or_else(from_env).or_else(from_files)
        };
        Ok(Settings {
            endpoint_url,
            region,
            keys,
        })
    }
}

/// An INI file as the AWS tools write it: `[section]`, then `key = value`
/// lines (`#` and `;` start comments; indented lines belong to a nested
/// block, which diskit does not read). A missing file is empty.
fn read_ini(path: Option<PathBuf>) -> Result<HashMap<String, HashMap<String, String>>> {
    let Some(path) = path else {
        return Ok(HashMap::new());
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(Error::from(e).context(format!("s3: {}", path.display()))),
    };
    Ok(parse_ini(&text))
}

/// The sections of an AWS credentials or config file's text, each a map
/// of its keys (see [`read_ini`]'s rules).
pub fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section: Option<String> = None;
    for line in text.lines() {
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let line = line.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            out.entry(name.clone()).or_default();
            section = Some(name);
        } else if let (Some(s), Some((k, v))) = (&section, line.split_once('=')) {
            let v = v.trim();
            if !v.is_empty() {
                out.entry(s.clone())
                    .or_default()
                    .insert(k.trim().to_string(), v.to_string());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    #[test]
    fn the_environment_comes_before_the_profile_and_options_before_both() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = DEF\naws_secret_access_key = defsecret\n\
             # a comment\n[other]\naws_access_key_id=OTH\naws_secret_access_key=othsecret\n\
             aws_session_token = tok\n",
        )
        .unwrap();
        std::fs::write(
            &config,
            "[default]\nregion = eu-west-1\n[profile other]\nregion = ap-south-1\n\
             endpoint_url = http://127.0.0.1:9000\ns3 =\n  addressing_style = path\n",
        )
        .unwrap();
        let files = [
            ("AWS_SHARED_CREDENTIALS_FILE", creds.to_str().unwrap()),
            ("AWS_CONFIG_FILE", config.to_str().unwrap()),
        ];
        let s = Settings::find(&S3Options::new(), &env_of(&files)).unwrap();
        assert_eq!(s.region, "eu-west-1");
        assert_eq!(s.endpoint_url, None);
        assert_eq!(s.keys.unwrap().access_key, "DEF");

        let mut vars = files.to_vec();
        vars.extend([
            ("AWS_ACCESS_KEY_ID", "ENV"),
            ("AWS_SECRET_ACCESS_KEY", "envsecret"),
            ("AWS_REGION", "us-west-2"),
            ("AWS_ENDPOINT_URL", "http://h:1"),
        ]);
        let s = Settings::find(&S3Options::new(), &env_of(&vars)).unwrap();
        assert_eq!(s.keys.as_ref().unwrap().access_key, "ENV");
        assert_eq!(s.region, "us-west-2");
        assert_eq!(s.endpoint_url.as_deref(), Some("http://h:1"));

        // A profile asked for by name: its keys before the environment's.
        let opts = S3Options {
            profile: Some("other".into()),
            ..S3Options::new()
        };
        let s = Settings::find(&opts, &env_of(&files)).unwrap();
        let k = s.keys.unwrap();
        assert_eq!(
            (k.access_key.as_str(), k.session_token.as_deref()),
            ("OTH", Some("tok"))
        );
        assert_eq!(s.region, "ap-south-1");
        assert_eq!(s.endpoint_url.as_deref(), Some("http://127.0.0.1:9000"));

        let opts = S3Options {
            access_key: Some("KEY".into()),
            secret_key: Some("SECRET".into()),
            region: Some("r".into()),
            ..S3Options::new()
        };
        let s = Settings::find(&opts, &env_of(&vars)).unwrap();
        assert_eq!(s.keys.unwrap().access_key, "KEY");
        assert_eq!(s.region, "r");

        let opts = S3Options {
            profile: Some("missing".into()),
            ..S3Options::new()
        };
        let e = Settings::find(&opts, &env_of(&files)).unwrap_err();
        assert!(e.to_string().contains("'missing'"), "{e}");
        let opts = S3Options {
            access_key: Some("KEY".into()),
            ..S3Options::new()
        };
        assert!(Settings::find(&opts, &env_of(&files)).is_err());
    }

    #[test]
    fn no_files_and_no_keys_is_anonymous_in_us_east_1() {
        let s = Settings::find(&S3Options::new(), &env_of(&[("HOME", "/nonexistent")])).unwrap();
        assert_eq!(s.keys, None);
        assert_eq!(s.region, "us-east-1");
    }
}
