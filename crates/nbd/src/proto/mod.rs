//! The NBD wire format: constants, and parsing/encoding of every message
//! of the handshake and the transmission phase. Nothing here does I/O.

pub mod consts;
pub mod cursor;
pub mod option;
pub mod option_reply;
pub mod reply;
pub mod request;

use std::fmt;

pub use consts::*;
pub use option::{ClientOption, InfoRequest, MetaRequest, OptionError, OptionHeader};
pub use option_reply::{Info, OptionReply};
pub use reply::{Chunk, ChunkHeader, ReplyHeader, ReplyStyle};
pub use request::{Command, Limits, Rejection, RequestHeader, validate};

/// A message that cannot be parsed at all: the peer broke the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProtoError {
    /// The buffer ends before the message does.
    Short,
    /// A magic number is wrong.
    BadMagic(u64),
    /// A field is inconsistent with the message.
    Malformed(&'static str),
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::Short => f.write_str("message truncated"),
            ProtoError::BadMagic(m) => write!(f, "bad magic {m:#x}"),
            ProtoError::Malformed(what) => write!(f, "malformed message: {what}"),
        }
    }
}

impl std::error::Error for ProtoError {}

/// The name of a command, for logs.
pub fn command_name(command: u16) -> &'static str {
    match command {
        CMD_READ => "read",
        CMD_WRITE => "write",
        CMD_DISC => "disc",
        CMD_FLUSH => "flush",
        CMD_TRIM => "trim",
        CMD_CACHE => "cache",
        CMD_WRITE_ZEROES => "write_zeroes",
        CMD_BLOCK_STATUS => "block_status",
        _ => "unknown",
    }
}
