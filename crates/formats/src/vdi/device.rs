//! An open VDI image: the block map says where each 1 MiB block lives,
//! and blocks not yet allocated get the next data block as QEMU gives it
//! (the whole block written, then the header, then the block map
//! sector); the generic mapped layer moves the bytes.

use std::sync::{Mutex, RwLock};

use diskit_core::sync::{self, lock};
use diskit_core::{Capabilities, Error, ErrorKind, Result, StorageRef};

use super::header::{BLOCK_SIZE, DISCARDED, HEADER_LEN, Header};
use crate::mapped::{self, Allocation, Fill, Layers, Mapped, MappedFormat, Place};

/// An open VDI image.
pub struct Vdi {
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    header: Mutex<Header>,
    bmap: RwLock<Vec<u32>>,
}

/// Whether a block map entry names a data block.
fn is_allocated(e: u32) -> bool {
    e < DISCARDED
}

impl Vdi {
    /// Opens the image in `file` (header validated, block map read).
    pub fn open(file: StorageRef, writable: bool) -> Result<Mapped<Vdi>> {
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
        if writable {
            // The header and the block map change in place.
            let end = header.offset_bmap as u64 + len;
            crate::in_order::check_in_place(&*file, "vdi", "header and block map", end)?;
        }
        let mut raw = vec![0u8; len as usize];
        file.read_at(&mut raw, header.offset_bmap as u64)?;
        let mut bmap = crate::bytes::le32s(&raw);
        bmap.truncate(header.blocks_in_image as usize);
        Ok(Mapped::new(Vdi {
            layers: Layers {
                data: file,
                backing: None,
                writable,
            },
            header: Mutex::new(header),
            bmap: RwLock::new(bmap),
        }))
    }

    /// The header as it is now.
    pub fn header(&self) -> Header {
        lock(&self.header).clone()
    }

    /// The block map as it is now.
    pub fn block_map(&self) -> Vec<u32> {
        sync::read(&self.bmap).clone()
    }

    /// Reserves the next data block (its host offset): the header's count
    /// goes up first, so that no two blocks get one index.
    fn next_block(&self) -> Result<u64> {
        let mut h = lock(&self.header);
        let index = h.blocks_allocated;
        if index >= DISCARDED - 1 {
            return Err(Error::new(
                ErrorKind::NoSpace,
                "VDI image has no free block index",
            ));
        }
        h.blocks_allocated += 1;
        Ok(h.offset_data as u64 + index as u64 * BLOCK_SIZE)
    }
}

impl MappedFormat for Vdi {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        lock(&self.header).disk_size
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        // A block's entry changes only from unallocated to allocated, and
        // only once its data is written: nothing to hold.
        let map = sync::read(&self.bmap);
        let offset_data = lock(&self.header).offset_data as u64;
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

    fn data_may_be_sparse(&self) -> bool {
        // QEMU asks the file about static images' blocks.
        lock(&self.header).is_static()
    }

    fn unit(&self) -> u64 {
        BLOCK_SIZE
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.layers.writable, true, true)
    }

    fn describe(&self) -> String {
        format!("vdi {}", self.layers.data.location())
    }

    /// The next data block, written whole (zeros around the data), as
    /// QEMU does.
    fn allocate(&self, g: u64, _data: &[u8]) -> Result<Allocation> {
        let host = self.next_block()?;
        Ok(Allocation {
            guest: g / BLOCK_SIZE * BLOCK_SIZE,
            len: BLOCK_SIZE,
            host,
            fill: Fill::Whole,
        })
    }

    /// After the data: the header (the count), then the block map sector,
    /// as QEMU orders them (a crash between leaves a data block unused,
    /// never one used twice).
    fn commit(&self, a: Allocation) -> Result<()> {
        let block = a.guest / BLOCK_SIZE;
        let h = self.header();
        let index = ((a.host - h.offset_data as u64) / BLOCK_SIZE) as u32;
        self.layers.data.write_extend(&h.to_bytes(), 0)?;
        let sector = {
            let mut map = sync::write(&self.bmap);
            map[block as usize] = index;
            let first = (block as usize / 128) * 128;
            let mut bytes = vec![0u8; 512];
            for (i, e) in map.iter().skip(first).take(128).enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&e.to_le_bytes());
            }
            bytes
        };
        self.layers
            .data
            .write_extend(&sector, h.offset_bmap as u64 + (block / 128) * 512)
    }
}
