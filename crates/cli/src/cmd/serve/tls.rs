//! `diskit serve`'s TLS options, as nbdkit spells them.

use std::path::{Path, PathBuf};

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
    /// Default: off, or on with --tls-psk.
    #[arg(long = "tls", value_enum, value_name = "MODE")]
    tls: Option<Mode>,
    /// Directory holding server-cert.pem, server-key.pem and ca-cert.pem
    /// (default: /etc/pki/nbdkit as root, else $HOME/.pki/nbdkit).
    #[arg(long = "tls-certificates", value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Require client certificates signed by the directory's ca-cert.pem.
    #[arg(long = "tls-verify-peer")]
    tls_verify_peer: bool,
    /// Authenticate clients with pre-shared keys instead of certificates:
    /// a file of identity:hexkey lines, as psktool writes (read again at
    /// every TLS handshake).
    #[arg(long = "tls-psk", value_name = "FILE")]
    tls_psk: Option<PathBuf>,
}

impl TlsArgs {
    /// The TLS mode in effect: `--tls`, else on with `--tls-psk` (as in
    /// nbdkit), else off.
    pub fn mode(&self) -> Mode {
        match (self.tls, &self.tls_psk) {
            (Some(m), _) => m,
            (None, Some(_)) => Mode::On,
            (None, None) => Mode::Off,
        }
    }

    /// Whether clients must use TLS (the URI scheme is then nbds).
    pub fn required(&self) -> bool {
        self.mode() == Mode::Require
    }

    /// `$tls` for `--run`, as nbdkit sets it: "1" for on, "2" for
    /// require, unset for off.
    pub fn env_value(&self) -> Option<&'static str> {
        match self.mode() {
            Mode::Off => None,
            Mode::On => Some("1"),
            Mode::Require => Some("2"),
        }
    }

    /// The server's TLS settings, `None` with `--tls=off`.
    pub fn config(&self) -> Result<Option<TlsConfig>, CliError> {
        let mode = match self.mode() {
            Mode::Off => return Ok(None),
            Mode::On => TlsMode::Allow,
            Mode::Require => TlsMode::Require,
        };
        if let Some(psk) = &self.tls_psk {
            // As in nbdkit, the keys override certificate authentication.
            if self.tls_certificates.is_some() || self.tls_verify_peer {
                eprintln!(
                    "{}: warning: --tls-psk overrides --tls-certificates and --tls-verify-peer",
                    crate::names::prog()
                );
            }
            return psk_config(mode, psk).map(Some);
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

/// Pre-shared keys from `file`; loads OpenSSL 3 (a system without it is
/// an error here, at start-up).
fn psk_config(mode: TlsMode, file: &Path) -> Result<TlsConfig, CliError> {
    TlsConfig::from_psk_file(mode, file).map_err(|e| CliError::new(format!("--tls-psk: {e}")))
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
