//! An open VHD image. A fixed disk is its file up to the footer; a
//! dynamic one maps each block through the block allocation table (BAT)
//! to a sector bitmap followed by the block's data. The generic mapped
//! layer moves the bytes; writes to unallocated blocks allocate them as
//! QEMU does (bitmap, the footer moved past the new block, the BAT entry,
//! then the data).

use std::sync::{Condvar, Mutex, RwLock};

use diskit_core::device::check_range;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, FileView, Result,
    StorageRef, WriteFlags, ZeroFlags,
};

use super::footer::{DYN_LEN, DynHeader, FOOTER_LEN, Footer, MAX_SECTORS, SizeCalc, too_large};
use crate::mapped::{self, Backing, MappedFormat, Place};

/// A BAT entry for a block never written.
const FREE: u32 = 0xFFFF_FFFF;

/// What the disk type adds.
enum Layout {
    Fixed,
    Dynamic {
        table_offset: u64,
        block_size: u64,
        bitmap_size: u64,
        bat: RwLock<Vec<u32>>,
        /// Where the next block goes (the footer sits there).
        next_free: Mutex<u64>,
    },
}

/// An open VHD image.
pub struct Vpc {
    file: StorageRef,
    footer: Footer,
    layout: Layout,
    size: u64,
    writable: bool,
    /// Ask the file about allocated blocks too ([`crate::OpenOptions::host_zeros`]).
    host_zeros: bool,
    allocating: Mutex<Vec<u64>>,
    allocated: Condvar,
}

impl Vpc {
    /// Opens the image in `file`: the footer copy at 0 (a dynamic disk),
    /// or the footer at the end (a fixed one), as QEMU reads them.
    pub fn open(file: StorageRef, writable: bool, calc: SizeCalc) -> Result<Vpc> {
        let len = file.file_len()?;
        if len == 0 {
            return Err(Error::invalid("File too small for a VHD header"));
        }
        let mut head = vec![0u8; FOOTER_LEN];
        file.read_padded(&mut head, 0)?;
        let (footer, dynamic) = if &head[..8] == super::footer::COOKIE {
            (Footer::parse(&head)?, true)
        } else {
            let at = len.div_ceil(512) * 512 - FOOTER_LEN as u64;
            let mut tail = vec![0u8; FOOTER_LEN];
            file.read_padded(&mut tail, at)?;
            let f = Footer::parse(&tail)?;
            if f.disk_type != super::footer::TYPE_FIXED {
                return Err(Error::invalid("invalid VPC image"));
            }
            (f, false)
        };
        let sectors = footer.total_sectors(calc);
        if sectors > MAX_SECTORS {
            return Err(too_large());
        }
        let size = sectors * 512;
        let layout = if dynamic {
            let mut d = vec![0u8; DYN_LEN];
            if footer.data_offset.saturating_add(DYN_LEN as u64) > len {
                return Err(Error::invalid("Error reading dynamic VHD header"));
            }
            file.read_at(&mut d, footer.data_offset)?;
            let h = DynHeader::parse(&d, size)?;
            let bat_len = h.max_table_entries as u64 * 4;
            if h.table_offset.saturating_add(bat_len) > len {
                return Err(Error::invalid("Error reading pagetable"));
            }
            let mut raw = vec![0u8; bat_len as usize];
            file.read_at(&mut raw, h.table_offset)?;
            let bat: Vec<u32> = raw
                .chunks_exact(4)
                .map(|c| u32::from_be_bytes(c.try_into().expect("4 bytes")))
                .collect();
            let block_size = h.block_size as u64;
            let bitmap_size = (block_size / 512 / 8).div_ceil(512) * 512;
            let mut next = (h.table_offset + bat_len).div_ceil(512) * 512;
            for &e in &bat {
                if e != FREE {
                    next = next.max(e as u64 * 512 + bitmap_size + block_size);
                }
            }
            if next > len {
                return Err(Error::invalid(
                    "block-vpc: free_data_block_offset points after the end of file. \
                     The image has been truncated.",
                ));
            }
            Layout::Dynamic {
                table_offset: h.table_offset,
                block_size,
                bitmap_size,
                bat: RwLock::new(bat),
                next_free: Mutex::new(next),
            }
        } else {
            if size > len - FOOTER_LEN as u64 && size > len {
                return Err(Error::invalid("Invalid file size"));
            }
            Layout::Fixed
        };
        Ok(Vpc {
            file,
            footer,
            layout,
            size,
            writable,
            host_zeros: false,
            allocating: Mutex::new(Vec::new()),
            allocated: Condvar::new(),
        })
    }

    /// Asks the file about the bytes of allocated blocks, not only a fixed
    /// disk's ([`crate::OpenOptions::host_zeros`]): QEMU extends the file
    /// past a new block without writing it, so most of a dynamic disk's
    /// block can be a hole in the file.
    pub fn with_host_zeros(mut self, on: bool) -> Vpc {
        self.host_zeros = on;
        self
    }

    /// The footer as read.
    pub fn footer(&self) -> &Footer {
        &self.footer
    }

    /// The block size of a dynamic disk.
    pub fn dynamic_block_size(&self) -> Option<u64> {
        match &self.layout {
            Layout::Fixed => None,
            Layout::Dynamic { block_size, .. } => Some(*block_size),
        }
    }

    /// Writes `buf` at guest `g` inside one block of a dynamic disk.
    fn write_dynamic(&self, buf: &[u8], g: u64) -> Result<()> {
        let Layout::Dynamic {
            table_offset,
            block_size,
            bitmap_size,
            bat,
            next_free,
        } = &self.layout
        else {
            unreachable!("dynamic layout");
        };
        let block = g / block_size;
        let within = g % block_size;
        loop {
            let e = bat.read().unwrap_or_else(|p| p.into_inner())[block as usize];
            if e != FREE {
                let at = e as u64 * 512 + bitmap_size + within;
                return self.file.write_at(buf, at, WriteFlags::NONE);
            }
            let mut busy = self.allocating.lock().unwrap_or_else(|p| p.into_inner());
            if busy.contains(&block) {
                let _unused = self.allocated.wait(busy).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            busy.push(block);
            drop(busy);
            let r = (|| {
                let start = {
                    let mut next = next_free.lock().unwrap_or_else(|p| p.into_inner());
                    let start = *next;
                    if start / 512 >= FREE as u64 {
                        return Err(Error::new(ErrorKind::NoSpace, "VHD image is full"));
                    }
                    // The bitmap (every sector present, as QEMU writes it),
                    // then the footer past the new block.
                    self.file
                        .write_extend(&vec![0xFF; *bitmap_size as usize], start)?;
                    *next = start + bitmap_size + block_size;
                    self.file.write_extend(self.footer.to_bytes(), *next)?;
                    start
                };
                let entry = (start / 512) as u32;
                self.file
                    .write_extend(&entry.to_be_bytes(), table_offset + block * 4)?;
                self.file.write_extend(buf, start + bitmap_size + within)?;
                bat.write().unwrap_or_else(|p| p.into_inner())[block as usize] = entry;
                Ok(())
            })();
            let mut busy = self.allocating.lock().unwrap_or_else(|p| p.into_inner());
            busy.retain(|b| *b != block);
            drop(busy);
            self.allocated.notify_all();
            return r;
        }
    }
}

impl MappedFormat for Vpc {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.size
    }

    fn data(&self) -> &StorageRef {
        &self.file
    }

    fn backing(&self) -> Option<&Backing> {
        None
    }

    fn mappings_change(&self) -> bool {
        self.writable
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        match &self.layout {
            Layout::Fixed => Ok((max, Place::Data(g), None)),
            Layout::Dynamic {
                block_size,
                bitmap_size,
                bat,
                ..
            } => {
                let bat = bat.read().unwrap_or_else(|p| p.into_inner());
                let block = g / block_size;
                let e = bat[block as usize];
                let mut n = (block_size - g % block_size).min(max);
                if e != FREE {
                    // Blocks are apart (a bitmap between): one at a time.
                    let at = e as u64 * 512 + bitmap_size + g % block_size;
                    return Ok((n, Place::Data(at), None));
                }
                let mut b = block + 1;
                while n < max && (b as usize) < bat.len() && bat[b as usize] == FREE {
                    n = (n + block_size).min(max);
                    b += 1;
                }
                Ok((n, Place::Zero { alloc: None }, None))
            }
        }
    }

    fn read_compressed(&self, _o: u64, _s: u64, _k: u64, _b: &mut [u8]) -> Result<()> {
        Err(Error::io("VHD has no compressed blocks"))
    }

    fn data_may_be_sparse(&self) -> bool {
        // QEMU asks the file about a fixed disk's bytes.
        self.host_zeros || matches!(self.layout, Layout::Fixed)
    }
}

impl BlockDevice for Vpc {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.writable, false, false)
    }

    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 4096,
            maximum: 32 << 20,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        mapped::read(self, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        if !self.writable {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "image is read-only",
            ));
        }
        check_range(self.size, offset, buf.len() as u64)?;
        match &self.layout {
            Layout::Fixed => self.file.write_at(buf, offset, WriteFlags::NONE)?,
            Layout::Dynamic { block_size, .. } => {
                let mut done = 0usize;
                while done < buf.len() {
                    let g = offset + done as u64;
                    let n = ((block_size - g % block_size) as usize).min(buf.len() - done);
                    self.write_dynamic(&buf[done..done + n], g)?;
                    done += n;
                }
            }
        }
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast {
            return Err(Error::new(ErrorKind::NotSupported, "VHD zeroes by writing"));
        }
        if let Layout::Dynamic {
            block_size, bat, ..
        } = &self.layout
        {
            // Unallocated blocks read as zeros already.
            check_range(self.size, offset, len)?;
            let mut pos = offset;
            let zeros = vec![0u8; len.min(*block_size) as usize];
            while pos < offset + len {
                let n = (block_size - pos % block_size).min(offset + len - pos);
                let e = bat.read().unwrap_or_else(|p| p.into_inner())[(pos / block_size) as usize];
                if e != FREE {
                    self.write_at(&zeros[..n as usize], pos, WriteFlags::NONE)?;
                }
                pos += n;
            }
            if flags.fua {
                self.flush()?;
            }
            return Ok(());
        }
        diskit_core::device::write_zero_buffer(self, offset, len, flags.fua)
    }

    fn flush(&self) -> Result<()> {
        self.file.flush()
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        mapped::extents(self, offset, len)
    }

    fn file_view(&self, offset: u64, len: u64) -> Option<FileView<'_>> {
        mapped::file_view(self, offset, len)
    }

    fn describe(&self) -> String {
        format!("vpc {}", self.file.location())
    }
}
