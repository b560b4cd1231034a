//! A connection held in the option phase, as libnbd's option mode holds
//! it (`nbd_set_opt_mode`): greeted, structured replies asked for, then
//! the caller's options one at a time (list the exports, list metadata
//! contexts, ask an export's information) until it enters transmission
//! on an export (GO, which may fail and leave the phase as it was) or
//! leaves (ABORT).

use std::collections::HashMap;

use diskit_core::{Error, ErrorKind, Result};

use super::command::{self, Subprocess};
use super::conn::Stream;
use super::handshake::{self, ExportInfo, Greeting, Negotiated};
use super::{NbdClient, connect_stream, uri::NbdUri};

/// What an export's information (INFO) or entry (GO) told.
#[derive(Debug, Clone)]
pub struct ExportAnswer {
    /// Size, flags, block sizes, description.
    pub info: ExportInfo,
    /// The metadata contexts the server agreed to, by name, with ids.
    pub contexts: HashMap<String, u32>,
}

/// A connection in the option phase.
pub struct OptionPhase {
    stream: Stream,
    greeting: Greeting,
    structured: bool,
    /// The server this connection runs, if any (stopped with it).
    subprocess: Option<Subprocess>,
    /// The server, for messages.
    name: String,
}

impl OptionPhase {
    /// Connects to the server `uri` names (plain connections: TCP or a
    /// Unix socket), asking for structured replies when `structured`.
    pub fn connect_uri(uri: &str, structured: bool) -> Result<OptionPhase> {
        let parsed = NbdUri::parse(uri)?;
        if parsed.tls {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "option mode over TLS is not supported",
            ));
        }
        let stream = connect_stream(&parsed)?;
        OptionPhase::start(stream, None, uri.to_string(), structured)
    }

    /// Runs `argv` as a server on its standard input and output (libnbd's
    /// `connect_command`).
    pub fn stdio_command(argv: &[String], structured: bool) -> Result<OptionPhase> {
        let (sub, stream) = command::spawn_stdio(argv)?;
        let name = format!("[ {} ]", sub.name);
        OptionPhase::start(Stream::Unix(stream), Some(sub), name, structured)
    }

    /// Runs `argv` as a socket-activated server (libnbd's
    /// `connect_systemd_socket_activation`).
    pub fn socket_activation(argv: &[String], structured: bool) -> Result<OptionPhase> {
        let (sub, stream) = command::spawn(argv)?;
        let name = format!("[ {} ]", sub.name);
        OptionPhase::start(Stream::Unix(stream), Some(sub), name, structured)
    }

    fn start(
        mut stream: Stream,
        subprocess: Option<Subprocess>,
        name: String,
        structured: bool,
    ) -> Result<OptionPhase> {
        let greeting = handshake::hello(&mut stream)?;
        if !matches!(greeting, Greeting::Newstyle { fixed: true, .. }) {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!(
                    "option mode needs a server that speaks fixed newstyle; this one speaks {}",
                    greeting.protocol()
                ),
            ));
        }
        let structured = structured && handshake::structured_replies(&mut stream)?;
        Ok(OptionPhase {
            stream,
            greeting,
            structured,
            subprocess,
            name,
        })
    }

    /// The protocol the server speaks, as libnbd names it.
    pub fn protocol(&self) -> &'static str {
        self.greeting.protocol()
    }

    /// Whether structured replies were negotiated.
    pub fn structured(&self) -> bool {
        self.structured
    }

    /// The exports the server lists (name, description).
    pub fn list(&mut self) -> Result<Vec<(String, String)>> {
        handshake::list_exports(&mut self.stream)
    }

    /// The metadata contexts of `export` that `queries` name (all of them
    /// for none).
    pub fn list_meta_contexts(&mut self, export: &str, queries: &[&str]) -> Result<Vec<String>> {
        self.need_structured("listing metadata contexts")?;
        handshake::list_meta_contexts_matching(&mut self.stream, export, queries)
    }

    /// `export`'s information, with `contexts` selected first (structured
    /// replies only).
    pub fn info(&mut self, export: &str, contexts: &[&str]) -> Result<ExportAnswer> {
        let contexts = self.select(export, contexts)?;
        match handshake::info(&mut self.stream, export)? {
            Some(info) => Ok(ExportAnswer { info, contexts }),
            None => Err(Error::new(
                ErrorKind::NotSupported,
                "the server does not answer NBD_OPT_INFO",
            )),
        }
    }

    /// Enters transmission on `export` with `contexts` selected. When the
    /// server refuses, the phase goes on: it is returned with the error
    /// (`None` when the connection is lost).
    pub fn go(
        mut self,
        export: &str,
        contexts: &[&str],
    ) -> std::result::Result<NbdClient, (Option<Box<OptionPhase>>, Error)> {
        let no_zeroes = matches!(
            self.greeting,
            Greeting::Newstyle {
                no_zeroes: true,
                ..
            }
        );
        let entered = self.select(export, contexts).and_then(|ids| {
            let info = handshake::go(&mut self.stream, export, no_zeroes)?;
            Ok(Negotiated {
                size: info.size,
                flags: info.flags,
                structured: self.structured,
                extended: false,
                block_size: info.block_size,
                contexts: ids,
            })
        });
        let negotiated = match entered {
            Ok(n) => n,
            Err(e) => return Err((Some(Box::new(self)), e)),
        };
        let OptionPhase {
            stream,
            subprocess,
            name,
            ..
        } = self;
        match NbdClient::transmitting(stream, negotiated, &name) {
            Ok(mut client) => {
                client.subprocess = subprocess;
                client.asked = contexts.iter().map(|c| c.to_string()).collect();
                Ok(client)
            }
            // The stream is gone: the phase cannot go on.
            Err(e) => Err((None, e.context("starting transmission"))),
        }
    }

    /// Leaves without entering transmission (NBD_OPT_ABORT); a server this
    /// connection ran is stopped.
    pub fn abort(mut self) {
        handshake::abort(&mut self.stream);
        self.stream.close();
    }

    /// Selects `contexts` on `export` (nothing without structured replies
    /// or contexts).
    fn select(&mut self, export: &str, contexts: &[&str]) -> Result<HashMap<String, u32>> {
        if !self.structured || contexts.is_empty() {
            return Ok(HashMap::new());
        }
        handshake::set_meta_contexts(&mut self.stream, export, contexts)
    }

    fn need_structured(&self, what: &str) -> Result<()> {
        if self.structured {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::NotSupported,
                format!("{what} needs structured replies, which were not negotiated"),
            ))
        }
    }
}
