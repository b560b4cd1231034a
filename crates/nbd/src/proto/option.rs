//! Handshake options sent by the client (`IHAVEOPT`, option, length, data):
//! parsing with every field validated, and encoding (for clients and tests).

use super::ProtoError;
use super::consts::*;
use super::cursor::{Cursor, PutBe};

/// Bytes in an option header: magic, option, length.
pub const OPTION_HEADER_LEN: usize = 16;

/// The fixed part of a client option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option code (`OPT_*`).
    pub option: u32,
    /// Bytes of option data that follow.
    pub length: u32,
}

impl OptionHeader {
    /// Parses an option header; a wrong magic is a protocol violation.
    pub fn parse(buf: &[u8; OPTION_HEADER_LEN]) -> Result<OptionHeader, ProtoError> {
        let mut c = Cursor::new(buf);
        let magic = c.u64().ok_or(ProtoError::Short)?;
        if magic != IHAVEOPT {
            return Err(ProtoError::BadMagic(magic));
        }
        Ok(OptionHeader {
            option: c.u32().ok_or(ProtoError::Short)?,
            length: c.u32().ok_or(ProtoError::Short)?,
        })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; OPTION_HEADER_LEN] {
        let mut v = Vec::with_capacity(OPTION_HEADER_LEN);
        v.put_u64(IHAVEOPT);
        v.put_u32(self.option);
        v.put_u32(self.length);
        v.try_into().expect("16 bytes")
    }
}

/// What NBD_OPT_INFO and NBD_OPT_GO ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// The export name ("" = the default export).
    pub name: String,
    /// The information types requested (`INFO_*`), unknown ones included.
    pub requests: Vec<u16>,
}

/// What NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    /// The export the contexts are for.
    pub export: String,
    /// The context names or queries.
    pub queries: Vec<String>,
}

/// A parsed client option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    /// NBD_OPT_EXPORT_NAME.
    ExportName(String),
    /// NBD_OPT_ABORT (any data is ignored, as the spec asks).
    Abort,
    /// NBD_OPT_LIST.
    List,
    /// NBD_OPT_STARTTLS.
    StartTls,
    /// NBD_OPT_INFO.
    Info(InfoRequest),
    /// NBD_OPT_GO.
    Go(InfoRequest),
    /// NBD_OPT_STRUCTURED_REPLY.
    StructuredReply,
    /// NBD_OPT_LIST_META_CONTEXT.
    ListMetaContext(MetaRequest),
    /// NBD_OPT_SET_META_CONTEXT.
    SetMetaContext(MetaRequest),
    /// NBD_OPT_EXTENDED_HEADERS.
    ExtendedHeaders,
    /// An option this implementation does not know (its data is skipped).
    Unknown(u32),
}

/// Why an option was refused: the error reply to send, with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionError {
    /// The `REP_ERR_*` code.
    pub reply: u32,
    /// Human-readable text for the reply payload.
    pub message: String,
}

impl OptionError {
    /// An NBD_REP_ERR_INVALID error.
    pub fn invalid(message: impl Into<String>) -> OptionError {
        OptionError {
            reply: REP_ERR_INVALID,
            message: message.into(),
        }
    }
}

/// Validates a protocol string: UTF-8, no NUL, at most [`MAX_STRING`] bytes.
pub fn parse_string(bytes: &[u8], what: &str) -> Result<String, OptionError> {
    if bytes.len() > MAX_STRING {
        return Err(OptionError {
            reply: REP_ERR_TOO_BIG,
            message: format!("{what} too long"),
        });
    }
    if bytes.contains(&0) {
        return Err(OptionError::invalid(format!("{what} contains NUL")));
    }
    String::from_utf8(bytes.to_vec())
        .map_err(|_| OptionError::invalid(format!("{what} is not UTF-8")))
}

fn no_data(data: &[u8], what: &str) -> Result<(), OptionError> {
    if data.is_empty() {
        Ok(())
    } else {
        Err(OptionError::invalid(format!("{what} takes no data")))
    }
}

impl ClientOption {
    /// Parses the data of option `option`; malformed data gives the error
    /// reply the spec names (ERR_INVALID, or ERR_TOO_BIG for long strings).
    pub fn parse(option: u32, data: &[u8]) -> Result<ClientOption, OptionError> {
        match option {
            OPT_EXPORT_NAME => Ok(ClientOption::ExportName(parse_string(data, "export name")?)),
            OPT_ABORT => Ok(ClientOption::Abort),
            OPT_LIST => no_data(data, "NBD_OPT_LIST").map(|_| ClientOption::List),
            OPT_STARTTLS => no_data(data, "NBD_OPT_STARTTLS").map(|_| ClientOption::StartTls),
            OPT_INFO => Ok(ClientOption::Info(parse_info(data)?)),
            OPT_GO => Ok(ClientOption::Go(parse_info(data)?)),
            OPT_STRUCTURED_REPLY => {
                no_data(data, "NBD_OPT_STRUCTURED_REPLY").map(|_| ClientOption::StructuredReply)
            }
            OPT_LIST_META_CONTEXT => Ok(ClientOption::ListMetaContext(parse_meta(data)?)),
            OPT_SET_META_CONTEXT => Ok(ClientOption::SetMetaContext(parse_meta(data)?)),
            OPT_EXTENDED_HEADERS => {
                no_data(data, "NBD_OPT_EXTENDED_HEADERS").map(|_| ClientOption::ExtendedHeaders)
            }
            other => Ok(ClientOption::Unknown(other)),
        }
    }

    /// The option code.
    pub fn code(&self) -> u32 {
        match self {
            ClientOption::ExportName(_) => OPT_EXPORT_NAME,
            ClientOption::Abort => OPT_ABORT,
            ClientOption::List => OPT_LIST,
            ClientOption::StartTls => OPT_STARTTLS,
            ClientOption::Info(_) => OPT_INFO,
            ClientOption::Go(_) => OPT_GO,
            ClientOption::StructuredReply => OPT_STRUCTURED_REPLY,
            ClientOption::ListMetaContext(_) => OPT_LIST_META_CONTEXT,
            ClientOption::SetMetaContext(_) => OPT_SET_META_CONTEXT,
            ClientOption::ExtendedHeaders => OPT_EXTENDED_HEADERS,
            ClientOption::Unknown(code) => *code,
        }
    }

    /// The option's data, as a client sends it.
    pub fn encode_data(&self) -> Vec<u8> {
        let mut v = Vec::new();
        match self {
            ClientOption::ExportName(name) => v.extend_from_slice(name.as_bytes()),
            ClientOption::Info(r) | ClientOption::Go(r) => {
                v.put_u32(r.name.len() as u32);
                v.extend_from_slice(r.name.as_bytes());
                v.put_u16(r.requests.len() as u16);
                for &i in &r.requests {
                    v.put_u16(i);
                }
            }
            ClientOption::ListMetaContext(r) | ClientOption::SetMetaContext(r) => {
                v.put_u32(r.export.len() as u32);
                v.extend_from_slice(r.export.as_bytes());
                v.put_u32(r.queries.len() as u32);
                for q in &r.queries {
                    v.put_u32(q.len() as u32);
                    v.extend_from_slice(q.as_bytes());
                }
            }
            _ => {}
        }
        v
    }

    /// The whole option (header and data), as a client sends it.
    pub fn encode(&self) -> Vec<u8> {
        let data = self.encode_data();
        let mut v = OptionHeader {
            option: self.code(),
            length: data.len() as u32,
        }
        .encode()
        .to_vec();
        v.extend_from_slice(&data);
        v
    }
}

/// The export name `data` starts with (a 32-bit length, then UTF-8), and
/// a cursor after it.
fn export_name(data: &[u8]) -> Result<(String, Cursor<'_>), OptionError> {
    let mut c = Cursor::new(data);
    let name = c
        .string32()
        .ok_or_else(|| OptionError::invalid("export name length exceeds the option"))?;
    Ok((parse_string(name, "export name")?, c))
}

fn parse_info(data: &[u8]) -> Result<InfoRequest, OptionError> {
    let (name, mut c) = export_name(data)?;
    let n = c
        .u16()
        .ok_or_else(|| OptionError::invalid("missing information request count"))?;
    if c.remaining() != usize::from(n) * 2 {
        return Err(OptionError::invalid(
            "information request count does not match the option length",
        ));
    }
    let requests = (0..n).map(|_| c.u16().expect("length checked")).collect();
    Ok(InfoRequest { name, requests })
}

fn parse_meta(data: &[u8]) -> Result<MetaRequest, OptionError> {
    let (export, mut c) = export_name(data)?;
    let n = c
        .u32()
        .ok_or_else(|| OptionError::invalid("missing query count"))?;
    // Each query takes at least its 4-byte length: bound the count first.
    if n as usize > c.remaining() / 4 {
        return Err(OptionError::invalid(
            "query count exceeds the option length",
        ));
    }
    let mut queries = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let q = c
            .string32()
            .ok_or_else(|| OptionError::invalid("query length exceeds the option"))?;
        queries.push(parse_string(q, "context query")?);
    }
    if c.remaining() != 0 {
        return Err(OptionError::invalid("trailing bytes after the queries"));
    }
    Ok(MetaRequest { export, queries })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_round_trip() {
        let opts = [
            ClientOption::ExportName("disk".into()),
            ClientOption::List,
            ClientOption::Go(InfoRequest {
                name: "x".into(),
                requests: vec![INFO_BLOCK_SIZE, INFO_NAME],
            }),
            ClientOption::SetMetaContext(MetaRequest {
                export: String::new(),
                queries: vec!["base:allocation".into(), "qemu:".into()],
            }),
            ClientOption::ExtendedHeaders,
            ClientOption::Unknown(99),
        ];
        for o in opts {
            let wire = o.encode();
            let h = OptionHeader::parse(wire[..16].try_into().unwrap()).unwrap();
            assert_eq!(h.length as usize, wire.len() - 16);
            assert_eq!(ClientOption::parse(h.option, &wire[16..]).unwrap(), o);
        }
    }

    #[test]
    fn malformed_options_are_invalid() {
        assert_eq!(
            ClientOption::parse(OPT_LIST, b"x").unwrap_err().reply,
            REP_ERR_INVALID
        );
        // Name length beyond the data.
        let bad = [0, 0, 0, 9, b'a', 0, 0];
        assert!(ClientOption::parse(OPT_GO, &bad).is_err());
        // Request count that does not match.
        let bad = [0, 0, 0, 0, 0, 2, 0, 3];
        assert!(ClientOption::parse(OPT_INFO, &bad).is_err());
        // Huge query count.
        let bad = [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert!(ClientOption::parse(OPT_SET_META_CONTEXT, &bad).is_err());
        assert!(ClientOption::parse(OPT_EXPORT_NAME, b"a\0b").is_err());
        let long = vec![b'a'; MAX_STRING + 1];
        assert_eq!(
            ClientOption::parse(OPT_EXPORT_NAME, &long)
                .unwrap_err()
                .reply,
            REP_ERR_TOO_BIG
        );
        assert_eq!(
            ClientOption::parse(OPT_ABORT, b"junk"),
            Ok(ClientOption::Abort)
        );
        let mut hdr = OptionHeader {
            option: 1,
            length: 0,
        }
        .encode();
        hdr[0] ^= 1;
        assert!(matches!(
            OptionHeader::parse(&hdr),
            Err(ProtoError::BadMagic(_))
        ));
    }
}
