//! One connection to the remote file: an SSH session, its SFTP channel
//! and the open file, set up as nbdkit's ssh plugin sets them up (the
//! options, the local SSH configuration, the host key check against the
//! known hosts, authentication by none, public key then password).

use std::ffi::{CStr, CString, c_int, c_void};

use diskit_core::{Error, ErrorKind, Result};

use crate::api::{self, Api, Attributes, Handle, known, options};

/// What every connection is made with: nbdkit's ssh plugin's parameters.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `host=`.
    pub host: String,
    /// `path=`: the remote file.
    pub path: String,
    /// `port=`.
    pub port: Option<String>,
    /// `user=`.
    pub user: Option<String>,
    /// `password=` (already read from its file or descriptor).
    pub password: Option<String>,
    /// `config=`: `None` reads the default files, `""` none.
    pub config: Option<String>,
    /// `known-hosts=`.
    pub known_hosts: Option<String>,
    /// `identity=`, in order.
    pub identities: Vec<String>,
    /// `verify-remote-host=` (default true).
    pub verify_remote_host: bool,
    /// `timeout=` in seconds (0: libssh's default).
    pub timeout: u32,
    /// `compression=`.
    pub compression: bool,
    /// `create-size=` with `create=true`: the new file's size, and its
    /// mode (`create-mode=`).
    pub create: Option<(u64, u32)>,
}

/// An open remote file. libssh's handles are used by one thread at a
/// time (the plugin's thread model serialises each connection's
/// requests, and the handle is behind its own lock too).
pub struct Remote {
    api: &'static Api,
    session: Handle,
    sftp: Handle,
    file: Handle,
}

// SAFETY: a libssh session and its SFTP handles may move between threads
// as long as one thread uses them at a time, which `Remote`'s owner
// guarantees (it keeps the remote behind a mutex).
unsafe impl Send for Remote {}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} has a NUL byte")))
}

impl Remote {
    /// libssh's last error on this session.
    fn error(&self) -> String {
        // SAFETY: the session is live; libssh returns a NUL-terminated
        // string it owns, valid until the next call on the session.
        unsafe {
            let p = (self.api.ssh_get_error)(self.session);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    fn set(&self, option: c_int, value: *const c_void, what: &str, shown: &str) -> Result<()> {
        // SAFETY: the session is live; `value` points to the type the
        // option takes, alive for the call (libssh copies it).
        let r = unsafe { (self.api.ssh_options_set)(self.session, option, value) };
        if r != api::SSH_OK {
            return Err(Error::invalid(format!(
                "failed to set {what} in libssh session: {shown}: {}",
                self.error()
            )));
        }
        Ok(())
    }

    fn set_str(&self, option: c_int, value: &str, what: &str) -> Result<()> {
        let c = cstring(what, value)?;
        self.set(option, c.as_ptr().cast(), what, value)
    }

    /// Connects, checks the host, authenticates and opens the file
    /// (read-only when `readonly`); with `create`, the file is made
    /// (replacing one there) with that size and mode.
    pub fn open(s: &Settings, readonly: bool, create: Option<(u64, u32)>) -> Result<Remote> {
        let api = api::api()?;
        // SAFETY: no arguments; NULL when libssh cannot allocate.
        let session = unsafe { (api.ssh_new)() };
        if session.is_null() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                "failed to initialize libssh session",
            ));
        }
        let mut r = Remote {
            api,
            session,
            sftp: std::ptr::null_mut(),
            file: std::ptr::null_mut(),
        };
        r.set_up(s)?;
        r.connect(s)?;
        r.open_file(s, readonly, create)?;
        Ok(r)
    }

    fn set_up(&self, s: &Settings) -> Result<()> {
        let one: c_int = 1;
        // Nagle's algorithm off, as libssh advises for SFTP (an error is
        // ignored, as nbdkit ignores it).
        let _ = self.set(
            options::NODELAY,
            (&one as *const c_int).cast(),
            "nodelay",
            "1",
        );
        self.set_str(options::HOST, &s.host, "host")?;
        if let Some(port) = &s.port {
            self.set_str(options::PORT_STR, port, "port")?;
        }
        if let Some(user) = &s.user {
            self.set_str(options::USER, user, "user")?;
        }
        if let Some(k) = &s.known_hosts {
            self.set_str(options::KNOWNHOSTS, k, "known_hosts")?;
        }
        for id in &s.identities {
            self.set_str(options::ADD_IDENTITY, id, "identity")?;
        }
        if s.timeout > 0 {
            let t = api::Long::from(s.timeout);
            self.set(
                options::TIMEOUT,
                (&t as *const api::Long).cast(),
                "timeout",
                &s.timeout.to_string(),
            )?;
        }
        if s.compression {
            self.set_str(options::COMPRESSION, "yes", "compression")?;
        }
        // The configuration last, once the host is known.
        let file = match s.config.as_deref() {
            None => None,
            Some("") => return Ok(()),
            Some(f) => Some(cstring("config", f)?),
        };
        // SAFETY: the session is live; the file name, if any, is a C
        // string alive for the call (NULL: the default files).
        let rc = unsafe {
            (self.api.ssh_options_parse_config)(
                self.session,
                file.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if rc != api::SSH_OK {
            return Err(Error::invalid(match &s.config {
                None => format!("failed to parse local SSH configuration: {}", self.error()),
                Some(f) => format!("failed to parse SSH configuration: {f}: {}", self.error()),
            }));
        }
        Ok(())
    }

    fn connect(&self, s: &Settings) -> Result<()> {
        // SAFETY: the session is live and set up.
        if unsafe { (self.api.ssh_connect)(self.session) } != api::SSH_OK {
            return Err(Error::io(format!(
                "failed to connect to remote host: {}: {}",
                s.host,
                self.error()
            )));
        }
        if s.verify_remote_host {
            self.verify_host()?;
        }
        self.authenticate(s)
    }

    fn verify_host(&self) -> Result<()> {
        // SAFETY: the session is connected.
        let state = unsafe { (self.api.ssh_session_is_known_server)(self.session) };
        let why = match state {
            known::OK => return Ok(()),
            known::CHANGED => "host key for server changed".to_string(),
            known::OTHER => {
                "host key for server was not found but another type of key exists".to_string()
            }
            known::NOT_FOUND => "could not find known_hosts file".to_string(),
            known::UNKNOWN => "either the host key is unknown, you must use ssh first and \
                               accept the host key; or the known_hosts file (usually \
                               ~/.ssh/known_hosts) could not be opened, check that the file \
                               exists and file permissions"
                .to_string(),
            known::ERROR => format!("known hosts error: {}", self.error()),
            other => format!("known hosts error: state {other}"),
        };
        Err(Error::new(ErrorKind::PermissionDenied, why))
    }

    fn authenticate(&self, s: &Settings) -> Result<()> {
        let (a, sess) = (self.api, self.session);
        // SAFETY: (every call below) the session is connected; the user
        // name argument is NULL (the session's), the password a C string
        // alive for the call.
        let rc = unsafe { (a.ssh_userauth_none)(sess, std::ptr::null()) };
        if rc == api::AUTH_SUCCESS {
            return Ok(());
        }
        let denied = |m: String| Err(Error::new(ErrorKind::PermissionDenied, m));
        if rc == api::AUTH_ERROR {
            return denied(format!("authentication failed: {}", self.error()));
        }
        // SAFETY: as above (a live, connected session; C strings alive for the call).
        let methods = unsafe { (a.ssh_userauth_list)(sess, std::ptr::null()) };
        if methods & api::METHOD_PUBLICKEY != 0 {
            // SAFETY: as above (a live, connected session; C strings alive for the call).
            let rc = unsafe {
                (a.ssh_userauth_publickey_auto)(sess, std::ptr::null(), std::ptr::null())
            };
            if rc == api::AUTH_SUCCESS {
                return Ok(());
            }
        }
        if let Some(pw) = &s.password
            && methods & api::METHOD_PASSWORD != 0
        {
            let c = cstring("password", pw)?;
            // SAFETY: as above (a live, connected session; C strings alive for the call).
            let rc = unsafe { (a.ssh_userauth_password)(sess, std::ptr::null(), c.as_ptr()) };
            if rc == api::AUTH_SUCCESS {
                return Ok(());
            }
        }
        let password = s.password.is_some();
        if methods & api::METHOD_PUBLICKEY == 0 && !password {
            return denied(
                "the server does not offer public key authentication; try using the \
                 password=... parameter"
                    .into(),
            );
        }
        if methods & api::METHOD_PASSWORD != 0 && password {
            return denied(
                "password authentication failed, is the username and password correct?".into(),
            );
        }
        if methods & api::METHOD_PASSWORD == 0 && password {
            return denied(
                "the server does not offer password authentication but you tried to use a \
                 password; if you have root access to the server, try editing 'sshd_config' \
                 and setting 'PasswordAuthentication yes'; otherwise try setting up public \
                 key authentication"
                    .into(),
            );
        }
        denied("all possible authentication methods failed".into())
    }

    fn open_file(
        &mut self,
        s: &Settings,
        readonly: bool,
        create: Option<(u64, u32)>,
    ) -> Result<()> {
        let a = self.api;
        // SAFETY: the session is authenticated.
        self.sftp = unsafe { (a.sftp_new)(self.session) };
        if self.sftp.is_null() {
            return Err(Error::io(format!(
                "failed to allocate sftp session: {}",
                self.error()
            )));
        }
        // SAFETY: `sftp` is a new SFTP session of this session.
        if unsafe { (a.sftp_init)(self.sftp) } != api::SSH_OK {
            return Err(Error::io(format!(
                "failed to initialize sftp session: {}",
                self.error()
            )));
        }
        let path = cstring("path", &s.path)?;
        let mut flags = if readonly {
            libc::O_RDONLY
        } else {
            libc::O_RDWR
        };
        if create.is_some() {
            flags |= libc::O_CREAT | libc::O_TRUNC;
        }
        // SAFETY: the SFTP session is initialised; the path a C string
        // alive for the call.
        self.file = unsafe { (a.sftp_open)(self.sftp, path.as_ptr(), flags, libc::S_IRWXU) };
        if self.file.is_null() {
            return Err(Error::io(format!(
                "cannot {} file for {}: {}",
                if create.is_some() { "create" } else { "open" },
                if readonly { "reading" } else { "writing" },
                self.error()
            )));
        }
        if let Some((size, mode)) = create {
            // No SFTP truncate: OpenSSH's SETSTAT with a size truncates.
            let mut attrs = Attributes::size_and_mode(size, mode);
            // SAFETY: `attrs` is a whole sftp_attributes_struct alive for
            // the call; the path a C string.
            let r = unsafe { (a.sftp_setstat)(self.sftp, path.as_ptr(), &mut attrs) };
            if r != api::SSH_OK {
                let why = format!("setstat failed: {}", self.error());
                // Best effort: the half-made file goes.
                // SAFETY: as above.
                unsafe { (a.sftp_unlink)(self.sftp, path.as_ptr()) };
                return Err(Error::io(why));
            }
        }
        Ok(())
    }

    /// The file's size.
    pub fn size(&self) -> Result<u64> {
        // SAFETY: the file is open; libssh allocates the attributes, freed
        // below.
        let attrs = unsafe { (self.api.sftp_fstat)(self.file) };
        if attrs.is_null() {
            return Err(Error::io(format!("fstat failed: {}", self.error())));
        }
        // SAFETY: non-null attributes from sftp_fstat, freed once.
        let size = unsafe { (*attrs).size };
        // SAFETY: as above (a live, connected session; C strings alive for the call).
        unsafe { (self.api.sftp_attributes_free)(attrs) };
        Ok(size)
    }

    fn seek(&self, offset: u64) -> Result<()> {
        // SAFETY: the file is open.
        if unsafe { (self.api.sftp_seek64)(self.file, offset) } != api::SSH_OK {
            return Err(Error::io(format!("seek64 failed: {}", self.error())));
        }
        Ok(())
    }

    /// Fills `buf` from `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.seek(offset)?;
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: the file is open; `rest` is writable for its length.
            let n =
                // SAFETY: as above (a live, connected session; C strings alive for the call).
                unsafe { (self.api.sftp_read)(self.file, rest.as_mut_ptr().cast(), rest.len()) };
            if n < 0 {
                return Err(Error::io(format!("read failed: {} ({n})", self.error())));
            }
            if n == 0 {
                return Err(Error::io("read failed: unexpected end of file"));
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Writes `buf` at `offset`, in pieces of at most 128 KiB (OpenSSH's
    /// packets are at most 256 KiB).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.seek(offset)?;
        for piece in buf.chunks(128 * 1024) {
            let mut done = 0;
            while done < piece.len() {
                let rest = &piece[done..];
                // SAFETY: the file is open; `rest` is readable.
                let n =
                    // SAFETY: as above (a live, connected session; C strings alive for the call).
                    unsafe { (self.api.sftp_write)(self.file, rest.as_ptr().cast(), rest.len()) };
                if n <= 0 {
                    return Err(Error::io(format!("write failed: {} ({n})", self.error())));
                }
                done += n as usize;
            }
        }
        Ok(())
    }

    /// Whether the server offers fsync (OpenSSH's `fsync@openssh.com`).
    pub fn can_fsync(&self) -> bool {
        // SAFETY: the SFTP session is initialised; the names are C strings.
        unsafe {
            (self.api.sftp_extension_supported)(
                self.sftp,
                c"fsync@openssh.com".as_ptr(),
                c"1".as_ptr(),
            ) != 0
        }
    }

    /// Makes what was written durable on the server.
    pub fn fsync(&self) -> Result<()> {
        loop {
            // SAFETY: the file is open.
            match unsafe { (self.api.sftp_fsync)(self.file) } {
                api::SSH_OK => return Ok(()),
                api::SSH_AGAIN => continue,
                _ => return Err(Error::io(format!("fsync failed: {}", self.error()))),
            }
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let a = self.api;
        // SAFETY: each handle is live (or NULL, skipped) and freed once,
        // the file before its SFTP session before the session.
        unsafe {
            if !self.file.is_null() {
                (a.sftp_close)(self.file);
            }
            if !self.sftp.is_null() {
                (a.sftp_free)(self.sftp);
            }
            (a.ssh_disconnect)(self.session);
            (a.ssh_free)(self.session);
        }
    }
}
