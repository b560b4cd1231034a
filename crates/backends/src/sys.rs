//! Thin, safe wrappers over the Linux system calls the file backend needs.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `fallocate(2)` with `mode` over `offset..offset+len`.
pub fn fallocate(fd: BorrowedFd<'_>, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    loop {
        // SAFETY: fallocate only reads its scalar arguments; fd is a live descriptor.
        let r = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset as i64, len as i64) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `lseek(2)` with SEEK_DATA or SEEK_HOLE. `Ok(None)` when there is no
/// data at or after `offset` (ENXIO).
pub fn seek(fd: BorrowedFd<'_>, offset: u64, whence: i32) -> io::Result<Option<u64>> {
    // SAFETY: lseek only reads its scalar arguments; fd is a live descriptor.
    let r = unsafe { libc::lseek(fd.as_raw_fd(), offset as i64, whence) };
    if r >= 0 {
        return Ok(Some(r as u64));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(e)
    }
}

/// The size of a block device (BLKGETSIZE64).
pub fn block_device_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(size)
    }
}

/// BLKZEROOUT or BLKDISCARD over a range of a block device.
pub fn block_range_ioctl(
    fd: BorrowedFd<'_>,
    request: u64,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: these ioctls read two u64s through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, range.as_ptr()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `posix_fadvise(2)`; advice failures are not errors worth reporting.
pub fn fadvise(fd: BorrowedFd<'_>, offset: u64, len: u64, advice: i32) {
    // SAFETY: posix_fadvise only reads its scalar arguments.
    unsafe {
        libc::posix_fadvise(fd.as_raw_fd(), offset as i64, len as i64, advice);
    }
}

/// One extent of a file as FS_IOC_FIEMAP reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileExtent {
    /// Its offset in the file.
    pub logical: u64,
    /// Its length.
    pub length: u64,
    /// `FIEMAP_EXTENT_*` flags.
    pub flags: u32,
}

/// The last extent of the file.
pub const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Allocated but never written: reads as zeros.
pub const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
/// Write dirty pages back before mapping, so that data still in the page
/// cache over unwritten space is reported as written.
pub const FIEMAP_FLAG_SYNC: u32 = 0x1;

/// The extents (at most `max`, ≤ 256) of the file that overlap
/// `start..start+len` (FS_IOC_FIEMAP), in order. `Err` with EOPNOTSUPP or
/// ENOTTY where the file system has no extent map (tmpfs).
pub fn fiemap(
    fd: BorrowedFd<'_>,
    start: u64,
    len: u64,
    flags: u32,
    max: usize,
) -> io::Result<Vec<FileExtent>> {
    // struct fiemap (32 bytes) followed by struct fiemap_extent (56 bytes
    // each), in u64 words.
    const HEAD: usize = 4;
    const EXTENT: usize = 7;
    let max = max.clamp(1, 256);
    let mut words = vec![0u64; HEAD + EXTENT * max];
    words[0] = start;
    words[1] = len;
    // fm_flags (low half of word 2) and fm_extent_count (low half of
    // word 3), in native byte order.
    words[2] = u64::from_ne_bytes(pack(flags, 0));
    words[3] = u64::from_ne_bytes(pack(max as u32, 0));
    // SAFETY: the buffer holds struct fiemap with room for `max` extents,
    // as fm_extent_count says; the kernel writes no further.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_FIEMAP as _, words.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mapped = (unpack(words[2]).1 as usize).min(max);
    Ok((0..mapped)
        .map(|i| {
            let e = &words[HEAD + EXTENT * i..HEAD + EXTENT * (i + 1)];
            FileExtent {
                logical: e[0],
                length: e[2],
                flags: unpack(e[5]).0,
            }
        })
        .collect())
}

/// Two u32s as the bytes of one u64 in memory order.
fn pack(a: u32, b: u32) -> [u8; 8] {
    let mut v = [0u8; 8];
    v[..4].copy_from_slice(&a.to_ne_bytes());
    v[4..].copy_from_slice(&b.to_ne_bytes());
    v
}

/// The two u32s of one u64 word, in memory order.
fn unpack(w: u64) -> (u32, u32) {
    let b = w.to_ne_bytes();
    (
        u32::from_ne_bytes(b[..4].try_into().unwrap()),
        u32::from_ne_bytes(b[4..].try_into().unwrap()),
    )
}

/// Whether the file system under `fd` is one whose extent map is known to
/// call written data written once FIEMAP_FLAG_SYNC returns (ext4, xfs):
/// elsewhere an unwritten extent is not taken for zeros.
pub fn extent_map_trusted(fd: BorrowedFd<'_>) -> bool {
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    // SAFETY: struct statfs is plain integers, for which all zeros is valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one struct statfs through the pointer, which
    // points to one; fd is a live descriptor.
    let r = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
    r == 0 && matches!(st.f_type as i64, EXT4 | XFS)
}

/// _IOWR('f', 11, struct fiemap)
const FS_IOC_FIEMAP: u64 = 0xC020_660B;

// _IOR(0x12, 114, size_t)
const BLKGETSIZE64: u64 = 0x8008_1272;
/// _IO(0x12, 127)
pub const BLKZEROOUT: u64 = 0x127f;
/// _IO(0x12, 119)
pub const BLKDISCARD: u64 = 0x1277;
