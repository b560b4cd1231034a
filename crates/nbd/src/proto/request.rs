//! Transmission requests: compact (28-byte) and extended (32-byte) headers,
//! and [`validate`], the one place where every field of a request is checked
//! against what was negotiated and advertised.

use super::ProtoError;
use super::consts::*;
use super::cursor::{Cursor, PutBe};

/// Bytes in a compact request header.
pub const COMPACT_REQUEST_LEN: usize = 28;
/// Bytes in an extended request header.
pub const EXTENDED_REQUEST_LEN: usize = 32;

/// A request header as received, before validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// Command type (`CMD_*`).
    pub command: u16,
    /// Opaque cookie echoed in the reply.
    pub cookie: u64,
    /// Offset in the export.
    pub offset: u64,
    /// Length (effect length, or payload length with PAYLOAD_LEN).
    pub length: u64,
    /// Whether the header was extended.
    pub extended: bool,
}

impl RequestHeader {
    /// The header length for the negotiated style.
    pub fn wire_len(extended: bool) -> usize {
        if extended {
            EXTENDED_REQUEST_LEN
        } else {
            COMPACT_REQUEST_LEN
        }
    }

    /// Parses a header of the negotiated style. `buf` must hold exactly
    /// [`RequestHeader::wire_len`] bytes; the other style's magic, like any
    /// wrong magic, is a protocol violation.
    pub fn parse(buf: &[u8], extended: bool) -> Result<RequestHeader, ProtoError> {
        if buf.len() != Self::wire_len(extended) {
            return Err(ProtoError::Short);
        }
        let mut c = Cursor::new(buf);
        let magic = c.u32().ok_or(ProtoError::Short)?;
        let want = if extended {
            EXTENDED_REQUEST_MAGIC
        } else {
            REQUEST_MAGIC
        };
        if magic != want {
            return Err(ProtoError::BadMagic(u64::from(magic)));
        }
        let flags = c.u16().ok_or(ProtoError::Short)?;
        let command = c.u16().ok_or(ProtoError::Short)?;
        let cookie = c.u64().ok_or(ProtoError::Short)?;
        let offset = c.u64().ok_or(ProtoError::Short)?;
        let length = if extended {
            c.u64().ok_or(ProtoError::Short)?
        } else {
            u64::from(c.u32().ok_or(ProtoError::Short)?)
        };
        Ok(RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
            extended,
        })
    }

    /// Encodes the header (a compact one truncates the length to 32 bits).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::wire_len(self.extended));
        v.put_u32(if self.extended {
            EXTENDED_REQUEST_MAGIC
        } else {
            REQUEST_MAGIC
        });
        v.put_u16(self.flags);
        v.put_u16(self.command);
        v.put_u64(self.cookie);
        v.put_u64(self.offset);
        if self.extended {
            v.put_u64(self.length);
        } else {
            v.put_u32(self.length as u32);
        }
        v
    }

    /// How many payload bytes follow the header on the wire: a WRITE
    /// always carries `length` bytes (with extended headers PAYLOAD_LEN is
    /// optional on it, and qemu does not set it); any other extended
    /// request carries `length` bytes exactly when it sets PAYLOAD_LEN.
    pub fn payload_len(&self) -> u64 {
        if self.command == CMD_WRITE || (self.extended && self.flags & CMD_FLAG_PAYLOAD_LEN != 0) {
            self.length
        } else {
            0
        }
    }
}

/// What the server negotiated and advertised for this connection: the
/// facts [`validate`] checks a request against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags advertised (`TFLAG_*`).
    pub tflags: u16,
    /// Minimum block size: offsets and lengths must be multiples of it.
    pub min_block: u32,
    /// Maximum payload of a READ or WRITE.
    pub max_payload: u32,
    /// Structured replies (or extended headers) negotiated.
    pub structured: bool,
    /// Extended headers negotiated.
    pub extended: bool,
    /// At least one metadata context is selected for this export.
    pub meta_contexts: bool,
}

/// A validated command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Read `len` bytes; `df`: at most one data chunk.
    Read {
        /// Offset.
        offset: u64,
        /// Length (≤ max payload).
        len: u32,
        /// Don't fragment.
        df: bool,
    },
    /// Write the payload.
    Write {
        /// Offset.
        offset: u64,
        /// Payload length (≤ max payload).
        len: u32,
        /// Force unit access.
        fua: bool,
    },
    /// Disconnect once every earlier request is answered.
    Disconnect,
    /// Flush.
    Flush,
    /// Trim.
    Trim {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Prefetch.
    Cache {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Write zeroes.
    WriteZeroes {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
        /// Holes may be punched (NO_HOLE clear).
        may_trim: bool,
        /// Fail fast with ENOTSUP unless cheap.
        fast: bool,
    },
    /// Block status.
    BlockStatus {
        /// Offset.
        offset: u64,
        /// Length of interest.
        len: u64,
        /// One extent only.
        req_one: bool,
    },
}

impl Command {
    /// Whether the command changes the export's contents.
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            Command::Write { .. } | Command::Trim { .. } | Command::WriteZeroes { .. }
        )
    }
}

/// A request refused before it reached the device: the wire error to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The NBD error code (`EINVAL`, `EPERM`, ...).
    pub error: u32,
    /// What was wrong, for the error chunk's message.
    pub message: String,
}

fn reject(error: u32, message: impl Into<String>) -> Rejection {
    Rejection {
        error,
        message: message.into(),
    }
}

/// The payload of a BLOCK_STATUS request sent with
/// NBD_CMD_FLAG_PAYLOAD_LEN (extended headers, a server that advertised
/// NBD_FLAG_BLOCK_STAT_PAYLOAD): the effect length, then the ids of the
/// negotiated metadata contexts the client wants this time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStatusPayload {
    /// The length of interest (the header's length is the payload's).
    pub length: u64,
    /// The contexts to report, a subset of those negotiated.
    pub ids: Vec<u32>,
}

impl BlockStatusPayload {
    /// Whether a payload of `len` bytes can be one for a connection that
    /// negotiated `contexts` contexts: 8 bytes and one to `contexts` ids.
    /// A payload that cannot is skipped unread and refused with EINVAL.
    pub fn plausible_len(len: u64, contexts: usize) -> bool {
        len >= 12 && len.is_multiple_of(4) && (len - 8) / 4 <= contexts as u64
    }

    /// Parses `payload` for a connection that negotiated the contexts
    /// `negotiated`: EINVAL (as qemu-nbd answers) for a length that is not
    /// [`Self::plausible_len`], an id that was not negotiated, or an id
    /// given twice.
    pub fn parse(payload: &[u8], negotiated: &[u32]) -> Result<BlockStatusPayload, Rejection> {
        if !Self::plausible_len(payload.len() as u64, negotiated.len()) {
            return Err(reject(
                EINVAL,
                format!("block status payload of {} bytes", payload.len()),
            ));
        }
        let (length, rest) = payload.split_at(8);
        let length = u64::from_be_bytes(length.try_into().expect("8 bytes"));
        let mut ids: Vec<u32> = Vec::with_capacity(rest.len() / 4);
        for chunk in rest.chunks_exact(4) {
            let id = u32::from_be_bytes(chunk.try_into().expect("4 bytes"));
            if !negotiated.contains(&id) {
                return Err(reject(
                    EINVAL,
                    format!("metadata context {id} not negotiated"),
                ));
            }
            if ids.contains(&id) {
                return Err(reject(EINVAL, format!("metadata context {id} asked twice")));
            }
            ids.push(id);
        }
        Ok(BlockStatusPayload { length, ids })
    }

    /// The payload on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + 4 * self.ids.len());
        v.extend_from_slice(&self.length.to_be_bytes());
        for id in &self.ids {
            v.extend_from_slice(&id.to_be_bytes());
        }
        v
    }
}

/// The command flags each command accepts (FUA is checked separately).
fn allowed_flags(command: u16) -> u16 {
    match command {
        CMD_READ => CMD_FLAG_DF,
        CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        _ => 0,
    }
}

/// Checks a request header against the connection's [`Limits`] and turns it
/// into a [`Command`], or gives the error the spec names:
///
/// - unknown command, unknown or inapplicable flag, command or flag not
///   advertised, zero length, misaligned, BLOCK_STATUS without a selected
///   context, a payload where none belongs: EINVAL;
/// - any write to a read-only export: EPERM;
/// - READ or WRITE longer than the maximum payload: EINVAL (EOVERFLOW for
///   a READ with DF);
/// - beyond the end of the export: ENOSPC for WRITE and WRITE_ZEROES,
///   EINVAL otherwise.
///
/// The payload (see [`RequestHeader::payload_len`]) is read or skipped by
/// the caller whatever the outcome.
pub fn validate(h: &RequestHeader, l: &Limits) -> Result<Command, Rejection> {
    use Command as C;
    let command = h.command;
    if command > CMD_BLOCK_STATUS {
        return Err(reject(EINVAL, format!("unknown command {command}")));
    }
    if command == CMD_DISC {
        return Ok(C::Disconnect);
    }

    // Flags.
    let mut flags = h.flags;
    if h.extended {
        if command != CMD_WRITE && flags & CMD_FLAG_PAYLOAD_LEN != 0 {
            return Err(reject(EINVAL, "payload on a command that takes none"));
        }
        flags &= !CMD_FLAG_PAYLOAD_LEN;
    }
    if flags & CMD_FLAG_FUA != 0 {
        if l.tflags & TFLAG_SEND_FUA == 0 {
            return Err(reject(EINVAL, "FUA flag not supported"));
        }
        flags &= !CMD_FLAG_FUA;
    }
    if flags & !allowed_flags(command) != 0 {
        return Err(reject(
            EINVAL,
            format!("invalid flags {:#x} for command {command}", h.flags),
        ));
    }
    if flags & CMD_FLAG_DF != 0 && l.tflags & TFLAG_SEND_DF == 0 {
        return Err(reject(EINVAL, "DF flag needs structured replies"));
    }
    if flags & CMD_FLAG_FAST_ZERO != 0 && l.tflags & TFLAG_SEND_FAST_ZERO == 0 {
        return Err(reject(EINVAL, "FAST_ZERO flag not supported"));
    }
    let fua = h.flags & CMD_FLAG_FUA != 0;

    // Read-only exports refuse every write, advertised or not.
    let writes = matches!(command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && l.tflags & TFLAG_READ_ONLY != 0 {
        return Err(reject(EPERM, "export is read-only"));
    }

    // Commands the client was not told about.
    let needed = match command {
        CMD_FLUSH => TFLAG_SEND_FLUSH,
        CMD_TRIM => TFLAG_SEND_TRIM,
        CMD_CACHE => TFLAG_SEND_CACHE,
        CMD_WRITE_ZEROES => TFLAG_SEND_WRITE_ZEROES,
        _ => 0,
    };
    if l.tflags & needed != needed {
        return Err(reject(EINVAL, format!("command {command} not supported")));
    }
    if command == CMD_BLOCK_STATUS && !(l.structured && l.meta_contexts) {
        return Err(reject(EINVAL, "no metadata context selected"));
    }

    if command == CMD_FLUSH {
        if h.offset != 0 || h.length != 0 {
            return Err(reject(EINVAL, "FLUSH with nonzero offset or length"));
        }
        return Ok(C::Flush);
    }

    let (offset, len) = (h.offset, h.length);
    if len == 0 {
        return Err(reject(EINVAL, "zero-length request"));
    }
    let min = u64::from(l.min_block.max(1));
    if !offset.is_multiple_of(min) || !len.is_multiple_of(min) {
        return Err(reject(
            EINVAL,
            format!("request not aligned to the minimum block size {min}"),
        ));
    }
    if matches!(command, CMD_READ | CMD_WRITE) && len > u64::from(l.max_payload) {
        let error = if flags & CMD_FLAG_DF != 0 {
            EOVERFLOW
        } else {
            EINVAL
        };
        return Err(reject(
            error,
            format!("request length {len} exceeds the maximum {}", l.max_payload),
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > l.size) {
        let error = if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) {
            ENOSPC
        } else {
            EINVAL
        };
        return Err(reject(
            error,
            format!(
                "request beyond the end of the export (offset {offset} length {len} size {})",
                l.size
            ),
        ));
    }

    Ok(match command {
        CMD_READ => C::Read {
            offset,
            len: len as u32,
            df: flags & CMD_FLAG_DF != 0,
        },
        CMD_WRITE => C::Write {
            offset,
            len: len as u32,
            fua,
        },
        CMD_TRIM => C::Trim { offset, len, fua },
        CMD_CACHE => C::Cache { offset, len },
        CMD_WRITE_ZEROES => C::WriteZeroes {
            offset,
            len,
            fua,
            may_trim: flags & CMD_FLAG_NO_HOLE == 0,
            fast: flags & CMD_FLAG_FAST_ZERO != 0,
        },
        CMD_BLOCK_STATUS => C::BlockStatus {
            offset,
            len,
            req_one: flags & CMD_FLAG_REQ_ONE != 0,
        },
        _ => unreachable!("every command below BLOCK_STATUS is handled"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            size: 1 << 20,
            tflags: TFLAG_HAS_FLAGS
                | TFLAG_SEND_FLUSH
                | TFLAG_SEND_FUA
                | TFLAG_SEND_TRIM
                | TFLAG_SEND_WRITE_ZEROES
                | TFLAG_SEND_DF
                | TFLAG_SEND_FAST_ZERO,
            min_block: 1,
            max_payload: 1 << 16,
            structured: true,
            extended: false,
            meta_contexts: true,
        }
    }

    fn req(command: u16, flags: u16, offset: u64, length: u64) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 7,
            offset,
            length,
            extended: false,
        }
    }

    fn err(h: RequestHeader, l: &Limits) -> u32 {
        validate(&h, l).unwrap_err().error
    }

    #[test]
    fn headers_round_trip() {
        for extended in [false, true] {
            let h = RequestHeader {
                extended,
                ..req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512)
            };
            let wire = h.encode();
            assert_eq!(wire.len(), RequestHeader::wire_len(extended));
            assert_eq!(RequestHeader::parse(&wire, extended).unwrap(), h);
            assert!(matches!(
                RequestHeader::parse(&wire, !extended),
                Err(ProtoError::Short)
            ));
        }
        let mut wire = req(CMD_READ, 0, 0, 1).encode();
        wire[3] ^= 0xff;
        assert!(matches!(
            RequestHeader::parse(&wire, false),
            Err(ProtoError::BadMagic(_))
        ));
    }

    #[test]
    fn payload_lengths() {
        assert_eq!(req(CMD_WRITE, 0, 0, 9).payload_len(), 9);
        assert_eq!(req(CMD_READ, 0, 0, 9).payload_len(), 0);
        let mut e = req(CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN, 0, 9);
        e.extended = true;
        assert_eq!(e.payload_len(), 9);
        e.flags = 0;
        assert_eq!(e.payload_len(), 0);
    }

    #[test]
    fn errors_follow_the_spec() {
        let l = limits();
        assert!(validate(&req(CMD_READ, CMD_FLAG_DF, 0, 512), &l).is_ok());
        assert_eq!(err(req(9, 0, 0, 1), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, 1 << 9, 0, 1), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, CMD_FLAG_NO_HOLE, 0, 1), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, CMD_FLAG_PAYLOAD_LEN, 0, 1), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, 0, 0), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, 1 << 20, 1), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, u64::MAX, 2), &l), EINVAL);
        assert_eq!(err(req(CMD_WRITE, 0, (1 << 20) - 1, 2), &l), ENOSPC);
        assert_eq!(err(req(CMD_WRITE_ZEROES, 0, 1 << 20, 2), &l), ENOSPC);
        assert_eq!(err(req(CMD_TRIM, 0, 1 << 20, 2), &l), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, 0, (1 << 16) + 1), &l), EINVAL);
        assert_eq!(
            err(req(CMD_READ, CMD_FLAG_DF, 0, (1 << 16) + 1), &l),
            EOVERFLOW
        );
        assert_eq!(err(req(CMD_FLUSH, 0, 1, 0), &l), EINVAL);
        assert_eq!(
            validate(&req(CMD_FLUSH, CMD_FLAG_FUA, 0, 0), &l),
            Ok(Command::Flush)
        );
        assert_eq!(
            validate(&req(CMD_DISC, 0, 5, 5), &l),
            Ok(Command::Disconnect)
        );
        assert_eq!(err(req(CMD_CACHE, 0, 0, 1), &l), EINVAL, "not advertised");

        let mut ro = l;
        ro.tflags |= TFLAG_READ_ONLY;
        ro.tflags &= !(TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES);
        assert_eq!(err(req(CMD_WRITE, 0, 0, 1), &ro), EPERM);
        assert_eq!(err(req(CMD_TRIM, 0, 0, 1), &ro), EPERM);
        assert_eq!(err(req(CMD_WRITE_ZEROES, 0, 0, 1), &ro), EPERM);

        let mut aligned = l;
        aligned.min_block = 512;
        assert_eq!(err(req(CMD_READ, 0, 1, 512), &aligned), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, 0, 513), &aligned), EINVAL);

        let mut plain = l;
        plain.tflags &= !(TFLAG_SEND_DF | TFLAG_SEND_FAST_ZERO | TFLAG_SEND_FUA);
        plain.structured = false;
        assert_eq!(err(req(CMD_READ, CMD_FLAG_DF, 0, 1), &plain), EINVAL);
        assert_eq!(err(req(CMD_WRITE, CMD_FLAG_FUA, 0, 1), &plain), EINVAL);
        assert_eq!(
            err(req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 1), &plain),
            EINVAL
        );
        assert_eq!(err(req(CMD_BLOCK_STATUS, 0, 0, 1), &plain), EINVAL);

        let zero = validate(
            &req(
                CMD_WRITE_ZEROES,
                CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                0,
                9,
            ),
            &l,
        );
        assert_eq!(
            zero,
            Ok(Command::WriteZeroes {
                offset: 0,
                len: 9,
                fua: false,
                may_trim: false,
                fast: true
            })
        );
    }

    #[test]
    fn extended_requests() {
        let mut l = limits();
        l.extended = true;
        let mut w = req(CMD_WRITE, 0, 0, 16);
        w.extended = true;
        assert!(validate(&w, &l).is_ok(), "PAYLOAD_LEN is optional on WRITE");
        assert_eq!(w.payload_len(), 16);
        w.flags = CMD_FLAG_PAYLOAD_LEN;
        assert!(validate(&w, &l).is_ok());
        let mut z = req(CMD_WRITE_ZEROES, 0, 0, 1 << 19);
        z.extended = true;
        assert!(validate(&z, &l).is_ok(), "64-bit effect lengths");
        z.flags = CMD_FLAG_PAYLOAD_LEN;
        assert_eq!(err(z, &l), EINVAL);
    }
}
