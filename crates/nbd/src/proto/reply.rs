//! Transmission replies: simple replies, structured chunks (compact 20-byte
//! and extended 32-byte headers) and their payloads. Encoding for the
//! server, parsing for clients, tests and the fuzzer.

use super::ProtoError;
use super::consts::*;
use super::cursor::{Cursor, PutBe};

/// Bytes in a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes in a compact structured chunk header.
pub const STRUCTURED_HEADER_LEN: usize = 20;
/// Bytes in an extended chunk header.
pub const EXTENDED_HEADER_LEN: usize = 32;

/// Which reply headers the connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyStyle {
    /// Only simple replies (nothing negotiated).
    Simple,
    /// Structured replies with compact chunk headers.
    Structured,
    /// Extended headers: 64-bit chunk headers, no simple replies.
    Extended,
}

/// Encodes a simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut v = Vec::with_capacity(SIMPLE_REPLY_LEN);
    v.put_u32(SIMPLE_REPLY_MAGIC);
    v.put_u32(error);
    v.put_u64(cookie);
    v.try_into().expect("16 bytes")
}

/// A structured reply chunk's header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Reply flags (`REPLY_FLAG_DONE`).
    pub flags: u16,
    /// Chunk type (`REPLY_TYPE_*`).
    pub kind: u16,
    /// The request's cookie.
    pub cookie: u64,
    /// The request's offset (carried only by extended headers).
    pub offset: u64,
    /// Payload length.
    pub length: u64,
}

impl ChunkHeader {
    /// Appends the header in the compact or extended form. A compact
    /// header cannot carry a payload of 4 GiB or more: callers split.
    pub fn encode_into(&self, extended: bool, v: &mut Vec<u8>) {
        if extended {
            v.put_u32(EXTENDED_REPLY_MAGIC);
            v.put_u16(self.flags);
            v.put_u16(self.kind);
            v.put_u64(self.cookie);
            v.put_u64(self.offset);
            v.put_u64(self.length);
        } else {
            debug_assert!(self.length <= u64::from(u32::MAX));
            v.put_u32(STRUCTURED_REPLY_MAGIC);
            v.put_u16(self.flags);
            v.put_u16(self.kind);
            v.put_u64(self.cookie);
            v.put_u32(self.length as u32);
        }
    }
}

/// Appends a whole chunk (header and payload) to `v`.
pub fn put_chunk(v: &mut Vec<u8>, extended: bool, header: ChunkHeader, payload: &[u8]) {
    debug_assert_eq!(header.length, payload.len() as u64);
    header.encode_into(extended, v);
    v.extend_from_slice(payload);
}

/// The payload of an NBD_REPLY_TYPE_ERROR chunk.
pub fn error_payload(error: u32, message: &str) -> Vec<u8> {
    let msg = &message.as_bytes()[..message.len().min(MAX_STRING)];
    let mut v = Vec::with_capacity(6 + msg.len());
    v.put_u32(error);
    v.put_u16(msg.len() as u16);
    v.extend_from_slice(msg);
    v
}

/// The payload of an NBD_REPLY_TYPE_OFFSET_HOLE chunk.
pub fn hole_payload(offset: u64, len: u32) -> [u8; 12] {
    let mut v = Vec::with_capacity(12);
    v.put_u64(offset);
    v.put_u32(len);
    v.try_into().expect("12 bytes")
}

/// The payload of a block status chunk: compact descriptors (u32 length,
/// u32 flags) or extended ones (u64, u64) for `BLOCK_STATUS_EXT`.
pub fn block_status_payload(context: u32, extents: &[(u64, u32)], extended: bool) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + extents.len() * 16);
    v.put_u32(context);
    if extended {
        v.put_u32(extents.len() as u32);
        for &(len, flags) in extents {
            v.put_u64(len);
            v.put_u64(u64::from(flags));
        }
    } else {
        for &(len, flags) in extents {
            debug_assert!(len <= u64::from(u32::MAX));
            v.put_u32(len as u32);
            v.put_u32(flags);
        }
    }
    v
}

/// A reply header as parsed by a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply (READ data may follow on success).
    Simple {
        /// Error code (0 = success).
        error: u32,
        /// The request's cookie.
        cookie: u64,
    },
    /// A structured or extended chunk; its payload follows.
    Chunk(ChunkHeader),
}

impl ReplyHeader {
    /// Parses the header at the start of `buf`, whatever its magic; returns
    /// it and its length, or [`ProtoError::Short`] when more bytes are needed.
    pub fn parse(buf: &[u8]) -> Result<(ReplyHeader, usize), ProtoError> {
        let mut c = Cursor::new(buf);
        let magic = c.u32().ok_or(ProtoError::Short)?;
        match magic {
            SIMPLE_REPLY_MAGIC => {
                let error = c.u32().ok_or(ProtoError::Short)?;
                let cookie = c.u64().ok_or(ProtoError::Short)?;
                Ok((ReplyHeader::Simple { error, cookie }, SIMPLE_REPLY_LEN))
            }
            STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC => {
                let extended = magic == EXTENDED_REPLY_MAGIC;
                let flags = c.u16().ok_or(ProtoError::Short)?;
                let kind = c.u16().ok_or(ProtoError::Short)?;
                let cookie = c.u64().ok_or(ProtoError::Short)?;
                let (offset, length, used) = if extended {
                    let offset = c.u64().ok_or(ProtoError::Short)?;
                    (
                        offset,
                        c.u64().ok_or(ProtoError::Short)?,
                        EXTENDED_HEADER_LEN,
                    )
                } else {
                    let len = c.u32().ok_or(ProtoError::Short)?;
                    (0, u64::from(len), STRUCTURED_HEADER_LEN)
                };
                Ok((
                    ReplyHeader::Chunk(ChunkHeader {
                        flags,
                        kind,
                        cookie,
                        offset,
                        length,
                    }),
                    used,
                ))
            }
            other => Err(ProtoError::BadMagic(u64::from(other))),
        }
    }
}

/// A parsed chunk payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk<'a> {
    /// NBD_REPLY_TYPE_NONE.
    None,
    /// NBD_REPLY_TYPE_OFFSET_DATA.
    Data {
        /// Offset of the first byte.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// NBD_REPLY_TYPE_OFFSET_HOLE.
    Hole {
        /// Offset.
        offset: u64,
        /// Length (nonzero).
        len: u32,
    },
    /// NBD_REPLY_TYPE_BLOCK_STATUS or BLOCK_STATUS_EXT: (length, flags).
    BlockStatus {
        /// Context id.
        context: u32,
        /// Descriptors.
        extents: Vec<(u64, u64)>,
    },
    /// NBD_REPLY_TYPE_ERROR or ERROR_OFFSET.
    Error {
        /// Error code (nonzero).
        error: u32,
        /// Message.
        message: String,
        /// Offset, for ERROR_OFFSET.
        offset: Option<u64>,
    },
    /// A chunk type this implementation does not know.
    Unknown(u16),
}

impl<'a> Chunk<'a> {
    /// Parses the payload of a chunk of type `kind`, checking lengths.
    pub fn parse(kind: u16, payload: &'a [u8]) -> Result<Chunk<'a>, ProtoError> {
        let mut c = Cursor::new(payload);
        let bad = ProtoError::Malformed;
        match kind {
            REPLY_TYPE_NONE if payload.is_empty() => Ok(Chunk::None),
            REPLY_TYPE_NONE => Err(bad("NONE chunk with a payload")),
            REPLY_TYPE_OFFSET_DATA => {
                let offset = c.u64().ok_or(bad("short OFFSET_DATA"))?;
                if c.remaining() == 0 {
                    return Err(bad("empty OFFSET_DATA"));
                }
                Ok(Chunk::Data {
                    offset,
                    data: c.rest(),
                })
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let offset = c.u64().ok_or(bad("short OFFSET_HOLE"))?;
                let len = c.u32().ok_or(bad("short OFFSET_HOLE"))?;
                if len == 0 || c.remaining() != 0 {
                    return Err(bad("bad OFFSET_HOLE"));
                }
                Ok(Chunk::Hole { offset, len })
            }
            REPLY_TYPE_BLOCK_STATUS => {
                let context = c.u32().ok_or(bad("short BLOCK_STATUS"))?;
                if c.remaining() == 0 || !c.remaining().is_multiple_of(8) {
                    return Err(bad("bad BLOCK_STATUS length"));
                }
                let mut extents = Vec::with_capacity(c.remaining() / 8);
                while c.remaining() > 0 {
                    let len = c.u32().expect("length checked");
                    let flags = c.u32().expect("length checked");
                    extents.push((u64::from(len), u64::from(flags)));
                }
                Ok(Chunk::BlockStatus { context, extents })
            }
            REPLY_TYPE_BLOCK_STATUS_EXT => {
                let context = c.u32().ok_or(bad("short BLOCK_STATUS_EXT"))?;
                let count = c.u32().ok_or(bad("short BLOCK_STATUS_EXT"))? as usize;
                if count == 0 || c.remaining() != count.saturating_mul(16) {
                    return Err(bad("bad BLOCK_STATUS_EXT count"));
                }
                let extents = (0..count)
                    .map(|_| (c.u64().expect("checked"), c.u64().expect("checked")))
                    .collect();
                Ok(Chunk::BlockStatus { context, extents })
            }
            REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                let error = c.u32().ok_or(bad("short ERROR"))?;
                let msg = c
                    .bytes(usize::from(c.clone().u16().ok_or(bad("short ERROR"))?) + 2)
                    .ok_or(bad("ERROR message overruns the chunk"))?;
                let message = String::from_utf8_lossy(&msg[2..]).into_owned();
                let offset = if kind == REPLY_TYPE_ERROR_OFFSET {
                    Some(c.u64().ok_or(bad("short ERROR_OFFSET"))?)
                } else {
                    None
                };
                if error == 0 || c.remaining() != 0 {
                    return Err(bad("bad ERROR chunk"));
                }
                Ok(Chunk::Error {
                    error,
                    message,
                    offset,
                })
            }
            other => Ok(Chunk::Unknown(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(extended: bool, kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        let h = ChunkHeader {
            flags: REPLY_FLAG_DONE,
            kind,
            cookie: 42,
            offset: if extended { 4096 } else { 0 },
            length: payload.len() as u64,
        };
        put_chunk(&mut v, extended, h, payload);
        let (parsed, used) = ReplyHeader::parse(&v).unwrap();
        assert_eq!(parsed, ReplyHeader::Chunk(h));
        v[used..].to_vec()
    }

    #[test]
    fn chunks_round_trip() {
        for ext in [false, true] {
            let p = round_trip(ext, REPLY_TYPE_OFFSET_HOLE, &hole_payload(8, 512));
            assert_eq!(
                Chunk::parse(REPLY_TYPE_OFFSET_HOLE, &p).unwrap(),
                Chunk::Hole {
                    offset: 8,
                    len: 512
                }
            );
            let p = round_trip(ext, REPLY_TYPE_ERROR, &error_payload(EIO, "boom"));
            assert_eq!(
                Chunk::parse(REPLY_TYPE_ERROR, &p).unwrap(),
                Chunk::Error {
                    error: EIO,
                    message: "boom".into(),
                    offset: None
                }
            );
            let kind = if ext {
                REPLY_TYPE_BLOCK_STATUS_EXT
            } else {
                REPLY_TYPE_BLOCK_STATUS
            };
            let p = round_trip(
                ext,
                kind,
                &block_status_payload(1, &[(4096, 3), (512, 0)], ext),
            );
            assert_eq!(
                Chunk::parse(kind, &p).unwrap(),
                Chunk::BlockStatus {
                    context: 1,
                    extents: vec![(4096, 3), (512, 0)]
                }
            );
        }
        assert_eq!(
            ReplyHeader::parse(&simple_reply(EPERM, 9)).unwrap(),
            (
                ReplyHeader::Simple {
                    error: EPERM,
                    cookie: 9
                },
                16
            )
        );
    }

    #[test]
    fn malformed_chunks_are_errors() {
        assert!(Chunk::parse(REPLY_TYPE_OFFSET_DATA, &[0; 8]).is_err());
        assert!(Chunk::parse(REPLY_TYPE_OFFSET_HOLE, &hole_payload(0, 0)).is_err());
        assert!(Chunk::parse(REPLY_TYPE_BLOCK_STATUS, &[0, 0, 0, 1, 0, 0]).is_err());
        assert!(Chunk::parse(REPLY_TYPE_ERROR, &[0, 0, 0, 5, 0, 9, b'x']).is_err());
        let mut ext = vec![0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff];
        ext.extend_from_slice(&[0; 16]);
        assert!(Chunk::parse(REPLY_TYPE_BLOCK_STATUS_EXT, &ext).is_err());
        assert!(ReplyHeader::parse(&[1, 2, 3, 4, 5]).is_err());
    }
}
