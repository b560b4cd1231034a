//! The ssh plugin's answers to nbdkit's plugin API: one remote file per
//! handle, requests serialised per connection (libssh's sessions take one
//! call at a time), flush and multi-conn where the server has OpenSSH's
//! fsync extension; no trim, zero or extents (the server writes zeros).

use std::sync::Mutex;

use diskit_backends::callbacks::{Callbacks, Can, Support, ThreadModel};
use diskit_core::params::{boolean, secret};
use diskit_core::size::parse_size;
use diskit_core::sync::lock;
use diskit_core::{BlockSizeLimits, Error, ErrorKind, Result, ZeroFlags};

use crate::remote::{Remote, Settings};

/// The keys the plugin takes (nbdkit's).
pub const KEYS: &[&str] = &[
    "host",
    "path",
    "port",
    "user",
    "password",
    "config",
    "known-hosts",
    "identity",
    "verify-remote-host",
    "timeout",
    "compression",
    "create",
    "create-size",
    "create-mode",
];

/// The plugin, configured.
pub struct SshPlugin {
    settings: Settings,
    /// `create=true`: the file is made by the first connection only.
    create: Mutex<Option<(u64, u32)>>,
}

impl SshPlugin {
    /// The plugin from its `key=value` parameters in command-line order
    /// (`identity` may be given more than once).
    pub fn configure(params: &[(String, String)]) -> Result<SshPlugin> {
        let mut s = Settings {
            verify_remote_host: true,
            ..Settings::default()
        };
        let (mut create, mut create_size, mut create_mode) = (false, None, 0o600);
        for (k, v) in params {
            match k.as_str() {
                "host" => s.host = v.clone(),
                "path" => s.path = v.clone(),
                "port" => s.port = Some(v.clone()),
                "user" => s.user = Some(v.clone()),
                "password" => s.password = Some(secret("ssh", k, v)?),
                "config" => s.config = Some(v.clone()),
                "known-hosts" => s.known_hosts = Some(v.clone()),
                "identity" => s.identities.push(v.clone()),
                "verify-remote-host" => s.verify_remote_host = boolean("ssh", k, v)?,
                "timeout" => {
                    s.timeout = v.trim().parse().map_err(|_| {
                        Error::invalid(format!("timeout: could not parse number: {v}"))
                    })?
                }
                "compression" => s.compression = boolean("ssh", k, v)?,
                "create" => create = boolean("ssh", k, v)?,
                "create-size" => {
                    create_size = Some(parse_size(v).map_err(|_| {
                        Error::invalid(format!("could not parse size string ({v})"))
                    })?)
                }
                "create-mode" => {
                    let mode = diskit_core::params::nbdkit_unsigned(k, v, u64::from(u32::MAX))?;
                    if mode > 0o777 {
                        return Err(Error::invalid("create-mode must be <= 0777"));
                    }
                    create_mode = mode as u32;
                }
                _ => return Err(Error::invalid(format!("unknown parameter '{k}'"))),
            }
        }
        if s.host.is_empty() || s.path.is_empty() {
            return Err(Error::invalid(
                "you must supply the host and path parameters after the plugin name on the \
                 command line",
            ));
        }
        let create = match (create, create_size) {
            (false, _) => None,
            (true, Some(size)) => Some((size, create_mode)),
            (true, None) => {
                return Err(Error::invalid(
                    "if using create=true, you must specify the size of the new remote file \
                     using create-size=SIZE",
                ));
            }
        };
        Ok(SshPlugin {
            settings: s,
            create: Mutex::new(create),
        })
    }
}

/// A connection's remote file, one call at a time.
pub struct Connection {
    remote: Mutex<Remote>,
    fsync: bool,
}

impl Callbacks for SshPlugin {
    type Handle = Connection;

    fn name(&self) -> String {
        "ssh".into()
    }
    fn thread_model(&self) -> ThreadModel {
        ThreadModel::SerializeRequests
    }
    fn open(&self, readonly: bool, _export: &str, _tls: bool) -> Result<Connection> {
        // The file is created once, by the first connection that opens it.
        let mut create = lock(&self.create);
        let remote = Remote::open(&self.settings, readonly, *create)?;
        *create = None;
        let fsync = remote.can_fsync();
        Ok(Connection {
            remote: Mutex::new(remote),
            fsync,
        })
    }
    fn close(&self, _h: &Connection) {}
    fn get_size(&self, h: &Connection) -> Result<u64> {
        lock(&h.remote).size()
    }
    fn block_size(&self, _h: &Connection) -> Result<Option<BlockSizeLimits>> {
        Ok(None)
    }
    fn can(&self, h: &Connection, what: Can) -> Result<Option<bool>> {
        Ok(Some(match what {
            // Writable unless served read-only (the server decides).
            Can::Write => true,
            // OpenSSH's sftp-server is safe for multi-conn; its fsync
            // extension stands for it, as in nbdkit.
            Can::Flush | Can::MultiConn => h.fsync,
            Can::Trim | Can::Zero | Can::Extents | Can::Rotational => false,
            Can::FastZero => return Ok(None),
        }))
    }
    fn can_fua(&self, _h: &Connection) -> Result<Option<Support>> {
        Ok(None)
    }
    fn can_cache(&self, _h: &Connection) -> Result<Option<Support>> {
        Ok(None)
    }
    fn pread(&self, h: &Connection, buf: &mut [u8], offset: u64) -> Result<()> {
        lock(&h.remote).read_at(buf, offset)
    }
    fn pwrite(&self, h: &Connection, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        lock(&h.remote).write_at(buf, offset)
    }
    fn flush(&self, h: &Connection) -> Result<()> {
        lock(&h.remote).fsync()
    }
    fn trim(&self, _h: &Connection, _offset: u64, _len: u64, _fua: bool) -> Result<()> {
        Ok(())
    }
    fn zero(&self, _h: &Connection, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<()> {
        Err(Error::from_kind(ErrorKind::NotSupported))
    }
    fn extents(
        &self,
        _h: &Connection,
        _offset: u64,
        _len: u64,
        _req_one: bool,
    ) -> Result<Vec<(u64, u64, u32)>> {
        Err(Error::from_kind(ErrorKind::NotSupported))
    }
    fn cache(&self, _h: &Connection, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parameters_are_checked_as_nbdkit_checks_them() {
        let e = SshPlugin::configure(&args(&[("host", "h")])).err().unwrap();
        assert!(
            e.to_string().contains("you must supply the host and path"),
            "{e}"
        );
        let e = SshPlugin::configure(&args(&[("host", "h"), ("path", "p"), ("create", "true")]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("create-size=SIZE"), "{e}");
        let e = SshPlugin::configure(&args(&[
            ("host", "h"),
            ("path", "p"),
            ("create-mode", "01000"),
        ]))
        .err()
        .unwrap();
        assert!(e.to_string().contains("create-mode must be <= 0777"), "{e}");
        let e = SshPlugin::configure(&args(&[("host", "h"), ("path", "p"), ("colour", "x")]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("unknown parameter 'colour'"), "{e}");
        let p = SshPlugin::configure(&args(&[
            ("host", "h"),
            ("path", "p"),
            ("identity", "/a"),
            ("identity", "/b"),
            ("verify-remote-host", "false"),
        ]))
        .unwrap();
        assert_eq!(p.settings.identities, ["/a", "/b"]);
        assert!(!p.settings.verify_remote_host);
    }
}
