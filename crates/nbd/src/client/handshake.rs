//! The client side of the fixed-newstyle handshake: greeting, structured
//! replies, metadata contexts, and NBD_OPT_GO (falling back to
//! NBD_OPT_EXPORT_NAME for servers that lack it).

use std::collections::HashMap;
use std::io::{Read, Write};

use diskit_core::{Error, ErrorKind, Result};

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
    /// Block size constraints (minimum, preferred, maximum), if given.
    pub block_size: Option<(u32, u32, u32)>,
    /// The ids of the metadata contexts the server agreed to, by name.
    pub contexts: HashMap<String, u32>,
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

/// Negotiates `export` on a fresh connection: structured replies and the
/// metadata contexts in `contexts` when the server has them, then GO.
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &str,
    contexts: &[&str],
) -> Result<Negotiated> {
    let magic = read_u64(s)?;
    if magic != NBDMAGIC {
        return Err(protocol("not an NBD server (bad magic)"));
    }
    let style = read_u64(s)?;
    if style != IHAVEOPT {
        return Err(protocol(
            "the server speaks the oldstyle protocol, which diskit does not",
        ));
    }
    let server_flags = read_u16(s)?;
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol("the server does not speak fixed newstyle"));
    }
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let mut client_flags = FLAG_C_FIXED_NEWSTYLE;
    if no_zeroes {
        client_flags |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&client_flags.to_be_bytes()).map_err(io)?;

    let r = exchange(s, &ClientOption::StructuredReply, |_| Ok(()))?;
    let structured = r.kind == REP_ACK;

    let mut ids = HashMap::new();
    if structured && !contexts.is_empty() {
        let req = MetaRequest {
            export: export.to_string(),
            queries: contexts.iter().map(|c| c.to_string()).collect(),
        };
        let r = exchange(s, &ClientOption::SetMetaContext(req), |r| {
            if r.kind == REP_META_CONTEXT {
                let (id, name) = r
                    .parse_meta_context()
                    .map_err(|e| protocol(format!("bad meta context reply: {e}")))?;
                ids.insert(name, id);
            }
            Ok(())
        })?;
        if r.is_error() {
            // Contexts are an optimisation: without them, all is data.
            ids.clear();
        }
    }

    let go = ClientOption::Go(InfoRequest {
        name: export.to_string(),
        requests: vec![INFO_BLOCK_SIZE],
    });
    let mut export_info = None;
    let mut block_size = None;
    let r = exchange(s, &go, |r| {
        if r.kind == REP_INFO {
            match Info::parse(&r.data).map_err(|e| protocol(format!("bad info reply: {e}")))? {
                Info::Export { size, flags } => export_info = Some((size, flags)),
                Info::BlockSize {
                    minimum,
                    preferred,
                    maximum,
                } => block_size = Some((minimum, preferred, maximum)),
                _ => {}
            }
        }
        Ok(())
    })?;
    let (size, flags) = if r.kind == REP_ACK {
        export_info.ok_or_else(|| protocol("the server sent no export information"))?
    } else if r.kind == REP_ERR_UNSUP {
        // An old server: EXPORT_NAME has no reply on failure (the server
        // closes the connection) and gives size and flags on success.
        s.write_all(&ClientOption::ExportName(export.to_string()).encode())
            .map_err(io)?;
        s.flush().map_err(io)?;
        let size = read_u64(s)?;
        let flags = read_u16(s)?;
        if !no_zeroes {
            let mut zeros = [0u8; 124];
            s.read_exact(&mut zeros).map_err(io)?;
        }
        (size, flags)
    } else {
        return Err(option_error(&format!("export '{export}'"), &r));
    };
    if let Some((min, pref, max)) = block_size {
        let pow2 = |v: u32| v.is_power_of_two();
        if !pow2(min) || min > 65536 || !pow2(pref) || pref < min || max < pref.min(max) {
            return Err(protocol(format!(
                "the server sent impossible block sizes ({min}, {pref}, {max})"
            )));
        }
    }
    Ok(Negotiated {
        size,
        flags,
        structured,
        block_size,
        contexts: ids,
    })
}
