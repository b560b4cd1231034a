//! One call of a script plugin's script, as nbdkit's sh plugin makes it:
//! the script run with the method and its arguments, the request's bytes
//! on its standard input, its answer on standard output, and what went
//! wrong, an errno name first, on standard error. The exit status says
//! how it went: 0 done, 2 the method is missing, 3 false, 4-8 nbdkit
//! 1.34's shutdown and disconnect requests, anything else an error.

use std::ffi::OsStr;
use std::io::{ErrorKind as IoKind, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};

use diskit_core::{Error, ErrorKind, Result};

/// How a call went, when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Exit status 0: done (or true).
    Done,
    /// Exit status 2: the script does not implement the method.
    Missing,
    /// Exit status 3: false, for the methods that answer a boolean.
    False,
}

/// A call's answer: its status and what it printed on standard output.
#[derive(Debug)]
pub struct Answer {
    /// How the call went.
    pub status: Status,
    /// Standard output.
    pub out: Vec<u8>,
}

impl Answer {
    /// Standard output as text without its last newline (nbdkit drops one
    /// newline from the answers it reads as text).
    pub fn text(&self) -> String {
        let s = String::from_utf8_lossy(&self.out);
        s.strip_suffix('\n').unwrap_or(&s).to_string()
    }
}

/// Runs `script` with `args`, writing `input` to its standard input, in an
/// environment with `$tmpdir` set.
pub fn call(script: &Path, args: &[&str], input: &[u8], tmpdir: &Path) -> Result<Answer> {
    let name = script.display().to_string();
    let spawn = |program: &OsStr, script_arg: Option<&Path>| {
        let mut c = Command::new(program);
        c.args(script_arg)
            .args(args.iter().map(OsStr::new))
            .env("tmpdir", tmpdir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
    };
    let mut child = match spawn(script.as_os_str(), None) {
        // An executable without a shebang runs under /bin/sh, as glibc's
        // execvp runs it for nbdkit.
        Err(e) if e.raw_os_error() == Some(libc::ENOEXEC) => {
            spawn(OsStr::new("/bin/sh"), Some(script))
        }
        r => r,
    }
    .map_err(|e| {
        let e = Error::from(e);
        Error::new(e.kind(), format!("{name}: {}", e.detail()))
    })?;
    let mut stdin = child.stdin.take();
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let (written, out, err) = std::thread::scope(|s| {
        let writer = s.spawn(move || match stdin.take() {
            Some(mut w) if !input.is_empty() => w.write_all(input),
            _ => Ok(()),
        });
        let errors = s.spawn(move || {
            let mut e = Vec::new();
            stderr.read_to_end(&mut e).map(|_| e)
        });
        let mut out = Vec::new();
        let read = stdout.read_to_end(&mut out).map(|_| out);
        (
            writer.join().unwrap_or(Ok(())),
            read,
            errors.join().unwrap_or_else(|_| Ok(Vec::new())),
        )
    });
    let status = child
        .wait()
        .map_err(|e| Error::io(format!("{name}: waitpid: {e}")))?;
    if let Some(sig) = status.signal() {
        return Err(Error::io(format!(
            "{name}: script terminated by signal {sig}"
        )));
    }
    let out = out.map_err(|e| Error::io(format!("{name}: read: {e}")))?;
    let err = err.map_err(|e| Error::io(format!("{name}: read: {e}")))?;
    let code = status.code();
    // nbdkit 1.34's statuses 4-8: a shutdown of the server (4 done, 5
    // failed) or a disconnect of this client (6 at once, 7 done, 8
    // failed), asked of the server the plugin runs in
    // (crate::callbacks::request_shutdown, request_disconnect); a failure
    // without an errno name is ESHUTDOWN.
    match code {
        Some(4 | 5) => crate::callbacks::request_shutdown(),
        Some(6..=8) => crate::callbacks::request_disconnect(),
        _ => {}
    }
    match code {
        Some(0 | 4 | 7) => Ok(Answer {
            status: Status::Done,
            out,
        }),
        Some(5 | 6 | 8) => Err(script_error_or(
            &name,
            &String::from_utf8_lossy(&err),
            ErrorKind::Shutdown,
        )),
        Some(2) => Ok(Answer {
            status: Status::Missing,
            out,
        }),
        Some(3) => Ok(Answer {
            status: Status::False,
            out,
        }),
        _ => {
            if let Err(e) = written
                && e.kind() == IoKind::BrokenPipe
            {
                return Err(Error::io(format!(
                    "{name}: write to script failed because of a broken pipe: this can \
                     happen if the script exits without consuming stdin, which usually \
                     indicates a bug in the script"
                )));
            }
            Err(script_error(&name, &String::from_utf8_lossy(&err)))
        }
    }
}

/// The errno names a script may begin its error with, as nbdkit reads
/// them, and the kinds they are.
const ERRNO_NAMES: &[(&str, i32)] = &[
    ("EPERM", libc::EPERM),
    ("EIO", libc::EIO),
    ("ENOMEM", libc::ENOMEM),
    ("EINVAL", libc::EINVAL),
    ("ENOSPC", libc::ENOSPC),
    ("EOVERFLOW", libc::EOVERFLOW),
    ("ESHUTDOWN", libc::ESHUTDOWN),
    ("ENOTSUP", libc::ENOTSUP),
    ("EOPNOTSUPP", libc::EOPNOTSUPP),
    ("EROFS", libc::EROFS),
    ("EDQUOT", libc::EDQUOT),
    ("EFBIG", libc::EFBIG),
];

/// The error a failed call reports: the kind its standard error names
/// (EIO when it names none), and its first line as the message.
pub fn script_error(script: &str, stderr: &str) -> Error {
    script_error_or(script, stderr, ErrorKind::Io)
}

/// [`script_error`] with `default` where the script names no errno.
fn script_error_or(script: &str, stderr: &str, default: ErrorKind) -> Error {
    let mut kind = default;
    let mut rest = stderr;
    // The longest name first: "EOPNOTSUPP" is not "EOPNOTSUP..." cut.
    let mut names: Vec<_> = ERRNO_NAMES.iter().collect();
    names.sort_by_key(|(n, _)| std::cmp::Reverse(n.len()));
    for (n, errno) in names {
        if stderr.len() >= n.len() && stderr[..n.len()].eq_ignore_ascii_case(n) {
            let after = &stderr[n.len()..];
            if after.is_empty() || after.starts_with(|c: char| c.is_ascii_whitespace()) {
                kind = ErrorKind::from_errno(*errno);
                rest = after.trim_start();
            }
            // "EINVALID" is no name: EIO, the whole text the message.
            break;
        }
    }
    let line = rest.trim_end_matches('\n').lines().next().unwrap_or("");
    if stderr.trim_end_matches('\n').is_empty() {
        return Error::new(
            kind,
            format!(
                "{script}: script exited with error, but did not print an error message on stderr"
            ),
        );
    }
    Error::new(kind, format!("{script}: {line}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_the_errno_their_script_names() {
        let e = script_error("s", "ENOSPC Out of space\nmore\n");
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(e.to_string().contains("s: Out of space"), "{e}");
        assert_eq!(
            script_error("s", "eperm").kind(),
            ErrorKind::PermissionDenied
        );
        assert_eq!(
            script_error("s", "EOPNOTSUPP x").kind(),
            ErrorKind::NotSupported
        );
        let e = script_error("s", "EINVALID thing");
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.to_string().contains("EINVALID thing"), "{e}");
        let e = script_error("s", "");
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(
            e.to_string().contains("did not print an error message"),
            "{e}"
        );
    }

    #[test]
    fn calls_pass_arguments_input_and_exit_statuses() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("s");
        std::fs::write(
            &script,
            "case \"$1\" in\n  echo) printf '%s|%s|%s' \"$2\" \"$tmpdir\" \"$(cat)\" ;;\n  \
             missing) exit 2 ;;\n  no) exit 3 ;;\n  fail) echo 'ENOSPC full' >&2; exit 1 ;;\n  \
             *) exit 9 ;;\nesac\n",
        )
        .unwrap();
        // Not executable: refused, as execvp refuses it for nbdkit.
        let e = call(&script, &["echo", "x"], b"", dir.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let a = call(&script, &["echo", "x"], b"in", dir.path()).unwrap();
        assert_eq!(a.status, Status::Done);
        assert_eq!(a.text(), format!("x|{}|in", dir.path().display()));
        assert_eq!(
            call(&script, &["missing"], b"", dir.path()).unwrap().status,
            Status::Missing
        );
        assert_eq!(
            call(&script, &["no"], b"", dir.path()).unwrap().status,
            Status::False
        );
        let e = call(&script, &["fail"], b"", dir.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(
            call(&script, &["other"], b"", dir.path())
                .unwrap_err()
                .kind(),
            ErrorKind::Io
        );
    }
}
