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
//!
//! The registry ([`FILTERS`], [`FilterSpec`]) turns a filter's name and its
//! `key=value` parameters, as nbdkit's command line gives them, into a
//! checked configuration; [`stack`] puts a list of them over a device, the
//! first of the list outermost (closest to the client), as nbdkit orders
//! `--filter` options.
//!
//! A new filter is one module that defines its `KEYS`, its configuration
//! (a [`FilterConfig`]: `from_params` reads it, `stack` puts the filter
//! over a device) and its row (`pub const FILTER: FilterInfo =
//! FilterInfo::new::<Config>(name, KEYS, HELP)`), plus that row in
//! [`FILTERS`] (and its `mod` line, and a line in the table above). The
//! filter implements only what it changes; [`diskit_core::Filtered`]
//! checks ranges and forwards the rest, submission included where the
//! filter says its requests may go below
//! ([`diskit_core::Filter::submits_below`]).

mod blockmap;
pub mod blocksize;
pub mod cache;
pub mod cow;
pub mod cow_file;
pub mod delay;
pub mod error;
pub mod fua;
pub mod log;
pub mod multi_conn;
pub mod noextents;
pub mod nozero;
pub mod offset;
mod overlay;
pub mod params;
pub mod partition;
pub mod rate;
pub mod readahead;
mod registry;
pub mod retry;
pub mod stats;
#[cfg(test)]
mod submit_tests;
pub mod truncate;

pub use registry::{Ctx, FilterConfig, FilterInfo, FilterSpec, Params, info, stack};

/// Every filter, by name: each module's row.
pub const FILTERS: &[FilterInfo] = &[
    blocksize::FILTER,
    cache::FILTER,
    cow::FILTER,
    delay::FILTER,
    error::FILTER,
    fua::FILTER,
    log::FILTER,
    multi_conn::FILTER,
    noextents::FILTER,
    nozero::FILTER,
    offset::FILTER,
    partition::FILTER,
    rate::FILTER,
    readahead::FILTER,
    retry::FILTER,
    stats::FILTER,
    truncate::FILTER,
];

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;
    use diskit_core::DeviceRef;
    use std::sync::Arc;

    use crate::params::kv;

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
