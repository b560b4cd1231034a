//! An open VDI image: the block map says where each 1 MiB block lives,
//! the generic mapped layer moves the bytes, and writes to blocks not yet
//! allocated allocate them as QEMU does (the next data block, the whole
//! block written, then the header, then the block map sector).

use std::sync::{Condvar, Mutex, RwLock};

use diskit_core::device::check_range;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Extent, FileView, Result,
    StorageRef, WriteFlags, ZeroFlags,
};

use super::header::{BLOCK_SIZE, DISCARDED, HEADER_LEN, Header};
use crate::mapped::{self, Backing, MappedFormat, Place};

/// An open VDI image.
pub struct Vdi {
    file: StorageRef,
    header: Mutex<Header>,
    bmap: RwLock<Vec<u32>>,
    writable: bool,
    /// Blocks being allocated (their writers hold them; others wait).
    allocating: Mutex<Vec<u32>>,
    allocated: Condvar,
}

/// Whether a block map entry names a data block.
fn is_allocated(e: u32) -> bool {
    e < DISCARDED
}

impl Vdi {
    /// Opens the image in `file` (header validated, block map read).
    pub fn open(file: StorageRef, writable: bool) -> Result<Vdi> {
        let mut b = vec![0u8; HEADER_LEN];
        if file.file_len()? < HEADER_LEN as u64 {
            // QEMU reads the short header as zeros, then finds no signature.
            file.read_padded(&mut b, 0)?;
        } else {
            file.read_at(&mut b, 0)?;
        }
        let header = Header::parse(&b)?;
        let len = header.bmap_len();
        let file_len = file.file_len()?;
        if header.offset_bmap as u64 + len > file_len {
            return Err(Error::invalid(format!(
                "VDI block map ({len} bytes at {:#x}) runs past the end of the file ({file_len} bytes)",
                header.offset_bmap
            )));
        }
        let mut raw = vec![0u8; len as usize];
        file.read_at(&mut raw, header.offset_bmap as u64)?;
        let bmap = raw
            .chunks_exact(4)
            .take(header.blocks_in_image as usize)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        Ok(Vdi {
            file,
            header: Mutex::new(header),
            bmap: RwLock::new(bmap),
            writable,
            allocating: Mutex::new(Vec::new()),
            allocated: Condvar::new(),
        })
    }

    /// The header as it is now.
    pub fn header(&self) -> Header {
        self.header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The block map as it is now.
    pub fn block_map(&self) -> Vec<u32> {
        self.bmap.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn entry(&self, block: u64) -> u32 {
        self.bmap.read().unwrap_or_else(|p| p.into_inner())[block as usize]
    }

    fn data_offset(&self, entry: u32) -> u64 {
        let h = self.header.lock().unwrap_or_else(|p| p.into_inner());
        h.offset_data as u64 + entry as u64 * BLOCK_SIZE
    }

    /// Writes `buf` at guest `g`, inside one block.
    fn write_in_block(&self, buf: &[u8], g: u64) -> Result<()> {
        let block = g / BLOCK_SIZE;
        let within = g % BLOCK_SIZE;
        loop {
            let e = self.entry(block);
            if is_allocated(e) {
                return self
                    .file
                    .write_at(buf, self.data_offset(e) + within, WriteFlags::NONE);
            }
            // Take the block for allocating, or wait for whoever has it.
            let mut busy = self.allocating.lock().unwrap_or_else(|p| p.into_inner());
            if busy.contains(&(block as u32)) {
                let _unused = self.allocated.wait(busy).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            if is_allocated(self.entry(block)) {
                continue;
            }
            busy.push(block as u32);
            drop(busy);
            let r = self.allocate(block, buf, within);
            let mut busy = self.allocating.lock().unwrap_or_else(|p| p.into_inner());
            busy.retain(|b| *b != block as u32);
            drop(busy);
            self.allocated.notify_all();
            return r;
        }
    }

    /// Allocates the next data block for `block` with `buf` at `within`
    /// and zeros around it: data, then the header (the count), then the
    /// block map sector, as QEMU orders them (a crash between leaves a
    /// data block unused, never one used twice).
    fn allocate(&self, block: u64, buf: &[u8], within: u64) -> Result<()> {
        let (index, offset_data) = {
            let mut h = self.header.lock().unwrap_or_else(|p| p.into_inner());
            let index = h.blocks_allocated;
            if index >= DISCARDED - 1 {
                return Err(Error::new(
                    ErrorKind::NoSpace,
                    "VDI image has no free block index",
                ));
            }
            h.blocks_allocated += 1;
            (index, h.offset_data as u64)
        };
        let mut whole = vec![0u8; BLOCK_SIZE as usize];
        whole[within as usize..within as usize + buf.len()].copy_from_slice(buf);
        self.file
            .write_extend(&whole, offset_data + index as u64 * BLOCK_SIZE)?;
        let header = self.header().to_bytes();
        self.file.write_extend(&header, 0)?;
        let sector = {
            let mut map = self.bmap.write().unwrap_or_else(|p| p.into_inner());
            map[block as usize] = index;
            let first = (block as usize / 128) * 128;
            let mut bytes = vec![0u8; 512];
            for (i, e) in map.iter().skip(first).take(128).enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&e.to_le_bytes());
            }
            bytes
        };
        let h = self.header();
        self.file
            .write_extend(&sector, h.offset_bmap as u64 + (block / 128) * 512)
    }

    fn read_only() -> Error {
        Error::new(ErrorKind::PermissionDenied, "image is read-only")
    }
}

impl MappedFormat for Vdi {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .disk_size
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
        // A block's entry changes only from unallocated to allocated, and
        // only once its data is written: nothing to hold.
        let map = self.bmap.read().unwrap_or_else(|p| p.into_inner());
        let offset_data = self
            .header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .offset_data as u64;
        let block = g / BLOCK_SIZE;
        let first = map[block as usize];
        let mut n = (BLOCK_SIZE - g % BLOCK_SIZE).min(max);
        // Later blocks join the run while they stay alike (unallocated, or
        // data following on in the file).
        let mut b = block + 1;
        while n < max && (b as usize) < map.len() {
            let e = map[b as usize];
            let same = match (is_allocated(first), is_allocated(e)) {
                (false, false) => true,
                (true, true) => e as u64 == first as u64 + (b - block),
                _ => false,
            };
            if !same {
                break;
            }
            n = (n + BLOCK_SIZE).min(max);
            b += 1;
        }
        let place = if is_allocated(first) {
            Place::Data(offset_data + first as u64 * BLOCK_SIZE + g % BLOCK_SIZE)
        } else {
            Place::Zero { alloc: None }
        };
        Ok((n, place, None))
    }

    fn read_compressed(&self, _o: u64, _s: u64, _k: u64, _b: &mut [u8]) -> Result<()> {
        Err(Error::io("VDI has no compressed blocks"))
    }

    fn data_may_be_sparse(&self) -> bool {
        // QEMU asks the file about static images' blocks.
        self.header
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_static()
    }
}

impl BlockDevice for Vdi {
    fn size(&self) -> u64 {
        self.guest_size()
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.writable, true, true)
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
            return Err(Self::read_only());
        }
        check_range(self.size(), offset, buf.len() as u64)?;
        let mut done = 0usize;
        while done < buf.len() {
            let g = offset + done as u64;
            let n = ((BLOCK_SIZE - g % BLOCK_SIZE) as usize).min(buf.len() - done);
            self.write_in_block(&buf[done..done + n], g)?;
            done += n;
        }
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if !self.writable {
            return Err(Self::read_only());
        }
        check_range(self.size(), offset, len)?;
        // Unallocated blocks read as zeros already; allocated ones get
        // zeros written (VDI cannot deallocate).
        let zeros = vec![0u8; len.min(BLOCK_SIZE) as usize];
        let mut pos = offset;
        while pos < offset + len {
            let n = (BLOCK_SIZE - pos % BLOCK_SIZE).min(offset + len - pos);
            let e = self.entry(pos / BLOCK_SIZE);
            if is_allocated(e) {
                if flags.fast {
                    return Err(Error::new(
                        ErrorKind::NotSupported,
                        "zeroing an allocated VDI block writes zeros",
                    ));
                }
                self.file.write_at(
                    &zeros[..n as usize],
                    self.data_offset(e) + pos % BLOCK_SIZE,
                    WriteFlags::NONE,
                )?;
            }
            pos += n;
        }
        if flags.fua {
            self.flush()?;
        }
        Ok(())
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
        format!("vdi {}", self.file.location())
    }
}
