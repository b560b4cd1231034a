//! What core's tests share: small devices and requests.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::aio::Request;
use crate::buffer::AlignedBuf;
use crate::device::{BlockDevice, Capabilities};
use crate::error::{Error, ErrorKind, Result};

/// A read-only device of 512 zero bytes that counts its closes, and fails
/// them (with ENOSPC) when told to.
#[derive(Default)]
pub(crate) struct Closing {
    /// Closes so far.
    pub(crate) closes: AtomicUsize,
    /// Whether closes fail.
    pub(crate) fail: bool,
}

impl Closing {
    /// Closes so far.
    pub(crate) fn closes(&self) -> usize {
        self.closes.load(Ordering::SeqCst)
    }
}

impl BlockDevice for Closing {
    fn size(&self) -> u64 {
        512
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::READ_ONLY
    }
    fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn close(&self) -> Result<()> {
        self.closes.fetch_add(1, Ordering::SeqCst);
        if self.fail {
            Err(Error::from_kind(ErrorKind::NoSpace))
        } else {
            Ok(())
        }
    }
}

/// A read of `len` bytes at `offset` into a buffer of `room` bytes.
pub(crate) fn read_request(offset: u64, len: usize, room: usize) -> Request {
    Request::Read {
        offset,
        buf: AlignedBuf::new(room, 4096).unwrap(),
        len,
    }
}
