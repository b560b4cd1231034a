//! diskit-filters: nbdkit's filters as diskit layers.
//!
//! Each module is one filter: a [`diskit_core::Filter`] that changes only
//! what it must and lets everything else (capabilities included) pass
//! through to the device below. Any tool can stack them over any
//! [`BlockDevice`]; `diskit serve --filter=NAME` is one user.
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
pub mod retry;
pub mod stats;
pub mod truncate;

use std::sync::Arc;

use diskit_core::{DeviceRef, Error, Filtered, Result};

/// A filter's name, the parameter keys it takes and a one-line description.
#[derive(Debug, Clone, Copy)]
pub struct FilterInfo {
    /// The name given to `--filter=`.
    pub name: &'static str,
    /// Every key the filter takes.
    pub keys: &'static [&'static str],
    /// One line for `--help`.
    pub help: &'static str,
}

/// Every filter, by name.
pub const FILTERS: &[FilterInfo] = &[
    FilterInfo {
        name: "blocksize",
        keys: blocksize::KEYS,
        help: "aligns and splits requests, read-modify-write for unaligned ones (minblock= maxdata= maxlen=)",
    },
    FilterInfo {
        name: "cache",
        keys: cache::KEYS,
        help: "keeps blocks in a temporary file (cache=writeback|writethrough|unsafe cache-min-block-size= cache-on-read=true|false|/PATH cache-max-size= cache-high-threshold= cache-low-threshold=)",
    },
    FilterInfo {
        name: "cow",
        keys: cow::KEYS,
        help: "a writable overlay in a temporary file, or kept as a qcow2 image backed by the source (cow-file=OVERLAY.qcow2); the device below is never written (cow-block-size= cow-on-read=true|false|/PATH cow-on-cache= cow-file=)",
    },
    FilterInfo {
        name: "delay",
        keys: delay::KEYS,
        help: "delays requests (rdelay= wdelay= delay-read= delay-write= delay-zero= delay-trim= delay-extents= delay-cache= delay-fast-zero=)",
    },
    FilterInfo {
        name: "error",
        keys: error::KEYS,
        help: "fails requests at random, for testing clients (error=EIO|ENOSPC|... error-rate=10% error-file=PATH, and error-pread-*= error-pwrite-*= error-trim-*= error-zero-*= error-extents-*= error-cache-*=)",
    },
    FilterInfo {
        name: "fua",
        keys: fua::KEYS,
        help: "changes FUA and flush handling (fuamode=none|emulate|native|force|pass|discard)",
    },
    FilterInfo {
        name: "log",
        keys: log::KEYS,
        help: "logs every request, its flags and result, and every connection, in nbdkit's format (logfile=FILE logappend=BOOL logscript=SCRIPT)",
    },
    FilterInfo {
        name: "multi-conn",
        keys: multi_conn::KEYS,
        help: "advertises, emulates (a flush reaches every connection) or hides multi-conn, and skips flushes nothing made necessary (multi-conn-mode=auto|emulate|plugin|unsafe|disable multi-conn-track-dirty=connection|fast|off multi-conn-exportname=BOOL)",
    },
    FilterInfo {
        name: "noextents",
        keys: noextents::KEYS,
        help: "hides allocation: the whole disk reads as data in block status",
    },
    FilterInfo {
        name: "nozero",
        keys: nozero::KEYS,
        help: "hides or degrades write-zeroes (zeromode=none|emulate|notrim|plugin fastzeromode=default|none|slow|ignore)",
    },
    FilterInfo {
        name: "offset",
        keys: offset::KEYS,
        help: "serves a window of the disk (offset= range=)",
    },
    FilterInfo {
        name: "partition",
        keys: partition::KEYS,
        help: "serves one partition of an MBR or GPT disk (partition=N: 1-4 primary, 5 and up logical, or the GPT entry)",
    },
    FilterInfo {
        name: "rate",
        keys: rate::KEYS,
        help: "limits the bandwidth of reads and writes in bits per second, over all connections and per connection (rate= connection-rate= rate-file=FILE connection-rate-file=FILE burstiness=SECS)",
    },
    FilterInfo {
        name: "readahead",
        keys: readahead::KEYS,
        help: "asks the layer below to cache, in the background, what is likely read next: ahead of sequential streams, around reads elsewhere (over cow with cow-on-cache=true, say)",
    },
    FilterInfo {
        name: "retry",
        keys: retry::KEYS,
        help: "retries failed requests after a delay, reopening the device below first (an NBD connection connects again) (retries=5 retry-delay=2 retry-exponential=yes retry-readonly=no)",
    },
    FilterInfo {
        name: "stats",
        keys: stats::KEYS,
        help: "counts requests (bytes, time, size and alignment breakdown) and writes nbdkit's summary when the server stops (statsfile=FILE statsappend=BOOL statsthreshold=PERCENT)",
    },
    FilterInfo {
        name: "truncate",
        keys: truncate::KEYS,
        help: "changes the size: cut, or extend with zeros (truncate= round-up= round-down=)",
    },
];

/// The filter called `name`; an unknown name is an error listing the
/// filters there are.
pub fn info(name: &str) -> Result<&'static FilterInfo> {
    FILTERS.iter().find(|f| f.name == name).ok_or_else(|| {
        let names: Vec<&str> = FILTERS.iter().map(|f| f.name).collect();
        Error::invalid(format!(
            "unknown filter '{name}' (filters: {})",
            names.join(", ")
        ))
    })
}

/// A filter chosen by name with its parameters checked, ready to stack.
#[derive(Debug, Clone, PartialEq)]
pub enum FilterSpec {
    /// [`blocksize`].
    Blocksize(blocksize::BlocksizeConfig),
    /// [`cache`].
    Cache(cache::CacheConfig),
    /// [`cow`].
    Cow(cow::CowConfig),
    /// [`delay`].
    Delay(delay::Delay),
    /// [`error`].
    Error(error::ErrorConfig),
    /// [`fua`].
    Fua(fua::Fua),
    /// [`log`].
    Log(log::LogConfig),
    /// [`multi_conn`].
    MultiConn(multi_conn::MultiConnConfig),
    /// [`noextents`].
    Noextents,
    /// [`nozero`].
    Nozero(nozero::Nozero),
    /// [`offset`].
    Offset(offset::OffsetConfig),
    /// [`partition`].
    Partition(partition::PartitionConfig),
    /// [`rate`].
    Rate(rate::RateConfig),
    /// [`readahead`].
    Readahead,
    /// [`retry`].
    Retry(retry::RetryConfig),
    /// [`stats`].
    Stats(stats::StatsConfig),
    /// [`truncate`].
    Truncate(truncate::TruncateConfig),
}

impl FilterSpec {
    /// The filter `name` with `params` (key, value), applied in order (a
    /// later value of a key replaces an earlier one, as in nbdkit).
    pub fn parse(name: &str, params: &[(String, String)]) -> Result<FilterSpec> {
        let f = info(name)?;
        if let Some((k, _)) = params.iter().find(|(k, _)| !f.keys.contains(&k.as_str())) {
            return Err(Error::invalid(format!("{name}: unknown parameter '{k}'")));
        }
        Ok(match f.name {
            "blocksize" => FilterSpec::Blocksize(blocksize::BlocksizeConfig::from_params(params)?),
            "cache" => FilterSpec::Cache(cache::CacheConfig::from_params(params)?),
            "cow" => FilterSpec::Cow(cow::CowConfig::from_params(params)?),
            "delay" => FilterSpec::Delay(delay::Delay::from_params(params)?),
            "error" => FilterSpec::Error(error::ErrorConfig::from_params(params)?),
            "fua" => FilterSpec::Fua(fua::Fua::from_params(params)?),
            "log" => FilterSpec::Log(log::LogConfig::from_params(params)?),
            "multi-conn" => {
                FilterSpec::MultiConn(multi_conn::MultiConnConfig::from_params(params)?)
            }
            "noextents" => FilterSpec::Noextents,
            "nozero" => FilterSpec::Nozero(nozero::Nozero::from_params(params)?),
            "offset" => FilterSpec::Offset(offset::OffsetConfig::from_params(params)?),
            "partition" => FilterSpec::Partition(partition::PartitionConfig::from_params(params)?),
            "rate" => FilterSpec::Rate(rate::RateConfig::from_params(params)?),
            "readahead" => FilterSpec::Readahead,
            "retry" => FilterSpec::Retry(retry::RetryConfig::from_params(params)?),
            "stats" => FilterSpec::Stats(stats::StatsConfig::from_params(params)?),
            "truncate" => FilterSpec::Truncate(truncate::TruncateConfig::from_params(params)?),
            other => unreachable!("filter {other} is in FILTERS but not here"),
        })
    }

    /// The filter's name.
    pub fn name(&self) -> &'static str {
        match self {
            FilterSpec::Blocksize(_) => "blocksize",
            FilterSpec::Cache(_) => "cache",
            FilterSpec::Cow(_) => "cow",
            FilterSpec::Delay(_) => "delay",
            FilterSpec::Error(_) => "error",
            FilterSpec::Fua(_) => "fua",
            FilterSpec::Log(_) => "log",
            FilterSpec::MultiConn(_) => "multi-conn",
            FilterSpec::Noextents => "noextents",
            FilterSpec::Nozero(_) => "nozero",
            FilterSpec::Offset(_) => "offset",
            FilterSpec::Partition(_) => "partition",
            FilterSpec::Rate(_) => "rate",
            FilterSpec::Readahead => "readahead",
            FilterSpec::Retry(_) => "retry",
            FilterSpec::Stats(_) => "stats",
            FilterSpec::Truncate(_) => "truncate",
        }
    }

    /// Whether the filter never writes to the device below (cow), so that
    /// the device below may be opened read-only, as nbdkit opens it.
    pub fn reads_only_below(&self) -> bool {
        matches!(self, FilterSpec::Cow(_))
    }

    /// Stacks the filter on `next`. `read_only`: the stack will be served
    /// read-only, so the checks of write capabilities that some filters
    /// make (fua, nozero) are skipped, as nbdkit skips them.
    pub fn stack(&self, next: DeviceRef, read_only: bool) -> Result<DeviceRef> {
        fn wrap<F: diskit_core::Filter + 'static>(f: F, next: DeviceRef) -> DeviceRef {
            Arc::new(Filtered::new(f, next))
        }
        Ok(match self {
            FilterSpec::Blocksize(c) => wrap(blocksize::Blocksize::new(&*next, c)?, next),
            FilterSpec::Cache(c) => wrap(cache::Cache::new(&*next, c)?, next),
            FilterSpec::Cow(c) if c.file.is_some() => wrap(cow_file::CowFile::new(&next, c)?, next),
            FilterSpec::Cow(c) => wrap(cow::Cow::new(&*next, c)?, next),
            FilterSpec::Delay(d) => wrap(*d, next),
            FilterSpec::Error(c) => wrap(error::ErrorFilter::new(c.clone()), next),
            FilterSpec::Fua(f) => {
                if !read_only {
                    f.check(&*next)?;
                }
                wrap(*f, next)
            }
            FilterSpec::Log(c) => wrap(log::Log::new(c)?, next),
            FilterSpec::MultiConn(c) => wrap(multi_conn::MultiConn::new(*c), next),
            FilterSpec::Noextents => wrap(noextents::Noextents, next),
            FilterSpec::Nozero(z) => {
                if !read_only {
                    z.check(&*next)?;
                }
                wrap(*z, next)
            }
            FilterSpec::Offset(c) => wrap(offset::Offset::new(&*next, c)?, next),
            FilterSpec::Partition(c) => wrap(partition::window(&*next, c)?, next),
            FilterSpec::Rate(c) => wrap(rate::Rate::new(c), next),
            FilterSpec::Readahead => wrap(readahead::Readahead::new(&next)?, next),
            FilterSpec::Retry(c) => wrap(retry::Retry::new(*c), next),
            FilterSpec::Stats(c) => wrap(stats::Stats::new(c)?, next),
            FilterSpec::Truncate(c) => wrap(truncate::Truncate::new(&*next, c)?, next),
        })
    }
}

/// Stacks `filters` over `device`: the first is the outermost (closest to
/// the client), the last sits directly on `device`.
pub fn stack(filters: &[FilterSpec], device: DeviceRef, read_only: bool) -> Result<DeviceRef> {
    filters
        .iter()
        .rev()
        .try_fold(device, |next, f| f.stack(next, read_only))
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::MemoryDevice;

    fn kv(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

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
        use diskit_backends::{FileDevice, FileOptions};
        use std::os::unix::fs::FileExt;
        let f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 253) as u8).collect();
        std::fs::write(f.path(), &data).unwrap();
        let file: DeviceRef = Arc::new(FileDevice::open(f.path(), FileOptions::default()).unwrap());
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
