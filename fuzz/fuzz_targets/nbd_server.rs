//! The NBD server's wire parsing, two ways: every parser on the raw input
//! (no panic; what parses re-encodes to the same message), and a whole
//! server session fed the input as the client's byte stream (handshake and
//! transmission, requests executed inline on a memory device): it must end
//! without panicking, whatever the bytes. The same bytes are also a
//! certificate subject for `--tls-authz` ([`diskit_nbd::tls::dn`]).
#![no_main]

use std::io::Cursor;
use std::sync::Arc;

use diskit_backends::MemoryDevice;
use diskit_core::{BlockDevice, BlockSizeLimits, Filter, Filtered};
use diskit_nbd::proto::option::OPTION_HEADER_LEN;
use diskit_nbd::proto::request::BlockStatusPayload;
use diskit_nbd::proto::*;
use diskit_nbd::server::{Export, ExportSet, Pipe, Server, ServerConfig};
use libfuzzer_sys::fuzz_target;

/// Small maximum payload, so that hostile lengths cost little memory.
struct SmallBlocks;

impl Filter for SmallBlocks {
    fn name(&self) -> &str {
        "small-blocks"
    }
    fn block_size(&self, _next: &dyn BlockDevice) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 4096,
            maximum: 64 * 1024,
        }
    }
}

fn parsers(data: &[u8]) {
    if let Some(head) = data.get(..OPTION_HEADER_LEN) {
        let head: &[u8; OPTION_HEADER_LEN] = head.try_into().unwrap();
        if let Ok(h) = OptionHeader::parse(head) {
            assert_eq!(&h.encode(), head);
            if let Ok(o) = ClientOption::parse(h.option, &data[OPTION_HEADER_LEN..]) {
                if !matches!(o, ClientOption::Abort | ClientOption::Unknown(_)) {
                    let again = ClientOption::parse(o.code(), &o.encode_data()).unwrap();
                    assert_eq!(again, o);
                }
            }
        }
    }
    for extended in [false, true] {
        let n = RequestHeader::wire_len(extended);
        if let Some(buf) = data.get(..n)
            && let Ok(h) = RequestHeader::parse(buf, extended)
        {
            assert_eq!(h.encode(), buf);
            let limits = Limits {
                size: u64::from(data[0]) << 12,
                tflags: u16::from_be_bytes([data[1], data[2]]),
                min_block: 1 << (data[3] % 13),
                max_payload: 1 << 16,
                structured: data[4] & 1 != 0,
                extended,
                meta_contexts: data[4] & 2 != 0,
            };
            if let Ok(cmd) = validate(&h, &limits) {
                if cmd.is_write() {
                    assert_eq!(limits.tflags & TFLAG_READ_ONLY, 0);
                }
                if let Command::Read { offset, len, .. } | Command::Write { offset, len, .. } = cmd
                {
                    assert!(offset + u64::from(len) <= limits.size);
                    assert!(len <= limits.max_payload);
                }
            }
        }
    }
    // A block status payload, for a connection that negotiated the ids
    // the first byte says (0 to 7 of them): what parses re-encodes to the
    // same bytes, and names only negotiated ids, each once.
    if let Some((&n, payload)) = data.split_first() {
        let negotiated: Vec<u32> = (1..=u32::from(n % 8)).collect();
        if let Ok(p) = BlockStatusPayload::parse(payload, &negotiated) {
            assert_eq!(p.encode(), payload);
            assert!(p.ids.iter().all(|id| negotiated.contains(id)));
            let mut ids = p.ids.clone();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), p.ids.len());
        }
    }
    if let Ok((ReplyHeader::Chunk(h), used)) = ReplyHeader::parse(data) {
        let _ = Chunk::parse(h.kind, &data[used..]);
    }
    let _ = OptionReply::parse(data).map(|(r, _)| {
        let _ = Info::parse(&r.data);
        let _ = r.parse_server();
        let _ = r.parse_meta_context();
    });
}

fn session(data: &[u8]) {
    let dev = Arc::new(Filtered::new(
        SmallBlocks,
        Arc::new(MemoryDevice::new(1 << 20)),
    ));
    let mut exports = ExportSet::new();
    exports.add(Export::new("", dev));
    exports.add(Export::new("ro", Arc::new(MemoryDevice::new(8192))).with_read_only(true));
    let server = Server::new(
        exports,
        ServerConfig {
            threads: 0,
            ..ServerConfig::default()
        },
    );
    let transport = Pipe::new(Cursor::new(data.to_vec()), std::io::sink(), "fuzz");
    let _ = server.serve(Box::new(transport));
}

/// The client certificate's subject, as `--tls-authz` sees it: any bytes
/// as a DER name and as a whole certificate (no panic).
fn subject(data: &[u8]) {
    let _ = diskit_nbd::tls::dn::format_name(data);
    let _ = diskit_nbd::tls::dn::certificate_subject(data);
}

fuzz_target!(|data: &[u8]| {
    parsers(data);
    session(data);
    subject(data);
});
