//! Requests submitted without waiting: the asynchronous side of a device.
//!
//! A caller hands a [`Request`] that owns its buffer to
//! [`BlockDevice::submit`](crate::BlockDevice::submit) with a tag and a
//! [`CompletionQueue`], and later takes [`Completion`]s (tag, result, the
//! buffer back) from the queue in the order they finish. One thread can so
//! keep many requests in flight. A device that can (an NBD connection)
//! sends the request and returns at once; every other device runs it
//! before `submit` returns (the default), which is always correct.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use crate::buffer::AlignedBuf;
use crate::device::{BlockDevice, WriteFlags, ZeroFlags};
use crate::error::Result;
use crate::sync::lock;

/// One operation, owning what it needs while in flight.
pub enum Request {
    /// Reads `len` bytes at `offset` into the start of `buf`.
    Read {
        /// Device offset.
        offset: u64,
        /// Where the bytes go (at least `len` long).
        buf: AlignedBuf,
        /// Bytes to read.
        len: usize,
    },
    /// Writes `buf[range]` at `offset`.
    Write {
        /// Device offset.
        offset: u64,
        /// The bytes, of which `range` is written.
        buf: AlignedBuf,
        /// The part of `buf` to write.
        range: Range<usize>,
        /// Write flags.
        flags: WriteFlags,
    },
    /// Reads `len` bytes at `offset` into the start of `buf` and hands
    /// them to `sink` in the thread that receives them, while they are
    /// still in its cache (a device that reads on threads of its own, an
    /// NBD connection's, delivers them there); the completion comes after
    /// the sink took them all. A copy moves data on to its destination
    /// this way without a hop to another thread.
    ReadTo {
        /// Device offset.
        offset: u64,
        /// Room for the bytes on the way (at least `len` long). A device
        /// that hands them over from buffers of its own (NBD: one per
        /// connection, which stays in cache) leaves it untouched; what it
        /// holds after the read is unspecified.
        buf: AlignedBuf,
        /// Bytes to read.
        len: usize,
        /// Who takes the bytes.
        sink: Arc<dyn ReadSink>,
    },
    /// Makes `len` bytes at `offset` read as zeros.
    Zero {
        /// Device offset.
        offset: u64,
        /// Bytes to zero.
        len: u64,
        /// Zero flags.
        flags: ZeroFlags,
    },
}

impl Request {
    /// The bytes of the device the request covers: `(offset, length)`.
    pub fn span(&self) -> (u64, u64) {
        match self {
            Request::Read { offset, len, .. } | Request::ReadTo { offset, len, .. } => {
                (*offset, *len as u64)
            }
            Request::Write { offset, range, .. } => (*offset, range.len() as u64),
            Request::Zero { offset, len, .. } => (*offset, *len),
        }
    }

    /// The same request at `to` instead (a filter that maps offsets sends
    /// it on so); the sink of a [`ReadTo`](Request::ReadTo) still gets the
    /// offsets it asked for.
    pub fn moved_to(self, to: u64) -> Request {
        match self {
            Request::Read { buf, len, .. } => Request::Read {
                offset: to,
                buf,
                len,
            },
            Request::Write {
                buf, range, flags, ..
            } => Request::Write {
                offset: to,
                buf,
                range,
                flags,
            },
            Request::ReadTo {
                offset,
                buf,
                len,
                sink,
            } => Request::ReadTo {
                offset: to,
                buf,
                len,
                sink: Arc::new(MovedSink {
                    sink,
                    asked: offset,
                    at: to,
                }),
            },
            Request::Zero { len, flags, .. } => Request::Zero {
                offset: to,
                len,
                flags,
            },
        }
    }

    /// The request finished, unstarted, with `result` (an error): its
    /// buffer is given back.
    pub fn fail(self, tag: u64, result: Result<()>) -> Completion {
        let buf = match self {
            Request::Read { buf, .. }
            | Request::ReadTo { buf, .. }
            | Request::Write { buf, .. } => Some(buf),
            Request::Zero { .. } => None,
        };
        Completion { tag, result, buf }
    }
}

/// Takes the bytes of a [`Request::ReadTo`] as they arrive, in whatever
/// thread receives them; calls for different parts of one read, and for
/// different reads, may come at once from several threads.
pub trait ReadSink: Send + Sync {
    /// `data` is what the device holds at `offset` (all or part of the read).
    fn data(&self, offset: u64, data: &[u8]) -> Result<()>;

    /// The `len` bytes at `offset` read as zeros: the device said so
    /// without sending them (an NBD hole chunk).
    fn zeros(&self, offset: u64, len: u64) -> Result<()>;

    /// The bytes are not wanted (a destination that discards its writes):
    /// a device may drop them unseen, without copying them to memory.
    fn discards(&self) -> bool {
        false
    }
}

/// A sink that was asked for bytes at `asked` of a device whose layer
/// below reads them at `at`.
struct MovedSink {
    sink: Arc<dyn ReadSink>,
    asked: u64,
    at: u64,
}

impl MovedSink {
    fn back(&self, offset: u64) -> u64 {
        offset - self.at + self.asked
    }
}

impl ReadSink for MovedSink {
    fn data(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.sink.data(self.back(offset), data)
    }
    fn zeros(&self, offset: u64, len: u64) -> Result<()> {
        self.sink.zeros(self.back(offset), len)
    }
    fn discards(&self) -> bool {
        self.sink.discards()
    }
}

/// A finished request: its tag, its result and its buffer, if it had one.
pub struct Completion {
    /// The tag given at submission.
    pub tag: u64,
    /// Whether the request succeeded.
    pub result: Result<()>,
    /// The request's buffer, given back (reads: filled).
    pub buf: Option<AlignedBuf>,
}

#[derive(Default)]
struct Inner {
    done: Mutex<Done>,
    ready: Condvar,
}

#[derive(Default)]
struct Done {
    queue: VecDeque<Completion>,
    /// How many completions the waiter waits for (0: nobody waits): it
    /// is woken when that many are there, not at each one.
    want: usize,
}

/// Where completions arrive; cloning gives another handle to the same queue.
#[derive(Clone, Default)]
pub struct CompletionQueue {
    inner: Arc<Inner>,
    /// Shown the completion pushed through this handle before it is
    /// queued, the last first (see [`watched`](Self::watched)).
    watchers: Vec<Arc<Watcher>>,
}

/// What a [`CompletionQueue::watched`] handle calls with the completion
/// of the one request it was made for.
type Watch = Box<dyn FnOnce(&Completion) + Send>;

/// A [`Watch`] until it is called.
struct Watcher(Mutex<Option<Watch>>);

impl CompletionQueue {
    /// An empty queue.
    pub fn new() -> CompletionQueue {
        CompletionQueue::default()
    }

    /// A handle to the same queue for one request: `watch` is shown its
    /// completion before it is queued (and before what the handle this
    /// one was made from watches). A filter that only looks at requests
    /// (a log) sends them below with such a handle, so that they stay in
    /// flight there.
    pub fn watched(&self, watch: impl FnOnce(&Completion) + Send + 'static) -> CompletionQueue {
        let mut watchers = self.watchers.clone();
        watchers.push(Arc::new(Watcher(Mutex::new(Some(Box::new(watch))))));
        CompletionQueue {
            inner: self.inner.clone(),
            watchers,
        }
    }

    /// Delivers a completion (called by devices).
    pub fn push(&self, c: Completion) {
        for w in self.watchers.iter().rev() {
            if let Some(watch) = lock(&w.0).take() {
                watch(&c);
            }
        }
        let mut d = lock(&self.inner.done);
        d.queue.push_back(c);
        let wake = d.want > 0 && d.queue.len() >= d.want;
        drop(d);
        if wake {
            self.inner.ready.notify_one();
        }
    }

    /// Waits for the next completion. The caller must have a request in
    /// flight, or this waits forever.
    pub fn wait(&self) -> Completion {
        let mut d = lock(&self.inner.done);
        loop {
            if let Some(c) = d.queue.pop_front() {
                d.want = 0;
                return c;
            }
            d.want = 1;
            d = self.inner.ready.wait(d).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits until at least `n` completions are there, then moves all
    /// there are to `out`. `n` must be at least 1 and no more than the
    /// requests in flight, or this waits forever. One wake-up serves many
    /// completions: a caller that keeps a deep queue of requests refills
    /// it in bursts, and does not take a processor from the threads doing
    /// the I/O at each one.
    pub fn wait_many(&self, n: usize, out: &mut Vec<Completion>) {
        let n = n.max(1);
        let mut d = lock(&self.inner.done);
        while d.queue.len() < n {
            d.want = n;
            d = self.inner.ready.wait(d).unwrap_or_else(|p| p.into_inner());
        }
        d.want = 0;
        out.extend(d.queue.drain(..));
    }

    /// The next completion if one is there.
    pub fn try_pop(&self) -> Option<Completion> {
        lock(&self.inner.done).queue.pop_front()
    }
}

/// Runs `req` on `dev` synchronously: the default `submit`.
pub fn run<D: BlockDevice + ?Sized>(dev: &D, tag: u64, req: Request) -> Completion {
    match req {
        Request::Read {
            offset,
            mut buf,
            len,
        } => {
            let result = match buf.get_mut(..len) {
                Some(b) => dev.read_at(b, offset),
                None => Err(crate::Error::invalid("read longer than its buffer")),
            };
            Completion {
                tag,
                result,
                buf: Some(buf),
            }
        }
        Request::Write {
            offset,
            buf,
            range,
            flags,
        } => {
            let result = match buf.get(range) {
                Some(b) => dev.write_at(b, offset, flags),
                None => Err(crate::Error::invalid("write outside its buffer")),
            };
            Completion {
                tag,
                result,
                buf: Some(buf),
            }
        }
        Request::ReadTo {
            offset,
            mut buf,
            len,
            sink,
        } => {
            let result = match buf.get_mut(..len) {
                Some(b) => dev
                    .read_at(b, offset)
                    .and_then(|()| hand_over(&*sink, offset, b)),
                None => Err(crate::Error::invalid("read longer than its buffer")),
            };
            Completion {
                tag,
                result,
                buf: Some(buf),
            }
        }
        Request::Zero { offset, len, flags } => Completion {
            tag,
            result: dev.write_zeroes(offset, len, flags),
            buf: None,
        },
    }
}

/// Hands the bytes read at `offset` to `sink`, unless it discards them.
pub fn hand_over(sink: &dyn ReadSink, offset: u64, data: &[u8]) -> Result<()> {
    if sink.discards() {
        return Ok(());
    }
    sink.data(offset, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{BlockDevice, Capabilities};
    use crate::testing::read_request;
    use std::sync::Mutex;

    struct Ones;
    impl BlockDevice for Ones {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::IN_MEMORY.read_only()
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            buf.fill(1);
            Ok(())
        }
    }

    /// Records what it is handed.
    #[derive(Default)]
    struct Recorder {
        got: Mutex<Vec<(u64, Vec<u8>)>>,
        discard: bool,
    }
    impl ReadSink for Recorder {
        fn data(&self, offset: u64, data: &[u8]) -> Result<()> {
            lock(&self.got).push((offset, data.to_vec()));
            Ok(())
        }
        fn zeros(&self, offset: u64, len: u64) -> Result<()> {
            lock(&self.got).push((offset, vec![0; len as usize]));
            Ok(())
        }
        fn discards(&self) -> bool {
            self.discard
        }
    }

    /// A read of `len` bytes at `offset` handed to `sink`, through a
    /// buffer of `room` bytes.
    fn read_to(offset: u64, len: usize, room: usize, sink: &Arc<Recorder>) -> Request {
        Request::ReadTo {
            offset,
            buf: AlignedBuf::new(room, 4096).unwrap(),
            len,
            sink: sink.clone(),
        }
    }

    #[test]
    fn default_read_to_hands_the_bytes_over_before_completing() {
        let cq = CompletionQueue::new();
        for discard in [false, true] {
            let sink = Arc::new(Recorder {
                discard,
                ..Recorder::default()
            });
            Ones.submit(3, read_to(4096, 4096, 8192, &sink), &cq);
            let c = cq.try_pop().expect("completed inline");
            c.result.unwrap();
            let got = lock(&sink.got);
            if discard {
                assert!(got.is_empty());
            } else {
                assert_eq!(got.len(), 1);
                assert_eq!(got[0].0, 4096);
                assert_eq!(got[0].1, vec![1u8; 4096]);
            }
        }
        // A read longer than its buffer fails, and nothing is handed over.
        let sink = Arc::new(Recorder::default());
        Ones.submit(4, read_to(0, 8192, 4096, &sink), &cq);
        assert!(cq.wait().result.is_err());
        assert!(lock(&sink.got).is_empty());
    }

    #[test]
    fn wait_many_wakes_when_enough_are_there() {
        let cq = CompletionQueue::new();
        let pusher = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                for tag in 0..5 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    cq.push(Completion {
                        tag,
                        result: Ok(()),
                        buf: None,
                    });
                }
            })
        };
        let mut out = Vec::new();
        cq.wait_many(3, &mut out);
        assert!(out.len() >= 3, "{}", out.len());
        pusher.join().unwrap();
        if out.len() < 5 {
            cq.wait_many(1, &mut out);
        }
        let tags: Vec<u64> = out.iter().map(|c| c.tag).collect();
        assert_eq!(tags, vec![0, 1, 2, 3, 4]);
        // A single wait after a batched one still wakes.
        let pusher = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(5));
                cq.push(Completion {
                    tag: 9,
                    result: Ok(()),
                    buf: None,
                })
            })
        };
        assert_eq!(cq.wait().tag, 9);
        pusher.join().unwrap();
    }

    #[test]
    fn watched_handles_show_the_completion_first_innermost_first() {
        let cq = CompletionQueue::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (outer, inner) = (seen.clone(), seen.clone());
        let outer_handle = cq.watched(move |c| lock(&outer).push(("outer", c.tag)));
        let handle = outer_handle.watched(move |c| lock(&inner).push(("inner", c.tag)));
        Ones.submit(
            5,
            Request::Zero {
                offset: 0,
                len: 512,
                flags: ZeroFlags::default(),
            },
            &handle,
        );
        assert_eq!(*lock(&seen), [("inner", 5), ("outer", 5)]);
        assert_eq!(cq.wait().tag, 5, "queued where the caller waits");
        // Each watch sees its one request only.
        handle.push(Completion {
            tag: 6,
            result: Ok(()),
            buf: None,
        });
        assert_eq!(lock(&seen).len(), 2);
        assert_eq!(cq.wait().tag, 6);
    }

    #[test]
    fn default_submit_completes_at_once_with_the_buffer() {
        let cq = CompletionQueue::new();
        Ones.submit(7, read_request(0, 4096, 8192), &cq);
        let c = cq.try_pop().expect("completed inline");
        assert_eq!(c.tag, 7);
        c.result.unwrap();
        let b = c.buf.unwrap();
        assert!(b[..4096].iter().all(|&x| x == 1));
        assert!(b[4096..].iter().all(|&x| x == 0));
        // Writes to a read-only device fail through the completion.
        let buf = AlignedBuf::new(512, 512).unwrap();
        Ones.submit(
            8,
            Request::Write {
                offset: 0,
                buf,
                range: 0..512,
                flags: WriteFlags::NONE,
            },
            &cq,
        );
        let c = cq.wait();
        assert_eq!(c.tag, 8);
        assert!(c.result.is_err());
        assert!(c.buf.is_some());
    }

    #[test]
    fn a_read_longer_than_its_buffer_fails() {
        let cq = CompletionQueue::new();
        Ones.submit(1, read_request(0, 1024, 512), &cq);
        assert!(cq.wait().result.is_err());
    }
}
