//! The client side of the fixed-newstyle handshake: greeting, structured
//! replies, metadata contexts, and NBD_OPT_GO (falling back to
//! NBD_OPT_EXPORT_NAME for servers that lack it).

use std::collections::HashMap;
use std::io::{Read, Write};

use diskit_core::{Error, ErrorKind, Result};

use crate::proto::ProtoError;
use crate::proto::consts::*;
use crate::proto::option::{ClientOption, InfoRequest, MetaRequest};
use crate::proto::option_reply::{Info, OPTION_REPLY_HEADER_LEN, OptionReply};

/// Option replies longer than this are refused (a hostile server must not
/// make the client allocate without bound).
pub const MAX_OPTION_REPLY: u32 = 64 << 10;

/// What the handshake settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The export's size in bytes.
    pub size: u64,
    /// Its transmission flags (`TFLAG_*`).
    pub flags: u16,
    /// Whether replies are structured.
    pub structured: bool,
    /// Whether requests and replies have extended headers.
    pub extended: bool,
    /// Block size constraints (minimum, preferred, maximum), if given.
    pub block_size: Option<(u32, u32, u32)>,
    /// The ids of the metadata contexts the server agreed to, by name.
    pub contexts: HashMap<String, u32>,
}

impl Negotiated {
    /// An export entered without options: simple replies, no contexts.
    fn plain(info: ExportInfo) -> Negotiated {
        Negotiated {
            size: info.size,
            flags: info.flags,
            structured: false,
            extended: false,
            block_size: None,
            contexts: HashMap::new(),
        }
    }
}

fn io(e: std::io::Error) -> Error {
    Error::from(e).context("NBD handshake")
}

fn protocol(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Io, format!("NBD handshake: {}", msg.into()))
}

fn read_u16<S: Read>(s: &mut S) -> Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b).map_err(io)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u64<S: Read>(s: &mut S) -> Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).map_err(io)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads one option reply, checking that it answers `option`.
fn read_reply<S: Read>(s: &mut S, option: u32) -> Result<OptionReply> {
    let mut head = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut head).map_err(io)?;
    let (opt, kind, len) =
        OptionReply::parse_header(&head).map_err(|e| protocol(format!("bad option reply: {e}")))?;
    if opt != option {
        return Err(protocol(format!(
            "reply to option {opt} while waiting for option {option}"
        )));
    }
    if len > MAX_OPTION_REPLY {
        return Err(protocol(format!("option reply of {len} bytes is too long")));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).map_err(io)?;
    Ok(OptionReply { option, kind, data })
}

/// The error a server's option error reply stands for.
fn option_error(what: &str, r: &OptionReply) -> Error {
    let text = String::from_utf8_lossy(&r.data);
    let (kind, name) = match r.kind {
        REP_ERR_UNKNOWN => (ErrorKind::NotFound, "unknown export"),
        REP_ERR_POLICY => (ErrorKind::PermissionDenied, "refused by policy"),
        REP_ERR_TLS_REQD => (ErrorKind::PermissionDenied, "the server requires TLS"),
        REP_ERR_UNSUP => (ErrorKind::NotSupported, "not supported"),
        REP_ERR_SHUTDOWN => (ErrorKind::Io, "the server is shutting down"),
        _ => (ErrorKind::Io, "refused"),
    };
    let msg = if text.is_empty() {
        format!("{what}: {name}")
    } else {
        format!("{what}: {name}: {text}")
    };
    Error::new(kind, msg)
}

/// Sends `opt` and reads its replies until the final one; `each` sees
/// every non-final reply. Returns the final reply (ACK or an error).
fn exchange<S: Read + Write>(
    s: &mut S,
    opt: &ClientOption,
    mut each: impl FnMut(&OptionReply) -> Result<()>,
) -> Result<OptionReply> {
    s.write_all(&opt.encode()).map_err(io)?;
    s.flush().map_err(io)?;
    loop {
        let r = read_reply(s, opt.code())?;
        if r.kind == REP_ACK || r.is_error() {
            return Ok(r);
        }
        each(&r)?;
    }
}

/// Sends `opt` and reads the replies of `kind` with `parse` (`what` they
/// are, for errors): them, and the final reply.
fn collect<S: Read + Write, T>(
    s: &mut S,
    opt: &ClientOption,
    kind: u32,
    what: &str,
    parse: impl Fn(&OptionReply) -> std::result::Result<T, ProtoError>,
) -> Result<(Vec<T>, OptionReply)> {
    let mut out = Vec::new();
    let last = exchange(s, opt, |r| {
        if r.kind == kind {
            out.push(parse(r).map_err(|e| protocol(format!("bad {what} reply: {e}")))?);
        }
        Ok(())
    })?;
    Ok((out, last))
}

/// What NBD_OPT_GO (or EXPORT_NAME) told of an export.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
    /// Block sizes (minimum, preferred, maximum), if sent.
    pub block_size: Option<(u32, u32, u32)>,
    /// The description, if sent.
    pub description: Option<String>,
}

/// What a server's greeting says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Greeting {
    /// Newstyle: options follow. `fixed`: the server speaks fixed
    /// newstyle (option errors are replies, not a dropped connection);
    /// `no_zeroes`: it omits the zeros after EXPORT_NAME.
    Newstyle {
        /// Fixed newstyle.
        fixed: bool,
        /// The server omits the 124 zeros after EXPORT_NAME.
        no_zeroes: bool,
    },
    /// Oldstyle: the one export's size and flags came with the greeting,
    /// and transmission has begun (simple replies only).
    Oldstyle(ExportInfo),
}

impl Greeting {
    /// The protocol's name as libnbd gives it.
    pub fn protocol(&self) -> &'static str {
        match self {
            Greeting::Newstyle { fixed: true, .. } => "newstyle-fixed",
            Greeting::Newstyle { fixed: false, .. } => "newstyle",
            Greeting::Oldstyle(_) => "oldstyle",
        }
    }
}

/// Reads the server's greeting and answers it.
pub fn hello<S: Read + Write>(s: &mut S) -> Result<Greeting> {
    let magic = read_u64(s)?;
    if magic != NBDMAGIC {
        return Err(protocol("not an NBD server (bad magic)"));
    }
    let style = read_u64(s)?;
    if style == CLISERV_MAGIC {
        let size = read_u64(s)?;
        let mut flags = [0u8; 4];
        s.read_exact(&mut flags).map_err(io)?;
        let mut zeros = [0u8; 124];
        s.read_exact(&mut zeros).map_err(io)?;
        // The low 16 bits are the transmission flags.
        let flags = (u32::from_be_bytes(flags) & 0xffff) as u16;
        if flags & TFLAG_HAS_FLAGS == 0 {
            return Err(protocol("oldstyle greeting without NBD_FLAG_HAS_FLAGS"));
        }
        return Ok(Greeting::Oldstyle(ExportInfo {
            size,
            flags,
            ..ExportInfo::default()
        }));
    }
    if style != IHAVEOPT {
        return Err(protocol(format!("unknown greeting {style:#x}")));
    }
    let server_flags = read_u16(s)?;
    let fixed = server_flags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let mut client_flags: u32 = 0;
    if fixed {
        client_flags |= FLAG_C_FIXED_NEWSTYLE;
    }
    if no_zeroes {
        client_flags |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&client_flags.to_be_bytes()).map_err(io)?;
    Ok(Greeting::Newstyle { fixed, no_zeroes })
}

/// Reads a fixed-newstyle greeting and answers it; returns whether the
/// server omits the zeros after EXPORT_NAME. Other greetings are errors.
pub fn greet<S: Read + Write>(s: &mut S) -> Result<bool> {
    match hello(s)? {
        Greeting::Newstyle {
            fixed: true,
            no_zeroes,
        } => Ok(no_zeroes),
        Greeting::Newstyle { fixed: false, .. } => {
            Err(protocol("the server does not speak fixed newstyle"))
        }
        Greeting::Oldstyle(_) => Err(protocol("the server speaks the oldstyle protocol")),
    }
}

/// Enters transmission with NBD_OPT_EXPORT_NAME: the server closes the
/// connection when it has no such export, or gives its size and flags.
pub fn export_name<S: Read + Write>(
    s: &mut S,
    export: &str,
    no_zeroes: bool,
) -> Result<ExportInfo> {
    s.write_all(&ClientOption::ExportName(export.to_string()).encode())
        .map_err(io)?;
    s.flush().map_err(io)?;
    let size = read_u64(s).map_err(|e| {
        e.context(format!(
            "the server closed the connection on export '{export}' (no such export?)"
        ))
    })?;
    let flags = read_u16(s)?;
    if !no_zeroes {
        let mut zeros = [0u8; 124];
        s.read_exact(&mut zeros).map_err(io)?;
    }
    Ok(ExportInfo {
        size,
        flags,
        ..ExportInfo::default()
    })
}

/// Asks the server to start TLS (NBD_OPT_STARTTLS) right after the
/// greeting. `Ok` on its acknowledgement: the TLS handshake comes next. A
/// refusal is an error naming it (a client that wants TLS must not go on
/// without it).
pub fn starttls<S: Read + Write>(s: &mut S) -> Result<()> {
    let r = exchange(s, &ClientOption::StartTls, |_| Ok(()))?;
    if r.kind == REP_ACK {
        Ok(())
    } else {
        Err(option_error("NBD_OPT_STARTTLS", &r))
    }
}

/// Asks for extended headers (64-bit lengths; structured replies come
/// with them); whether the server agreed.
pub fn extended_headers<S: Read + Write>(s: &mut S) -> Result<bool> {
    Ok(exchange(s, &ClientOption::ExtendedHeaders, |_| Ok(()))?.kind == REP_ACK)
}

/// Asks for structured replies; whether the server agreed.
pub fn structured_replies<S: Read + Write>(s: &mut S) -> Result<bool> {
    Ok(exchange(s, &ClientOption::StructuredReply, |_| Ok(()))?.kind == REP_ACK)
}

/// Sends a meta context option and collects the (id, name) replies; None
/// when the server refused the option.
fn meta_contexts<S: Read + Write>(
    s: &mut S,
    opt: ClientOption,
) -> Result<Option<Vec<(u32, String)>>> {
    let (out, r) = collect(s, &opt, REP_META_CONTEXT, "meta context", |r| {
        r.parse_meta_context()
    })?;
    Ok((!r.is_error()).then_some(out))
}

/// Selects metadata contexts for `export`: the ids the server gave, by
/// name (none if it refused).
pub fn set_meta_contexts<S: Read + Write>(
    s: &mut S,
    export: &str,
    queries: &[&str],
) -> Result<HashMap<String, u32>> {
    let req = MetaRequest {
        export: export.to_string(),
        queries: queries.iter().map(|c| c.to_string()).collect(),
    };
    Ok(meta_contexts(s, ClientOption::SetMetaContext(req))?
        .unwrap_or_default()
        .into_iter()
        .map(|(id, name)| (name, id))
        .collect())
}

/// Every metadata context the server has for `export`, in the server's
/// order.
pub fn list_meta_contexts<S: Read + Write>(s: &mut S, export: &str) -> Result<Vec<String>> {
    list_meta_contexts_matching(s, export, &[])
}

/// The metadata contexts of `export` that `queries` name (an empty query
/// list asks for all of them), in the server's order; none from a server
/// that refuses the request.
pub fn list_meta_contexts_matching<S: Read + Write>(
    s: &mut S,
    export: &str,
    queries: &[&str],
) -> Result<Vec<String>> {
    let req = MetaRequest {
        export: export.to_string(),
        queries: queries.iter().map(|q| q.to_string()).collect(),
    };
    Ok(meta_contexts(s, ClientOption::ListMetaContext(req))?
        .unwrap_or_default()
        .into_iter()
        .map(|(_, name)| name)
        .collect())
}

/// The exports the server lists (name, description), NBD_OPT_LIST.
pub fn list_exports<S: Read + Write>(s: &mut S) -> Result<Vec<(String, String)>> {
    let (out, r) = collect(s, &ClientOption::List, REP_SERVER, "export list", |r| {
        r.parse_server()
    })?;
    if r.is_error() {
        return Err(option_error("listing exports", &r));
    }
    Ok(out)
}

/// Ends the negotiation without entering transmission (NBD_OPT_ABORT).
pub fn abort<S: Read + Write>(s: &mut S) {
    // The server may close at once: its reply is not needed.
    let _ = s.write_all(&ClientOption::Abort.encode());
    let _ = s.flush();
}

/// Enters transmission on `export`: NBD_OPT_GO asking for block sizes and
/// the description, or EXPORT_NAME for a server that lacks GO.
pub fn go<S: Read + Write>(s: &mut S, export: &str, no_zeroes: bool) -> Result<ExportInfo> {
    let go = ClientOption::Go(info_request(export));
    let (r, info) = export_info(s, &go)?;
    if r.kind == REP_ACK {
        Ok(info)
    } else if r.kind == REP_ERR_UNSUP {
        // An old server, without GO.
        export_name(s, export, no_zeroes)
    } else {
        Err(option_error(&format!("export '{export}'"), &r))
    }
}

/// What NBD_OPT_INFO tells of `export` (size, flags, block sizes,
/// description) without entering transmission; `None` from a server
/// that lacks INFO.
pub fn info<S: Read + Write>(s: &mut S, export: &str) -> Result<Option<ExportInfo>> {
    let (r, info) = export_info(s, &ClientOption::Info(info_request(export)))?;
    match r.kind {
        REP_ACK => Ok(Some(info)),
        REP_ERR_UNSUP => Ok(None),
        _ => Err(option_error(&format!("export '{export}'"), &r)),
    }
}

/// INFO or GO on `export`, asking for block sizes and the description.
fn info_request(export: &str) -> InfoRequest {
    InfoRequest {
        name: export.to_string(),
        requests: vec![INFO_BLOCK_SIZE, INFO_DESCRIPTION],
    }
}

/// Sends INFO or GO and gathers the information replies: the final reply
/// and, when it is an ACK, what they said (checked: the export's size and
/// flags were sent, its block sizes are possible).
fn export_info<S: Read + Write>(
    s: &mut S,
    opt: &ClientOption,
) -> Result<(OptionReply, ExportInfo)> {
    let mut info = ExportInfo::default();
    let mut export_seen = false;
    let r = exchange(s, opt, |r| {
        if r.kind == REP_INFO {
            match Info::parse(&r.data).map_err(|e| protocol(format!("bad info reply: {e}")))? {
                Info::Export { size, flags } => {
                    (info.size, info.flags) = (size, flags);
                    export_seen = true;
                }
                Info::BlockSize {
                    minimum,
                    preferred,
                    maximum,
                } => info.block_size = Some((minimum, preferred, maximum)),
                Info::Description(d) => info.description = Some(d),
                _ => {}
            }
        }
        Ok(())
    })?;
    if r.kind != REP_ACK {
        return Ok((r, info));
    }
    if !export_seen {
        return Err(protocol("the server sent no export information"));
    }
    if let Some((min, pref, max)) = info.block_size {
        let pow2 = |v: u32| v.is_power_of_two();
        if !pow2(min) || min > 65536 || !pow2(pref) || pref < min || max < pref.min(max) {
            return Err(protocol(format!(
                "the server sent impossible block sizes ({min}, {pref}, {max})"
            )));
        }
    }
    Ok((r, info))
}

/// Negotiates `export` on a fresh connection: structured replies and the
/// metadata contexts in `contexts` when the server has them, then GO.
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &str,
    contexts: &[&str],
) -> Result<Negotiated> {
    let no_zeroes = match hello(s)? {
        Greeting::Oldstyle(info) => {
            if !export.is_empty() {
                return Err(protocol(format!(
                    "an oldstyle server has one export, not '{export}'"
                )));
            }
            return Ok(Negotiated::plain(info));
        }
        // Without fixed newstyle any other option may end the connection.
        Greeting::Newstyle {
            fixed: false,
            no_zeroes,
        } => return Ok(Negotiated::plain(export_name(s, export, no_zeroes)?)),
        Greeting::Newstyle { no_zeroes, .. } => no_zeroes,
    };
    negotiate_options(s, export, contexts, no_zeroes)
}

/// The options of [`negotiate`] after a fixed-newstyle greeting (and
/// after STARTTLS, over TLS): extended headers or structured replies, the
/// metadata contexts in `contexts`, then GO. `no_zeroes` is what the
/// greeting said, for a server that only knows EXPORT_NAME.
pub fn negotiate_options<S: Read + Write>(
    s: &mut S,
    export: &str,
    contexts: &[&str],
    no_zeroes: bool,
) -> Result<Negotiated> {
    let extended = extended_headers(s)?;
    let structured = extended || structured_replies(s)?;
    let ids = if structured && !contexts.is_empty() {
        set_meta_contexts(s, export, contexts)?
    } else {
        HashMap::new()
    };
    let info = go(s, export, no_zeroes)?;
    Ok(Negotiated {
        size: info.size,
        flags: info.flags,
        structured,
        extended,
        block_size: info.block_size,
        contexts: ids,
    })
}
