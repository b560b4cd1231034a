//! The server byte by byte over a socket pair: option parsing, option
//! replies, request parsing and the errors the spec names, with compact,
//! structured and extended headers. Every socket read has a timeout.

mod common;

use std::io::{Read, Write};
use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::BlockDevice;
use diskit_nbd::proto::option_reply::OPTION_REPLY_HEADER_LEN;
use diskit_nbd::proto::reply::{ChunkHeader, SIMPLE_REPLY_LEN};
use diskit_nbd::proto::request::BlockStatusPayload;
use diskit_nbd::proto::*;
use diskit_nbd::server::{
    ConnectionEnd, End, Export, ExportSet, HandshakeEnd, Server, ServerConfig,
};

use common::Peer;

const SIZE: u64 = 1 << 20;
const MAX: u64 = 64 << 20;

fn start(threads: usize) -> Peer {
    let dev = Arc::new(MemoryDevice::new(SIZE));
    let mut exports = ExportSet::new();
    exports.add(Export::new("a", dev.clone()));
    exports.add(Export::new("b", Arc::new(MemoryDevice::new(4096))).with_description("bee"));
    let server = Server::new(
        exports,
        ServerConfig {
            threads,
            ..ServerConfig::default()
        },
    );
    common::connect(server, dev)
}

impl Peer {
    fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.sock.read_exact(&mut v).expect("read from server");
        v
    }

    fn greet(&mut self, client_flags: u32) {
        let g = self.read_n(18);
        assert_eq!(&g[..8], &NBDMAGIC.to_be_bytes());
        assert_eq!(&g[8..16], &IHAVEOPT.to_be_bytes());
        assert_eq!(
            u16::from_be_bytes([g[16], g[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        self.sock.write_all(&client_flags.to_be_bytes()).unwrap();
    }

    fn opt(&mut self, o: &ClientOption) {
        self.sock.write_all(&o.encode()).unwrap();
    }

    fn raw_opt(&mut self, option: u32, data: &[u8]) {
        let h = OptionHeader {
            option,
            length: data.len() as u32,
        };
        self.sock.write_all(&h.encode()).unwrap();
        self.sock.write_all(data).unwrap();
    }

    fn reply(&mut self) -> OptionReply {
        let mut buf = self.read_n(OPTION_REPLY_HEADER_LEN);
        let (_, _, len) = OptionReply::parse_header(buf[..].try_into().unwrap()).unwrap();
        buf.extend(self.read_n(len as usize));
        OptionReply::parse(&buf).unwrap().0
    }

    /// Replies up to and including the final one.
    fn replies(&mut self) -> Vec<OptionReply> {
        let mut v = Vec::new();
        loop {
            let r = self.reply();
            let last = r.kind == REP_ACK || r.is_error();
            v.push(r);
            if last {
                return v;
            }
        }
    }

    fn go(&mut self, name: &str) -> Vec<Info> {
        self.opt(&ClientOption::Go(InfoRequest {
            name: name.into(),
            requests: vec![INFO_BLOCK_SIZE],
        }));
        let r = self.replies();
        assert_eq!(r.last().unwrap().kind, REP_ACK, "{r:?}");
        r[..r.len() - 1]
            .iter()
            .map(|x| Info::parse(&x.data).unwrap())
            .collect()
    }

    fn request(
        &mut self,
        extended: bool,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        cookie: u64,
    ) {
        let h = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
            extended,
        };
        self.sock.write_all(&h.encode()).unwrap();
    }

    fn simple(&mut self) -> (u32, u64) {
        match ReplyHeader::parse(&self.read_n(SIMPLE_REPLY_LEN))
            .unwrap()
            .0
        {
            ReplyHeader::Simple { error, cookie } => (error, cookie),
            other => panic!("{other:?}"),
        }
    }

    /// One reply: a simple reply as an error code, or a chunk.
    fn chunk(&mut self, extended: bool) -> (ChunkHeader, Vec<u8>) {
        let n = if extended { 32 } else { 20 };
        let head = self.read_n(n);
        let (h, _) = ReplyHeader::parse(&head).unwrap();
        let ReplyHeader::Chunk(h) = h else {
            panic!("simple reply where a chunk was due: {h:?}")
        };
        let payload = self.read_n(h.length as usize);
        (h, payload)
    }

    /// The error code of a reply that must be an error chunk.
    fn error_chunk(&mut self, extended: bool, cookie: u64) -> u32 {
        let (h, p) = self.chunk(extended);
        assert_eq!(h.cookie, cookie);
        assert_eq!(h.flags, REPLY_FLAG_DONE);
        match Chunk::parse(h.kind, &p).unwrap() {
            Chunk::Error { error, .. } => error,
            other => panic!("not an error: {other:?}"),
        }
    }

    fn expect_closed(mut self) -> ConnectionEnd {
        let mut b = [0u8; 1];
        assert_eq!(self.sock.read(&mut b).unwrap(), 0, "connection still open");
        self.server.join().unwrap()
    }
}

#[test]
fn options_are_parsed_and_answered() {
    let mut p = start(2);
    p.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    // Unknown options: ERR_UNSUP, and parsing goes on.
    p.raw_opt(99, b"whatever");
    assert_eq!(p.reply().kind, REP_ERR_UNSUP);
    p.raw_opt(OPT_PEEK_EXPORT, b"");
    assert_eq!(p.reply().kind, REP_ERR_UNSUP);
    // Data where none belongs, and bad inner lengths.
    p.raw_opt(OPT_LIST, b"x");
    assert_eq!(p.reply().kind, REP_ERR_INVALID);
    p.raw_opt(OPT_GO, &[0, 0, 0, 200, b'a', 0, 0]);
    assert_eq!(p.reply().kind, REP_ERR_INVALID);
    p.raw_opt(OPT_INFO, &[0, 0, 0, 0, 0, 3, 0, 1]);
    assert_eq!(p.reply().kind, REP_ERR_INVALID);
    p.raw_opt(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(p.reply().kind, REP_ERR_INVALID);
    // Oversized option data is skipped.
    p.raw_opt(OPT_SET_META_CONTEXT, &vec![0u8; 100_000]);
    assert_eq!(p.reply().kind, REP_ERR_TOO_BIG);
    // LIST.
    p.opt(&ClientOption::List);
    let r = p.replies();
    assert_eq!(r.len(), 3);
    assert_eq!(r[0].parse_server().unwrap(), ("a".into(), String::new()));
    assert_eq!(r[1].parse_server().unwrap(), ("b".into(), "bee".into()));
    // STARTTLS without TLS configured.
    p.opt(&ClientOption::StartTls);
    assert_eq!(p.reply().kind, REP_ERR_POLICY);
    // INFO: unknown export, then a known one with its name.
    p.opt(&ClientOption::Info(InfoRequest {
        name: "zz".into(),
        requests: vec![],
    }));
    assert_eq!(p.reply().kind, REP_ERR_UNKNOWN);
    p.opt(&ClientOption::Info(InfoRequest {
        name: "b".into(),
        requests: vec![INFO_NAME, 77],
    }));
    let infos: Vec<Info> = p
        .replies()
        .iter()
        .filter(|r| r.kind == REP_INFO)
        .map(|r| Info::parse(&r.data).unwrap())
        .collect();
    assert!(matches!(infos[0], Info::Export { size: 4096, flags } if flags & TFLAG_SEND_DF == 0));
    assert!(infos.contains(&Info::Name("b".into())));
    assert!(infos.contains(&Info::Description("bee".into())));
    // Meta contexts need structured replies first.
    let meta = |q: &[&str]| MetaRequest {
        export: String::new(),
        queries: q.iter().map(|s| s.to_string()).collect(),
    };
    p.opt(&ClientOption::SetMetaContext(meta(&["base:allocation"])));
    assert_eq!(p.reply().kind, REP_ERR_INVALID);
    p.opt(&ClientOption::StructuredReply);
    assert_eq!(p.reply().kind, REP_ACK);
    p.opt(&ClientOption::StructuredReply);
    assert_eq!(p.reply().kind, REP_ERR_INVALID);
    p.opt(&ClientOption::ListMetaContext(meta(&["qemu:", "nope:x"])));
    let r = p.replies();
    assert_eq!(r.len(), 2);
    assert_eq!(
        r[0].parse_meta_context().unwrap(),
        (0, "qemu:allocation-depth".into())
    );
    p.opt(&ClientOption::SetMetaContext(meta(&[
        "base:allocation",
        "base:",
    ])));
    let r = p.replies();
    assert_eq!(r.len(), 2);
    assert_eq!(
        r[0].parse_meta_context().unwrap(),
        (1, "base:allocation".into())
    );
    // INFO now advertises DF.
    let infos = p.go("a");
    assert!(matches!(infos[0], Info::Export { size: SIZE, flags } if flags & TFLAG_SEND_DF != 0));
    assert!(infos.contains(&Info::BlockSize {
        minimum: 1,
        preferred: 4096,
        maximum: MAX as u32
    }));
    // Block status works: the context was set for this export.
    p.request(false, CMD_BLOCK_STATUS, 0, 0, 8192, 5);
    let (h, payload) = p.chunk(false);
    assert_eq!(h.kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(
        Chunk::parse(h.kind, &payload).unwrap(),
        Chunk::BlockStatus {
            context: 1,
            extents: vec![(8192, u64::from(STATE_HOLE | STATE_ZERO))]
        }
    );
    p.request(false, CMD_DISC, 0, 0, 0, 6);
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Transmission(End::Disconnect)
    ));
}

#[test]
fn abort_and_protocol_violations_in_the_handshake() {
    let mut p = start(0);
    p.greet(FLAG_C_FIXED_NEWSTYLE);
    p.opt(&ClientOption::Abort);
    assert_eq!(p.reply().kind, REP_ACK);
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Handshake(HandshakeEnd::Aborted)
    ));

    let mut p = start(0);
    p.greet(1 << 7);
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(_))
    ));

    // Plain newstyle: any option but EXPORT_NAME ends the session.
    let mut p = start(0);
    p.greet(0);
    p.opt(&ClientOption::List);
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(_))
    ));

    // Bad option magic.
    let mut p = start(0);
    p.greet(FLAG_C_FIXED_NEWSTYLE);
    p.sock.write_all(&[0u8; 16]).unwrap();
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(_))
    ));

    // Unknown export with EXPORT_NAME cannot be refused politely.
    let mut p = start(0);
    p.greet(FLAG_C_FIXED_NEWSTYLE);
    p.opt(&ClientOption::ExportName("zz".into()));
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(_))
    ));
}

#[test]
fn plain_newstyle_with_simple_replies() {
    let mut p = start(4);
    p.greet(0);
    p.opt(&ClientOption::ExportName(String::new()));
    let info = p.read_n(134);
    assert_eq!(u64::from_be_bytes(info[..8].try_into().unwrap()), SIZE);
    let flags = u16::from_be_bytes([info[8], info[9]]);
    assert_eq!(flags & (TFLAG_SEND_DF | TFLAG_READ_ONLY), 0);
    assert!(info[10..].iter().all(|&b| b == 0));

    p.request(false, CMD_WRITE, CMD_FLAG_FUA, 512, 4, 1);
    p.sock.write_all(b"abcd").unwrap();
    assert_eq!(p.simple(), (0, 1));
    p.request(false, CMD_READ, 0, 510, 8, 2);
    assert_eq!(p.simple(), (0, 2));
    assert_eq!(p.read_n(8), b"\0\0abcd\0\0".to_vec());
    // Errors: no payload follows, the connection lives on.
    p.request(false, CMD_READ, 0, SIZE, 8, 3);
    assert_eq!(p.simple(), (EINVAL, 3));
    p.request(false, CMD_READ, CMD_FLAG_DF, 0, 8, 4);
    assert_eq!(p.simple(), (EINVAL, 4), "DF needs structured replies");
    p.request(false, CMD_BLOCK_STATUS, 0, 0, 8, 5);
    assert_eq!(p.simple(), (EINVAL, 5));
    p.request(false, CMD_WRITE, 0, SIZE - 2, 4, 6);
    p.sock.write_all(b"wxyz").unwrap();
    assert_eq!(p.simple(), (ENOSPC, 6));
    p.request(false, CMD_FLUSH, 0, 0, 0, 7);
    assert_eq!(p.simple(), (0, 7), "flush is taken (a no-op on memory)");
    p.request(false, CMD_FLUSH, 0, 0, 1, 7);
    assert_eq!(p.simple(), (EINVAL, 7), "flush has no length");
    p.request(false, CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 512, 2, 8);
    assert_eq!(p.simple(), (0, 8));
    p.request(false, CMD_DISC, 0, 0, 0, 9);
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Transmission(End::Disconnect)
    ));
}

#[test]
fn bad_requests_get_errors_and_bad_magic_ends_the_connection() {
    let mut p = start(4);
    p.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    p.opt(&ClientOption::StructuredReply);
    assert_eq!(p.reply().kind, REP_ACK);
    p.go("");
    p.request(false, 42, 0, 0, 8, 1);
    assert_eq!(p.error_chunk(false, 1), EINVAL);
    p.request(false, CMD_READ, 1 << 12, 0, 8, 2);
    assert_eq!(p.error_chunk(false, 2), EINVAL);
    p.request(false, CMD_READ, 0, 0, 0, 3);
    assert_eq!(p.error_chunk(false, 3), EINVAL);
    p.request(false, CMD_READ, CMD_FLAG_DF, 0, MAX + 1, 4);
    assert_eq!(p.error_chunk(false, 4), EOVERFLOW);
    p.request(false, CMD_BLOCK_STATUS, 0, 0, 8, 5);
    assert_eq!(p.error_chunk(false, 5), EINVAL, "no context selected");
    p.request(false, CMD_TRIM, 0, SIZE, 1, 6);
    assert_eq!(p.error_chunk(false, 6), EINVAL);
    // An oversized write: the payload is read and thrown away.
    p.request(false, CMD_WRITE, 0, 0, MAX + 1, 7);
    p.sock.write_all(&vec![0x5a; (MAX + 1) as usize]).unwrap();
    assert_eq!(p.error_chunk(false, 7), EINVAL);
    // The connection is still in step.
    p.request(false, CMD_WRITE, 0, 4096, 3, 8);
    p.sock.write_all(b"xyz").unwrap();
    assert_eq!(p.simple(), (0, 8));
    p.request(false, CMD_READ, 0, 4096, 3, 9);
    let (h, payload) = p.chunk(false);
    assert_eq!((h.cookie, h.flags), (9, REPLY_FLAG_DONE));
    assert_eq!(
        Chunk::parse(h.kind, &payload).unwrap(),
        Chunk::Data {
            offset: 4096,
            data: b"xyz"
        }
    );
    // A payload far beyond the maximum ends the connection.
    p.request(false, CMD_WRITE, 0, 0, 1 << 31, 10);
    let end = p.expect_closed();
    assert!(
        matches!(end, ConnectionEnd::Transmission(End::Protocol(_))),
        "{end:?}"
    );

    let mut p = start(4);
    p.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    p.go("");
    p.request(true, CMD_READ, 0, 0, 8, 1);
    let end = p.expect_closed();
    assert!(
        matches!(end, ConnectionEnd::Transmission(End::Protocol(_))),
        "{end:?}"
    );
}

#[test]
fn extended_headers() {
    let mut p = start(4);
    p.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    p.opt(&ClientOption::ExtendedHeaders);
    assert_eq!(p.reply().kind, REP_ACK);
    p.opt(&ClientOption::StructuredReply);
    assert_eq!(p.reply().kind, REP_ERR_EXT_HEADER_REQD);
    p.opt(&ClientOption::SetMetaContext(MetaRequest {
        export: "a".into(),
        queries: vec!["base:allocation".into(), "qemu:allocation-depth".into()],
    }));
    assert_eq!(p.replies().len(), 3);
    p.go("a");
    // WRITE without PAYLOAD_LEN (as qemu sends it): a NONE chunk echoing the offset.
    p.request(true, CMD_WRITE, 0, 8192, 4, 1);
    p.sock.write_all(b"1234").unwrap();
    let (h, payload) = p.chunk(true);
    assert_eq!(
        (h.kind, h.cookie, h.offset, h.flags),
        (REPLY_TYPE_NONE, 1, 8192, REPLY_FLAG_DONE)
    );
    assert!(payload.is_empty());
    // 64-bit effect length on WRITE_ZEROES is fine; on READ it is too big.
    p.request(true, CMD_WRITE_ZEROES, 0, 16384, SIZE - 16384, 2);
    assert_eq!(p.chunk(true).0.kind, REPLY_TYPE_NONE);
    p.request(true, CMD_READ, 0, 0, 1 << 33, 3);
    assert_eq!(p.error_chunk(true, 3), EINVAL);
    // Block status: extended descriptors in both contexts.
    p.request(true, CMD_BLOCK_STATUS, 0, 0, SIZE, 4);
    let mut contexts = Vec::new();
    loop {
        let (h, payload) = p.chunk(true);
        assert_eq!(h.kind, REPLY_TYPE_BLOCK_STATUS_EXT);
        assert!(matches!(
            Chunk::parse(h.kind, &payload).unwrap(),
            Chunk::BlockStatus { ref extents, .. } if extents.iter().map(|e| e.0).sum::<u64>() == SIZE
        ));
        contexts.push(h);
        if h.flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    assert_eq!(contexts.len(), 2);
    // A payload on a command that takes none: consumed, then EINVAL.
    p.request(true, CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN, 0, 16, 5);
    p.sock.write_all(&[0u8; 16]).unwrap();
    assert_eq!(p.error_chunk(true, 5), EINVAL);
    // A block status payload picks one of the two contexts: one chunk.
    let filtered = |length: u64, ids: &[u32]| {
        BlockStatusPayload {
            length,
            ids: ids.to_vec(),
        }
        .encode()
    };
    let payload = filtered(SIZE, &[2]);
    p.request(
        true,
        CMD_BLOCK_STATUS,
        CMD_FLAG_PAYLOAD_LEN,
        0,
        payload.len() as u64,
        50,
    );
    p.sock.write_all(&payload).unwrap();
    let (h, body) = p.chunk(true);
    assert_eq!(
        (h.kind, h.flags),
        (REPLY_TYPE_BLOCK_STATUS_EXT, REPLY_FLAG_DONE)
    );
    match Chunk::parse(h.kind, &body).unwrap() {
        Chunk::BlockStatus { context, extents } => {
            assert_eq!(context, 2);
            assert_eq!(extents.iter().map(|e| e.0).sum::<u64>(), SIZE);
        }
        other => panic!("{other:?}"),
    }
    // Malformed payloads: consumed, EINVAL, and the connection goes on.
    let bad: [Vec<u8>; 5] = [
        filtered(SIZE, &[1, 1]),    // an id twice
        filtered(SIZE, &[7]),       // an id not negotiated
        filtered(0, &[1]),          // no length of interest
        filtered(SIZE, &[]),        // no context
        filtered(SIZE, &[1, 2, 1]), // more ids than contexts
    ];
    for (i, payload) in bad.iter().enumerate() {
        let cookie = 51 + i as u64;
        p.request(
            true,
            CMD_BLOCK_STATUS,
            CMD_FLAG_PAYLOAD_LEN,
            0,
            payload.len() as u64,
            cookie,
        );
        p.sock.write_all(payload).unwrap();
        assert_eq!(p.error_chunk(true, cookie), EINVAL, "payload {i}");
    }
    p.request(true, CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN, 0, 10, 56);
    p.sock.write_all(&[0u8; 10]).unwrap();
    assert_eq!(p.error_chunk(true, 56), EINVAL);
    p.request(true, CMD_READ, 0, 8192, 4, 6);
    let (h, payload) = p.chunk(true);
    assert_eq!(h.offset, 8192);
    assert_eq!(
        Chunk::parse(h.kind, &payload).unwrap(),
        Chunk::Data {
            offset: 8192,
            data: b"1234"
        }
    );
    // Compact headers are a protocol violation now (padded to the
    // extended length, as the server reads whole headers).
    p.request(false, CMD_READ, 0, 0, 8, 7);
    p.sock.write_all(&[0u8; 4]).unwrap();
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Transmission(End::Protocol(_))
    ));

    // EXPORT_NAME is forbidden after extended headers.
    let mut p = start(0);
    p.greet(FLAG_C_FIXED_NEWSTYLE);
    p.opt(&ClientOption::ExtendedHeaders);
    assert_eq!(p.reply().kind, REP_ACK);
    p.opt(&ClientOption::ExportName("a".into()));
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Handshake(HandshakeEnd::Protocol(_))
    ));
}

#[test]
fn disconnect_drains_every_request_already_sent() {
    let mut p = start(8);
    p.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    p.opt(&ClientOption::StructuredReply);
    assert_eq!(p.reply().kind, REP_ACK);
    p.go("a");
    let n = 200u64;
    let mut wire = Vec::new();
    for i in 0..n {
        let h = RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            cookie: i,
            offset: i * 4096,
            length: 4096,
            extended: false,
        };
        wire.extend(h.encode());
        wire.extend(std::iter::repeat_n(i as u8 + 1, 4096));
    }
    wire.extend(
        RequestHeader {
            flags: 0,
            command: CMD_DISC,
            cookie: n,
            offset: 0,
            length: 0,
            extended: false,
        }
        .encode(),
    );
    // Send everything, DISC included, before reading any reply.
    let mut sock = p.sock.try_clone().unwrap();
    let writer = std::thread::spawn(move || sock.write_all(&wire).unwrap());
    let mut cookies = Vec::new();
    for _ in 0..n {
        let (error, cookie) = p.simple();
        assert_eq!(error, 0);
        cookies.push(cookie);
    }
    writer.join().unwrap();
    cookies.sort();
    assert_eq!(cookies, (0..n).collect::<Vec<_>>());
    let dev = p.dev.clone();
    assert!(matches!(
        p.expect_closed(),
        ConnectionEnd::Transmission(End::Disconnect)
    ));
    let mut buf = vec![0u8; (n * 4096) as usize];
    dev.read_at(&mut buf, 0).unwrap();
    for i in 0..n as usize {
        assert!(
            buf[i * 4096..(i + 1) * 4096]
                .iter()
                .all(|&b| b == i as u8 + 1),
            "write {i} lost"
        );
    }
}
