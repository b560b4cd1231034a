//! The handshake: greeting, client flags, and option haggling until the
//! client picks an export (EXPORT_NAME or GO) or leaves.

use std::io::{self, Read, Write};
use std::sync::Arc;

use diskit_core::{BlockDevice, DeviceRef, ExportEntry, ExportQuery, Session};

use super::export::{Export, ExportSet, MetaContext};
use crate::proto::consts::*;
use crate::proto::option::{OPTION_HEADER_LEN, OptionError};
use crate::proto::{ClientOption, Info, InfoRequest, MetaRequest, OptionHeader, OptionReply};

/// Option data longer than this is not buffered: it is skipped and refused
/// with ERR_TOO_BIG (no legitimate option comes close).
pub const MAX_OPTION_DATA: u32 = 64 * 1024;
/// Option data longer than this ends the connection: skipping it would
/// only serve a client that is trying to waste the server's time.
pub const MAX_OPTION_SKIP: u32 = 16 << 20;

/// What the handshake settled.
pub struct Negotiated {
    /// The export chosen.
    pub export: Arc<Export>,
    /// The name the connection opened it by (`""` made canonical).
    pub name: String,
    /// The export's device as this connection sees it (see
    /// [`diskit_core::BlockDevice::connect`]); dropped when it ends.
    pub device: DeviceRef,
    /// Structured replies (implied by extended headers).
    pub structured: bool,
    /// Extended headers.
    pub extended: bool,
    /// The metadata contexts selected for this export.
    pub contexts: Vec<MetaContext>,
    /// The transmission flags sent to the client.
    pub tflags: u16,
    /// Raised by a layer of the export to have the connection closed.
    pub hangup: diskit_core::Hangup,
}

/// Why the handshake ended without transmission.
#[derive(Debug)]
pub enum HandshakeEnd {
    /// The client sent NBD_OPT_ABORT (soft disconnect).
    Aborted,
    /// The client broke the protocol; the connection is closed.
    Protocol(String),
    /// The stream failed or the client went away.
    Io(io::Error),
}

impl From<io::Error> for HandshakeEnd {
    fn from(e: io::Error) -> HandshakeEnd {
        HandshakeEnd::Io(e)
    }
}

#[derive(Default)]
struct State {
    tls: TlsState,
    fixed: bool,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    /// The last SET_META_CONTEXT: the export it named and what it selected.
    meta: Option<(Arc<Export>, Vec<MetaContext>)>,
    /// Who the client is.
    client: Client,
}

/// A connection, as the server knows it before the handshake.
#[derive(Debug, Clone, Default)]
pub struct Client {
    /// The server's number for the connection.
    pub id: u64,
    /// Who is at the other end.
    pub peer: diskit_core::Peer,
    /// Raised by a layer of the export to have the connection closed.
    pub hangup: diskit_core::Hangup,
}

/// What the client said in its flags.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientFlags {
    /// Fixed newstyle: options get replies.
    pub fixed: bool,
    /// No 124 zero bytes after EXPORT_NAME.
    pub no_zeroes: bool,
}

/// Where TLS stands on a connection while options are haggled over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsState {
    /// No TLS: STARTTLS is refused with ERR_POLICY.
    #[default]
    Unavailable,
    /// STARTTLS is accepted; plain-text clients are served too.
    Offered,
    /// Nothing but STARTTLS and ABORT until TLS is up: other options get
    /// ERR_TLS_REQD, EXPORT_NAME closes the connection.
    Required,
    /// TLS is up: a second STARTTLS is invalid.
    Active,
}

/// How option haggling ended well.
pub enum Step {
    /// The client chose an export: transmission starts.
    Go(Negotiated),
    /// STARTTLS was acknowledged: the caller runs the TLS handshake and
    /// haggles again over TLS, from a clean slate.
    StartTls,
}

/// Runs the handshake on `stream` (unbuffered, so that nothing the client
/// sends after its last option is lost), without TLS.
pub fn negotiate<S: Read + Write + ?Sized>(
    stream: &mut S,
    exports: &ExportSet,
) -> Result<Negotiated, HandshakeEnd> {
    let flags = greet(stream)?;
    match haggle(
        stream,
        exports,
        flags,
        TlsState::Unavailable,
        &Client::default(),
    )? {
        Step::Go(n) => Ok(n),
        Step::StartTls => Err(HandshakeEnd::Protocol("STARTTLS without TLS".into())),
    }
}

/// Sends the greeting and reads the client's flags.
pub fn greet<S: Read + Write + ?Sized>(stream: &mut S) -> Result<ClientFlags, HandshakeEnd> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting)?;
    stream.flush()?;

    let mut flags = [0u8; 4];
    stream.read_exact(&mut flags)?;
    let flags = u32::from_be_bytes(flags);
    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeEnd::Protocol(format!(
            "unknown client flags {flags:#x}"
        )));
    }
    Ok(ClientFlags {
        fixed: flags & FLAG_C_FIXED_NEWSTYLE != 0,
        no_zeroes: flags & FLAG_C_NO_ZEROES != 0,
    })
}

/// Handles options until the client picks an export, asks for TLS, or
/// leaves. Everything negotiated before starts afresh with each call (as
/// STARTTLS demands). `id` is the server's number for the connection,
/// which the export's device sees when the client picks it (see
/// [`diskit_core::BlockDevice::connect`]).
pub fn haggle<S: Read + Write + ?Sized>(
    stream: &mut S,
    exports: &ExportSet,
    flags: ClientFlags,
    tls: TlsState,
    client: &Client,
) -> Result<Step, HandshakeEnd> {
    let mut st = State {
        fixed: flags.fixed,
        no_zeroes: flags.no_zeroes,
        tls,
        client: client.clone(),
        ..State::default()
    };

    loop {
        let mut head = [0u8; OPTION_HEADER_LEN];
        stream.read_exact(&mut head)?;
        let h = OptionHeader::parse(&head)
            .map_err(|e| HandshakeEnd::Protocol(format!("option header: {e}")))?;
        if !st.fixed && h.option != OPT_EXPORT_NAME {
            // Plain newstyle knows no option replies: hang up.
            return Err(HandshakeEnd::Protocol(format!(
                "option {} from a client without fixed newstyle",
                h.option
            )));
        }
        let tls_reqd =
            st.tls == TlsState::Required && h.option != OPT_STARTTLS && h.option != OPT_ABORT;
        if tls_reqd && h.option == OPT_EXPORT_NAME {
            // EXPORT_NAME cannot fail cleanly: close.
            return Err(HandshakeEnd::Protocol(
                "NBD_OPT_EXPORT_NAME before STARTTLS, and TLS is required".into(),
            ));
        }
        if h.length > MAX_OPTION_DATA {
            if h.option == OPT_EXPORT_NAME || h.length > MAX_OPTION_SKIP {
                return Err(HandshakeEnd::Protocol(format!(
                    "option {} with {} bytes of data",
                    h.option, h.length
                )));
            }
            io::copy(
                &mut (&mut *stream).take(u64::from(h.length)),
                &mut io::sink(),
            )?;
            send(
                stream,
                &OptionReply::error(h.option, REP_ERR_TOO_BIG, "option data too long"),
            )?;
            continue;
        }
        let mut data = vec![0u8; h.length as usize];
        stream.read_exact(&mut data)?;
        if tls_reqd {
            refuse(
                stream,
                h.option,
                error(
                    REP_ERR_TLS_REQD,
                    "TLS is required: send NBD_OPT_STARTTLS first",
                ),
            )?;
            continue;
        }
        let option = match ClientOption::parse(h.option, &data) {
            Ok(o) => o,
            Err(e) if h.option == OPT_EXPORT_NAME => {
                return Err(HandshakeEnd::Protocol(e.message));
            }
            Err(e) => {
                send(stream, &OptionReply::error(h.option, e.reply, &e.message))?;
                continue;
            }
        };
        if let ClientOption::StartTls = option {
            match st.tls {
                TlsState::Unavailable => refuse(
                    stream,
                    h.option,
                    error(REP_ERR_POLICY, "TLS is not configured"),
                )?,
                TlsState::Active => refuse(
                    stream,
                    h.option,
                    error(REP_ERR_INVALID, "TLS is already negotiated"),
                )?,
                TlsState::Offered | TlsState::Required => {
                    send(stream, &OptionReply::ack(h.option))?;
                    return Ok(Step::StartTls);
                }
            }
            continue;
        }
        match handle(stream, exports, &mut st, option)? {
            Some(n) => return Ok(Step::Go(n)),
            None => continue,
        }
    }
}

fn send<S: Write + ?Sized>(stream: &mut S, reply: &OptionReply) -> io::Result<()> {
    stream.write_all(&reply.encode())?;
    stream.flush()
}

fn refuse<S: Write + ?Sized>(stream: &mut S, option: u32, e: OptionError) -> io::Result<()> {
    send(stream, &OptionReply::error(option, e.reply, &e.message))
}

fn error(reply: u32, message: impl Into<String>) -> OptionError {
    OptionError {
        reply,
        message: message.into(),
    }
}

/// The export's device as this connection will see it.
/// What the export's device is told when asked about its exports.
fn query(st: &State, export: &Export) -> ExportQuery {
    ExportQuery {
        read_only: export.read_only(),
        tls: st.tls == TlsState::Active,
    }
}

/// The name a client's `name` stands for: `""` is the default export's
/// canonical name (nbdkit's default_export, the export's own name when the
/// device does not say); an error refuses the default export.
fn canonical(st: &State, export: &Export, name: &str) -> diskit_core::Result<String> {
    if !name.is_empty() {
        return Ok(name.to_string());
    }
    Ok(export
        .device()
        .default_export(&query(st, export))?
        .unwrap_or_else(|| export.name().to_string()))
}

/// Every export a listing shows, as the exports' devices list them (the
/// server's own names where they do not say).
fn listing(st: &State, exports: &ExportSet) -> diskit_core::Result<Vec<ExportEntry>> {
    let mut v = Vec::new();
    for e in exports.iter() {
        match e.device().list_exports(&query(st, e))? {
            Some(list) => v.extend(list),
            None => {
                let description = Some(e.description().to_string()).filter(|d| !d.is_empty());
                v.push(ExportEntry::new(canonical(st, e, e.name())?, description));
            }
        }
    }
    Ok(v)
}

fn connect(st: &State, export: &Export, name: &str) -> diskit_core::Result<DeviceRef> {
    let session = Session {
        id: st.client.id,
        export: name.to_string(),
        tls: st.tls == TlsState::Active,
        read_only: export.read_only(),
        peer: st.client.peer.clone(),
        hangup: st.client.hangup.clone(),
    };
    let shared = export.device();
    Ok(shared.connect(&session)?.unwrap_or_else(|| shared.clone()))
}

/// Handles one option; `Some` when transmission starts.
fn handle<S: Read + Write + ?Sized>(
    stream: &mut S,
    exports: &ExportSet,
    st: &mut State,
    option: ClientOption,
) -> Result<Option<Negotiated>, HandshakeEnd> {
    let code = option.code();
    match option {
        ClientOption::ExportName(name) => {
            if st.extended {
                return Err(HandshakeEnd::Protocol(
                    "NBD_OPT_EXPORT_NAME after extended headers".into(),
                ));
            }
            let export = exports
                .find(&name)
                .ok_or_else(|| HandshakeEnd::Protocol(format!("unknown export '{name}'")))?;
            let (name, device) = canonical(st, &export, &name)
                .and_then(|canon| Ok((canon.clone(), connect(st, &export, &canon)?)))
                .map_err(|e| HandshakeEnd::Protocol(format!("export '{name}': {e}")))?;
            let tflags = export.transmission_flags_of(&*device, st.structured);
            let mut out = Vec::with_capacity(134);
            out.extend_from_slice(&device.size().to_be_bytes());
            out.extend_from_slice(&tflags.to_be_bytes());
            if !st.no_zeroes {
                out.extend_from_slice(&[0u8; 124]);
            }
            stream.write_all(&out)?;
            stream.flush()?;
            let contexts = selected_contexts(st, &export);
            return Ok(Some(Negotiated {
                export,
                name,
                device,
                structured: st.structured,
                extended: false,
                contexts,
                tflags,
                hangup: st.client.hangup.clone(),
            }));
        }
        ClientOption::Abort => {
            // The client may close before reading this.
            let _ = send(stream, &OptionReply::ack(code));
            return Err(HandshakeEnd::Aborted);
        }
        ClientOption::List => match listing(st, exports) {
            Ok(list) => {
                let mut out = Vec::new();
                for e in &list {
                    let description = e.description.as_deref().unwrap_or("");
                    out.extend(OptionReply::server(code, &e.name, description).encode());
                }
                out.extend(OptionReply::ack(code).encode());
                stream.write_all(&out)?;
                stream.flush()?;
            }
            Err(e) => refuse(stream, code, error(REP_ERR_PLATFORM, e.to_string()))?,
        },
        ClientOption::StartTls => {
            // Answered by `haggle`, which owns the TLS state.
            refuse(stream, code, error(REP_ERR_POLICY, "TLS is not configured"))?;
        }
        ClientOption::Info(req) | ClientOption::Go(req) => {
            let Some(export) = exports.find(&req.name) else {
                refuse(
                    stream,
                    code,
                    error(REP_ERR_UNKNOWN, format!("unknown export '{}'", req.name)),
                )?;
                return Ok(None);
            };
            // The connection's view of the device is made when the
            // client picks the export, so that a failure is this option's.
            let name = match canonical(st, &export, &req.name) {
                Ok(n) => n,
                Err(e) => {
                    refuse(stream, code, error(REP_ERR_UNKNOWN, e.to_string()))?;
                    return Ok(None);
                }
            };
            // The connection's view of the device is made when the client
            // asks about the export, so that a failure is this option's,
            // and what it is told is what its connection sees: INFO opens
            // one too, dropped after the reply, as nbdkit opens its plugin.
            let device = match connect(st, &export, &name) {
                Ok(d) => d,
                Err(e) => {
                    refuse(stream, code, error(REP_ERR_UNKNOWN, e.to_string()))?;
                    return Ok(None);
                }
            };
            let mut tflags = export.transmission_flags_of(&*device, st.structured);
            let contexts = selected_contexts(st, &export);
            // As qemu-nbd: a BLOCK_STATUS payload may pick among the
            // contexts with extended headers (said to INFO whatever the
            // contexts, to GO when there are some).
            if st.extended && (code == OPT_INFO || !contexts.is_empty()) {
                tflags |= TFLAG_BLOCK_STATUS_PAYLOAD;
            }
            send_info(stream, code, &export, &name, &*device, &req, tflags)?;
            send(stream, &OptionReply::ack(code))?;
            let device = (code == OPT_GO).then_some(device);
            if let Some(device) = device {
                return Ok(Some(Negotiated {
                    export,
                    name,
                    device,
                    structured: st.structured,
                    extended: st.extended,
                    contexts,
                    tflags,
                    hangup: st.client.hangup.clone(),
                }));
            }
        }
        ClientOption::StructuredReply => {
            let r = if st.extended {
                Err(error(
                    REP_ERR_EXT_HEADER_REQD,
                    "extended headers already negotiated",
                ))
            } else if st.structured {
                Err(error(
                    REP_ERR_INVALID,
                    "structured replies already negotiated",
                ))
            } else {
                st.structured = true;
                Ok(())
            };
            reply_result(stream, code, r)?;
        }
        ClientOption::ExtendedHeaders => {
            let r = if st.extended {
                Err(error(
                    REP_ERR_INVALID,
                    "extended headers already negotiated",
                ))
            } else {
                st.extended = true;
                st.structured = true;
                Ok(())
            };
            reply_result(stream, code, r)?;
        }
        ClientOption::ListMetaContext(req) => meta_context(stream, exports, st, code, req, false)?,
        ClientOption::SetMetaContext(req) => meta_context(stream, exports, st, code, req, true)?,
        ClientOption::Unknown(_) => {
            refuse(
                stream,
                code,
                error(REP_ERR_UNSUP, format!("option {code} not supported")),
            )?;
        }
    }
    Ok(None)
}

fn reply_result<S: Write + ?Sized>(
    stream: &mut S,
    code: u32,
    r: Result<(), OptionError>,
) -> io::Result<()> {
    match r {
        Ok(()) => send(stream, &OptionReply::ack(code)),
        Err(e) => refuse(stream, code, e),
    }
}

/// The contexts selected by the last SET_META_CONTEXT, if it named `export`.
fn selected_contexts(st: &State, export: &Arc<Export>) -> Vec<MetaContext> {
    match &st.meta {
        Some((e, contexts)) if st.structured && Arc::ptr_eq(e, export) => contexts.clone(),
        _ => Vec::new(),
    }
}

/// INFO_EXPORT always, BLOCK_SIZE always, NAME and DESCRIPTION when asked
/// (the description also whenever there is one, as qemu-nbd does).
fn send_info<S: Write + ?Sized>(
    stream: &mut S,
    code: u32,
    export: &Export,
    name: &str,
    device: &dyn BlockDevice,
    req: &InfoRequest,
    tflags: u16,
) -> io::Result<()> {
    let mut out = Vec::new();
    let mut put = |info: Info| out.extend(OptionReply::info(code, &info).encode());
    put(Info::Export {
        size: device.size(),
        flags: tflags,
    });
    if req.requests.contains(&INFO_NAME) {
        put(Info::Name(name.to_string()));
    }
    let description = device
        .export_description()
        .unwrap_or_else(|| export.description().to_string());
    if !description.is_empty() {
        put(Info::Description(description));
    }
    let b = export.block_size_of(device);
    put(Info::BlockSize {
        minimum: b.minimum,
        preferred: b.preferred,
        maximum: b.maximum,
    });
    stream.write_all(&out)?;
    stream.flush()
}

fn meta_context<S: Write + ?Sized>(
    stream: &mut S,
    exports: &ExportSet,
    st: &mut State,
    code: u32,
    req: MetaRequest,
    set: bool,
) -> io::Result<()> {
    if set {
        // A SET replaces the previous selection, even when it fails.
        st.meta = None;
    }
    if !st.structured {
        return refuse(
            stream,
            code,
            error(
                REP_ERR_INVALID,
                "structured replies must be negotiated first",
            ),
        );
    }
    let Some(export) = exports.find(&req.export) else {
        return refuse(
            stream,
            code,
            error(REP_ERR_UNKNOWN, format!("unknown export '{}'", req.export)),
        );
    };
    let mut found: Vec<MetaContext> = Vec::new();
    if req.queries.is_empty() && !set {
        found.extend(export.contexts());
    }
    for q in &req.queries {
        let matches = if set {
            export.set_match(q).into_iter().collect()
        } else {
            export.list_matches(q)
        };
        found.extend(matches);
    }
    // Each once, in the export's order (as qemu-nbd replies).
    found.sort();
    found.dedup();
    let mut out = Vec::new();
    for &m in &found {
        let id = if set { m.id() } else { 0 };
        out.extend(OptionReply::meta_context(code, id, &export.context_name(m)).encode());
    }
    out.extend(OptionReply::ack(code).encode());
    stream.write_all(&out)?;
    stream.flush()?;
    if set {
        st.meta = Some((export, found));
    }
    Ok(())
}
