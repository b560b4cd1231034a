//! A space-efficient sparse extent (ESXi's seSparse), read only as in
//! QEMU: a constant header, a volatile header, a grain directory of
//! 64-bit entries naming grain tables of 4096 entries, each naming a 4 KiB
//! grain (or zeros). The journal is never replayed: a disk that needs it
//! is refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use diskit_core::sync::lock;
use diskit_core::{Error, Result, StorageRef};

use super::header::SECTOR;
use crate::mapped::{Backing, Layers, MappedFormat, Place};

const CONST_MAGIC: u64 = 0xcafe_babe;
const VOLATILE_MAGIC: u64 = 0xcafe_cafe;
const VERSION: u64 = 0x2_0000_0001;
/// Sectors per grain.
const GRAIN_SECTORS: u64 = 8;
/// Sectors per grain table.
const TABLE_SECTORS: u64 = 64;
/// Entries per grain table.
const TABLE_ENTRIES: u64 = TABLE_SECTORS * SECTOR / 8;
/// Bytes per grain.
const GRAIN: u64 = GRAIN_SECTORS * SECTOR;
/// The most grain directory entries QEMU accepts.
const MAX_L1_ENTRIES: u64 = 32 << 20;
/// The grain tables kept in memory at most.
const CACHED_TABLES: usize = 512;

fn u64_at(b: &[u8], i: usize) -> u64 {
    crate::bytes::le64(b, i * 8)
}

/// An open seSparse extent.
pub struct SeSparseExtent {
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    capacity: u64,
    /// The grain directory (entries inside the file).
    gd: Vec<u64>,
    tables_at: u64,
    grains_at: u64,
    tables: Mutex<HashMap<u64, Arc<Vec<u64>>>>,
}

impl SeSparseExtent {
    /// Opens the extent in `file`, checking both headers as QEMU does.
    pub fn open(
        file: StorageRef,
        writable: bool,
        backing: Option<Backing>,
    ) -> Result<SeSparseExtent> {
        if writable {
            return Err(Error::unsupported(
                "No write support for seSparse images available",
            ));
        }
        let mut h = vec![0u8; SECTOR as usize];
        file.read_padded(&mut h, 0)?;
        let f = |i| u64_at(&h, i);
        if f(0) != CONST_MAGIC {
            return Err(Error::invalid(format!(
                "Bad const header magic: 0x{:016x}",
                f(0)
            )));
        }
        if f(1) != VERSION {
            return Err(Error::unsupported(format!(
                "Unsupported version: 0x{:016x}",
                f(1)
            )));
        }
        if f(3) != GRAIN_SECTORS {
            return Err(Error::unsupported(format!(
                "Unsupported grain size: {}",
                f(3)
            )));
        }
        if f(4) != TABLE_SECTORS {
            return Err(Error::unsupported(format!(
                "Unsupported grain table size: {}",
                f(4)
            )));
        }
        if f(5) != 0 {
            return Err(Error::unsupported(format!(
                "Unsupported flags: 0x{:016x}",
                f(5)
            )));
        }
        if (6..10).any(|i| f(i) != 0) {
            return Err(Error::unsupported(format!(
                "Unsupported reserved bits: 0x{:016x} 0x{:016x} 0x{:016x} 0x{:016x}",
                f(6),
                f(7),
                f(8),
                f(9)
            )));
        }
        if h[26 * 8..].iter().any(|&b| b != 0) {
            return Err(Error::unsupported(
                "Unsupported non-zero const header padding",
            ));
        }
        let mut v = vec![0u8; SECTOR as usize];
        file.read_padded(&mut v, f(10).saturating_mul(SECTOR))?;
        let vf = |i| u64_at(&v, i);
        if vf(0) != VOLATILE_MAGIC {
            return Err(Error::invalid(format!(
                "Bad volatile header magic: 0x{:016x}",
                vf(0)
            )));
        }
        if vf(3) != 0 {
            return Err(Error::unsupported(
                "Image is dirty, Replaying journal not supported",
            ));
        }
        if v[32..].iter().any(|&b| b != 0) {
            return Err(Error::unsupported(
                "Unsupported non-zero volatile header padding",
            ));
        }
        let len = file.file_len()?;
        let gd_at = f(16).saturating_mul(SECTOR);
        // Entries past the end of the file read as 0: not held.
        let declared = f(17).saturating_mul(SECTOR / 8);
        if declared > MAX_L1_ENTRIES {
            return Err(Error::invalid("L1 size too big"));
        }
        let entries = declared.min(len.saturating_sub(gd_at) / 8);
        let mut raw = vec![0u8; (entries * 8) as usize];
        file.read_padded(&mut raw, gd_at)?;
        let gd = crate::bytes::le64s(&raw);
        Ok(SeSparseExtent {
            layers: Layers {
                data: file,
                backing,
                writable: false,
            },
            capacity: f(2).saturating_mul(SECTOR),
            gd,
            tables_at: f(18).saturating_mul(SECTOR),
            grains_at: f(24).saturating_mul(SECTOR),
            tables: Mutex::new(HashMap::new()),
        })
    }

    /// Guest bytes the extent holds.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The extent's file.
    pub fn file(&self) -> &StorageRef {
        &self.layers.data
    }

    /// The bytes of a grain.
    pub fn grain(&self) -> u64 {
        GRAIN
    }

    fn table(&self, l1: u64) -> Result<Option<Arc<Vec<u64>>>> {
        let e = self.gd.get(l1 as usize).copied().unwrap_or(0);
        if e == 0 {
            return Ok(None);
        }
        if e >> 32 != 0x1000_0000 {
            return Err(Error::io(format!(
                "seSparse grain directory entry {l1} is invalid: 0x{e:016x}"
            )));
        }
        if let Some(t) = lock(&self.tables).get(&l1) {
            return Ok(Some(t.clone()));
        }
        let index = e & 0xFFFF_FFFF;
        let at = self
            .tables_at
            .saturating_add(index * TABLE_SECTORS * SECTOR);
        let mut raw = vec![0u8; (TABLE_ENTRIES * 8) as usize];
        self.layers.data.read_padded(&mut raw, at)?;
        let t = Arc::new(crate::bytes::le64s(&raw));
        let mut c = lock(&self.tables);
        if c.len() >= CACHED_TABLES {
            c.clear();
        }
        c.insert(l1, t.clone());
        Ok(Some(t))
    }

    /// The place of grain table entry `e` (`Err` for an invalid one).
    fn place_of(&self, e: u64, within: u64) -> Result<Place> {
        Ok(match e >> 60 {
            0 if e == 0 => Place::Unallocated { alloc: None },
            1 | 2 => Place::Zero { alloc: None },
            3 => {
                let index = ((e >> 48) & 0xFFF) | ((e & 0xFFFF_FFFF_FFFF) << 12);
                Place::Data(
                    self.grains_at
                        .saturating_add(index.saturating_mul(GRAIN))
                        .saturating_add(within),
                )
            }
            _ => {
                return Err(Error::io(format!(
                    "seSparse grain table entry is invalid: 0x{e:016x}"
                )));
            }
        })
    }

    /// Where guest byte `g` lives and for how long (one grain table at
    /// most, merging grains of one kind).
    pub fn locate(&self, g: u64, max: u64) -> Result<(u64, Place)> {
        let span = TABLE_ENTRIES * GRAIN;
        let in_table = (span - g % span).min(max);
        let Some(t) = self.table(g / span)? else {
            return Ok((in_table, Place::Unallocated { alloc: None }));
        };
        let first = ((g % span) / GRAIN) as usize;
        let place = self.place_of(t[first], g % GRAIN)?;
        let mut n = (GRAIN - g % GRAIN).min(in_table);
        let mut i = first + 1;
        while n < in_table && i < t.len() {
            let next = self.place_of(t[i], 0)?;
            let same = match (place, next) {
                (Place::Data(h), Place::Data(h2)) => {
                    Some(h2) == (h - g % GRAIN).checked_add((i - first) as u64 * GRAIN)
                }
                (a, b) => {
                    !matches!(a, Place::Data(_))
                        && std::mem::discriminant(&a) == std::mem::discriminant(&b)
                }
            };
            if !same {
                break;
            }
            n = (n + GRAIN).min(in_table);
            i += 1;
        }
        Ok((n, place))
    }
}

impl MappedFormat for SeSparseExtent {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.capacity
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        let (n, p) = self.locate(g, max)?;
        Ok((n, p, None))
    }

    fn unit(&self) -> u64 {
        GRAIN
    }

    fn describe(&self) -> String {
        format!("vmdk seSparse extent {}", self.layers.data.location())
    }
}
