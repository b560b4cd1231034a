//! A sparse extent: guest grains mapped through a grain directory and
//! grain tables (hosted KDMV extents, streamOptimized ones with
//! compressed grains, and ESX COWD ones). It answers where a guest range
//! lives and where new grains go ([`MappedFormat`]); the generic layer
//! moves the bytes. New grains are whole grains at the end of the file,
//! data first and the table entries after (in both directories), so that
//! a crash leaks grains at worst.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use diskit_core::sync::{self, lock};
use diskit_core::{DeviceRef, Error, ErrorKind, Result, StorageRef, ZeroFlags};

use super::header::{
    COWD_GTES, CowdHeader, FLAG_MARKERS, FLAG_RGD, GD_AT_END, GRAIN_MARKER, GTE_ZERO, SECTOR,
    SparseHeader,
};
use crate::mapped::{Allocation, Backing, Fill, Layers, MappedFormat, Place, Zeroed};

/// The largest compressed grain read (bytes).
const MAX_COMPRESSED_GRAIN: u64 = 16 << 20;

/// Grain tables kept in memory at most (bytes), beyond which the cache
/// starts over.
const TABLE_CACHE_BYTES: usize = 32 << 20;

/// How a sparse extent is laid out, from its header.
#[derive(Debug, Clone)]
pub struct Geometry {
    /// Guest bytes the extent holds.
    pub capacity: u64,
    /// Bytes per grain.
    pub grain: u64,
    /// Entries per grain table.
    pub gtes: u64,
    /// Grain directory (bytes into the file).
    pub gd_at: u64,
    /// Redundant grain directory, if kept (bytes).
    pub rgd_at: Option<u64>,
    /// Entries of the directory.
    pub l1_entries: u64,
    /// GTE 1 is a zero grain.
    pub zeroed_grain: bool,
    /// Grains are deflate-compressed.
    pub compressed: bool,
    /// Grains carry markers.
    pub markers: bool,
    /// The header's version (3: read-only unless compressed).
    pub version: u32,
}

impl Geometry {
    /// The layout a checked KDMV header gives.
    pub fn of(h: &SparseHeader) -> Geometry {
        Geometry {
            capacity: h.capacity.saturating_mul(SECTOR),
            grain: h.grain_sectors * SECTOR,
            gtes: u64::from(h.gtes_per_gt),
            gd_at: h.gd_offset.saturating_mul(SECTOR),
            rgd_at: (h.flags & FLAG_RGD != 0 && h.rgd_offset != 0)
                .then(|| h.rgd_offset.saturating_mul(SECTOR)),
            l1_entries: h.l1_entries(),
            zeroed_grain: h.zeroed_grain(),
            compressed: h.compressed(),
            markers: h.flags & FLAG_MARKERS != 0,
            version: h.version,
        }
    }

    /// The layout of a COWD header.
    pub fn of_cowd(h: &CowdHeader) -> Geometry {
        let grain = h.grain_sectors * SECTOR;
        let per = u64::from(COWD_GTES) * h.grain_sectors;
        Geometry {
            capacity: h.capacity * SECTOR,
            grain,
            gtes: u64::from(COWD_GTES),
            gd_at: h.gd_offset * SECTOR,
            rgd_at: None,
            l1_entries: h.gd_entries.min(h.capacity.div_ceil(per)),
            zeroed_grain: false,
            compressed: false,
            markers: false,
            version: 1,
        }
    }

    /// Bytes of guest data one grain table covers.
    fn table_span(&self) -> u64 {
        self.grain * self.gtes
    }

    /// Bytes of one grain table on disk.
    fn table_bytes(&self) -> u64 {
        self.gtes * 4
    }
}

/// Grain tables read so far, by directory index.
#[derive(Default)]
struct Tables {
    map: HashMap<u64, Arc<Vec<u32>>>,
    bytes: usize,
    /// Bumped by every table change: a table read from the file before a
    /// change may be older than it, and is not cached.
    generation: u64,
}

/// An open sparse extent.
pub struct SparseExtent {
    /// Its data storage, the image below and whether it takes writes.
    layers: Layers,
    geo: Geometry,
    /// The directory: the sector of each grain table (0: none).
    gd: RwLock<Vec<u32>>,
    /// The redundant directory, when kept.
    rgd: RwLock<Vec<u32>>,
    tables: Mutex<Tables>,
    /// Where the next grain goes (bytes); held while tables change.
    next: Mutex<u64>,
    /// The last grain decompressed: its host offset and contents.
    last_grain: Mutex<Option<(u64, Arc<Vec<u8>>)>>,
}

/// Reads a directory of `n` u32 entries at `at`.
fn read_dir(file: &StorageRef, at: u64, n: u64) -> Result<Vec<u32>> {
    let mut raw = vec![0u8; (n * 4) as usize];
    file.read_padded(&mut raw, at)?;
    Ok(crate::bytes::le32s(&raw))
}

impl SparseExtent {
    /// Opens the sparse extent in `file` (its first sector read as
    /// `head`); `backing` is what this extent's unallocated grains read.
    pub fn open(
        file: StorageRef,
        head: &[u8],
        writable: bool,
        backing: Option<Backing>,
    ) -> Result<SparseExtent> {
        let len = file.file_len()?;
        let geo = if &head[..4] == super::header::COWD {
            Geometry::of_cowd(&CowdHeader::parse(head)?)
        } else {
            let mut h = SparseHeader::parse(head);
            if h.gd_offset == GD_AT_END {
                // A stream keeps its real header in the footer.
                if len < 1536 {
                    return Err(Error::invalid("Failed to read footer"));
                }
                let mut tail = vec![0u8; 1536];
                file.read_padded(&mut tail, len - 1536)?;
                h = super::header::parse_footer(&tail)?;
                // New grains would go after the footer, which must stay
                // last: such a stream is read, never written.
                if writable {
                    return Err(Error::unsupported(
                        "A streamOptimized disk with its grain directory at its end is read only",
                    ));
                }
            }
            h.check(len, writable)?;
            // A compressed grain is read and inflated whole: streams use
            // 64 KiB grains, and a huge one is refused rather than read.
            if h.compressed() && h.grain_sectors * SECTOR > MAX_COMPRESSED_GRAIN {
                return Err(Error::invalid("Invalid granularity, image may be corrupt"));
            }
            Geometry::of(&h)
        };
        // Directory entries past the end of the file read as 0 (no
        // table): only those inside it are kept, so that a header claiming
        // a huge disk costs no memory.
        let in_file = |at: u64| geo.l1_entries.min(len.saturating_sub(at) / 4);
        let gd = read_dir(&file, geo.gd_at, in_file(geo.gd_at))
            .map_err(|e| e.context("Could not read l1 table from extent"))?;
        let rgd = match geo.rgd_at {
            Some(at) => read_dir(&file, at, in_file(at))
                .map_err(|e| e.context("Could not read l1 backup table from extent"))?,
            None => Vec::new(),
        };
        // The directories must be addressable where they are.
        for at in std::iter::once(geo.gd_at).chain(geo.rgd_at) {
            if at
                .checked_add(geo.l1_entries * 4)
                .is_none_or(|end| end > 1 << 62)
            {
                return Err(Error::invalid("Invalid grain directory offset"));
            }
        }
        if writable {
            // The directories and tables change in place as grains come.
            let mut end = 0;
            for at in std::iter::once(geo.gd_at).chain(geo.rgd_at) {
                end = end.max(at + geo.l1_entries * 4);
            }
            for &t in gd.iter().chain(rgd.iter()).filter(|&&t| t != 0) {
                end = end.max(u64::from(t) * SECTOR + geo.table_bytes());
            }
            crate::in_order::check_in_place(&*file, "vmdk", "grain directories and tables", end)?;
        }
        // New grains go after everything the extent holds: the end of the
        // file, and metadata reaching past it (directories, tables). On
        // storage of a fixed size (an NBD export, a block device) the end
        // of the storage says nothing: the end is where the last table or
        // grain the extent points at ends.
        let fixed = file.is_fixed_size();
        let mut end = if fixed { 0 } else { len };
        for at in std::iter::once(geo.gd_at).chain(geo.rgd_at) {
            end = end.max(at + geo.l1_entries * 4);
        }
        for &t in gd.iter().chain(rgd.iter()) {
            if t != 0 {
                end = end.max(u64::from(t) * SECTOR + geo.table_bytes());
                if fixed {
                    for &g in &read_dir(&file, u64::from(t) * SECTOR, geo.gtes)? {
                        if g > GTE_ZERO {
                            end = end.max(u64::from(g) * SECTOR + geo.grain);
                        }
                    }
                }
            }
        }
        let next = end.div_ceil(geo.grain) * geo.grain;
        Ok(SparseExtent {
            layers: Layers {
                data: file,
                backing,
                writable,
            },
            gd: RwLock::new(gd),
            rgd: RwLock::new(rgd),
            tables: Mutex::new(Tables::default()),
            next: Mutex::new(next),
            last_grain: Mutex::new(None),
            geo,
        })
    }

    /// The extent's layout.
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    /// The extent's file.
    pub fn file(&self) -> &StorageRef {
        &self.layers.data
    }

    /// Guest bytes the extent holds.
    pub fn capacity(&self) -> u64 {
        self.geo.capacity
    }

    /// The grain table at directory index `l1`, if it has one.
    fn table(&self, l1: u64) -> Result<Option<Arc<Vec<u32>>>> {
        let sector = match sync::read(&self.gd).get(l1 as usize) {
            Some(&s) if s != 0 => s,
            _ => return Ok(None),
        };
        loop {
            let generation = {
                let c = lock(&self.tables);
                if let Some(t) = c.map.get(&l1) {
                    return Ok(Some(t.clone()));
                }
                c.generation
            };
            let t = Arc::new(read_dir(
                &self.layers.data,
                u64::from(sector) * SECTOR,
                self.geo.gtes,
            )?);
            let mut c = lock(&self.tables);
            if c.generation != generation {
                // A table changed while this one was read: it may be the
                // one, and the copy read may be older than the change.
                continue;
            }
            if let Some(t) = c.map.get(&l1) {
                return Ok(Some(t.clone()));
            }
            let bytes = t.len() * 4;
            if c.bytes + bytes > TABLE_CACHE_BYTES {
                c.map.clear();
                c.bytes = 0;
            }
            c.bytes += bytes;
            c.map.insert(l1, t.clone());
            return Ok(Some(t));
        }
    }

    /// The place of grain table entry `e` for guest byte `g`.
    fn place_of(&self, e: u32, g: u64) -> Place {
        let within = g % self.geo.grain;
        match e {
            0 => Place::Unallocated { alloc: None },
            GTE_ZERO if self.geo.zeroed_grain => Place::Zero { alloc: None },
            _ if self.geo.compressed => Place::Compressed {
                offset: u64::from(e) * SECTOR,
                size: 2 * self.geo.grain + GRAIN_MARKER as u64,
                skip: within,
            },
            _ => Place::Data(u64::from(e) * SECTOR + within),
        }
    }

    /// Where guest byte `g` lives and for how long (within one grain
    /// table, merging grains of one kind: contiguous data, zeros,
    /// unallocated).
    pub fn locate(&self, g: u64, max: u64) -> Result<(u64, Place)> {
        let span = self.geo.table_span();
        let l1 = g / span;
        if l1 >= self.geo.l1_entries {
            // (A COWD directory shorter than its capacity, as QEMU.)
            return Err(Error::io(format!(
                "guest offset {g} is past the extent's grain directory"
            )));
        }
        let in_table = (span - g % span).min(max);
        let Some(t) = self.table(l1)? else {
            return Ok((in_table, Place::Unallocated { alloc: None }));
        };
        let grain = self.geo.grain;
        let first = ((g % span) / grain) as usize;
        let e0 = t[first];
        let place = self.place_of(e0, g);
        let mut n = (grain - g % grain).min(in_table);
        let mut i = first + 1;
        while n < in_table && i < t.len() {
            let e = t[i];
            let same = match place {
                Place::Data(_) => {
                    u64::from(e) == u64::from(e0) + (i - first) as u64 * grain / SECTOR
                }
                Place::Zero { .. } | Place::Unallocated { .. } => {
                    std::mem::discriminant(&self.place_of(e, 0)) == std::mem::discriminant(&place)
                }
                // (vmdk shares no grains.)
                Place::Compressed { .. } | Place::Shared(_) => false,
            };
            if !same {
                break;
            }
            n = (n + grain).min(in_table);
            i += 1;
        }
        Ok((n, place))
    }

    /// Reads a compressed grain's bytes `skip` into it.
    fn read_grain(&self, offset: u64, skip: u64, buf: &mut [u8]) -> Result<()> {
        let grain = self.geo.grain;
        let cached = lock(&self.last_grain)
            .as_ref()
            .filter(|(at, _)| *at == offset)
            .map(|(_, d)| d.clone());
        let short = |have: usize, end: usize| {
            Error::io(format!(
                "compressed grain at host offset {offset} holds {have} bytes, not {end}"
            ))
        };
        let end = skip as usize + buf.len();
        if cached.is_none() && skip == 0 && buf.len() as u64 == grain {
            // The whole grain (a copy reads grain after grain): inflated
            // straight into the caller's buffer, and not kept.
            let n = self.inflate_grain(offset, buf)?;
            return if n == buf.len() {
                Ok(())
            } else {
                Err(short(n, end))
            };
        }
        let data = match cached {
            Some(d) => d,
            None => {
                let mut out = vec![0u8; grain as usize];
                let n = self.inflate_grain(offset, &mut out)?;
                out.truncate(n);
                let d = Arc::new(out);
                *lock(&self.last_grain) = Some((offset, d.clone()));
                d
            }
        };
        if end > data.len() {
            return Err(short(data.len(), end));
        }
        buf.copy_from_slice(&data[skip as usize..end]);
        Ok(())
    }

    /// Inflates the compressed grain at host `offset` into `out` (a grain
    /// long); returns how many bytes it holds. The compressed bytes and the
    /// inflater are the thread's own, reused from grain to grain.
    fn inflate_grain(&self, offset: u64, out: &mut [u8]) -> Result<usize> {
        thread_local! {
            static SCRATCH: std::cell::RefCell<(Vec<u8>, Option<flate2::Decompress>)> =
                const { std::cell::RefCell::new((Vec::new(), None)) };
        }
        let grain = self.geo.grain;
        let fault = || {
            Error::io(format!(
                "compressed grain at host offset {offset} does not decompress"
            ))
        };
        SCRATCH.with_borrow_mut(|(raw, inflater)| {
            // Most grains fit in a grain and a page; a bigger one (or one
            // without a marker, whose length is unknown) is read on up to
            // twice the grain.
            let first = (grain + 4096) as usize + GRAIN_MARKER;
            if raw.len() < first {
                raw.resize(first, 0);
            }
            self.layers.data.read_padded(&mut raw[..first], offset)?;
            let (from, len) = if self.geo.markers {
                let size = u32::from_le_bytes(raw[8..12].try_into().expect("4 bytes")) as u64;
                if size == 0 || size > 2 * grain {
                    return Err(fault());
                }
                (GRAIN_MARKER, size as usize)
            } else {
                (0, (2 * grain) as usize)
            };
            if from + len > first {
                if raw.len() < from + len {
                    raw.resize(from + len, 0);
                }
                self.layers
                    .data
                    .read_padded(&mut raw[first..from + len], offset + first as u64)?;
            }
            let z = match inflater {
                Some(z) => {
                    z.reset(true);
                    z
                }
                None => inflater.insert(flate2::Decompress::new(true)),
            };
            // The stream must end within a grain (QEMU asks Z_OK of
            // uncompress, which says as much).
            let status = z
                .decompress(&raw[from..from + len], out, flate2::FlushDecompress::Finish)
                .map_err(|_| fault())?;
            if status != flate2::Status::StreamEnd {
                return Err(fault());
            }
            Ok(z.total_out() as usize)
        })
    }

    /// Makes whole grains of zeros at guest `g` (`len` bytes, grain
    /// aligned) where the extent can say so in its tables (zeroed-grain
    /// extents); false when it cannot.
    pub fn zero_grains(&self, g: u64, len: u64) -> Result<bool> {
        if !self.geo.zeroed_grain
            || !g.is_multiple_of(self.geo.grain)
            || !len.is_multiple_of(self.geo.grain)
        {
            return Ok(false);
        }
        let mut next = lock(&self.next);
        let mut pos = g;
        while pos < g + len {
            let span = self.geo.table_span();
            let n = (span - pos % span).min(g + len - pos);
            let count = n / self.geo.grain;
            self.set_entries(&mut next, pos, &vec![GTE_ZERO; count as usize])?;
            pos += n;
        }
        Ok(true)
    }

    /// Compresses the whole grains of `buf` at guest `g`, each behind
    /// its marker and padded to a sector: the frames end to end, and where
    /// each starts.
    fn compress(&self, buf: &[u8], g: u64) -> Result<(Vec<u8>, Vec<u64>)> {
        let grain = self.geo.grain;
        let end = g + buf.len() as u64;
        if !self.geo.markers
            || !g.is_multiple_of(grain)
            || (!end.is_multiple_of(grain) && end != self.geo.capacity)
        {
            return Err(Error::invalid(
                "streamOptimized images take whole grains written once",
            ));
        }
        let mut bytes = Vec::new();
        let mut starts = Vec::new();
        for (i, chunk) in buf.chunks(grain as usize).enumerate() {
            let lba = (g + i as u64 * grain) / SECTOR;
            let mut enc =
                flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            std::io::Write::write_all(&mut enc, chunk)?;
            let data = enc.finish()?;
            starts.push(bytes.len() as u64);
            bytes.extend_from_slice(&lba.to_le_bytes());
            bytes.extend_from_slice(&(data.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&data);
            bytes.resize(
                (bytes.len() as u64).div_ceil(SECTOR) as usize * SECTOR as usize,
                0,
            );
        }
        Ok((bytes, starts))
    }

    /// Takes `len` bytes at the end of the file for new grains.
    fn take_space(&self, len: u64) -> Result<u64> {
        let mut next = lock(&self.next);
        let host = *next;
        if (host + len) / SECTOR > u64::from(u32::MAX) {
            return Err(Error::new(ErrorKind::NoSpace, "VMDK extent is full"));
        }
        *next = host + len;
        Ok(host)
    }

    /// Sets the table entries of consecutive grains from guest `g` (in
    /// one grain table), in both directories, making the table first if
    /// the directory has none. Called with the allocation lock held
    /// (`next` is the cursor it guards).
    fn set_entries(&self, next: &mut u64, g: u64, entries: &[u32]) -> Result<()> {
        let span = self.geo.table_span();
        let l1 = g / span;
        let first = (g % span) / self.geo.grain;
        let gt = sync::read(&self.gd).get(l1 as usize).copied().unwrap_or(0);
        let gt = if gt == 0 {
            self.new_table(next, l1)?
        } else {
            gt
        };
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_le_bytes()).collect();
        let rgt = sync::read(&self.rgd).get(l1 as usize).copied();
        if let Some(r) = rgt.filter(|&r| r != 0) {
            self.layers
                .data
                .write_extend(&bytes, u64::from(r) * SECTOR + first * 4)?;
        }
        self.layers
            .data
            .write_extend(&bytes, u64::from(gt) * SECTOR + first * 4)?;
        let mut c = lock(&self.tables);
        let table = match c.map.get(&l1) {
            Some(t) => {
                let mut t = (**t).clone();
                t[first as usize..first as usize + entries.len()].copy_from_slice(entries);
                t
            }
            None => {
                drop(c);
                let t = read_dir(&self.layers.data, u64::from(gt) * SECTOR, self.geo.gtes)?;
                c = lock(&self.tables);
                t
            }
        };
        c.generation += 1;
        if c.bytes + table.len() * 4 > TABLE_CACHE_BYTES {
            c.map.clear();
            c.bytes = 0;
        }
        if c.map.insert(l1, Arc::new(table)).is_none() {
            c.bytes += self.geo.table_bytes() as usize;
        }
        Ok(())
    }

    /// Makes a grain table (and its redundant copy) for directory index
    /// `l1`, which has none (VMware leaves tables out): zeroed tables at
    /// the end of the file, then the directory entries.
    fn new_table(&self, next: &mut u64, l1: u64) -> Result<u32> {
        let tb = self.geo.table_bytes().div_ceil(SECTOR) * SECTOR;
        let zeros = vec![0u8; tb as usize];
        let place = |next: &mut u64| -> Result<u32> {
            let at = *next;
            self.layers.data.write_extend(&zeros, at)?;
            *next = (at + tb).div_ceil(self.geo.grain) * self.geo.grain;
            u32::try_from(at / SECTOR)
                .map_err(|_| Error::new(ErrorKind::NoSpace, "VMDK extent is full"))
        };
        let gt = place(next)?;
        let rgt = match self.geo.rgd_at {
            Some(_) => Some(place(next)?),
            None => None,
        };
        if let (Some(at), Some(r)) = (self.geo.rgd_at, rgt) {
            self.layers
                .data
                .write_extend(&r.to_le_bytes(), at + l1 * 4)?;
            set_entry(&mut sync::write(&self.rgd), l1, r);
        }
        self.layers
            .data
            .write_extend(&gt.to_le_bytes(), self.geo.gd_at + l1 * 4)?;
        set_entry(&mut sync::write(&self.gd), l1, gt);
        Ok(gt)
    }
}

/// Sets directory entry `l1`, growing the directory held in memory (it
/// holds only the entries inside the file).
fn set_entry(dir: &mut Vec<u32>, l1: u64, v: u32) {
    let i = l1 as usize;
    if dir.len() <= i {
        dir.resize(i + 1, 0);
    }
    dir[i] = v;
}

impl MappedFormat for SparseExtent {
    type Hold<'a> = ();

    fn guest_size(&self) -> u64 {
        self.geo.capacity
    }

    fn layers(&self) -> &Layers {
        &self.layers
    }

    fn lookup(&self, g: u64, max: u64, _hold: bool) -> Result<(u64, Place, Option<()>)> {
        let (n, p) = self.locate(g, max)?;
        Ok((n, p, None))
    }

    fn read_compressed(&self, offset: u64, _size: u64, skip: u64, buf: &mut [u8]) -> Result<()> {
        self.read_grain(offset, skip, buf)
    }

    fn unit(&self) -> u64 {
        self.geo.grain
    }

    fn describe(&self) -> String {
        format!("vmdk extent {}", self.layers.data.location())
    }

    /// Whole grains at the end of the file (what they held before copied
    /// around the data), or a stream's compressed grains packed there.
    fn allocate(&self, g: u64, data: &[u8]) -> Result<Allocation> {
        let grain = self.geo.grain;
        if let (_, Place::Compressed { .. }) = self.locate(g, 1)? {
            return Err(Error::io(
                "Could not write to allocated cluster for streamOptimized",
            ));
        }
        if self.geo.compressed {
            let (bytes, starts) = self.compress(data, g)?;
            return Ok(Allocation {
                guest: g,
                len: starts.len() as u64 * grain,
                host: self.take_space(bytes.len() as u64)?,
                fill: Fill::Encoded { bytes, starts },
            });
        }
        let start = g / grain * grain;
        let len = (g + data.len() as u64).div_ceil(grain) * grain - start;
        Ok(Allocation {
            guest: start,
            len,
            host: self.take_space(len)?,
            fill: Fill::Whole,
        })
    }

    /// The table entries (in both directories), once the grains are
    /// written.
    fn commit(&self, a: Allocation) -> Result<()> {
        let entries: Vec<u32> = match &a.fill {
            Fill::Encoded { starts, .. } => starts
                .iter()
                .map(|s| ((a.host + s) / SECTOR) as u32)
                .collect(),
            _ => (0..a.len / self.geo.grain)
                .map(|i| ((a.host + i * self.geo.grain) / SECTOR) as u32)
                .collect(),
        };
        let mut next = lock(&self.next);
        self.set_entries(&mut next, a.guest, &entries)
    }

    /// Runs that read as zeros stay; whole grains become zero grains where
    /// the extent has them; the rest is written.
    fn zero(&self, g: u64, len: u64, _flags: ZeroFlags) -> Result<Zeroed> {
        let grain = self.geo.grain;
        let (m, place) = self.locate(g, len)?;
        let zero_already = match place {
            Place::Zero { .. } => true,
            Place::Unallocated { .. } => self.layers.backing.is_none(),
            _ => false,
        };
        if zero_already {
            return Ok(Zeroed::Done(m));
        }
        if !g.is_multiple_of(grain) {
            return Ok(Zeroed::Write(m.min(grain - g % grain)));
        }
        let whole = m / grain * grain;
        if whole > 0 && self.zero_grains(g, whole)? {
            Ok(Zeroed::Done(whole))
        } else {
            Ok(Zeroed::Write(m))
        }
    }
}

/// The image below as one extent sees it: the backing device from the
/// extent's first guest byte on.
pub fn shifted_backing(below: &Backing, start: u64) -> Option<Backing> {
    if start >= below.size {
        return None;
    }
    if start == 0 {
        return Some(Backing {
            device: below.device.clone(),
            size: below.size,
        });
    }
    let device: DeviceRef = Arc::new(Shifted {
        inner: below.device.clone(),
        start,
        size: below.size - start,
    });
    Some(Backing {
        device,
        size: below.size - start,
    })
}

/// A device seen from `start` on (reads and extents only).
struct Shifted {
    inner: DeviceRef,
    start: u64,
    size: u64,
}

impl diskit_core::BlockDevice for Shifted {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> diskit_core::Capabilities {
        self.inner.capabilities().read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset + self.start)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<diskit_core::Extent>> {
        self.inner.extents(offset + self.start, len)
    }
}
