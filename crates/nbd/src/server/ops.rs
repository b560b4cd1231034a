//! Executing validated commands on an export's device and building the
//! replies: simple, structured or extended, with sparse reads sent as hole
//! chunks and block status in every selected context.

use std::ops::Range;
use std::sync::Arc;

use diskit_core::{BlockDevice, DeviceRef, Error, ErrorKind, Extent, Lent, WriteFlags, ZeroFlags};

use super::export::{Export, MetaContext};
use super::splice::ZeroCopy;
use crate::proto::consts::*;
use crate::proto::reply::{
    ChunkHeader, block_status_payload, error_payload, hole_payload, put_chunk, simple_reply,
};
use crate::proto::{Command, ReplyStyle};

/// Zero extents shorter than this are sent as data (a hole chunk costs
/// about as much as a few hundred bytes of zeros).
const MIN_HOLE: u64 = 512;
/// Reads shorter than this are not planned from the device's extents
/// (asking can cost more syscalls than the read itself, e.g. two lseeks
/// on a file): they are read whole, and sent as a hole if all zero.
const PLANNED_READ: u64 = 128 << 10;
/// The most descriptors one block status chunk carries.
const MAX_DESCRIPTORS: usize = 1 << 16;
/// Reads at least this long go from a file-backed device to the socket
/// without a copy when they can (see [`super::splice`]); shorter ones cost
/// less copied than spliced.
const ZERO_COPY_READ: u64 = 128 << 10;

/// What a connection knows when it executes a command.
pub struct Conn {
    /// The export.
    pub export: Arc<Export>,
    /// The export's device as this connection sees it.
    pub device: DeviceRef,
    /// The reply headers in use.
    pub style: ReplyStyle,
    /// The contexts selected for block status.
    pub contexts: Vec<MetaContext>,
}

/// One piece of a reply on the wire.
#[derive(Debug)]
pub enum Part {
    /// Bytes built for this reply (headers, small payloads).
    Bytes(Vec<u8>),
    /// A range of the reply's data buffer.
    Data(Range<usize>),
    /// Bytes waiting in the worker's splice pipe, sent from there.
    Piped(u64),
    /// Bytes the device lent out of memory it holds, sent from there.
    Lent(Lent),
}

/// A reply to one request, ready to write. Its [`Part::Data`] pieces are
/// ranges of the buffer the request was executed with (see [`execute`]).
#[derive(Debug)]
pub struct Reply {
    /// The pieces, in wire order.
    pub parts: Vec<Part>,
    /// Whether the request succeeded.
    pub ok: bool,
}

impl Reply {
    fn bytes(b: Vec<u8>, ok: bool) -> Reply {
        Reply {
            parts: vec![Part::Bytes(b)],
            ok,
        }
    }

    /// Bytes of READ data this reply carries.
    pub fn data_len(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Data(r) => r.len() as u64,
                Part::Piped(n) => *n,
                Part::Lent(l) => l.bytes().len() as u64,
                Part::Bytes(_) => 0,
            })
            .sum()
    }
}

fn done(kind: u16, cookie: u64, offset: u64, length: u64) -> ChunkHeader {
    ChunkHeader {
        flags: REPLY_FLAG_DONE,
        kind,
        cookie,
        offset,
        length,
    }
}

/// The reply for a failed request: a simple reply, or an ERROR chunk.
pub fn error_reply(style: ReplyStyle, cookie: u64, offset: u64, code: u32, msg: &str) -> Reply {
    match style {
        ReplyStyle::Simple => Reply::bytes(simple_reply(code, cookie).to_vec(), false),
        _ => {
            let payload = error_payload(code, msg);
            let mut v = Vec::new();
            let h = done(REPLY_TYPE_ERROR, cookie, offset, payload.len() as u64);
            put_chunk(&mut v, style == ReplyStyle::Extended, h, &payload);
            Reply::bytes(v, false)
        }
    }
}

/// The reply for a successful request without data: a simple reply
/// (allowed with structured replies), or a NONE chunk with extended headers.
pub fn ok_reply(style: ReplyStyle, cookie: u64, offset: u64) -> Reply {
    match style {
        ReplyStyle::Extended => {
            let mut v = Vec::new();
            put_chunk(&mut v, true, done(REPLY_TYPE_NONE, cookie, offset, 0), &[]);
            Reply::bytes(v, true)
        }
        _ => Reply::bytes(simple_reply(0, cookie).to_vec(), true),
    }
}

/// The wire error for a device error. ENOTSUP is reserved for FAST_ZERO and
/// EOVERFLOW for DF reads, so elsewhere they become EINVAL.
pub fn wire_error(e: &Error, fast_zero: bool) -> u32 {
    match e.kind() {
        ErrorKind::NotSupported if fast_zero => ENOTSUP,
        ErrorKind::NotSupported | ErrorKind::Overflow => EINVAL,
        k => k.nbd_code(),
    }
}

/// The part of `buf` a request of `len` bytes uses, growing `buf` (never
/// shrinking it) so that a worker's buffer is allocated once, not per request.
pub fn request_buf(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

/// Executes `cmd` (never [`Command::Disconnect`]) and builds its reply.
///
/// `buf` is the worker's buffer: a WRITE's payload is its first
/// `payload_len` bytes, and READ data is read into it (the reply's
/// [`Part::Data`] pieces are ranges of it). With `zero_copy`, a big READ
/// from a file-backed device goes into the worker's pipe instead (the
/// reply's [`Part::Piped`] pieces), to be sent from there.
pub fn execute(
    conn: &Conn,
    cookie: u64,
    offset: u64,
    cmd: Command,
    buf: &mut Vec<u8>,
    payload_len: usize,
    zero_copy: Option<&mut ZeroCopy>,
) -> Reply {
    let dev = &conn.device;
    let style = conn.style;
    let result = match cmd {
        Command::Read { offset, len, df } => {
            return read(conn, cookie, offset, len, df, buf, zero_copy);
        }
        Command::BlockStatus {
            offset,
            len,
            req_one,
        } => {
            // With a payload (checked when it was read), the contexts
            // wanted follow the effect length.
            let only: Option<Vec<u32>> = (payload_len > 8).then(|| {
                buf[8..payload_len]
                    .chunks_exact(4)
                    .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            });
            return block_status(conn, cookie, offset, len, req_one, only.as_deref());
        }
        Command::Write { offset, fua, .. } => {
            conn.export.note_write(offset, payload_len as u64);
            dev.write_at(&buf[..payload_len], offset, WriteFlags { fua })
        }
        Command::Flush => dev.flush(),
        Command::Trim { offset, len, fua } => {
            conn.export.note_write(offset, len);
            // A trim is a hint: a device that cannot do it has done enough.
            match dev.trim(offset, len, WriteFlags { fua }) {
                Err(e) if e.kind() == ErrorKind::NotSupported => Ok(()),
                r => r,
            }
        }
        Command::Cache { offset, len } => match dev.cache(offset, len) {
            Err(e) if e.kind() == ErrorKind::NotSupported => Ok(()),
            r => r,
        },
        Command::WriteZeroes {
            offset,
            len,
            fua,
            may_trim,
            fast,
        } => {
            conn.export.note_write(offset, len);
            dev.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua,
                    may_trim,
                    fast,
                },
            )
        }
        Command::Disconnect => Ok(()),
    };
    match result {
        Ok(()) => ok_reply(style, cookie, offset),
        Err(e) => {
            let fast = matches!(cmd, Command::WriteZeroes { fast: true, .. });
            error_reply(style, cookie, offset, wire_error(&e, fast), &e.to_string())
        }
    }
}

/// A run of a read: data to read, or a hole to send as such.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    start: u64,
    len: u64,
    hole: bool,
}

/// Splits `offset..offset+len` into data and hole runs from the device's
/// extents; any trouble asking makes the whole range data.
fn plan_read(dev: &dyn BlockDevice, offset: u64, len: u64) -> Vec<Run> {
    let all_data = vec![Run {
        start: 0,
        len,
        hole: false,
    }];
    let Ok(extents) = collect_extents(dev, offset, len, usize::MAX) else {
        return all_data;
    };
    let mut runs: Vec<Run> = Vec::new();
    let mut pos = 0u64;
    for e in extents {
        let hole = e.flags.zero && e.length >= MIN_HOLE;
        match runs.last_mut() {
            Some(last) if last.hole == hole => last.len += e.length,
            _ => runs.push(Run {
                start: pos,
                len: e.length,
                hole,
            }),
        }
        pos += e.length;
    }
    if pos < len {
        runs.push(Run {
            start: pos,
            len: len - pos,
            hole: false,
        });
    }
    runs
}

/// The device's extents over `offset..offset+len`, clipped to it; stops
/// early after `max` extents or when the device makes no progress.
fn collect_extents(
    dev: &dyn BlockDevice,
    offset: u64,
    len: u64,
    max: usize,
) -> diskit_core::Result<Vec<Extent>> {
    let mut walk = diskit_core::extent::walk(dev, offset, len);
    let mut out: Vec<Extent> = Vec::new();
    while out.len() < max {
        match walk.next_answered()? {
            Some(e) => out.push(e),
            None => break,
        }
    }
    Ok(out)
}

fn read(
    conn: &Conn,
    cookie: u64,
    offset: u64,
    len: u32,
    df: bool,
    buf: &mut Vec<u8>,
    zero_copy: Option<&mut ZeroCopy>,
) -> Reply {
    let dev = conn.device.as_ref();
    let style = conn.style;
    let len64 = u64::from(len);
    let whole = |hole| {
        vec![Run {
            start: 0,
            len: len64,
            hole,
        }]
    };
    let structured = style != ReplyStyle::Simple;
    let planned = structured
        && !df
        && len64 >= PLANNED_READ
        && conn.export.capabilities_of(dev).can_extents
        && dev.extents_before_reads();
    let plan = planned.then(|| plan_read(dev, offset, len64));
    if let Some(zc) = zero_copy
        && len64 >= ZERO_COPY_READ
    {
        let all_data;
        let runs = match &plan {
            Some(runs) => runs,
            None => {
                all_data = whole(false);
                &all_data
            }
        };
        if let Some(reply) = splice_read(dev, style, cookie, offset, runs, zc) {
            return reply;
        }
    }
    // Every byte sent is read first: parts of the buffer left from an
    // earlier request are only ever under hole chunks, which carry no data.
    let data = request_buf(buf, len as usize);
    let may_be_hole =
        |bytes: &[u8]| structured && !df && len64 >= MIN_HOLE && diskit_core::zero::is_zero(bytes);
    let runs = match plan {
        Some(runs) => runs,
        None => match dev.read_or_lend(data, offset) {
            Err(e) => {
                return error_reply(style, cookie, offset, wire_error(&e, false), &e.to_string());
            }
            // Bytes the device holds go out from there, not copied first.
            Ok(Some(lent)) if lent.bytes().len() == data.len() => {
                let runs = whole(may_be_hole(lent.bytes()));
                return read_reply(style, cookie, offset, &runs, |_| Part::Lent(lent.clone()));
            }
            Ok(Some(_)) => {
                let e = Error::new(ErrorKind::Io, "the device lent other than the bytes asked");
                return error_reply(style, cookie, offset, wire_error(&e, false), &e.to_string());
            }
            Ok(None) => whole(may_be_hole(data)),
        },
    };
    // Read everything first: an error then fails the request as a whole,
    // before any chunk is on the wire.
    for r in runs.iter().filter(|r| planned && !r.hole) {
        let range = r.start as usize..(r.start + r.len) as usize;
        if let Err(e) = dev.read_at(&mut data[range], offset + r.start) {
            return error_reply(style, cookie, offset, wire_error(&e, false), &e.to_string());
        }
    }
    read_reply(style, cookie, offset, &runs, |r| {
        Part::Data(r.start as usize..(r.start + r.len) as usize)
    })
}

/// The zero-copy READ: every data run moved into the worker's pipe, or
/// `None` (and nothing sent, the pipe forgotten if it holds a part) when
/// the device has no file view of a run, the pipe is too small or the
/// file gave less; the caller then reads the ordinary way, which also
/// gives any error its reply.
fn splice_read(
    dev: &dyn BlockDevice,
    style: ReplyStyle,
    cookie: u64,
    offset: u64,
    runs: &[Run],
    zc: &mut ZeroCopy,
) -> Option<Reply> {
    // Err(error from the pipe, if any): not spliced.
    let filled = runs.iter().filter(|r| !r.hole).try_for_each(|r| {
        let view = dev.file_view(offset + r.start, r.len).ok_or(None)?;
        let pipe = zc.pipe().ok_or(None)?;
        if !pipe.make_room(view.offset, r.len) {
            return Err(None);
        }
        match pipe.fill(view, r.len) {
            Ok(true) => Ok(()),
            Ok(false) => Err(None),
            Err(e) => Err(Some(e)),
        }
    });
    match filled {
        Ok(()) => Some(read_reply(style, cookie, offset, runs, |r| {
            Part::Piped(r.len)
        })),
        Err(e) => {
            zc.give_up(e.as_ref());
            None
        }
    }
}

/// The reply to a successful READ of `runs`, each data run's bytes given
/// by `data`.
fn read_reply(
    style: ReplyStyle,
    cookie: u64,
    offset: u64,
    runs: &[Run],
    data: impl Fn(&Run) -> Part,
) -> Reply {
    if style == ReplyStyle::Simple {
        // A simple reply carries the data whole (one data run).
        let mut parts = vec![Part::Bytes(simple_reply(0, cookie).to_vec())];
        parts.extend(runs.iter().map(&data));
        return Reply { parts, ok: true };
    }
    let extended = style == ReplyStyle::Extended;
    let mut parts = Vec::with_capacity(runs.len() * 2);
    for (i, r) in runs.iter().enumerate() {
        let flags = if i + 1 == runs.len() {
            REPLY_FLAG_DONE
        } else {
            0
        };
        let mut head = Vec::with_capacity(48);
        if r.hole {
            let h = ChunkHeader {
                flags,
                kind: REPLY_TYPE_OFFSET_HOLE,
                cookie,
                offset,
                length: 12,
            };
            put_chunk(
                &mut head,
                extended,
                h,
                &hole_payload(offset + r.start, r.len as u32),
            );
            parts.push(Part::Bytes(head));
        } else {
            let h = ChunkHeader {
                flags,
                kind: REPLY_TYPE_OFFSET_DATA,
                cookie,
                offset,
                length: 8 + r.len,
            };
            h.encode_into(extended, &mut head);
            head.extend_from_slice(&(offset + r.start).to_be_bytes());
            parts.push(Part::Bytes(head));
            parts.push(data(r));
        }
    }
    Reply { parts, ok: true }
}

/// The status of an extent in a context the device's extents answer.
fn status(ctx: MetaContext, e: &Extent) -> u32 {
    match ctx {
        MetaContext::BaseAllocation => {
            let mut s = 0;
            if !e.flags.data {
                s |= STATE_HOLE;
            }
            if e.flags.zero {
                s |= STATE_ZERO;
            }
            s
        }
        MetaContext::AllocationDepth => {
            if e.flags.present {
                e.depth.saturating_add(1)
            } else {
                0
            }
        }
        MetaContext::DirtyBitmap(_) => unreachable!("bitmaps answer for themselves"),
    }
}

/// The BLOCK_STATUS reply: one chunk per context of the connection, or
/// of those in `only` (a request's payload), in the connection's order.
fn block_status(
    conn: &Conn,
    cookie: u64,
    offset: u64,
    len: u64,
    req_one: bool,
    only: Option<&[u32]>,
) -> Reply {
    let style = conn.style;
    let contexts: Vec<MetaContext> = conn
        .contexts
        .iter()
        .copied()
        .filter(|c| only.is_none_or(|ids| ids.contains(&c.id())))
        .collect();
    let dev = conn.device.as_ref();
    let max = if req_one { 1 } else { MAX_DESCRIPTORS };
    let extended = style == ReplyStyle::Extended;
    // The device's extents, once, for the contexts they answer.
    let from_device = contexts
        .iter()
        .any(|c| !matches!(c, MetaContext::DirtyBitmap(_)));
    let extents = if from_device {
        match collect_extents(dev, offset, len, max) {
            Ok(e) if !e.is_empty() => e,
            Ok(_) => vec![Extent::data(len)],
            Err(e) => {
                return error_reply(style, cookie, offset, wire_error(&e, false), &e.to_string());
            }
        }
    } else {
        Vec::new()
    };
    let kind = if extended {
        REPLY_TYPE_BLOCK_STATUS_EXT
    } else {
        REPLY_TYPE_BLOCK_STATUS
    };
    let mut v = Vec::new();
    for (i, &ctx) in contexts.iter().enumerate() {
        let descs = match ctx {
            MetaContext::DirtyBitmap(b) => {
                conn.export.bitmaps()[b].status(offset, len, max, extended)
            }
            _ => {
                let mut descs: Vec<(u64, u32)> = Vec::new();
                for e in &extents {
                    let s = status(ctx, e);
                    match descs.last_mut() {
                        Some(last) if last.1 == s => last.0 += e.length,
                        _ => descs.push((e.length, s)),
                    }
                }
                descs.truncate(max);
                descs
            }
        };
        let payload = block_status_payload(ctx.id(), &descs, extended);
        let flags = if i + 1 == contexts.len() {
            REPLY_FLAG_DONE
        } else {
            0
        };
        let h = ChunkHeader {
            flags,
            kind,
            cookie,
            offset,
            length: payload.len() as u64,
        };
        put_chunk(&mut v, extended, h, &payload);
    }
    Reply::bytes(v, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Chunk, ReplyHeader};
    use diskit_backends::MemoryDevice;

    /// The memory device's allocation granularity.
    const P: usize = 64 * 1024;

    fn conn(style: ReplyStyle) -> (Conn, Arc<MemoryDevice>) {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let export = Arc::new(Export::new("", mem.clone()));
        (
            Conn {
                device: export.device().clone(),
                export,
                style,
                contexts: vec![MetaContext::BaseAllocation, MetaContext::AllocationDepth],
            },
            mem,
        )
    }

    fn wire(r: &Reply, buf: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        for p in &r.parts {
            match p {
                Part::Bytes(b) => v.extend_from_slice(b),
                Part::Data(range) => v.extend_from_slice(&buf[range.clone()]),
                Part::Lent(l) => v.extend_from_slice(l.bytes()),
                Part::Piped(_) => panic!("piped data without a pipe"),
            }
        }
        v
    }

    /// Executes `cmd` with a buffer full of junk (as left by earlier
    /// requests) and returns the reply and its bytes on the wire.
    fn run(c: &Conn, cookie: u64, offset: u64, cmd: Command) -> (Reply, Vec<u8>) {
        let mut buf = vec![0xa5u8; 8 * P];
        let r = execute(c, cookie, offset, cmd, &mut buf, 0, None);
        let w = wire(&r, &buf);
        (r, w)
    }

    /// Parses every chunk of a structured reply.
    fn chunks(mut buf: &[u8]) -> Vec<(ChunkHeader, Vec<u8>)> {
        let mut out = Vec::new();
        while !buf.is_empty() {
            let (h, used) = ReplyHeader::parse(buf).unwrap();
            let ReplyHeader::Chunk(h) = h else {
                panic!("simple reply")
            };
            let end = used + h.length as usize;
            out.push((h, buf[used..end].to_vec()));
            buf = &buf[end..];
        }
        out
    }

    /// A read-only device that lends its bytes (data, then zeros).
    struct Lender(Arc<Vec<u8>>);

    impl BlockDevice for Lender {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        fn capabilities(&self) -> diskit_core::Capabilities {
            diskit_core::Capabilities::READ_ONLY
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> diskit_core::Result<()> {
            let at = offset as usize;
            buf.copy_from_slice(&self.0[at..at + buf.len()]);
            Ok(())
        }
        fn read_or_lend(&self, buf: &mut [u8], offset: u64) -> diskit_core::Result<Option<Lent>> {
            let at = offset as usize;
            Ok(Lent::new(self.0.clone(), at..at + buf.len()))
        }
    }

    #[test]
    fn lent_bytes_are_sent_as_they_are_and_zeros_as_holes() {
        let bytes: Vec<u8> = (0..4 * P)
            .map(|i| if i < 2 * P { (i % 253) as u8 + 1 } else { 0 })
            .collect();
        let dev: DeviceRef = Arc::new(Lender(Arc::new(bytes.clone())));
        for style in [
            ReplyStyle::Simple,
            ReplyStyle::Structured,
            ReplyStyle::Extended,
        ] {
            let export = Arc::new(Export::new("", dev.clone()));
            let c = Conn {
                device: dev.clone(),
                export,
                style,
                contexts: vec![],
            };
            let read = |offset: u64, len: u32| {
                let cmd = Command::Read {
                    offset,
                    len,
                    df: false,
                };
                run(&c, 9, offset, cmd)
            };
            let (r, w) = read(17, P as u32);
            assert!(
                r.parts.iter().any(|p| matches!(p, Part::Lent(_))),
                "{style:?}"
            );
            assert_eq!(r.data_len(), P as u64);
            let data = if style == ReplyStyle::Simple {
                w[crate::proto::reply::SIMPLE_REPLY_LEN..].to_vec()
            } else {
                let got = chunks(&w);
                assert_eq!(got.len(), 1);
                match Chunk::parse(got[0].0.kind, &got[0].1).unwrap() {
                    Chunk::Data { offset, data } => {
                        assert_eq!(offset, 17);
                        data.to_vec()
                    }
                    other => panic!("{other:?}"),
                }
            };
            assert_eq!(data, bytes[17..17 + P], "{style:?}");
            // Lent zeros go as a hole where holes may be sent.
            let (_, w) = read(2 * P as u64, P as u32);
            if style == ReplyStyle::Simple {
                assert_eq!(
                    w[crate::proto::reply::SIMPLE_REPLY_LEN..],
                    bytes[2 * P..3 * P]
                );
            } else {
                let got = chunks(&w);
                assert_eq!(got[0].0.kind, REPLY_TYPE_OFFSET_HOLE, "{style:?}");
            }
        }
    }

    #[test]
    fn sparse_reads_send_holes() {
        for style in [ReplyStyle::Structured, ReplyStyle::Extended] {
            let (c, mem) = conn(style);
            mem.write_at(&[7u8; P], 2 * P as u64, WriteFlags::NONE)
                .unwrap();
            let cmd = Command::Read {
                offset: P as u64,
                len: 3 * P as u32,
                df: false,
            };
            let (r, w) = run(&c, 5, P as u64, cmd);
            let got = chunks(&w);
            assert_eq!(got.len(), 3);
            assert_eq!(
                Chunk::parse(got[0].0.kind, &got[0].1).unwrap(),
                Chunk::Hole {
                    offset: P as u64,
                    len: P as u32
                }
            );
            match Chunk::parse(got[1].0.kind, &got[1].1).unwrap() {
                Chunk::Data { offset, data } => {
                    assert_eq!(offset, 2 * P as u64);
                    assert!(data.iter().all(|&b| b == 7) && data.len() == P);
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(got[2].0.flags, REPLY_FLAG_DONE);
            assert_eq!(got[0].0.flags, 0);
            assert_eq!(r.data_len(), P as u64);

            // DF: one data chunk with the zeros in it.
            let cmd = Command::Read {
                offset: P as u64,
                len: 3 * P as u32,
                df: true,
            };
            let got = chunks(&run(&c, 5, P as u64, cmd).1);
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].0.kind, REPLY_TYPE_OFFSET_DATA);
            match Chunk::parse(got[0].0.kind, &got[0].1).unwrap() {
                Chunk::Data { data, .. } => {
                    assert_eq!(data.len(), 3 * P);
                    assert!(data[..P].iter().all(|&b| b == 0), "junk sent as data");
                    assert!(data[P..2 * P].iter().all(|&b| b == 7));
                    assert!(data[2 * P..].iter().all(|&b| b == 0), "junk sent as data");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn block_status_in_both_contexts() {
        let (c, mem) = conn(ReplyStyle::Structured);
        mem.write_at(&[1u8; P], 0, WriteFlags::NONE).unwrap();
        let cmd = Command::BlockStatus {
            offset: 0,
            len: 3 * P as u64,
            req_one: false,
        };
        let got = chunks(&run(&c, 1, 0, cmd).1);
        assert_eq!(got.len(), 2);
        assert_eq!(
            Chunk::parse(got[0].0.kind, &got[0].1).unwrap(),
            Chunk::BlockStatus {
                context: 1,
                extents: vec![(P as u64, 0), (2 * P as u64, 3)]
            }
        );
        // Memory holes are still "present" at this layer.
        assert_eq!(
            Chunk::parse(got[1].0.kind, &got[1].1).unwrap(),
            Chunk::BlockStatus {
                context: 2,
                extents: vec![(3 * P as u64, 1)]
            }
        );
        assert_eq!(got[1].0.flags, REPLY_FLAG_DONE);
        let cmd = Command::BlockStatus {
            offset: 0,
            len: 3 * P as u64,
            req_one: true,
        };
        let got = chunks(&run(&c, 1, 0, cmd).1);
        assert_eq!(
            Chunk::parse(got[0].0.kind, &got[0].1).unwrap(),
            Chunk::BlockStatus {
                context: 1,
                extents: vec![(P as u64, 0)]
            }
        );
    }

    #[test]
    fn block_status_of_a_bitmap_follows_the_export_s_writes() {
        use crate::server::ExportBitmap;
        use diskit_core::bits::Bits;
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let mut bits = Bits::new(1 << 20, 16);
        bits.set_range(0, 1);
        let bitmap = Arc::new(ExportBitmap::new("b", bits, true));
        let export = Arc::new(Export::new("", mem).with_bitmaps(vec![bitmap]));
        let b = MetaContext::DirtyBitmap(0);
        let c = Conn {
            device: export.device().clone(),
            export,
            style: ReplyStyle::Structured,
            contexts: vec![b],
        };
        let status = |c: &Conn| {
            let cmd = Command::BlockStatus {
                offset: 0,
                len: 4 * P as u64,
                req_one: false,
            };
            let got = chunks(&run(c, 1, 0, cmd).1);
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].0.flags, REPLY_FLAG_DONE);
            match Chunk::parse(got[0].0.kind, &got[0].1).unwrap() {
                Chunk::BlockStatus { context, extents } => (context, extents),
                other => panic!("{other:?}"),
            }
        };
        let p = P as u64;
        assert_eq!(status(&c), (b.id(), vec![(p, 1), (3 * p, 0)]));
        let zero = Command::WriteZeroes {
            offset: 2 * P as u64 + 1,
            len: 10,
            fua: false,
            may_trim: true,
            fast: false,
        };
        run(&c, 2, 2 * P as u64 + 1, zero);
        assert_eq!(status(&c), (b.id(), vec![(p, 1), (p, 0), (p, 1), (p, 0)]));
    }

    #[test]
    fn errors_map_to_protocol_codes() {
        assert_eq!(wire_error(&Error::unsupported("x"), true), ENOTSUP);
        assert_eq!(wire_error(&Error::unsupported("x"), false), EINVAL);
        assert_eq!(
            wire_error(&Error::from_kind(ErrorKind::NoSpace), false),
            ENOSPC
        );
        assert_eq!(
            wire_error(&Error::from_kind(ErrorKind::Overflow), false),
            EINVAL
        );
        let r = error_reply(ReplyStyle::Simple, 3, 0, EPERM, "ro");
        assert_eq!(wire(&r, &[]), simple_reply(EPERM, 3).to_vec());
        let r = ok_reply(ReplyStyle::Extended, 3, 9);
        let got = chunks(&wire(&r, &[]));
        assert_eq!(got[0].0.kind, REPLY_TYPE_NONE);
        assert_eq!(got[0].0.offset, 9);
    }

    /// A connection to a raw file holding 300 KiB of data, a 200 KiB hole
    /// and 100 KiB of data.
    fn file_conn(style: ReplyStyle) -> (Conn, tempfile::NamedTempFile, Vec<u8>) {
        use diskit_backends::FileDevice;
        use diskit_core::StorageOptions;
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut want = vec![0u8; 600 << 10];
        for (i, b) in want.iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        want[300 << 10..500 << 10].fill(0);
        std::fs::write(f.path(), &want).unwrap();
        // Punch the zeros out where the file system can.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .unwrap();
        // SAFETY: fallocate reads its scalar arguments; the file is open.
        unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                300 << 10,
                200 << 10,
            );
        }
        let dev = FileDevice::open(f.path(), StorageOptions::default()).unwrap();
        let export = Arc::new(Export::new("", Arc::new(dev)));
        let conn = Conn {
            device: export.device().clone(),
            export,
            style,
            contexts: vec![MetaContext::BaseAllocation],
        };
        (conn, f, want)
    }

    /// Sends `r` as the server does, pipe included, through a socket pair,
    /// and returns what the client receives.
    fn wire_spliced(r: &Reply, buf: &[u8], zc: &mut ZeroCopy) -> Vec<u8> {
        use std::io::{Read, Write};
        use std::os::fd::AsFd;
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            b.read_to_end(&mut v).unwrap();
            v
        });
        for p in &r.parts {
            match p {
                Part::Bytes(x) => a.write_all(x).unwrap(),
                Part::Data(range) => a.write_all(&buf[range.clone()]).unwrap(),
                Part::Piped(n) => zc.pipe().unwrap().drain(a.as_fd(), *n).unwrap(),
                Part::Lent(l) => a.write_all(l.bytes()).unwrap(),
            }
        }
        drop(a);
        reader.join().unwrap()
    }

    #[test]
    fn big_file_reads_are_spliced_and_arrive_intact() {
        for style in [
            ReplyStyle::Simple,
            ReplyStyle::Structured,
            ReplyStyle::Extended,
        ] {
            let (c, _f, want) = file_conn(style);
            let mut zc = ZeroCopy::default();
            for (offset, len, df) in [
                (0u64, 256u32 << 10, false),
                (4097, 700_000 - 4097 - (100 << 10), false),
                (200 << 10, 400 << 10, false),
                (200 << 10, 400 << 10, true),
            ] {
                let mut buf = Vec::new();
                let cmd = Command::Read { offset, len, df };
                let r = execute(&c, 9, offset, cmd, &mut buf, 0, Some(&mut zc));
                let len = len.min((600 << 10) - offset as u32);
                assert!(r.ok);
                assert!(
                    r.parts.iter().any(|p| matches!(p, Part::Piped(_))),
                    "{style:?} {offset}+{len}: not spliced"
                );
                assert!(r.data_len() > 0);
                let w = wire_spliced(&r, &buf, &mut zc);
                assert!(zc.pipe().unwrap().is_empty());
                let got = if style == ReplyStyle::Simple {
                    w[16..].to_vec()
                } else {
                    let mut got = vec![0xeeu8; len as usize];
                    for (h, payload) in chunks(&w) {
                        match Chunk::parse(h.kind, &payload).unwrap() {
                            Chunk::Data { offset: o, data } => {
                                let at = (o - offset) as usize;
                                got[at..at + data.len()].copy_from_slice(data);
                            }
                            Chunk::Hole { offset: o, len: n } => {
                                assert!(!df, "hole chunk in a DF read");
                                let at = (o - offset) as usize;
                                got[at..at + n as usize].fill(0);
                            }
                            other => panic!("unexpected chunk {other:?}"),
                        }
                    }
                    got
                };
                assert_eq!(got.len(), len as usize);
                assert!(
                    got == want[offset as usize..(offset + u64::from(len)) as usize],
                    "{style:?} {offset}+{len}: bytes differ"
                );
            }
        }
    }

    #[test]
    fn a_file_shorter_than_its_device_falls_back_to_copying() {
        let (c, f, want) = file_conn(ReplyStyle::Structured);
        let set_len = |len: u64| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(f.path())
                .unwrap()
                .set_len(len)
                .unwrap()
        };
        // Shrunk behind the device's back: the splice comes up short, so
        // the read is done the ordinary way (zeros past the end).
        set_len(100 << 10);
        let mut zc = ZeroCopy::default();
        let mut buf = Vec::new();
        let cmd = Command::Read {
            offset: 0,
            len: 256 << 10,
            df: true,
        };
        let r = execute(&c, 9, 0, cmd, &mut buf, 0, Some(&mut zc));
        assert!(r.ok);
        assert!(r.parts.iter().all(|p| !matches!(p, Part::Piped(_))));
        let w = wire(&r, &buf);
        let (h, payload) = &chunks(&w)[0];
        let Chunk::Data { data, .. } = Chunk::parse(h.kind, payload).unwrap() else {
            panic!("not data")
        };
        assert_eq!(&data[..100 << 10], &want[..100 << 10]);
        assert!(data[100 << 10..].iter().all(|&b| b == 0));
        // Reads wholly past the new end find nothing to splice, again and
        // again: each falls back without using up the pipe.
        for _ in 0..10 {
            let past = Command::Read {
                offset: 300 << 10,
                len: 256 << 10,
                df: true,
            };
            let r = execute(&c, 9, 300 << 10, past, &mut buf, 0, Some(&mut zc));
            assert!(r.ok);
            assert!(r.parts.iter().all(|p| !matches!(p, Part::Piped(_))));
        }
        // Grown back, the file splices again.
        set_len(600 << 10);
        let r = execute(&c, 9, 0, cmd, &mut buf, 0, Some(&mut zc));
        assert!(r.parts.iter().any(|p| matches!(p, Part::Piped(_))));
        let w = wire_spliced(&r, &buf, &mut zc);
        let data = &w[w.len() - (256 << 10)..];
        assert_eq!(&data[..100 << 10], &want[..100 << 10]);
        assert!(data[100 << 10..].iter().all(|&b| b == 0));
    }
}
