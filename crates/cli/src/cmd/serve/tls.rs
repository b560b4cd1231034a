//! `diskit serve`'s TLS options, as nbdkit spells them.

use std::path::PathBuf;

use crate::util::CliError;
use diskit_nbd::server::{TlsConfig, TlsMode};

/// `--tls=off|on|require`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// No TLS (STARTTLS is refused).
    #[default]
    Off,
    /// TLS offered, plain-text clients served too.
    On,
    /// TLS required: nothing is served before STARTTLS.
    Require,
}

/// The TLS options of `serve`.
#[derive(clap::Args, Debug)]
pub struct TlsArgs {
    /// TLS: off, on (offered) or require (nothing served in plain text).
    #[arg(long = "tls", value_enum, default_value_t = Mode::Off, value_name = "MODE")]
    tls: Mode,
    /// Directory holding server-cert.pem, server-key.pem and ca-cert.pem
    /// (default: /etc/pki/nbdkit as root, else $HOME/.pki/nbdkit).
    #[arg(long = "tls-certificates", value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Require client certificates signed by the directory's ca-cert.pem.
    #[arg(long = "tls-verify-peer")]
    tls_verify_peer: bool,
    /// TLS-PSK key file (username:hexkey lines): not supported by this build.
    #[arg(long = "tls-psk", value_name = "FILE")]
    tls_psk: Option<PathBuf>,
}

impl TlsArgs {
    /// Whether clients must use TLS (the URI scheme is then nbds).
    pub fn required(&self) -> bool {
        self.tls == Mode::Require
    }

    /// The server's TLS settings, `None` with `--tls=off`.
    pub fn config(&self) -> Result<Option<TlsConfig>, CliError> {
        let mode = match self.tls {
            Mode::Off => return Ok(None),
            Mode::On => TlsMode::Allow,
            Mode::Require => TlsMode::Require,
        };
        if let Some(psk) = &self.tls_psk {
            return Err(CliError::new(format!(
                "--tls-psk={}: TLS-PSK is not supported (rustls has no PSK key exchange); use X.509 certificates",
                psk.display()
            )));
        }
        let dir = match &self.tls_certificates {
            Some(d) => d.clone(),
            None => default_dir(),
        };
        TlsConfig::from_dir(mode, &dir, self.tls_verify_peer)
            .map(Some)
            .map_err(|e| CliError::new(format!("TLS: {e}")))
    }
}

/// nbdkit's default certificate directory.
fn default_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    match std::env::var_os("HOME") {
        Some(home) if !root => PathBuf::from(home).join(".pki/nbdkit"),
        _ => PathBuf::from("/etc/pki/nbdkit"),
    }
}

/// The URI clients use: nbds when TLS is required.
pub fn uri(plain: String, required: bool) -> String {
    match plain.strip_prefix("nbd") {
        Some(rest) if required => format!("nbds{rest}"),
        _ => plain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            uri("nbd+unix:///?socket=/s".into(), true),
            "nbds+unix:///?socket=/s"
        );
        assert_eq!(uri("nbd://localhost/x".into(), true), "nbds://localhost/x");
        assert_eq!(uri("nbd://localhost/x".into(), false), "nbd://localhost/x");
    }
}
