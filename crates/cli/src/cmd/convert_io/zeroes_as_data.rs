//! `convert -S 0`: every byte of the target is written, zeros as data.
//! As qemu-img, which with a minimum sparse size of 0 turns the source's
//! zero ranges into buffers of zeros and writes them: the target ends up
//! allocated everywhere, whatever its format does with zero requests.

use diskit_core::{BlockDevice, Filter, Request, Result, Route, ZeroFlags};

/// A layer over the target that writes zero requests as zero data.
pub struct ZeroesAsData;

impl Filter for ZeroesAsData {
    fn name(&self) -> &str {
        "zeroes-as-data"
    }
    fn write_zeroes(
        &self,
        next: &dyn BlockDevice,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<()> {
        // Writing zeros is never the fast kind of zeroing.
        if flags.fast {
            return Err(diskit_core::Error::from_kind(
                diskit_core::ErrorKind::NotSupported,
            ));
        }
        diskit_core::device::write_zero_buffer(next, offset, len, flags.fua)
    }
    fn submits_below(&self) -> bool {
        true
    }
    /// Reads and writes go below as they are, where they stay in flight;
    /// zero requests become writes here.
    fn route(&self, _next: &dyn BlockDevice, req: Request) -> Route {
        match req {
            Request::Zero { .. } => Route::Here(req),
            _ => Route::Below(req),
        }
    }
}
