//! What a server offers, without transmission: its greeting, its export
//! list, and each export's handshake information (size, flags, block
//! sizes, description, metadata contexts). What `nbdinfo` shows, as an
//! API: the handshake stays inside the client.

use std::io::Write;

use diskit_core::{Error, ErrorKind, Result};

use super::conn::Stream;
use super::connect_stream;
use super::handshake::{self, ExportInfo, Greeting};
use super::tls::ClientTls;
use super::uri::NbdUri;
use crate::proto::consts::CMD_DISC;
use crate::proto::request::RequestHeader;

/// A connection for looking only: greeted, with TLS started when the URI
/// asks for it.
pub struct Probe {
    stream: Stream,
    greeting: Greeting,
}

/// What one export's handshake told.
#[derive(Debug, Clone)]
pub struct ExportReport {
    /// The export's name.
    pub name: String,
    /// The protocol the server speaks, as libnbd names it.
    pub protocol: &'static str,
    /// Whether the connection was encrypted.
    pub tls: bool,
    /// Size, flags, block sizes, description.
    pub info: ExportInfo,
    /// Whether structured replies were negotiated.
    pub structured: bool,
    /// Whether extended headers were negotiated.
    pub extended: bool,
    /// The metadata contexts the server offers for it.
    pub contexts: Vec<String>,
}

/// How a probe failed: reaching the server, or talking to it.
#[derive(Debug)]
pub enum ProbeError {
    /// The socket could not be connected.
    Connect(Error),
    /// The server was reached, and then something failed.
    Talk(Error),
}

impl Probe {
    /// Connects to the server `uri` names and reads its greeting; with an
    /// `nbds` URI, starts TLS (a server that cannot is an error).
    pub fn connect(
        uri: &NbdUri,
        tls: Option<&ClientTls>,
    ) -> std::result::Result<Probe, ProbeError> {
        let mut stream = connect_stream(uri).map_err(ProbeError::Connect)?;
        let greeting = handshake::hello(&mut stream).map_err(ProbeError::Talk)?;
        let Some(tls) = tls else {
            return Ok(Probe { stream, greeting });
        };
        if !matches!(greeting, Greeting::Newstyle { fixed: true, .. }) {
            return Err(ProbeError::Talk(Error::new(
                ErrorKind::NotSupported,
                format!(
                    "TLS needs a server that speaks fixed newstyle; this one speaks {}",
                    greeting.protocol()
                ),
            )));
        }
        let stream = tls.start(stream).map_err(ProbeError::Talk)?;
        Ok(Probe { stream, greeting })
    }

    /// The server's greeting.
    pub fn greeting(&self) -> &Greeting {
        &self.greeting
    }

    /// The exports the server lists (name, description), then leaves.
    pub fn list_exports(mut self) -> Result<Vec<(String, String)>> {
        if !matches!(self.greeting, Greeting::Newstyle { fixed: true, .. }) {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!(
                    "a server that speaks {} cannot list its exports",
                    self.greeting.protocol()
                ),
            ));
        }
        let list = handshake::list_exports(&mut self.stream)?;
        handshake::abort(&mut self.stream);
        self.stream.close();
        Ok(list)
    }

    /// Negotiates up to GO on `export` (its contexts listed on the way),
    /// then leaves politely (NBD_CMD_DISC).
    pub fn inspect(mut self, export: &str) -> Result<ExportReport> {
        let s = &mut self.stream;
        let (info, structured, contexts) = match &self.greeting {
            Greeting::Oldstyle(info) => (info.clone(), false, Vec::new()),
            Greeting::Newstyle {
                fixed: false,
                no_zeroes,
            } => (
                handshake::export_name(s, export, *no_zeroes)?,
                false,
                Vec::new(),
            ),
            Greeting::Newstyle { no_zeroes, .. } => {
                let structured = handshake::structured_replies(s)?;
                let contexts = if structured {
                    handshake::list_meta_contexts(s, export)?
                } else {
                    Vec::new()
                };
                (handshake::go(s, export, *no_zeroes)?, structured, contexts)
            }
        };
        let disc = RequestHeader {
            flags: 0,
            command: CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
            extended: false,
        };
        let _ = s.write_all(&disc.encode());
        let _ = s.flush();
        let tls = s.is_tls();
        self.stream.close();
        Ok(ExportReport {
            name: export.to_string(),
            protocol: self.greeting.protocol(),
            tls,
            info,
            structured,
            extended: false,
            contexts,
        })
    }

    /// Everything the server tells of each of its exports on this one
    /// connection, as qemu-nbd's `--list` asks: extended headers (else
    /// structured replies), the export list, then NBD_OPT_INFO and the
    /// metadata contexts of each export; then leaves (NBD_OPT_ABORT). The
    /// description is the list's when INFO sends none.
    pub fn survey(mut self) -> Result<Vec<ExportReport>> {
        if !matches!(self.greeting, Greeting::Newstyle { fixed: true, .. }) {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "Server does not support export lists",
            ));
        }
        let s = &mut self.stream;
        let extended = handshake::extended_headers(s)?;
        let structured = extended || handshake::structured_replies(s)?;
        let mut reports = Vec::new();
        for (name, description) in handshake::list_exports(s)? {
            let Some(mut info) = handshake::info(s, &name)? else {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    "Server does not support export lists",
                ));
            };
            if info.description.is_none() && !description.is_empty() {
                info.description = Some(description);
            }
            let contexts = if structured {
                handshake::list_meta_contexts(s, &name)?
            } else {
                Vec::new()
            };
            reports.push(ExportReport {
                name,
                protocol: self.greeting.protocol(),
                tls: s.is_tls(),
                info,
                structured,
                extended,
                contexts,
            });
        }
        handshake::abort(s);
        self.stream.close();
        Ok(reports)
    }
}
