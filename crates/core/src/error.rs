//! Errors: a small, stable kind enum plus context.
//!
//! Every [`ErrorKind`] maps onto one errno value and one NBD error code, so a
//! failure deep in a format driver reaches an NBD client or a shell script
//! with the right meaning. Context strings are added as the error travels up.

use std::fmt;
use std::io;

/// What went wrong, in the vocabulary shared by errno and the NBD protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Operation not permitted (read-only device, write to a protected area).
    PermissionDenied,
    /// An I/O error from the medium, or a corrupt image.
    Io,
    /// Out of memory, or a request too large to buffer.
    OutOfMemory,
    /// An invalid argument: out-of-range offset, bad option, malformed input.
    InvalidInput,
    /// No space left on the device.
    NoSpace,
    /// A value does not fit (offset overflow, request too large for the protocol).
    Overflow,
    /// The operation is not supported (also: fast zero that would be slow).
    NotSupported,
    /// The device or server is shutting down.
    Shutdown,
    /// A named file or export does not exist.
    NotFound,
}

impl ErrorKind {
    /// The errno value for this kind.
    pub fn errno(self) -> i32 {
        match self {
            ErrorKind::PermissionDenied => libc::EPERM,
            ErrorKind::Io => libc::EIO,
            ErrorKind::OutOfMemory => libc::ENOMEM,
            ErrorKind::InvalidInput => libc::EINVAL,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Overflow => libc::EOVERFLOW,
            ErrorKind::NotSupported => libc::ENOTSUP,
            ErrorKind::Shutdown => libc::ESHUTDOWN,
            ErrorKind::NotFound => libc::ENOENT,
        }
    }

    /// The NBD wire error code for this kind (the protocol's fixed values,
    /// not the host's errno numbers).
    pub fn nbd_code(self) -> u32 {
        match self {
            ErrorKind::PermissionDenied => 1,
            ErrorKind::Io => 5,
            ErrorKind::OutOfMemory => 12,
            ErrorKind::InvalidInput | ErrorKind::NotFound => 22,
            ErrorKind::NoSpace => 28,
            ErrorKind::Overflow => 75,
            ErrorKind::NotSupported => 95,
            ErrorKind::Shutdown => 108,
        }
    }

    /// The kind for an NBD wire error code; unknown codes become [`ErrorKind::InvalidInput`]
    /// as the protocol recommends.
    pub fn from_nbd_code(code: u32) -> ErrorKind {
        match code {
            1 => ErrorKind::PermissionDenied,
            5 => ErrorKind::Io,
            12 => ErrorKind::OutOfMemory,
            28 => ErrorKind::NoSpace,
            75 => ErrorKind::Overflow,
            95 => ErrorKind::NotSupported,
            108 => ErrorKind::Shutdown,
            _ => ErrorKind::InvalidInput,
        }
    }

    /// The kind for an errno value.
    pub fn from_errno(errno: i32) -> ErrorKind {
        match errno {
            libc::EPERM | libc::EACCES | libc::EROFS => ErrorKind::PermissionDenied,
            libc::ENOMEM => ErrorKind::OutOfMemory,
            libc::EINVAL | libc::EISDIR | libc::ENOTDIR | libc::EBADF => ErrorKind::InvalidInput,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ErrorKind::NoSpace,
            libc::EOVERFLOW => ErrorKind::Overflow,
            // ENODEV/ENXIO/ENOTTY come back from ioctls and fallocate modes
            // a file system or device does not implement.
            libc::ENOTSUP | libc::ENOSYS | libc::ENODEV | libc::ENXIO | libc::ENOTTY => {
                ErrorKind::NotSupported
            }
            libc::ESHUTDOWN | libc::EPIPE | libc::ECONNRESET => ErrorKind::Shutdown,
            libc::ENOENT => ErrorKind::NotFound,
            _ => ErrorKind::Io,
        }
    }

    /// A short human description, as strerror would say it.
    pub fn description(self) -> &'static str {
        match self {
            ErrorKind::PermissionDenied => "Operation not permitted",
            ErrorKind::Io => "Input/output error",
            ErrorKind::OutOfMemory => "Cannot allocate memory",
            ErrorKind::InvalidInput => "Invalid argument",
            ErrorKind::NoSpace => "No space left on device",
            ErrorKind::Overflow => "Value too large for defined data type",
            ErrorKind::NotSupported => "Operation not supported",
            ErrorKind::Shutdown => "Cannot send after transport endpoint shutdown",
            ErrorKind::NotFound => "No such file or directory",
        }
    }
}

/// An error: a kind, what was being done, and the underlying OS error if any.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: Vec<String>,
    message: Option<String>,
    source: Option<io::Error>,
}

/// Result alias used throughout diskit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with a message describing it.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            context: Vec::new(),
            message: Some(message.into()),
            source: None,
        }
    }

    /// An error of `kind` with only the kind's own description.
    pub fn from_kind(kind: ErrorKind) -> Error {
        Error {
            kind,
            context: Vec::new(),
            message: None,
            source: None,
        }
    }

    /// Shorthand for an [`ErrorKind::InvalidInput`] error.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidInput, message)
    }

    /// Shorthand for an [`ErrorKind::NotSupported`] error.
    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::NotSupported, message)
    }

    /// Shorthand for an [`ErrorKind::Io`] error (also used for corrupt metadata).
    pub fn io(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Io, message)
    }

    /// The error's kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The errno value to report for this error.
    pub fn errno(&self) -> i32 {
        self.kind.errno()
    }

    /// Adds what was being done when the error happened (outermost last).
    pub fn context(mut self, what: impl Into<String>) -> Error {
        self.context.push(what.into());
        self
    }

    /// The innermost description, without context: the message if one was
    /// given, otherwise the OS error text, otherwise the kind's description.
    pub fn detail(&self) -> String {
        if let Some(m) = &self.message {
            m.clone()
        } else if let Some(s) = &self.source {
            os_error_text(s)
        } else {
            self.kind.description().to_string()
        }
    }
}

/// strerror-like text for an io::Error, without Rust's " (os error N)" suffix.
fn os_error_text(e: &io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error") {
        Some(i) if e.raw_os_error().is_some() => s[..i].to_string(),
        _ => s,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.context.iter().rev() {
            write!(f, "{c}: ")?;
        }
        if let (Some(m), Some(s)) = (&self.message, &self.source) {
            write!(f, "{m}: {}", os_error_text(s))
        } else {
            f.write_str(&self.detail())
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        let kind = match e.raw_os_error() {
            Some(errno) => ErrorKind::from_errno(errno),
            None => match e.kind() {
                io::ErrorKind::NotFound => ErrorKind::NotFound,
                io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData => ErrorKind::InvalidInput,
                io::ErrorKind::Unsupported => ErrorKind::NotSupported,
                io::ErrorKind::OutOfMemory => ErrorKind::OutOfMemory,
                io::ErrorKind::UnexpectedEof => ErrorKind::Io,
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => ErrorKind::Shutdown,
                _ => ErrorKind::Io,
            },
        };
        Error {
            kind,
            context: Vec::new(),
            message: None,
            source: Some(e),
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        io::Error::from_raw_os_error(e.errno())
    }
}

/// Adds context to results, as the error travels up.
pub trait ResultExt<T> {
    /// Adds `what` as context to an error.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// Adds lazily built context to an error.
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<Error>> ResultExt<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| e.into().context(what))
    }
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| e.into().context(what()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_nbd_codes() {
        for k in [
            ErrorKind::PermissionDenied,
            ErrorKind::Io,
            ErrorKind::OutOfMemory,
            ErrorKind::InvalidInput,
            ErrorKind::NoSpace,
            ErrorKind::Overflow,
            ErrorKind::NotSupported,
            ErrorKind::Shutdown,
        ] {
            assert_eq!(ErrorKind::from_nbd_code(k.nbd_code()), k);
            assert_eq!(ErrorKind::from_errno(k.errno()), k);
        }
        assert_eq!(ErrorKind::from_nbd_code(9999), ErrorKind::InvalidInput);
    }

    #[test]
    fn io_errors_keep_their_meaning_and_text() {
        let e: Error = io::Error::from_raw_os_error(libc::ENOENT).into();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        let e = e.context("Could not open 'x'");
        assert_eq!(
            e.to_string(),
            "Could not open 'x': No such file or directory"
        );
        let e: Error = io::Error::from_raw_os_error(libc::ENOTTY).into();
        assert_eq!(e.kind(), ErrorKind::NotSupported);
    }
}
