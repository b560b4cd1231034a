//! Requests submitted through each filter give what its methods give, and
//! the filters that send them below keep the queue depth below.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use diskit_core::aio::{ReadSink, Request};
use diskit_core::{BlockDevice, Result, ZeroFlags};

use crate::testing::{Probe, buf, kv, read, read_request, submit, write_request, zero_request};
use crate::{FilterSpec, stack};

/// Keeps what a read hands over, by offset.
#[derive(Default)]
struct Collect(Mutex<Vec<(u64, Vec<u8>)>>);

impl ReadSink for Collect {
    fn data(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.0.lock().unwrap().push((offset, data.to_vec()));
        Ok(())
    }
    fn zeros(&self, offset: u64, len: u64) -> Result<()> {
        self.data(offset, &vec![0; len as usize])
    }
}

impl Collect {
    /// The bytes of `offset..offset+len` handed over.
    fn bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0xee; len];
        for (at, data) in self.0.lock().unwrap().iter() {
            let start = (at - offset) as usize;
            out[start..start + data.len()].copy_from_slice(data);
        }
        out
    }
}

/// A filter, its parameters, and whether requests stay in flight below.
type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], bool);

#[test]
fn submitted_requests_give_what_the_filters_methods_give() {
    const SIZE: u64 = 4 << 20;
    // (filter, parameters, whether requests stay in flight below).
    let dir = tempfile::tempdir().unwrap();
    let statsfile = dir.path().join("stats");
    let cases: &[Case<'_>] = &[
        ("log", &[], true),
        ("stats", &[("statsfile", statsfile.to_str().unwrap())], true),
        ("noextents", &[], true),
        ("error", &[], true),
        ("rate", &[("rate", "10G")], true),
        ("delay", &[("rdelay", "1ms"), ("wdelay", "1ms")], true),
        ("offset", &[("offset", "1M"), ("range", "2M")], true),
        ("truncate", &[("truncate", "5M")], true),
        ("truncate", &[("truncate", "3M")], true),
        ("nozero", &[], false),
        ("fua", &[], false),
        ("blocksize", &[("minblock", "4k")], false),
        ("cow", &[], false),
        ("cache", &[], false),
    ];
    for &(name, params, below) in cases {
        // Takes submitted requests as an NBD connection does (a queue
        // depth above 1), and counts them.
        let queued = Arc::new(Probe::new(SIZE).patterned(SIZE));
        let spec = FilterSpec::parse(name, &kv(params)).unwrap();
        let dev = stack(&[spec], queued.clone(), false).unwrap();
        let what = format!("{name} {params:?}");
        assert_eq!(dev.queue_depth(), if below { 8 } else { 1 }, "{what}");
        let size = dev.size();
        // Across the end of what lies below, where there is such a place.
        let (at, len) = (size - 6000, 6000usize);
        let want = read(&*dev, at, len);

        let c = submit(&*dev, read_request(at, len));
        c.result.unwrap();
        assert_eq!(&c.buf.unwrap()[..len], &want[..], "{what}: read");

        let sink = Arc::new(Collect::default());
        let c = submit(
            &*dev,
            Request::ReadTo {
                offset: at,
                buf: buf(&vec![0; len]),
                len,
                sink: sink.clone(),
            },
        );
        c.result.unwrap();
        assert_eq!(sink.bytes(at, len), want, "{what}: read to a sink");

        let data = vec![0x5a; 3000];
        let c = submit(&*dev, write_request(8192, &data));
        c.result.unwrap();
        assert_eq!(read(&*dev, 8192, 3000), data, "{what}: write");

        let c = submit(&*dev, zero_request(8192, 1000, ZeroFlags::default()));
        c.result.unwrap();
        assert_eq!(read(&*dev, 8192, 1000), vec![0; 1000], "{what}: zero");

        let sent = queued.submitted.load(Ordering::SeqCst);
        assert_eq!(sent > 0, below, "{what}: {sent} submitted below");
    }
}
