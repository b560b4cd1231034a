//! Wire constants of the NBD protocol (doc/proto.md, with the extended
//! headers extension). All integers travel big-endian.

/// First 8 bytes of every server greeting ("NBDMAGIC").
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// Oldstyle greeting's second word (the export follows at once).
pub const CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Newstyle greeting's second word and prefix of every client option ("IHAVEOPT").
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Prefix of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Compact request header magic (28-byte header).
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Extended request header magic (32-byte header).
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Simple reply magic (16-byte header).
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Structured reply chunk magic (20-byte header).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Extended reply chunk magic (32-byte header).
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: omit the 124 zero bytes after EXPORT_NAME.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option: choose an export and enter transmission (no reply on failure).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: end negotiation (soft disconnect).
pub const OPT_ABORT: u32 = 2;
/// Option: list exports.
pub const OPT_LIST: u32 = 3;
/// Option: withdrawn.
pub const OPT_PEEK_EXPORT: u32 = 4;
/// Option: upgrade to TLS.
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: use structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list metadata contexts.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts for block status.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// Option: use 64-bit extended headers.
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply: final success.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of a LIST.
pub const REP_SERVER: u32 = 2;
/// Option reply: one piece of information of INFO/GO.
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context.
pub const REP_META_CONTEXT: u32 = 4;
/// Bit set in every option error reply.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// Option error: unknown option.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// Option error: forbidden by policy.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// Option error: malformed option.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// Option error: not supported on this platform.
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
/// Option error: TLS needed first.
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// Option error: no such export.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// Option error: the client must ask for block sizes.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
/// Option error: the request or its answer is too big.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;
/// Option error: extended headers needed (or already negotiated).
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_FLAG_ERROR | 10;

/// Info: size and transmission flags (mandatory).
pub const INFO_EXPORT: u16 = 0;
/// Info: canonical export name.
pub const INFO_NAME: u16 = 1;
/// Info: human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Info: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag: always set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: FLUSH is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: the FUA flag is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: the medium is rotational.
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: TRIM is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: WRITE_ZEROES is supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: the DF flag is supported on READ.
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: flushes are consistent across connections.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: RESIZE is supported (resize extension).
pub const TFLAG_SEND_RESIZE: u16 = 1 << 9;
/// Transmission flag: CACHE is supported.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag: the FAST_ZERO flag is supported.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;
/// Transmission flag: BLOCK_STATUS may carry a context filter payload.
pub const TFLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write (carries a payload).
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect after finishing every request.
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: prefetch.
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status.
pub const CMD_BLOCK_STATUS: u16 = 7;
/// Command: resize (resize extension; not supported here).
pub const CMD_RESIZE: u16 = 8;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: do not punch holes (WRITE_ZEROES).
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: don't fragment (READ).
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: one extent only (BLOCK_STATUS).
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: fail fast unless zeroing is cheap (WRITE_ZEROES).
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Command flag: the length field is a payload length (extended headers).
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

/// Reply flag: last chunk of a structured reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

/// Chunk: nothing (final, success unless an error chunk came before).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk: data at an offset.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk: a range that reads as zeros.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Chunk: block status descriptors with 32-bit lengths.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk: block status descriptors with 64-bit lengths (extended headers).
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// Chunk: the request failed.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
/// Chunk: the request failed at an offset.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

/// Wire error: operation not permitted.
pub const EPERM: u32 = 1;
/// Wire error: input/output error.
pub const EIO: u32 = 5;
/// Wire error: out of memory.
pub const ENOMEM: u32 = 12;
/// Wire error: invalid argument.
pub const EINVAL: u32 = 22;
/// Wire error: no space left.
pub const ENOSPC: u32 = 28;
/// Wire error: value too large (DF reads).
pub const EOVERFLOW: u32 = 75;
/// Wire error: not supported (FAST_ZERO only).
pub const ENOTSUP: u32 = 95;
/// Wire error: the server is shutting down.
pub const ESHUTDOWN: u32 = 108;

/// `base:allocation` status bit: unallocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status bit: reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;

/// The longest string (export name, context name, message) the protocol allows.
pub const MAX_STRING: usize = 4096;
