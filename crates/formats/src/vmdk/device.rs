//! An open VMDK disk: its extents end to end (flat files, sparse
//! extents), the descriptor that names them, and the content ID that
//! changes at the first write after each open (so that an overlay made
//! on this disk knows it changed, as VMware and QEMU do).

use std::sync::{Arc, Mutex};

use diskit_core::device::check_range;
use diskit_core::sync::lock;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, FileView, Result,
    StorageRef, WriteFlags, ZeroFlags,
};

use super::header::SECTOR;
use super::sesparse::SeSparseExtent;
use super::sparse::SparseExtent;
use crate::mapped::{self, Backing, Mapped, Place};

/// What one extent is.
pub enum ExtentData {
    /// Raw data in a file from `offset` on (FLAT, VMFS).
    Flat {
        /// The file.
        file: StorageRef,
        /// Bytes into it.
        offset: u64,
    },
    /// Grains mapped through tables.
    Sparse(Arc<Mapped<SparseExtent>>),
    /// A space-efficient sparse extent (read only).
    SeSparse(Arc<SeSparseExtent>),
}

/// One extent of the disk.
pub struct VmdkExtent {
    /// Its first guest byte.
    pub start: u64,
    /// Its guest bytes.
    pub size: u64,
    /// The file name as the descriptor gives it (info shows it).
    pub name: String,
    /// The type as the descriptor spells it ("" for a monolithic file).
    pub kind: &'static str,
    /// The data.
    pub data: ExtentData,
}

impl VmdkExtent {
    /// The file the extent's data is in.
    pub fn file(&self) -> &StorageRef {
        match &self.data {
            ExtentData::Flat { file, .. } => file,
            ExtentData::Sparse(s) => s.file(),
            ExtentData::SeSparse(s) => s.file(),
        }
    }

    /// The grain size of a sparse extent.
    pub fn grain(&self) -> Option<u64> {
        match &self.data {
            ExtentData::Flat { .. } => None,
            ExtentData::Sparse(s) => Some(s.geometry().grain),
            ExtentData::SeSparse(s) => Some(s.grain()),
        }
    }

    /// Whether its grains are compressed.
    pub fn compressed(&self) -> bool {
        matches!(&self.data, ExtentData::Sparse(s) if s.geometry().compressed)
    }

    /// Where byte `at` of a sparse extent lives and for how long (`None`
    /// for a flat one).
    pub fn locate(&self, at: u64, max: u64) -> Option<Result<(u64, Place)>> {
        match &self.data {
            ExtentData::Flat { .. } => None,
            ExtentData::Sparse(s) => Some(s.locate(at, max)),
            ExtentData::SeSparse(s) => Some(s.locate(at, max)),
        }
    }
}

/// Where the descriptor is kept, for the content ID's update.
pub enum DescriptorHome {
    /// Embedded in a sparse file: this many bytes at this offset.
    Embedded {
        /// The file.
        file: StorageRef,
        /// Bytes into it.
        offset: u64,
        /// Bytes of the area.
        len: u64,
    },
    /// A file of its own.
    File(StorageRef),
}

/// An open VMDK disk.
pub struct Vmdk {
    extents: Vec<VmdkExtent>,
    size: u64,
    writable: bool,
    /// The descriptor's bytes as read, and where they live.
    text: Vec<u8>,
    home: DescriptorHome,
    /// The content ID was changed since the open (held while it is
    /// changed, so that no write overtakes the change).
    cid_changed: Mutex<bool>,
    /// The image below (for extents' unallocated grains: each has its own
    /// view; kept for info).
    backing: Option<Backing>,
}

impl Vmdk {
    /// Joins the extents; `text` is the descriptor as read from `home`.
    pub fn new(
        extents: Vec<VmdkExtent>,
        writable: bool,
        text: Vec<u8>,
        home: DescriptorHome,
        backing: Option<Backing>,
    ) -> Result<Vmdk> {
        if extents.is_empty() {
            return Err(Error::invalid("The VMDK descriptor lists no usable extent"));
        }
        let size = extents.iter().map(|e| e.size).sum();
        Ok(Vmdk {
            extents,
            size,
            writable,
            text,
            home,
            cid_changed: Mutex::new(false),
            backing,
        })
    }

    /// The extents, in guest order.
    pub fn extents(&self) -> &[VmdkExtent] {
        &self.extents
    }

    /// The image below, if any.
    pub fn backing(&self) -> Option<&Backing> {
        self.backing.as_ref()
    }

    /// The extent holding guest byte `g` and its index.
    fn extent_at(&self, g: u64) -> &VmdkExtent {
        let i = self
            .extents
            .partition_point(|e| e.start <= g)
            .saturating_sub(1);
        &self.extents[i]
    }

    /// Calls `f` for each extent's piece of `offset..offset+len`: the
    /// extent, the offset in it, the offset in the request, the length.
    fn pieces(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&VmdkExtent, u64, usize, usize) -> Result<()>,
    ) -> Result<()> {
        check_range(self.size, offset, len)?;
        let mut done = 0u64;
        while done < len {
            let g = offset + done;
            let e = self.extent_at(g);
            let n = (e.start + e.size - g).min(len - done);
            f(e, g - e.start, done as usize, n as usize)?;
            done += n;
        }
        Ok(())
    }

    /// Gives the disk a new content ID, once per open, before its first
    /// change.
    fn touch(&self) -> Result<()> {
        let mut done = lock(&self.cid_changed);
        if *done {
            return Ok(());
        }
        let mut r = [0u8; 4];
        crate::luks::keys::random(&mut r)?;
        if let Some(mut text) = super::descriptor::with_cid(&self.text, u32::from_le_bytes(r)) {
            match &self.home {
                DescriptorHome::Embedded { file, offset, len } => {
                    // A descriptor that does not fit keeps its ID.
                    if text.len() as u64 <= *len {
                        text.resize(*len as usize, 0);
                        file.write_extend(&text, *offset)?;
                    }
                }
                DescriptorHome::File(file) => {
                    // In one write, NUL-padded to whole sectors and over
                    // all of the old text, as QEMU 10 rewrites it.
                    let len = (text.len() as u64)
                        .div_ceil(SECTOR)
                        .saturating_mul(SECTOR)
                        .max(file.file_len()?.min(super::descriptor::MAX_TEXT as u64));
                    text.resize(len as usize, 0);
                    file.write_extend(&text, 0)?;
                }
            }
        }
        *done = true;
        Ok(())
    }

    fn ensure_writable(&self) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ))
        }
    }
}

/// Reads `buf` at `at` bytes of extent `e`.
fn read_extent(e: &VmdkExtent, buf: &mut [u8], at: u64) -> Result<()> {
    match &e.data {
        ExtentData::Flat { file, offset } => file.read_padded(buf, offset + at),
        ExtentData::Sparse(s) => s.read_at(buf, at),
        ExtentData::SeSparse(s) => mapped::read(&**s, buf, at),
    }
}

impl BlockDevice for Vmdk {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.writable, true, false)
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 4096,
            maximum: 32 << 20,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.pieces(offset, buf.len() as u64, |e, at, o, n| {
            read_extent(e, &mut buf[o..o + n], at)
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.ensure_writable()?;
        check_range(self.size, offset, buf.len() as u64)?;
        self.touch()?;
        self.pieces(offset, buf.len() as u64, |e, at, o, n| match &e.data {
            ExtentData::Flat { file, offset } => file.write_extend(&buf[o..o + n], offset + at),
            ExtentData::Sparse(s) => s.write_at(&buf[o..o + n], at, WriteFlags::NONE),
            ExtentData::SeSparse(_) => Err(read_only_extent()),
        })?;
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.ensure_writable()?;
        check_range(self.size, offset, len)?;
        self.touch()?;
        self.pieces(offset, len, |e, at, _, n| {
            let n = n as u64;
            match &e.data {
                ExtentData::Flat { file, offset } => {
                    let fz = ZeroFlags {
                        fua: false,
                        ..flags
                    };
                    let end = offset + at + n;
                    if end <= file.size() {
                        file.write_zeroes(offset + at, n, fz)
                    } else if flags.fast {
                        Err(Error::from_kind(ErrorKind::NotSupported))
                    } else {
                        // Past the end of a short flat file: written out.
                        let zeros = vec![0u8; n.min(1 << 20) as usize];
                        let mut p = 0;
                        while p < n {
                            let k = (n - p).min(zeros.len() as u64);
                            file.write_extend(&zeros[..k as usize], offset + at + p)?;
                            p += k;
                        }
                        Ok(())
                    }
                }
                ExtentData::Sparse(s) => s.write_zeroes(
                    at,
                    n,
                    ZeroFlags {
                        fua: false,
                        ..flags
                    },
                ),
                ExtentData::SeSparse(_) => Err(read_only_extent()),
            }
        })?;
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        let mut seen: Vec<*const ()> = Vec::new();
        for e in &self.extents {
            let f = e.file();
            let p = Arc::as_ptr(f) as *const ();
            if !seen.contains(&p) {
                seen.push(p);
                f.flush()?;
            }
        }
        if let DescriptorHome::File(f) = &self.home {
            f.flush()?;
        }
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_range(self.size, offset, len)?;
        let e = self.extent_at(offset);
        let at = offset - e.start;
        let n = (e.size - at).min(len);
        match &e.data {
            ExtentData::Flat { file, offset: base } => {
                let h = base + at;
                let fsize = file.size();
                if h >= fsize {
                    let mut past = Extent::hole(n).at_host(h);
                    past.flags.data = true;
                    return Ok(vec![past]);
                }
                // Flat data is allocated to the disk wherever the file has
                // a hole: data that reads as zeros, as QEMU reports it.
                let mut v = file.extents(h, n.min(fsize - h))?;
                let mut pos = h;
                for x in &mut v {
                    x.host_offset = Some(pos);
                    x.flags.data = true;
                    pos += x.length;
                }
                Ok(v)
            }
            ExtentData::Sparse(s) => s.extents(at, n),
            ExtentData::SeSparse(s) => mapped::extents(&**s, at, n),
        }
    }

    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        if self.writable || check_range(self.size, offset, len).is_err() || len == 0 {
            return None;
        }
        let e = self.extent_at(offset);
        let at = offset - e.start;
        if at + len > e.size {
            return None;
        }
        match &e.data {
            ExtentData::Flat { file, offset: base } => {
                if base + at + len > file.size() {
                    return None;
                }
                file.file_view(base + at, len)
            }
            ExtentData::Sparse(s) => s.file_view(at, len),
            ExtentData::SeSparse(s) => mapped::file_view(&**s, at, len),
        }
    }

    fn describe(&self) -> String {
        String::from("vmdk")
    }

    fn close(&self) -> Result<()> {
        if self.writable {
            self.flush()?;
        }
        Ok(())
    }
}

/// Writing to a seSparse extent (never opened writable).
fn read_only_extent() -> Error {
    Error::unsupported("No write support for seSparse images available")
}
