//! `diskit._diskit`: diskit's NBD client for Python. The libnbd-shaped
//! API (`diskit.nbd`, nbdsh) is written in Python over this module, which
//! does the work: connecting (a URI, a Unix socket, TCP, a command on its
//! standard input or with socket activation), synchronous requests with
//! the GIL released, and asynchronous ones through the client's own
//! request queue, whose completions are announced on a pipe (the handle's
//! `aio_get_fd`).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use diskit_core::buffer::AlignedBuf;
use diskit_core::{BlockDevice, CompletionQueue, Request, WriteFlags, ZeroFlags};
use diskit_nbd::client::NbdClient;
use diskit_nbd::client::options::OptionPhase;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

create_exception!(
    _diskit,
    Error,
    PyException,
    "A failed call: (message, errno)."
);

/// A Python error for a diskit error: its message and errno.
fn err(e: diskit_core::Error) -> PyErr {
    Error::new_err((e.to_string(), e.kind().errno()))
}

fn closed() -> PyErr {
    Error::new_err(("the handle is not connected".to_string(), libc::ENOTCONN))
}

/// A finished asynchronous request: its tag, its errno (0: done) and, for
/// a read, the bytes.
type Done = (u64, i32, Option<Vec<u8>>);

/// The completions not yet taken, and the pipe that says there are some.
struct Finished {
    queue: Mutex<VecDeque<Done>>,
    ready: Condvar,
    signal: Mutex<UnixStream>,
    watch: UnixStream,
}

impl Finished {
    fn push(&self, d: Done) {
        diskit_core::sync::lock(&self.queue).push_back(d);
        self.ready.notify_all();
        let _ = diskit_core::sync::lock(&self.signal).write(&[1]);
    }
}

/// The tag that tells the forwarding thread to stop.
const STOP: u64 = u64::MAX;

/// A connection to an NBD server.
#[pyclass(frozen)]
struct Client {
    client: RwLock<Option<Arc<NbdClient>>>,
    cq: CompletionQueue,
    finished: Arc<Finished>,
}

impl Client {
    fn new(client: NbdClient) -> PyResult<Client> {
        let (watch, signal) = UnixStream::pair().map_err(|e| err(e.into()))?;
        watch.set_nonblocking(true).map_err(|e| err(e.into()))?;
        signal.set_nonblocking(true).map_err(|e| err(e.into()))?;
        let finished = Arc::new(Finished {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            signal: Mutex::new(signal),
            watch,
        });
        let cq = CompletionQueue::new();
        // Completions move from the client's queue to the finished list,
        // each announced on the pipe, until the handle closes.
        let (from, to) = (cq.clone(), finished.clone());
        std::thread::spawn(move || {
            loop {
                let c = from.wait();
                if c.tag == STOP {
                    break;
                }
                let (errno, data) = match c.result {
                    Ok(()) => (0, c.buf.map(|b| b[..].to_vec())),
                    Err(e) => (e.kind().errno(), None),
                };
                to.push((c.tag, errno, data));
            }
        });
        Ok(Client {
            client: RwLock::new(Some(Arc::new(client))),
            cq,
            finished,
        })
    }

    fn get(&self) -> PyResult<Arc<NbdClient>> {
        self.client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(closed)
    }
}

fn contexts(names: &[String]) -> Vec<&str> {
    names.iter().map(String::as_str).collect()
}

#[pymethods]
impl Client {
    /// Connects to the export an NBD URI names.
    #[staticmethod]
    fn connect_uri(py: Python<'_>, uri: String, contexts_: Vec<String>) -> PyResult<Client> {
        let c = py
            .detach(|| NbdClient::connect_with(&uri, &contexts(&contexts_)))
            .map_err(err)?;
        Client::new(c)
    }

    /// Runs `argv` as a server on its standard input and output
    /// (`nbd_connect_command`) and connects to `export`.
    #[staticmethod]
    fn connect_command(
        py: Python<'_>,
        argv: Vec<String>,
        export: String,
        contexts_: Vec<String>,
    ) -> PyResult<Client> {
        let c = py
            .detach(|| NbdClient::connect_stdio_command(&argv, &export, &contexts(&contexts_)))
            .map_err(err)?;
        Client::new(c)
    }

    /// Runs `argv` as a socket-activated server
    /// (`nbd_connect_systemd_socket_activation`) and connects to `export`.
    #[staticmethod]
    fn connect_socket_activation(
        py: Python<'_>,
        argv: Vec<String>,
        export: String,
        contexts_: Vec<String>,
    ) -> PyResult<Client> {
        let c = py
            .detach(|| NbdClient::connect_command_to(&argv, &export, &contexts(&contexts_)))
            .map_err(err)?;
        Client::new(c)
    }

    /// The export's size.
    fn size(&self) -> PyResult<u64> {
        Ok(self.get()?.size())
    }

    /// The transmission flags the server sent.
    fn flags(&self) -> PyResult<u16> {
        Ok(self.get()?.flags())
    }

    /// Whether structured replies were negotiated.
    fn structured(&self) -> PyResult<bool> {
        Ok(self.get()?.structured_replies())
    }

    /// Whether extended headers were negotiated.
    fn extended(&self) -> PyResult<bool> {
        Ok(self.get()?.extended_headers())
    }

    /// Whether the server agreed to the metadata context `name`.
    fn offers_context(&self, name: &str) -> PyResult<bool> {
        Ok(self.get()?.offers_context(name))
    }

    /// Reads `count` bytes at `offset`.
    fn pread<'py>(
        &self,
        py: Python<'py>,
        count: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let c = self.get()?;
        let mut buf = vec![0u8; count];
        py.detach(|| c.read_at(&mut buf, offset)).map_err(err)?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Writes `data` at `offset`.
    fn pwrite(&self, py: Python<'_>, data: PyBackedBytes, offset: u64, fua: bool) -> PyResult<()> {
        let c = self.get()?;
        let flags = WriteFlags { fua };
        py.detach(|| c.write_at(&data, offset, flags)).map_err(err)
    }

    /// Zeroes `count` bytes at `offset`.
    fn zero(
        &self,
        py: Python<'_>,
        count: u64,
        offset: u64,
        fua: bool,
        may_trim: bool,
        fast: bool,
    ) -> PyResult<()> {
        let c = self.get()?;
        let flags = ZeroFlags {
            fua,
            may_trim,
            fast,
        };
        py.detach(|| c.write_zeroes(offset, count, flags))
            .map_err(err)
    }

    /// Trims `count` bytes at `offset`.
    fn trim(&self, py: Python<'_>, count: u64, offset: u64, fua: bool) -> PyResult<()> {
        let c = self.get()?;
        py.detach(|| c.trim(offset, count, WriteFlags { fua }))
            .map_err(err)
    }

    /// Flushes.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.get()?;
        py.detach(|| c.flush()).map_err(err)
    }

    /// Asks the server to cache `count` bytes at `offset`.
    fn cache(&self, py: Python<'_>, count: u64, offset: u64) -> PyResult<()> {
        let c = self.get()?;
        py.detach(|| c.cache(offset, count)).map_err(err)
    }

    /// The server's block status for `context` from `offset`, as it sent
    /// it: (length, flags) pairs.
    fn block_status(
        &self,
        py: Python<'_>,
        context: String,
        count: u64,
        offset: u64,
        flags: u16,
    ) -> PyResult<Vec<(u64, u32)>> {
        let c = self.get()?;
        py.detach(|| c.block_status_as_sent(&context, offset, count, flags))
            .map_err(err)
    }

    /// Starts reading `count` bytes at `offset`; its completion comes
    /// with `tag`.
    fn submit_pread(&self, tag: u64, count: usize, offset: u64) -> PyResult<()> {
        let c = self.get()?;
        if count == 0 {
            self.finished.push((tag, 0, Some(Vec::new())));
            return Ok(());
        }
        let buf = AlignedBuf::new(count, 4096).map_err(err)?;
        c.submit(
            tag,
            Request::Read {
                offset,
                buf,
                len: count,
            },
            &self.cq,
        );
        Ok(())
    }

    /// Starts writing `data` at `offset`.
    fn submit_pwrite(&self, tag: u64, data: PyBackedBytes, offset: u64, fua: bool) -> PyResult<()> {
        let c = self.get()?;
        if data.is_empty() {
            self.finished.push((tag, 0, None));
            return Ok(());
        }
        let mut buf = AlignedBuf::new(data.len(), 4096).map_err(err)?;
        buf[..data.len()].copy_from_slice(&data);
        c.submit(
            tag,
            Request::Write {
                offset,
                buf,
                range: 0..data.len(),
                flags: WriteFlags { fua },
            },
            &self.cq,
        );
        Ok(())
    }

    /// Starts zeroing `count` bytes at `offset`.
    fn submit_zero(
        &self,
        tag: u64,
        count: u64,
        offset: u64,
        fua: bool,
        may_trim: bool,
        fast: bool,
    ) -> PyResult<()> {
        let c = self.get()?;
        let flags = ZeroFlags {
            fua,
            may_trim,
            fast,
        };
        c.submit(
            tag,
            Request::Zero {
                offset,
                len: count,
                flags,
            },
            &self.cq,
        );
        Ok(())
    }

    /// Records a request done at once (flush, trim, cache: the client
    /// runs them synchronously) as finished with `errno`.
    fn finish(&self, tag: u64, errno: i32) {
        self.finished.push((tag, errno, None));
    }

    /// The descriptor that is readable while completions wait to be
    /// taken.
    fn event_fd(&self) -> i32 {
        self.finished.watch.as_raw_fd()
    }

    /// Waits up to `timeout_ms` (-1: for ever) for a completion.
    fn wait(&self, py: Python<'_>, timeout_ms: i64) -> bool {
        let f = self.finished.clone();
        py.detach(move || {
            let q = diskit_core::sync::lock(&f.queue);
            if !q.is_empty() {
                return true;
            }
            if timeout_ms < 0 {
                let q = f
                    .ready
                    .wait_while(q, |q| q.is_empty())
                    .unwrap_or_else(|e| e.into_inner());
                !q.is_empty()
            } else {
                let (q, _) = f
                    .ready
                    .wait_timeout_while(q, Duration::from_millis(timeout_ms as u64), |q| {
                        q.is_empty()
                    })
                    .unwrap_or_else(|e| e.into_inner());
                !q.is_empty()
            }
        })
    }

    /// Takes the completions that have come: (tag, errno, bytes).
    fn take<'py>(&self, py: Python<'py>) -> Vec<(u64, i32, Option<Bound<'py, PyBytes>>)> {
        let mut drain = [0u8; 256];
        while matches!((&self.finished.watch).read(&mut drain), Ok(n) if n > 0) {}
        let done: Vec<Done> = diskit_core::sync::lock(&self.finished.queue)
            .drain(..)
            .collect();
        done.into_iter()
            .map(|(tag, errno, data)| (tag, errno, data.map(|d| PyBytes::new(py, &d))))
            .collect()
    }

    /// Closes the connection (the server it ran, if any, is stopped).
    fn close(&self, py: Python<'_>) {
        let taken = self
            .client
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(c) = taken {
            py.detach(|| {
                let _ = c.close();
                drop(c);
            });
            self.cq.push(diskit_core::Completion {
                tag: STOP,
                result: Ok(()),
                buf: None,
            });
        }
    }

    /// Whether the handle is closed.
    fn is_closed(&self) -> bool {
        self.client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.cq.push(diskit_core::Completion {
            tag: STOP,
            result: Ok(()),
            buf: None,
        });
    }
}

/// One run of a map: offset, length, data, zero, depth.
type Run = (u64, u64, bool, bool, u32);

/// An image of any format diskit reads, over any storage the opener
/// knows (a file, an NBD URI, http, rbd:, s3://, a `json:` description).
#[pyclass(frozen)]
struct Image {
    image: RwLock<Option<Arc<diskit_open::Image>>>,
    format: String,
}

impl Image {
    fn get(&self) -> PyResult<Arc<diskit_open::Image>> {
        self.image
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::new_err(("the image is closed".to_string(), libc::EBADF)))
    }
}

#[pymethods]
impl Image {
    /// Opens `name` (its format probed unless given), for writing when
    /// `writable`.
    #[new]
    #[pyo3(signature = (name, format=None, writable=false))]
    fn open(
        py: Python<'_>,
        name: String,
        format: Option<String>,
        writable: bool,
    ) -> PyResult<Image> {
        let format = format
            .map(|f| diskit_open::Format::from_name(&f))
            .transpose()
            .map_err(err)?;
        let opts = diskit_open::OpenOptions {
            writable,
            ..Default::default()
        };
        let image = py
            .detach(|| diskit_open::open_image(&name, format, opts))
            .map_err(err)?;
        Ok(Image {
            format: image.format.name().to_string(),
            image: RwLock::new(Some(Arc::new(image))),
        })
    }

    /// The image's format.
    #[getter]
    fn format(&self) -> String {
        self.format.clone()
    }

    /// The guest-visible size.
    #[getter]
    fn size(&self) -> PyResult<u64> {
        Ok(self.get()?.virtual_size())
    }

    /// The backing chain's file names, this image's first.
    fn chain(&self) -> PyResult<Vec<String>> {
        Ok(self
            .get()?
            .chain()
            .iter()
            .map(|i| i.filename.display().to_string())
            .collect())
    }

    /// Reads `count` bytes at `offset`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        count: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let img = self.get()?;
        let mut buf = vec![0u8; count];
        py.detach(|| img.device.read_at(&mut buf, offset))
            .map_err(err)?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Writes `data` at `offset`.
    #[pyo3(signature = (data, offset, fua=false))]
    fn write(&self, py: Python<'_>, data: PyBackedBytes, offset: u64, fua: bool) -> PyResult<()> {
        let img = self.get()?;
        py.detach(|| img.device.write_at(&data, offset, WriteFlags { fua }))
            .map_err(err)
    }

    /// Makes `count` bytes at `offset` read as zeros.
    #[pyo3(signature = (count, offset, may_trim=true))]
    fn zero(&self, py: Python<'_>, count: u64, offset: u64, may_trim: bool) -> PyResult<()> {
        let img = self.get()?;
        let flags = ZeroFlags {
            may_trim,
            ..Default::default()
        };
        py.detach(|| img.device.write_zeroes(offset, count, flags))
            .map_err(err)
    }

    /// Makes what was written durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let img = self.get()?;
        py.detach(|| img.device.flush()).map_err(err)
    }

    /// The allocation from `offset` for `length` bytes (to the end when
    /// None): (offset, length, data, zero, depth) runs, as qemu-img map
    /// describes them.
    #[pyo3(signature = (offset=0, length=None))]
    fn map(&self, py: Python<'_>, offset: u64, length: Option<u64>) -> PyResult<Vec<Run>> {
        let img = self.get()?;
        let end = length.map_or(img.virtual_size(), |l| offset.saturating_add(l));
        py.detach(|| {
            let mut out = Vec::new();
            let mut at = offset;
            while at < end {
                for e in img.device.extents(at, end - at)? {
                    out.push((at, e.length, e.flags.data, e.flags.zero, e.depth));
                    at += e.length;
                }
            }
            Ok(out)
        })
        .map_err(err)
    }

    /// Writes the image's metadata back and closes it.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.image.write().unwrap_or_else(|e| e.into_inner()).take();
        match taken {
            Some(img) => py.detach(|| img.close()).map_err(err),
            None => Ok(()),
        }
    }
}

/// A connection in the option phase (libnbd's option mode): options one
/// at a time until `go` enters transmission (a `Client`) or `abort`
/// leaves.
#[pyclass(frozen)]
struct Options {
    phase: Mutex<Option<OptionPhase>>,
}

impl Options {
    fn new(phase: OptionPhase) -> Options {
        Options {
            phase: Mutex::new(Some(phase)),
        }
    }

    /// Runs `f` on the phase, the GIL released.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut OptionPhase) -> diskit_core::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut g = diskit_core::sync::lock(&self.phase);
            let phase = g.as_mut().ok_or_else(closed)?;
            f(phase).map_err(err)
        })
    }
}

#[pymethods]
impl Options {
    /// Connects to the server a URI names, greets it and asks for
    /// structured replies when `structured`.
    #[staticmethod]
    fn connect_uri(py: Python<'_>, uri: String, structured: bool) -> PyResult<Options> {
        let p = py
            .detach(|| OptionPhase::connect_uri(&uri, structured))
            .map_err(err)?;
        Ok(Options::new(p))
    }

    /// Runs `argv` as a server on its standard input and output.
    #[staticmethod]
    fn connect_command(py: Python<'_>, argv: Vec<String>, structured: bool) -> PyResult<Options> {
        let p = py
            .detach(|| OptionPhase::stdio_command(&argv, structured))
            .map_err(err)?;
        Ok(Options::new(p))
    }

    /// Runs `argv` as a socket-activated server.
    #[staticmethod]
    fn connect_socket_activation(
        py: Python<'_>,
        argv: Vec<String>,
        structured: bool,
    ) -> PyResult<Options> {
        let p = py
            .detach(|| OptionPhase::socket_activation(&argv, structured))
            .map_err(err)?;
        Ok(Options::new(p))
    }

    /// The protocol the server speaks.
    fn protocol(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, |p| Ok(p.protocol()))
    }

    /// Whether structured replies were negotiated.
    fn structured(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |p| Ok(p.structured()))
    }

    /// The exports the server lists: (name, description) pairs.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        self.with(py, |p| p.list())
    }

    /// The metadata contexts of `export` that `queries` name.
    fn list_meta_contexts(
        &self,
        py: Python<'_>,
        export: String,
        queries: Vec<String>,
    ) -> PyResult<Vec<String>> {
        self.with(py, |p| p.list_meta_contexts(&export, &contexts(&queries)))
    }

    /// `export`'s size, transmission flags and the contexts agreed to of
    /// `contexts_`.
    fn info(
        &self,
        py: Python<'_>,
        export: String,
        contexts_: Vec<String>,
    ) -> PyResult<(u64, u16, Vec<String>)> {
        let a = self.with(py, |p| p.info(&export, &contexts(&contexts_)))?;
        Ok((a.info.size, a.info.flags, a.contexts.into_keys().collect()))
    }

    /// Enters transmission on `export`; a refusal leaves the phase as it
    /// was.
    fn go(&self, py: Python<'_>, export: String, contexts_: Vec<String>) -> PyResult<Client> {
        let client = py.detach(|| {
            let mut g = diskit_core::sync::lock(&self.phase);
            let phase = g.take().ok_or_else(closed)?;
            phase
                .go(&export, &contexts(&contexts_))
                .map_err(|(back, e)| {
                    *g = back.map(|b| *b);
                    err(e)
                })
        })?;
        Client::new(client)
    }

    /// Leaves without transmission (NBD_OPT_ABORT).
    fn abort(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(p) = diskit_core::sync::lock(&self.phase).take() {
                p.abort();
            }
        })
    }

    /// Whether the connection is gone (aborted, or entered transmission).
    fn is_closed(&self) -> bool {
        diskit_core::sync::lock(&self.phase).is_none()
    }
}

/// The module.
#[pymodule]
fn _diskit(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<Options>()?;
    m.add_class::<Image>()?;
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
