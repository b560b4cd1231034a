//! Fixed-newstyle option replies (magic, option, type, length, data):
//! encoding for the server, parsing for clients and tests.

use super::ProtoError;
use super::consts::*;
use super::cursor::{Cursor, PutBe};

/// Bytes in an option reply header.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;

/// One option reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    /// The option this answers.
    pub option: u32,
    /// The reply type (`REP_*`).
    pub kind: u32,
    /// The reply's data.
    pub data: Vec<u8>,
}

/// The meaning of an NBD_REP_INFO reply's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    /// NBD_INFO_EXPORT: size and transmission flags.
    Export {
        /// Export size in bytes.
        size: u64,
        /// Transmission flags.
        flags: u16,
    },
    /// NBD_INFO_NAME.
    Name(String),
    /// NBD_INFO_DESCRIPTION.
    Description(String),
    /// NBD_INFO_BLOCK_SIZE.
    BlockSize {
        /// Minimum block size.
        minimum: u32,
        /// Preferred block size.
        preferred: u32,
        /// Maximum payload size.
        maximum: u32,
    },
    /// An information type this implementation does not know.
    Unknown(u16),
}

impl Info {
    /// Encodes the info as NBD_REP_INFO data (type first).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        match self {
            Info::Export { size, flags } => {
                v.put_u16(INFO_EXPORT);
                v.put_u64(*size);
                v.put_u16(*flags);
            }
            Info::Name(n) => {
                v.put_u16(INFO_NAME);
                v.extend_from_slice(n.as_bytes());
            }
            Info::Description(d) => {
                v.put_u16(INFO_DESCRIPTION);
                v.extend_from_slice(d.as_bytes());
            }
            Info::BlockSize {
                minimum,
                preferred,
                maximum,
            } => {
                v.put_u16(INFO_BLOCK_SIZE);
                v.put_u32(*minimum);
                v.put_u32(*preferred);
                v.put_u32(*maximum);
            }
            Info::Unknown(t) => v.put_u16(*t),
        }
        v
    }

    /// Parses NBD_REP_INFO data, checking each type's exact length.
    pub fn parse(data: &[u8]) -> Result<Info, ProtoError> {
        let mut c = Cursor::new(data);
        let kind = c.u16().ok_or(ProtoError::Short)?;
        let text = |c: &mut Cursor<'_>| {
            String::from_utf8(c.rest().to_vec()).map_err(|_| ProtoError::Malformed("info text"))
        };
        let info = match kind {
            INFO_EXPORT if c.remaining() == 10 => Info::Export {
                size: c.u64().ok_or(ProtoError::Short)?,
                flags: c.u16().ok_or(ProtoError::Short)?,
            },
            INFO_NAME => Info::Name(text(&mut c)?),
            INFO_DESCRIPTION => Info::Description(text(&mut c)?),
            INFO_BLOCK_SIZE if c.remaining() == 12 => Info::BlockSize {
                minimum: c.u32().ok_or(ProtoError::Short)?,
                preferred: c.u32().ok_or(ProtoError::Short)?,
                maximum: c.u32().ok_or(ProtoError::Short)?,
            },
            INFO_EXPORT | INFO_BLOCK_SIZE => return Err(ProtoError::Malformed("info length")),
            other => Info::Unknown(other),
        };
        Ok(info)
    }
}

impl OptionReply {
    /// NBD_REP_ACK.
    pub fn ack(option: u32) -> OptionReply {
        OptionReply {
            option,
            kind: REP_ACK,
            data: Vec::new(),
        }
    }

    /// An error reply (`REP_ERR_*`) with a human-readable message.
    pub fn error(option: u32, kind: u32, message: &str) -> OptionReply {
        debug_assert!(kind & REP_FLAG_ERROR != 0);
        let msg = &message.as_bytes()[..message.len().min(MAX_STRING)];
        OptionReply {
            option,
            kind,
            data: msg.to_vec(),
        }
    }

    /// NBD_REP_SERVER: one export of a LIST, with its description.
    pub fn server(option: u32, name: &str, description: &str) -> OptionReply {
        let mut data = Vec::new();
        data.put_u32(name.len() as u32);
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(description.as_bytes());
        OptionReply {
            option,
            kind: REP_SERVER,
            data,
        }
    }

    /// NBD_REP_INFO.
    pub fn info(option: u32, info: &Info) -> OptionReply {
        OptionReply {
            option,
            kind: REP_INFO,
            data: info.encode(),
        }
    }

    /// NBD_REP_META_CONTEXT: a context id and name.
    pub fn meta_context(option: u32, id: u32, name: &str) -> OptionReply {
        let mut data = Vec::new();
        data.put_u32(id);
        data.extend_from_slice(name.as_bytes());
        OptionReply {
            option,
            kind: REP_META_CONTEXT,
            data,
        }
    }

    /// Whether this is an error reply.
    pub fn is_error(&self) -> bool {
        self.kind & REP_FLAG_ERROR != 0
    }

    /// Encodes the reply, header and data.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + self.data.len());
        v.put_u64(OPTION_REPLY_MAGIC);
        v.put_u32(self.option);
        v.put_u32(self.kind);
        v.put_u32(self.data.len() as u32);
        v.extend_from_slice(&self.data);
        v
    }

    /// Parses a header: (option, type, data length).
    pub fn parse_header(
        buf: &[u8; OPTION_REPLY_HEADER_LEN],
    ) -> Result<(u32, u32, u32), ProtoError> {
        let mut c = Cursor::new(buf);
        let magic = c.u64().ok_or(ProtoError::Short)?;
        if magic != OPTION_REPLY_MAGIC {
            return Err(ProtoError::BadMagic(magic));
        }
        Ok((
            c.u32().ok_or(ProtoError::Short)?,
            c.u32().ok_or(ProtoError::Short)?,
            c.u32().ok_or(ProtoError::Short)?,
        ))
    }

    /// Parses one whole reply at the start of `buf`; returns it and the
    /// bytes it took, or [`ProtoError::Short`] if more bytes are needed.
    pub fn parse(buf: &[u8]) -> Result<(OptionReply, usize), ProtoError> {
        let head: &[u8; OPTION_REPLY_HEADER_LEN] = buf
            .get(..OPTION_REPLY_HEADER_LEN)
            .ok_or(ProtoError::Short)?
            .try_into()
            .expect("20 bytes");
        let (option, kind, len) = Self::parse_header(head)?;
        let end = OPTION_REPLY_HEADER_LEN + len as usize;
        let data = buf
            .get(OPTION_REPLY_HEADER_LEN..end)
            .ok_or(ProtoError::Short)?;
        Ok((
            OptionReply {
                option,
                kind,
                data: data.to_vec(),
            },
            end,
        ))
    }

    /// For NBD_REP_SERVER: the export name and description.
    pub fn parse_server(&self) -> Result<(String, String), ProtoError> {
        let mut c = Cursor::new(&self.data);
        let name = c.string32().ok_or(ProtoError::Malformed("server reply"))?;
        let to_s =
            |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| ProtoError::Malformed("name"));
        Ok((to_s(name)?, to_s(c.rest())?))
    }

    /// For NBD_REP_META_CONTEXT: the context id and name.
    pub fn parse_meta_context(&self) -> Result<(u32, String), ProtoError> {
        let mut c = Cursor::new(&self.data);
        let id = c.u32().ok_or(ProtoError::Malformed("meta context reply"))?;
        let name =
            String::from_utf8(c.rest().to_vec()).map_err(|_| ProtoError::Malformed("name"))?;
        Ok((id, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_round_trip() {
        let infos = [
            Info::Export {
                size: 1 << 40,
                flags: 0x1ed,
            },
            Info::Name("disk".into()),
            Info::BlockSize {
                minimum: 1,
                preferred: 4096,
                maximum: 1 << 25,
            },
        ];
        for i in infos {
            let r = OptionReply::info(OPT_GO, &i);
            let wire = r.encode();
            let (back, used) = OptionReply::parse(&wire).unwrap();
            assert_eq!(used, wire.len());
            assert_eq!(Info::parse(&back.data).unwrap(), i);
        }
        let r = OptionReply::server(OPT_LIST, "a", "desc");
        assert_eq!(
            r.parse_server().unwrap(),
            ("a".to_string(), "desc".to_string())
        );
        let r = OptionReply::meta_context(OPT_SET_META_CONTEXT, 7, "base:allocation");
        assert_eq!(r.parse_meta_context().unwrap().0, 7);
        assert!(OptionReply::error(1, REP_ERR_UNSUP, "x").is_error());
        assert_eq!(
            OptionReply::parse(&OptionReply::ack(1).encode()[..19]),
            Err(ProtoError::Short)
        );
        assert!(Info::parse(&[0, 0, 1]).is_err());
    }
}
