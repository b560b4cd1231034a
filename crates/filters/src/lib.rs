//! diskit-filters: nbdkit's filters as diskit layers.
//!
//! Each module is one filter: a [`diskit_core::Filter`] that changes only
//! what it must and lets everything else (capabilities included) pass
//! through to the device below. Any tool can stack them over any
//! [`BlockDevice`](diskit_core::BlockDevice); `diskit serve --filter=NAME` is one user.
//!
//! | filter | parameters | what it does |
//! |---|---|---|
//! | [`multi_conn`] | `multi-conn-mode=`, `multi-conn-track-dirty=`, `multi-conn-exportname=` | advertises, emulates or hides multi-conn; saves needless flushes |
//! | [`offset`] | `offset=`, `range=` | serves a window of the device |
//! | [`partition`] | `partition=` | serves one partition (MBR or GPT) |
//! | [`log`] | `logfile=`, `logappend=`, `logscript=` | logs every request and connection, in nbdkit's format |
//! | [`retry`] | `retries=`, `retry-delay=`, `retry-exponential=`, `retry-readonly=` | retries failed requests, reopening the device below |
//! | [`stats`] | `statsfile=`, `statsappend=`, `statsthreshold=` | counts requests, writes nbdkit's summary at close |
//! | [`rate`] | `rate=`, `connection-rate=`, `rate-file=`, `connection-rate-file=`, `burstiness=` | limits read and write bandwidth |
//! | [`readahead`] | | asks the layer below to cache what is likely read next |
//! | [`truncate`] | `truncate=`, `round-up=`, `round-down=` | changes the size |
//! | [`nozero`] | `zeromode=`, `fastzeromode=` | hides or degrades write-zeroes |
//! | [`noextents`] | | hides allocation: everything is data |
//! | [`fua`] | `fuamode=` | changes FUA and flush handling |
//! | [`cache`] | `cache=`, `cache-min-block-size=`, `cache-on-read=`, `cache-max-size=`, `cache-*-threshold=` | keeps blocks in a temporary file; writes back at flush |
//! | [`cow`] | `cow-block-size=`, `cow-on-read=`, `cow-on-cache=` | a writable overlay; the device below is never written |
//! | [`delay`] | `rdelay=`, `wdelay=`, `delay-*=` | sleeps before each request |
//! | [`error`] | `error=`, `error-rate=`, `error-file=`, `error-OP-*=` | fails requests at random |
//! | [`blocksize`] | `minblock=`, `maxdata=`, `maxlen=` | aligns and splits requests |
//! | [`xz`] | `xz-max-block=`, `xz-max-depth=` | serves an .xz file decompressed, by block, read-only |
//! | [`gzip`] | | serves a gzip file decompressed (whole, into a temporary file), read-only |
//! | [`bzip2`] | | serves a bzip2 file decompressed as gzip does, read-only |
//! | [`tar`] | `tar-entry=`, `tar-limit=` | serves one file inside a tarball |
//! | [`protect`] | `protect=START-END`, `protect=~START-END` | write-protects ranges (EPERM) |
//! | [`readonly`] | `readonly-file=` | read-only, always or while a file exists |
//! | [`checkwrite`] | | writes become checks that nothing changes (EIO) |
//! | [`swab`] | `swab-bits=` | swaps the bytes of 16-, 32- or 64-bit words |
//! | [`nocache`] | `cachemode=` | hides, emulates or ignores cache requests |
//! | [`count`] | | counts bytes read, written, zeroed, trimmed |
//! | [`cacheextents`] | | keeps the last extents answer |
//! | [`ddrescue`] | `ddrescue-mapfile=` | fails reads of the bad blocks of a ddrescue mapfile |
//! | [`scan`] | `scan-ahead=`, `scan-clock=`, `scan-forever=`, `scan-size=` | caches the whole disk below, in the background, while connected |
//! | [`noparallel`] | `serialize=` | one request, or one connection, at a time |
//! | [`limit`] | `limit=` | limits the clients connected at once |
//! | [`ip`] | `allow=`, `deny=` | allows or denies clients by address or credentials |
//! | [`exitlast`] | | the server stops when its last client leaves |
//! | [`exitwhen`] | `exit-when-*=` | the server stops when an event occurs |
//! | [`time_limit`] | `time-limit=` | closes connections after a time |
//! | [`exportname`] | `default-export=`, `exportname-list=`, `exportname=`, `exportname-strict=`, `exportdesc=` | changes the export names and descriptions clients see |
//!
//! The last five, and noparallel's `connections`, act on connections:
//! through the server's events that every layer passes on
//! ([`diskit_core::serving`]).
//!
//! [`unmap`] is QEMU's, not nbdkit's: the `discard=` and `detect-zeroes=`
//! policy of a block node, stacked by commands that take QEMU's options
//! (qemu-nbd's `--discard`, `--detect-zeroes`); it has no row in
//! [`FILTERS`].
//!
//! The registry ([`FILTERS`], [`FilterSpec`]) turns a filter's name and its
//! `key=value` parameters, as nbdkit's command line gives them, into a
//! checked configuration; [`stack`] puts a list of them over a device, the
//! first of the list outermost (closest to the client), as nbdkit orders
//! `--filter` options.
//!
//! A new filter is one module that defines its `KEYS` and its
//! configuration (a [`Configure`]: `set` takes one parameter, `stack` puts
//! the filter over a device; the registry reads the parameters in order),
//! plus its row in [`FILTERS`] (`FilterInfo::new::<Config>(name, KEYS,
//! help)`), its `mod` line and a line in the table above. The filter
//! implements only what it changes; [`diskit_core::Filtered`]
//! checks ranges and forwards the rest, submission included where the
//! filter says its requests may go below
//! ([`diskit_core::Filter::submits_below`]).

mod blockmap;
pub mod blocksize;
pub mod bzip2;
pub mod cache;
pub mod cacheextents;
mod call;
pub mod checkwrite;
pub mod count;
pub mod cow;
pub mod cow_file;
pub mod ddrescue;
pub mod delay;
pub mod error;
pub mod exitlast;
pub mod exitwhen;
pub mod exportname;
pub mod fua;
mod gate;
pub mod gzip;
pub mod inflate;
pub mod ip;
pub mod limit;
pub mod log;
pub mod multi_conn;
pub mod nocache;
pub mod noextents;
pub mod noparallel;
pub mod nozero;
pub mod offset;
mod overlay;
pub mod params;
pub mod partition;
mod prefetch;
pub mod protect;
pub mod rate;
pub mod readahead;
pub mod readonly;
mod registry;
pub mod retry;
pub mod scan;
pub mod stats;
#[cfg(test)]
mod submit_tests;
pub mod swab;
pub mod tar;
#[cfg(test)]
mod testing;
pub mod time_limit;
pub mod truncate;
pub mod unmap;
mod verify;
mod watch;
pub mod xz;

pub use registry::{Configure, FilterInfo, FilterSpec, Keyless, Params, info, stack, unknown};

/// Every filter, by name: its row.
pub const FILTERS: &[FilterInfo] = &[
    FilterInfo::new::<blocksize::BlocksizeConfig>(
        "blocksize",
        blocksize::KEYS,
        "aligns and splits requests, read-modify-write for unaligned ones (minblock= maxdata= maxlen=)",
    ),
    FilterInfo::new::<bzip2::Bzip2Config>(
        "bzip2",
        bzip2::KEYS,
        "serves a bzip2 file decompressed, read-only: the whole stream once, into a temporary file in $TMPDIR (or /var/tmp)",
    ).reads_only_below(),
    FilterInfo::new::<cache::CacheConfig>(
        "cache",
        cache::KEYS,
        "keeps blocks in a temporary file (cache=writeback|writethrough|unsafe cache-min-block-size= cache-on-read=true|false|/PATH cache-max-size= cache-high-threshold= cache-low-threshold=)",
    ),
    FilterInfo::new::<Keyless<cacheextents::Cacheextents>>(
        "cacheextents",
        cacheextents::KEYS,
        "keeps the answer of the last extents request and answers from it until a write, for clients that ask one extent at a time",
    ),
    FilterInfo::new::<Keyless<checkwrite::Checkwrite>>(
        "checkwrite",
        checkwrite::KEYS,
        "turns writes into checks that the data is already there (EIO if not), to test copying tools; the device below is never written",
    ).reads_only_below(),
    FilterInfo::new::<Keyless<count::Count>>(
        "count",
        count::KEYS,
        "counts the bytes read, written, zeroed and trimmed, and writes the totals to stderr when the server stops",
    ),
    FilterInfo::new::<cow::CowConfig>(
        "cow",
        cow::KEYS,
        "a writable overlay in a temporary file, or kept as a qcow2 image backed by the source (cow-file=OVERLAY.qcow2); the device below is never written (cow-block-size= cow-on-read=true|false|/PATH cow-on-cache= cow-file=)",
    ).reads_only_below(),
    FilterInfo::new::<ddrescue::Ddrescue>(
        "ddrescue",
        ddrescue::KEYS,
        "serves a disk rescued by GNU ddrescue read-only, failing reads (EIO) of the blocks its mapfile does not list as rescued (ddrescue-mapfile=FILE)",
    ),
    FilterInfo::new::<delay::Delay>(
        "delay",
        delay::KEYS,
        "delays requests (rdelay= wdelay= delay-read= delay-write= delay-zero= delay-trim= delay-extents= delay-cache= delay-fast-zero=)",
    ),
    FilterInfo::new::<error::ErrorConfig>(
        "error",
        error::KEYS,
        "fails requests at random, for testing clients (error=EIO|ENOSPC|... error-rate=10% error-file=PATH, and error-pread-*= error-pwrite-*= error-trim-*= error-zero-*= error-extents-*= error-cache-*=)",
    ),
    FilterInfo::new::<Keyless<exitlast::Exitlast>>(
        "exitlast",
        exitlast::KEYS,
        "stops the server when the last client leaves (not before the first comes)",
    ),
    FilterInfo::new::<exitwhen::ExitwhenConfig>(
        "exitwhen",
        exitwhen::KEYS,
        "stops the server gracefully when an event occurs: new clients are refused, the connected ones finish (exit-when-file-created=FILE exit-when-file-deleted=FILE exit-when-pipe-closed=FD exit-when-process-exits=PID exit-when-script=COMMAND exit-when-poll=SECS)",
    ),
    FilterInfo::new::<exportname::Exportname>(
        "exportname",
        exportname::KEYS,
        "changes the export names clients are shown and may open: the default export (default-export=NAME), the listing (exportname-list=keep|error|empty|defaultonly|explicit, exportname=NAME...), only the listed names (exportname-strict=true), descriptions (exportdesc=keep|none|fixed:TEXT|script:SCRIPT)",
    ),
    FilterInfo::new::<fua::Fua>(
        "fua",
        fua::KEYS,
        "changes FUA and flush handling (fuamode=none|emulate|native|force|pass|discard)",
    ),
    FilterInfo::new::<gzip::GzipConfig>(
        "gzip",
        gzip::KEYS,
        "serves a gzip file decompressed, read-only: the whole stream once, into a temporary file in $TMPDIR (or /var/tmp)",
    ).reads_only_below(),
    FilterInfo::new::<ip::Ip>(
        "ip",
        ip::KEYS,
        "allows or denies clients, before their handshake, by address or (Unix sockets) credentials: allow rules first, then deny, else allowed (allow=RULE,... deny=RULE,...: all, anyipv4, anyipv6, anyunix, A.B.C.D/NN, IPV6/NN, pid:N, uid:N, gid:N)",
    ),
    FilterInfo::new::<limit::LimitConfig>(
        "limit",
        limit::KEYS,
        "limits the clients connected at once; more are closed before their handshake (limit=N, default 1, 0: none)",
    ),
    FilterInfo::new::<log::LogConfig>(
        "log",
        log::KEYS,
        "logs every request, its flags and result, and every connection, in nbdkit's format (logfile=FILE logappend=BOOL logscript=SCRIPT)",
    ),
    FilterInfo::new::<multi_conn::MultiConnConfig>(
        "multi-conn",
        multi_conn::KEYS,
        "advertises, emulates (a flush reaches every connection) or hides multi-conn, and skips flushes nothing made necessary (multi-conn-mode=auto|emulate|plugin|unsafe|disable multi-conn-track-dirty=connection|fast|off multi-conn-exportname=BOOL)",
    ),
    FilterInfo::new::<nocache::Nocache>(
        "nocache",
        nocache::KEYS,
        "hides cache requests, emulates them by reading, or ignores them (cachemode=none|emulate|nop)",
    ),
    FilterInfo::new::<noextents::Noextents>(
        "noextents",
        noextents::KEYS,
        "hides allocation: the whole disk reads as data in block status",
    ),
    FilterInfo::new::<noparallel::NoparallelConfig>(
        "noparallel",
        noparallel::KEYS,
        "serializes requests per connection, requests of all connections, or connections (one client at a time, no multi-conn) (serialize=requests|all-requests|connections)",
    ),
    FilterInfo::new::<nozero::Nozero>(
        "nozero",
        nozero::KEYS,
        "hides or degrades write-zeroes (zeromode=none|emulate|notrim|plugin fastzeromode=default|none|slow|ignore)",
    ),
    FilterInfo::new::<offset::OffsetConfig>(
        "offset",
        offset::KEYS,
        "serves a window of the disk (offset= range=)",
    ),
    FilterInfo::new::<partition::PartitionConfig>(
        "partition",
        partition::KEYS,
        "serves one partition of an MBR or GPT disk (partition=N: 1-4 primary, 5 and up logical, or the GPT entry)",
    ),
    FilterInfo::new::<protect::ProtectConfig>(
        "protect",
        protect::KEYS,
        "write-protects ranges: writes that would change them fail with EPERM (protect=START-END, repeatable; protect=~START-END protects the rest)",
    ),
    FilterInfo::new::<rate::RateConfig>(
        "rate",
        rate::KEYS,
        "limits the bandwidth of reads and writes in bits per second, over all connections and per connection (rate= connection-rate= rate-file=FILE connection-rate-file=FILE burstiness=SECS)",
    ),
    FilterInfo::new::<readahead::ReadaheadConfig>(
        "readahead",
        readahead::KEYS,
        "asks the layer below to cache, in the background, what is likely read next: ahead of sequential streams, around reads elsewhere (over cow with cow-on-cache=true, say)",
    ),
    FilterInfo::new::<readonly::Readonly>(
        "readonly",
        readonly::KEYS,
        "makes the export read-only; with readonly-file=PATH, writes fail with EPERM only while PATH exists",
    ),
    FilterInfo::new::<retry::RetryConfig>(
        "retry",
        retry::KEYS,
        "retries failed requests after a delay, reopening the device below first (an NBD connection connects again) (retries=5 retry-delay=2 retry-exponential=yes retry-readonly=no)",
    ),
    FilterInfo::new::<scan::ScanConfig>(
        "scan",
        scan::KEYS,
        "while a client is connected, asks the layer below to cache the whole disk in the background (stack cache below where the device has no cache) (scan-ahead=BOOL scan-clock=BOOL scan-forever=BOOL scan-size=2M)",
    ),
    FilterInfo::new::<stats::StatsConfig>(
        "stats",
        stats::KEYS,
        "counts requests (bytes, time, size and alignment breakdown) and writes nbdkit's summary when the server stops (statsfile=FILE statsappend=BOOL statsthreshold=PERCENT)",
    ),
    FilterInfo::new::<swab::Swab>(
        "swab",
        swab::KEYS,
        "swaps the bytes of each word; unaligned requests fail (swab-bits=8|16|32|64, default 16)",
    ),
    FilterInfo::new::<tar::TarConfig>(
        "tar",
        tar::KEYS,
        "serves one file inside a tarball (ustar, GNU long names, pax headers), found by its headers (tar-entry=NAME, required; tar-limit=SIZE: look only that far in)",
    ),
    FilterInfo::new::<time_limit::TimeLimitConfig>(
        "time-limit",
        time_limit::KEYS,
        "closes a connection at its first request after a time; that request fails with ESHUTDOWN (time-limit=SECS, default 60, 0: none)",
    ),
    FilterInfo::new::<truncate::TruncateConfig>(
        "truncate",
        truncate::KEYS,
        "changes the size: cut, or extend with zeros (truncate= round-up= round-down=)",
    ),
    FilterInfo::new::<xz::XzConfig>(
        "xz",
        xz::KEYS,
        "serves an .xz file decompressed, read-only, seeking by xz block; blocks are kept and decompressed ahead of sequential reads on every processor (xz-max-block=512M: larger blocks are refused; xz-max-depth=8: blocks kept)",
    ).reads_only_below(),
];

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::DeviceRef;
    use std::sync::Arc;

    use crate::testing::kv;

    #[test]
    fn unknown_names_and_keys_are_refused_with_the_choices() {
        let e = FilterSpec::parse("nosuch", &[]).unwrap_err();
        assert!(e.to_string().contains("unknown filter 'nosuch'"), "{e}");
        for f in FILTERS {
            assert!(e.to_string().contains(f.name), "{e}");
        }
        let e = FilterSpec::parse("offset", &kv(&[("size", "1")])).unwrap_err();
        assert!(e.to_string().contains("'size'"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_with_the_filter_and_the_reason() {
        for (filter, key, value, why) in [
            ("cache", "cache", "sometimes", "unknown cache"),
            ("cache", "cache-min-block-size", "1000", "power of 2"),
            ("cache", "cache-high-threshold", "0", "between 1 and 100"),
            ("cache", "cache-on-read", "perhaps", "boolean"),
            ("cache", "cache-max-size", "512K", "too small"),
            ("cow", "cow-block-size", "1000", "must be a power of 2"),
            ("cow", "cow-block-size", "512", "must be a power of 2"),
            ("cow", "cow-on-read", "maybe", "could not decipher boolean"),
            ("error", "error", "EAGAIN", "unknown error 'EAGAIN'"),
            ("error", "error-rate", "150%", "out of range"),
            ("error", "error-rate", "-0.1", "out of range"),
            ("error", "error-rate", "lots", "could not parse rate"),
            ("error", "error-trim-rate", "1:0", "could not parse rate"),
            (
                "error",
                "error-flush",
                "EIO",
                "unknown parameter 'error-flush'",
            ),
            ("error", "error-pread-size", "1", "unknown parameter"),
            ("retry", "retries", "-1", "retries"),
            ("retry", "retry-delay", "0", "cannot be 0"),
            ("retry", "retry-exponential", "maybe", "retry-exponential"),
        ] {
            let e = FilterSpec::parse(filter, &kv(&[(key, value)]))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!("{filter}: ")) && e.contains(why),
                "{filter} {key}={value}: {e}"
            );
        }
    }

    #[test]
    fn every_filter_parses_with_defaults_and_names_itself() {
        for f in FILTERS {
            let spec = FilterSpec::parse(f.name, &[]).unwrap();
            assert_eq!(spec.name(), f.name);
        }
    }

    #[test]
    fn the_first_filter_is_the_outermost() {
        let mem: DeviceRef = Arc::new(MemoryDevice::new(4 << 20));
        let offset = FilterSpec::parse("offset", &kv(&[("offset", "1M")])).unwrap();
        let truncate = FilterSpec::parse("truncate", &kv(&[("truncate", "5M")])).unwrap();
        // offset over truncate: (5M) - 1M.
        let d = stack(&[offset.clone(), truncate.clone()], mem.clone(), false).unwrap();
        assert_eq!(d.size(), 4 << 20);
        assert!(
            d.describe().starts_with("offset over truncate over memory"),
            "{}",
            d.describe()
        );
        // truncate over offset: 5M whatever the window.
        let d = stack(&[truncate, offset], mem, false).unwrap();
        assert_eq!(d.size(), 5 << 20);
    }

    /// A device that lends every read out of the bytes it holds.
    struct Lending(Arc<Vec<u8>>);

    impl diskit_core::BlockDevice for Lending {
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
        fn read_or_lend(
            &self,
            buf: &mut [u8],
            offset: u64,
        ) -> diskit_core::Result<Option<diskit_core::Lent>> {
            let at = offset as usize;
            Ok(diskit_core::Lent::new(self.0.clone(), at..at + buf.len()))
        }
    }

    #[test]
    fn lent_reads_pass_only_through_filters_that_keep_reads() {
        let data: Arc<Vec<u8>> = Arc::new((0..1u32 << 20).map(|i| (i % 251) as u8).collect());
        let dev: DeviceRef = Arc::new(Lending(data.clone()));
        let one = |name: &str, params: &[(&str, &str)]| {
            let spec = FilterSpec::parse(name, &kv(params)).unwrap();
            stack(&[spec], dev.clone(), true).unwrap()
        };
        let mut buf = vec![0u8; 4096];
        // (stack, whether it lends, where below its byte 8192 lies).
        for (d, lends, below) in [
            (one("nozero", &[]), true, 8192),
            (one("noextents", &[]), true, 8192),
            (one("offset", &[("offset", "4096")]), false, 8192 + 4096),
            (one("log", &[("logfile", "/dev/null")]), false, 8192),
        ] {
            buf.fill(0);
            let want = &data[below..below + 4096];
            match d.read_or_lend(&mut buf, 8192).unwrap() {
                Some(lent) => {
                    assert!(
                        lends,
                        "{}: lent past a filter that sees reads",
                        d.describe()
                    );
                    assert_eq!(lent.bytes(), want);
                }
                None => {
                    assert!(!lends, "{}: the bytes below were not lent", d.describe());
                    assert_eq!(&buf[..], want);
                }
            }
        }
    }

    #[test]
    fn file_views_pass_only_through_filters_that_keep_reads() {
        use diskit_backends::FileDevice;
        use diskit_core::StorageOptions;
        use std::os::unix::fs::FileExt;
        let f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 253) as u8).collect();
        std::fs::write(f.path(), &data).unwrap();
        let file: DeviceRef =
            Arc::new(FileDevice::open(f.path(), StorageOptions::default()).unwrap());
        let one = |name: &str, params: &[(&str, &str)]| {
            let spec = FilterSpec::parse(name, &kv(params)).unwrap();
            stack(&[spec], file.clone(), false).unwrap()
        };
        // (filter, offset and length asked, where the view must start).
        let cases: Vec<(DeviceRef, u64, u64, Option<u64>)> = vec![
            (one("nozero", &[]), 4096, 65536, Some(4096)),
            (one("noextents", &[]), 1, 65536, Some(1)),
            (one("fua", &[]), 0, 1 << 20, Some(0)),
            (
                one("blocksize", &[("minblock", "4k")]),
                512,
                8192,
                Some(512),
            ),
            (
                one("offset", &[("offset", "1M")]),
                100,
                4096,
                Some((1 << 20) + 100),
            ),
            (one("offset", &[("offset", "1M")]), 3 << 20, 4096, None),
            (
                one("truncate", &[("truncate", "5M")]),
                1 << 20,
                4096,
                Some(1 << 20),
            ),
            (
                one("truncate", &[("truncate", "5M")]),
                (4 << 20) - 10,
                20,
                None,
            ),
            (one("delay", &[("rdelay", "1ms")]), 0, 4096, None),
        ];
        for (d, offset, len, want) in cases {
            let view = d.file_view(offset, len);
            assert_eq!(view.map(|v| v.offset), want, "{} at {offset}", d.describe());
            if let Some(v) = view {
                // The view's bytes are what the filter reads.
                let mut through = vec![0u8; len as usize];
                d.read_at(&mut through, offset).unwrap();
                let file = std::fs::File::from(v.fd.try_clone_to_owned().unwrap());
                let mut viewed = vec![0u8; len as usize];
                file.read_exact_at(&mut viewed, v.offset).unwrap();
                assert!(through == viewed, "{}", d.describe());
            }
        }
    }
}
