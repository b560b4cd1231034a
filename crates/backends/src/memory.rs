//! A sparse RAM disk: an anonymous in-memory file (memfd), read and written
//! through the file backend. The kernel keeps its pages (4 KiB each,
//! allocated on first write, freed again by trim and zeroing) with no lock
//! of ours around I/O, and, being a file, it can hand its bytes to a socket
//! without a copy (see [`BlockDevice::file_view`]).

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::Path;

use diskit_core::{
    BlockDevice, Capabilities, Error, Extent, FileView, Result, WriteFlags, ZeroFlags,
};

use crate::file::{FileDevice, FileOptions};

/// A sparse in-memory device.
pub struct MemoryDevice {
    file: FileDevice,
}

impl MemoryDevice {
    /// A device of `size` bytes that reads as zeros. Fails when the kernel
    /// refuses an in-memory file (out of descriptors or memory) or the size
    /// is beyond what a file can hold (2^63 - 1 bytes).
    pub fn try_new(size: u64) -> Result<MemoryDevice> {
        let name = c"diskit-memory";
        // SAFETY: the name is a valid C string; memfd_create reads it only.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            let e = Error::from(std::io::Error::last_os_error());
            return Err(e.context("cannot create an in-memory file"));
        }
        // SAFETY: memfd_create succeeded: the descriptor is open and ours.
        let file = unsafe { File::from_raw_fd(fd) };
        let too_big = || Error::invalid(format!("memory: size {size} is too large"));
        if i64::try_from(size).is_err() {
            return Err(too_big());
        }
        file.set_len(size).map_err(|_| too_big())?;
        let opts = FileOptions {
            writable: true,
            ..Default::default()
        };
        Ok(MemoryDevice {
            file: FileDevice::from_file(file, Path::new("memory"), opts)?,
        })
    }

    /// Like [`try_new`](Self::try_new), for sizes known to be fine (tests,
    /// fuzzing). Panics if the kernel refuses.
    pub fn new(size: u64) -> MemoryDevice {
        Self::try_new(size).unwrap_or_else(|e| panic!("RAM disk of {size} bytes: {e}"))
    }

    /// Bytes of memory in use for data.
    pub fn allocated_bytes(&self) -> u64 {
        self.file.allocated_bytes().unwrap_or(0)
    }
}

impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.file.size()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::IN_MEMORY
    }

    fn is_known_zero(&self) -> bool {
        self.allocated_bytes() == 0
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        // Nothing to make durable: FUA is done when the write is.
        self.file.write_at(buf, offset, WriteFlags::NONE)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        // Zeroed pages are freed even when the client asked to keep them
        // allocated (NO_HOLE is a "should not"): in RAM, allocated zeros
        // only cost memory, as in nbdkit's memory plugin.
        let flags = ZeroFlags {
            fua: false,
            may_trim: true,
            ..flags
        };
        self.file.write_zeroes(offset, len, flags)
    }

    fn trim(&self, offset: u64, len: u64, _flags: WriteFlags) -> Result<()> {
        self.file.trim(offset, len, WriteFlags::NONE)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.file.extents(offset, len)
    }

    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        self.file.file_view(offset, len)
    }

    fn describe(&self) -> String {
        format!("memory({})", self.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    #[test]
    fn sparse_writes_zeroes_and_extents() {
        let m = MemoryDevice::new(1 << 30);
        assert!(m.is_known_zero());
        m.write_at(b"hello", 16 * PAGE - 2, WriteFlags::NONE)
            .unwrap();
        assert!(!m.is_known_zero());
        let mut b = [0u8; 7];
        m.read_at(&mut b, 16 * PAGE - 3).unwrap();
        assert_eq!(&b, b"\0hello\0");
        assert_eq!(m.allocated_bytes(), 2 * PAGE);
        let mut kinds: Vec<(bool, u64)> = Vec::new();
        let mut pos = 0;
        while pos < 64 * PAGE {
            for e in m.extents(pos, 64 * PAGE - pos).unwrap() {
                kinds.push((e.flags.data, e.length));
                pos += e.length;
            }
        }
        assert_eq!(
            kinds,
            [(false, 15 * PAGE), (true, 2 * PAGE), (false, 47 * PAGE)]
        );
        m.write_zeroes(0, 32 * PAGE, ZeroFlags::default()).unwrap();
        m.read_at(&mut b, 16 * PAGE - 3).unwrap();
        assert_eq!(b, [0u8; 7]);
        assert_eq!(m.allocated_bytes(), 0);
        m.write_at(b"x", 0, WriteFlags::NONE).unwrap();
        m.trim(0, PAGE, WriteFlags::NONE).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        assert!(m.read_at(&mut b, (1 << 30) - 3).is_err());
        assert!(m.write_at(&b, (1 << 30) - 3, WriteFlags::NONE).is_err());
    }

    #[test]
    fn sizes_beyond_a_file_are_refused() {
        assert!(MemoryDevice::try_new(u64::MAX).is_err());
        assert!(MemoryDevice::try_new(1 << 63).is_err());
        let m = MemoryDevice::try_new((1 << 63) - 1).unwrap();
        m.write_at(b"end", (1 << 63) - 4, WriteFlags::NONE).unwrap();
        let mut b = [0u8; 3];
        m.read_at(&mut b, (1 << 63) - 4).unwrap();
        assert_eq!(&b, b"end");
    }
}
