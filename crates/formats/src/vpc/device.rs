//! An open VHD image. A fixed disk is its file up to the footer; a
//! dynamic one maps each block through the block allocation table (BAT)
//! to a sector bitmap followed by the block's data. Unallocated blocks
//! get new space as QEMU gives it (the bitmap where the footer was, the
//! footer moved past the new block); the data, then the BAT entry, are
//! written after. The generic mapped layer moves the bytes.

use std::sync::{Mutex, RwLock};

use diskit_core::sync::{self, lock};
use diskit_core::{Capabilities, Error, ErrorKind, Result, StorageRef, ZeroFlags};

use super::footer::{DYN_LEN, DynHeader, FOOTER_LEN, Footer, MAX_SECTORS, SizeCalc, too_large};
use crate::mapped::{self, Allocation, Fill, Layers, Mapped, MappedFormat, Place, Zeroed};

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
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    footer: Footer,
    layout: Layout,
    size: u64,
    /// Ask the file about allocated blocks too ([`crate::OpenOptions::host_zeros`]).
    host_zeros: bool,
}

impl Vpc {
    /// Opens the image in `file`: the footer copy at 0 (a dynamic disk),
    /// or the footer at the end (a fixed one), as QEMU reads them.
    /// `host_zeros`: ask the file about the bytes of allocated blocks, not
    /// only a fixed disk's ([`crate::OpenOptions::host_zeros`]): QEMU
    /// extends the file past a new block without writing it, so most of a
    /// dynamic disk's block can be a hole in the file.
    pub fn open(
        file: StorageRef,
        writable: bool,
        calc: SizeCalc,
        host_zeros: bool,
    ) -> Result<Mapped<Vpc>> {
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
            if writable {
                // The BAT changes in place; the footer moves along at the end.
                crate::in_order::check_in_place(&*file, "vpc", "BAT", h.table_offset + bat_len)?;
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
        Ok(Mapped::new(Vpc {
            layers: Layers {
                data: file,
                backing: None,
                writable,
            },
            footer,
            layout,
            size,
            host_zeros,
        }))
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
}

impl MappedFormat for Vpc {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.size
    }

    fn layers(&self) -> &Layers {
        &self.layers
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
                let bat = sync::read(bat);
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

    fn data_may_be_sparse(&self) -> bool {
        // QEMU asks the file about a fixed disk's bytes.
        self.host_zeros || matches!(self.layout, Layout::Fixed)
    }

    fn unit(&self) -> u64 {
        match &self.layout {
            Layout::Fixed => 1 << 20,
            Layout::Dynamic { block_size, .. } => *block_size,
        }
    }

    fn capabilities(&self) -> Capabilities {
        mapped::image_capabilities(self.layers.writable, false, false)
    }

    fn describe(&self) -> String {
        format!("vpc {}", self.layers.data.location())
    }

    /// Zeros are written, never marked: a fast zero is refused.
    fn zero(&self, g: u64, len: u64, flags: ZeroFlags) -> Result<Zeroed> {
        if flags.fast {
            return Err(Error::new(ErrorKind::NotSupported, "VHD zeroes by writing"));
        }
        mapped::zero_where_zeros(self, g, len)
    }

    /// A new block where the footer is: its bitmap (every sector present,
    /// as QEMU writes it), then the footer past it; the data alone is
    /// written (the file's new space reads as zeros).
    fn allocate(&self, g: u64, _data: &[u8]) -> Result<Allocation> {
        let Layout::Dynamic {
            block_size,
            bitmap_size,
            next_free,
            ..
        } = &self.layout
        else {
            return Err(Error::io("a fixed VHD allocates nothing"));
        };
        let mut next = lock(next_free);
        let start = *next;
        if start / 512 >= FREE as u64 {
            return Err(Error::new(ErrorKind::NoSpace, "VHD image is full"));
        }
        self.layers
            .data
            .write_extend(&vec![0xFF; *bitmap_size as usize], start)?;
        *next = start + bitmap_size + block_size;
        self.layers
            .data
            .write_extend(self.footer.to_bytes(), *next)?;
        Ok(Allocation {
            guest: g / block_size * block_size,
            len: *block_size,
            host: start + bitmap_size,
            fill: Fill::DataOnly,
        })
    }

    /// The BAT entry, on disk and then in memory.
    fn commit(&self, a: Allocation) -> Result<()> {
        let Layout::Dynamic {
            table_offset,
            block_size,
            bitmap_size,
            bat,
            ..
        } = &self.layout
        else {
            return Ok(());
        };
        let block = a.guest / block_size;
        let entry = ((a.host - bitmap_size) / 512) as u32;
        self.layers
            .data
            .write_extend(&entry.to_be_bytes(), table_offset + block * 4)?;
        sync::write(bat)[block as usize] = entry;
        Ok(())
    }
}
