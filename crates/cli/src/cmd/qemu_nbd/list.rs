//! `qemu-nbd -L`: the client side, listing what a server exports as
//! qemu-nbd prints it (each export's name, description, size, flags,
//! block sizes, transaction size and metadata contexts), over one
//! connection (see [`Probe::survey`]).

use std::fmt::Write as _;

use crate::CmdResult;
use crate::util::CliError;
use diskit_nbd::client::probe::{ExportReport, Probe, ProbeError};
use diskit_nbd::client::tls::ClientTls;
use diskit_nbd::client::uri::{Address, NbdUri};

/// The transmission flags by bit, as qemu-nbd names them.
const FLAG_NAMES: [&str; 13] = [
    "",
    "readonly",
    "flush",
    "fua",
    "rotational",
    "trim",
    "zeroes",
    "df",
    "multi",
    "resize",
    "cache",
    "fast-zero",
    "block-status-payload",
];

/// Lists the exports of the server at `address`, with the TLS
/// credentials object `tls_creds` and the name its certificate must
/// carry (`hostname`) if given.
pub fn run(address: Address, tls_creds: Option<&str>, hostname: Option<&str>) -> CmdResult {
    let mut uri = NbdUri::plain(address, "");
    if let Some(id) = tls_creds {
        diskit_open::protocol::with_tls_creds(&mut uri, id, hostname)
            .map_err(|e| CliError::new(format!("Failed to get TLS creds: {e}")))?;
    }
    let tls = ClientTls::for_uri(&uri)?;
    let probe = Probe::connect(&uri, tls.as_ref()).map_err(|e| match e {
        ProbeError::Connect(e) | ProbeError::Talk(e) => CliError::from(e),
    })?;
    let exports = probe.survey()?;
    print!("{}", render(&exports));
    Ok(0)
}

/// What qemu-nbd prints for `exports`.
fn render(exports: &[ExportReport]) -> String {
    let mut out = format!("exports available: {}\n", exports.len());
    for e in exports {
        let i = &e.info;
        let _ = writeln!(out, " export: '{}'", e.name);
        if let Some(d) = i.description.as_deref().filter(|d| !d.is_empty()) {
            let _ = writeln!(out, "  description: {d}");
        }
        if i.flags & 1 != 0 {
            let _ = writeln!(out, "  size:  {}", i.size);
            let names: String = FLAG_NAMES
                .iter()
                .enumerate()
                .filter(|(bit, name)| !name.is_empty() && i.flags & (1 << bit) != 0)
                .map(|(_, name)| format!(" {name}"))
                .collect();
            let _ = writeln!(out, "  flags: {:#x} ({names} )", i.flags);
        }
        if let Some((min, opt, max)) = i.block_size.filter(|b| b.0 != 0) {
            let _ = writeln!(out, "  min block: {min}");
            let _ = writeln!(out, "  opt block: {opt}");
            let _ = writeln!(out, "  max block: {max}");
        }
        let width = if e.extended { "64-bit" } else { "32-bit" };
        let _ = writeln!(out, "  transaction size: {width}");
        if !e.contexts.is_empty() {
            let _ = writeln!(out, "  available meta contexts: {}", e.contexts.len());
            for c in &e.contexts {
                let _ = writeln!(out, "   {c}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_nbd::client::handshake::ExportInfo;

    #[test]
    fn exports_print_as_qemu_nbd_prints_them() {
        let report = ExportReport {
            name: "foo".into(),
            protocol: "newstyle-fixed",
            tls: false,
            info: ExportInfo {
                size: 1 << 20,
                flags: 0x148f,
                block_size: Some((1, 4096, 32 << 20)),
                description: Some("a desc".into()),
            },
            structured: true,
            extended: true,
            contexts: vec!["base:allocation".into()],
        };
        assert_eq!(
            render(&[report]),
            "exports available: 1\n export: 'foo'\n  description: a desc\n  size:  1048576\n  \
             flags: 0x148f ( readonly flush fua df cache block-status-payload )\n  min block: 1\n  \
             opt block: 4096\n  max block: 33554432\n  transaction size: 64-bit\n  \
             available meta contexts: 1\n   base:allocation\n"
        );
    }
}
