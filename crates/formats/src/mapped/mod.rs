//! The generic half of every format: drivers describe, this layer moves
//! the bytes.
//!
//! A format answers one question, "where does this guest range live?"
//! ([`MappedFormat::lookup`] gives a [`Place`]: a plain offset in its data
//! storage, zeros, unallocated here (the backing image answers), or inside
//! a compressed unit). Reading, extents (with the depth of the layer that
//! answered and the host offset), backing reads past the backing image's
//! end, and zero-copy file views of data runs are written once, here, for
//! every format.
//!
//! The write half asks a format two more things: new space for a guest
//! range that is not data yet ([`MappedFormat::allocate`], the mapping
//! published by [`MappedFormat::commit`] once the bytes are written), and
//! how to make a range read as zeros ([`MappedFormat::zero`]). The
//! device that moves the bytes, [`Mapped`], holds the read-only guard,
//! the range checks, the split at the allocation unit, FUA as a flush and
//! the per-unit allocation lock once for every format (see `device.rs`),
//! qcow2 included: its copied flags, subclusters, compressed clusters and
//! runs of new clusters are answers to these questions.

use diskit_core::device::check_range;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, DeviceRef, Error, Extent, FileView, Result,
    StorageRef, ZeroFlags,
};

mod device;
#[cfg(test)]
mod tests;

pub use device::Mapped;

/// The image below an image.
#[derive(Clone)]
pub struct Backing {
    /// The backing device.
    pub device: DeviceRef,
    /// Its size (reads past it are zeros).
    pub size: u64,
}

/// What every mapped image holds alike: the storage its data lives in,
/// the image below it and whether it takes writes.
pub struct Layers {
    /// The storage that [`Place::Data`] offsets point into.
    pub data: StorageRef,
    /// The image below, if any.
    pub backing: Option<Backing>,
    /// Whether the image takes writes.
    pub writable: bool,
}

/// Where a guest range lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// At this offset of the format's data storage, byte for byte.
    Data(u64),
    /// As [`Place::Data`], in space other images share (qcow2's clusters
    /// that a snapshot also maps): read in place, written through new
    /// space.
    Shared(u64),
    /// Reads as zeros; `alloc` is host space kept for it, if any.
    Zero {
        /// Host bytes reserved for the range.
        alloc: Option<u64>,
    },
    /// Not allocated in this layer: the backing image answers (zeros
    /// without one); `alloc` is host space already reserved, if any.
    Unallocated {
        /// Host bytes reserved for the range.
        alloc: Option<u64>,
    },
    /// Inside a compressed unit of `size` bytes at `offset` of the data
    /// storage, `skip` bytes into its decompressed contents.
    Compressed {
        /// Where the compressed unit starts.
        offset: u64,
        /// How many bytes it may take.
        size: u64,
        /// Offset of the range in the decompressed unit.
        skip: u64,
    },
}

/// A format as the generic layer sees it.
pub trait MappedFormat: Send + Sync {
    /// What keeps a mapping valid while its bytes are read (a range of the
    /// format's own range lock); released when dropped.
    type Hold<'a>
    where
        Self: 'a;

    /// The guest-visible size.
    fn guest_size(&self) -> u64;

    /// Its data storage, the image below and whether it takes writes.
    fn layers(&self) -> &Layers;

    /// The storage that [`Place::Data`] offsets point into.
    fn data(&self) -> &StorageRef {
        &self.layers().data
    }

    /// The image below, if any.
    fn backing(&self) -> Option<&Backing> {
        self.layers().backing.as_ref()
    }

    /// Whether the image takes writes.
    fn writable(&self) -> bool {
        self.layers().writable
    }

    /// Whether mappings can change while the image is open (by default:
    /// it is writable): reads then hold their mapping, and no file view is
    /// given out (it would outlive the hold).
    fn mappings_change(&self) -> bool {
        self.writable()
    }

    /// Whether the format frees data space only when a change may
    /// deallocate (a discard, a zero with `may_trim`): a range it maps as
    /// data then keeps its space, holding its bytes or newer ones of the
    /// same range, while neither happens (see
    /// [`Mapped::keeping_allocations`]). False unless the format says so.
    fn frees_data_only_when_trimmed(&self) -> bool {
        false
    }

    /// Where guest byte `g` lives: the place of a prefix of `[g, g+max)`
    /// (`max > 0`) and its length (> 0, at most `max`). With `hold`, the
    /// mapping stays valid until the returned hold is dropped.
    fn lookup(&self, g: u64, max: u64, hold: bool) -> Result<(u64, Place, Option<Self::Hold<'_>>)>;

    /// Reads `buf.len()` bytes `skip` bytes into the compressed unit at
    /// `offset` (of at most `size` bytes); a format without compressed
    /// units never maps to one.
    fn read_compressed(&self, offset: u64, size: u64, skip: u64, buf: &mut [u8]) -> Result<()> {
        let _ = (offset, size, skip, buf);
        Err(Error::io(format!(
            "{}: no compressed units",
            self.describe()
        )))
    }

    /// A cipher whose IVs are guest sectors (qcow2's legacy AES): data read
    /// from [`Place::Data`] is decrypted with it. Encryption keyed by host
    /// offsets is the data storage's own business instead.
    fn guest_cipher(&self) -> Option<&crate::crypto::SectorCipher> {
        None
    }

    /// Whether data places may be holes in the storage that read as zeros
    /// and that extents should report (QEMU asks the file only for images
    /// with preallocated metadata).
    fn data_may_be_sparse(&self) -> bool {
        false
    }

    // The write half: what a format that takes writes adds.

    /// The allocation unit in guest bytes (> 0): writes are split at its
    /// multiples, and new space maps whole units, each held exclusively
    /// by the generic layer while it is allocated.
    fn unit(&self) -> u64;

    /// What the image can do: by default writes, flushes, FUA and extents,
    /// zeroing cheaper than writing zeros but never promised fast, no trim
    /// (see [`image_capabilities`]).
    fn capabilities(&self) -> Capabilities {
        image_capabilities(self.writable(), true, false)
    }

    /// Block size constraints.
    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 4096,
            maximum: 32 << 20,
        }
    }

    /// A short description for messages ("vdi /path").
    fn describe(&self) -> String;

    /// Called before guest bytes `[g, g+len)` change by a write, zeroing
    /// or discard (`len > 0`): headers a format updates at the first
    /// change of a session, dirty bitmaps.
    fn before_change(&self, g: u64, len: u64) -> Result<()> {
        let _ = (g, len);
        Ok(())
    }

    /// Where a write of `len` bytes at guest `g` goes in place, given the
    /// place `lookup` found for them: the host offset and how many of the
    /// bytes (> 0) go there, or `None` when new space must be allocated
    /// (by default data places take writes in place, and shared data
    /// never does).
    fn write_in_place(&self, g: u64, len: u64, place: Place) -> Result<Option<(u64, u64)>> {
        let _ = g;
        Ok(match place {
            Place::Data(h) => Some((h, len)),
            _ => None,
        })
    }

    /// How far from guest `g` an allocation may reach, where `lookup`
    /// found a run of `run` bytes that is not written in place, in a write
    /// of `max` bytes: by default the run. A format that allocates over
    /// following ranges needing new space whatever they map now (qcow2,
    /// as QEMU: unallocated, zero and shared clusters alike) says more;
    /// the generic layer holds the units that far, and [`allocate`] sees
    /// the data that far.
    ///
    /// [`allocate`]: MappedFormat::allocate
    fn allocation_span(&self, g: u64, run: u64, max: u64) -> u64 {
        let _ = (g, max);
        run
    }

    /// Reserves new space for guest `g` on, where `lookup` finds no data
    /// to write in place: the units from the one holding `g` for at most
    /// `data.len()` bytes past `g` (what the caller will write there),
    /// which the generic layer holds exclusively until [`commit`]. The
    /// new mapping must not be visible yet: the generic layer writes the
    /// bytes first (as [`Allocation::fill`] says), then commits. A format
    /// that keeps host space mapped for part of a unit (qcow2's clusters
    /// with subclusters) may map the rest of that unit only: the
    /// allocation then starts and ends inside it.
    ///
    /// [`commit`]: MappedFormat::commit
    fn allocate(&self, g: u64, data: &[u8]) -> Result<Allocation> {
        let _ = (g, data);
        Err(Error::unsupported(format!(
            "{}: writes are not supported",
            self.describe()
        )))
    }

    /// Points the guest range of `a` at its new space, whose bytes are
    /// written (the units are still held).
    fn commit(&self, a: Allocation) -> Result<()> {
        let _ = a;
        Ok(())
    }

    /// Makes a prefix of `[g, g+len)` read as zeros, with its units held
    /// exclusively: [`Zeroed::Done`] when the metadata says so (or the
    /// bytes read as zeros already), [`Zeroed::Write`] for a prefix whose
    /// zeros must be written (refused for fast zeroing). The default asks
    /// `lookup`: zeros and unallocated ranges without a backing image are
    /// zeros already, the rest is written.
    fn zero(&self, g: u64, len: u64, flags: ZeroFlags) -> Result<Zeroed> {
        let _ = flags;
        zero_where_zeros(self, g, len)
    }

    /// Drops the data of `[g, g+len)` where the format can (a hint: the
    /// contents are unspecified after it); by default nothing is dropped.
    fn discard(&self, g: u64, len: u64) -> Result<()> {
        let _ = (g, len);
        Ok(())
    }

    /// Makes every completed write durable (by default: the data
    /// storage's flush).
    fn flush(&self) -> Result<()> {
        self.data().flush()
    }

    /// Writes cached metadata before the image is dropped (see
    /// [`BlockDevice::close`]); by default nothing.
    fn close(&self) -> Result<()> {
        Ok(())
    }

    /// The extents of a prefix of `offset..offset+len`: by default the
    /// generic [`extents`].
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        extents(self, offset, len)
    }
}

/// New space a format reserved for a guest range (see
/// [`MappedFormat::allocate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The first guest byte the space maps: the start of the unit holding
    /// the write's first byte (or of the part of it newly mapped), at or
    /// before that byte.
    pub guest: u64,
    /// Guest bytes mapped: whole units (the last may end at the end of the
    /// image) or a part of one, past the write's first byte.
    pub len: u64,
    /// Where `guest` lies in the data storage.
    pub host: u64,
    /// What the generic layer writes there.
    pub fill: Fill,
}

/// What is written into new space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fill {
    /// The whole range: the data, and around it what the range read as
    /// before (the backing image's bytes, or zeros).
    Whole,
    /// The data alone: the rest of the new space reads as zeros already,
    /// and so did the range.
    DataOnly,
    /// As [`Fill::Whole`], onto space that reads as zeros already (new
    /// space past the end of its storage): zeros around the data are not
    /// written, but the space's last byte is, so that the storage ends
    /// where the space does.
    OverZeros,
    /// These bytes at the host offset instead (units the format encoded,
    /// compressed, from the data); `starts[i]` is where unit `i` begins
    /// in them.
    Encoded {
        /// The encoded units, end to end.
        bytes: Vec<u8>,
        /// Each unit's offset in `bytes`.
        starts: Vec<u64>,
    },
}

/// What [`MappedFormat::zero`] did with a prefix of its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zeroed {
    /// These bytes read as zeros now.
    Done(u64),
    /// These bytes need zeros written.
    Write(u64),
}

/// [`MappedFormat::zero`] for a format that cannot mark zeros: a prefix of
/// `[g, g+len)` that reads as zeros already (zeros, or unallocated without
/// a backing image) is done, any other needs zeros written.
pub fn zero_where_zeros<F: MappedFormat + ?Sized>(f: &F, g: u64, len: u64) -> Result<Zeroed> {
    let (n, place, _) = f.lookup(g, len, false)?;
    Ok(match place {
        Place::Zero { .. } => Zeroed::Done(n),
        Place::Unallocated { .. } if f.backing().is_none() => Zeroed::Done(n),
        _ => Zeroed::Write(n),
    })
}

/// Reads what `place` holds for `buf.len()` bytes at guest `g`.
pub fn read_place<F: MappedFormat + ?Sized>(
    f: &F,
    place: Place,
    g: u64,
    buf: &mut [u8],
) -> Result<()> {
    match place {
        Place::Data(h) | Place::Shared(h) => match f.guest_cipher() {
            None => f.data().read_padded(buf, h),
            Some(c) => read_guest_encrypted(f, c, h, g, buf),
        },
        Place::Zero { .. } => {
            buf.fill(0);
            Ok(())
        }
        Place::Unallocated { .. } => read_backing(f.backing(), g, buf),
        Place::Compressed { offset, size, skip } => f.read_compressed(offset, size, skip, buf),
    }
}

/// Reads data at host `h` (guest `g`) encrypted by guest sectors: the
/// whole sectors around it are read and decrypted. A format's data places
/// start and end on sector boundaries (clusters), so the sectors around a
/// range are in the same place.
fn read_guest_encrypted<F: MappedFormat + ?Sized>(
    f: &F,
    c: &crate::crypto::SectorCipher,
    h: u64,
    g: u64,
    buf: &mut [u8],
) -> Result<()> {
    use crate::crypto::SECTOR_SIZE;
    let skip = g % SECTOR_SIZE;
    let end = (g + buf.len() as u64).div_ceil(SECTOR_SIZE) * SECTOR_SIZE;
    let mut tmp = vec![0u8; (end - (g - skip)) as usize];
    f.data().read_padded(&mut tmp, h - skip)?;
    c.decrypt((g - skip) / SECTOR_SIZE, &mut tmp);
    buf.copy_from_slice(&tmp[skip as usize..skip as usize + buf.len()]);
    Ok(())
}

/// Reads `buf.len()` bytes at guest `g` from the backing image: zeros
/// without one, and past its end.
pub fn read_backing(backing: Option<&Backing>, g: u64, buf: &mut [u8]) -> Result<()> {
    let Some(b) = backing else {
        buf.fill(0);
        return Ok(());
    };
    let n = b.size.saturating_sub(g).min(buf.len() as u64) as usize;
    if n > 0 {
        b.device.read_at(&mut buf[..n], g)?;
    }
    buf[n..].fill(0);
    Ok(())
}

/// Reads `buf.len()` bytes at guest `offset`: one lookup per run of one
/// place, the bytes moved outside any format lock.
pub fn read<F: MappedFormat + ?Sized>(f: &F, buf: &mut [u8], offset: u64) -> Result<()> {
    check_range(f.guest_size(), offset, buf.len() as u64)?;
    let hold = f.mappings_change();
    let mut done = 0usize;
    while done < buf.len() {
        let g = offset + done as u64;
        let (n, place, held) = f.lookup(g, (buf.len() - done) as u64, hold)?;
        let r = read_place(f, place, g, &mut buf[done..done + n as usize]);
        drop(held);
        r?;
        done += n as usize;
    }
    Ok(())
}

/// The allocation of a prefix of `offset..offset+len`: one run of one
/// place, or what the backing image says (one layer deeper) for a range
/// unallocated here.
pub fn extents<F: MappedFormat + ?Sized>(f: &F, offset: u64, len: u64) -> Result<Vec<Extent>> {
    check_range(f.guest_size(), offset, len)?;
    if len == 0 {
        return Ok(vec![Extent::data(0)]);
    }
    let sparse = f.data_may_be_sparse();
    let (n, place, _) = f.lookup(offset, len, false)?;
    let mut e = Extent::data(n);
    match place {
        Place::Data(h) | Place::Shared(h) => {
            e = e.at_host(h);
            if sparse {
                // Ask the storage: preallocated clusters never written are
                // holes there and read as zeros.
                let data = f.data();
                let size = data.size();
                if h >= size {
                    e.flags.zero = true;
                } else if let Some(fe) = data.extents(h, n.min(size - h))?.first().copied() {
                    e.length = fe.length.min(n);
                    e.flags.zero = fe.flags.zero;
                }
            }
        }
        Place::Zero { alloc } => {
            e = Extent::hole(n);
            e.host_offset = alloc;
        }
        Place::Compressed { .. } => e.flags.compressed = true,
        Place::Unallocated { alloc } => match f.backing() {
            Some(b) if offset < b.size => {
                let mut v = b.device.extents(offset, n.min(b.size - offset))?;
                for x in &mut v {
                    x.depth += 1;
                }
                return Ok(v);
            }
            // Nothing below: unallocated here, with the host space already
            // reserved for it if any.
            _ => {
                e = Extent::hole(n);
                e.flags.present = false;
                e.host_offset = alloc;
            }
        },
    }
    Ok(vec![e])
}

/// The data storage's file under `offset..offset+len`, when the whole
/// range is one run of data, so that a server can splice it without
/// copying; only for an image whose data space cannot go to other guest
/// bytes meanwhile (the caller's to know: [`Mapped`] asks, and a format
/// inside another asks for its own).
pub fn file_view<F: MappedFormat + ?Sized>(f: &F, offset: u64, len: u64) -> Option<FileView<'_>> {
    // Bytes encrypted by guest sector are not the guest's.
    if len == 0 || f.guest_cipher().is_some() || check_range(f.guest_size(), offset, len).is_err() {
        return None;
    }
    match f.lookup(offset, len, false).ok()? {
        (n, Place::Data(h), _) if n == len => f.data().file_view(h, len),
        // A write moves shared data to new space and may free the old
        // (its count was one after all): read-only images only.
        (n, Place::Shared(h), _) if n == len && !f.writable() => f.data().file_view(h, len),
        _ => None,
    }
}

/// The capabilities of an image a format maps: writes, flushes, FUA and
/// extents; zeroing as the format can do it (`zero`: cheaper than writing
/// zeros, `fast_zero`: a fast-zero request can succeed); no trim; all of
/// it read-only unless `writable`.
pub fn image_capabilities(
    writable: bool,
    zero: bool,
    fast_zero: bool,
) -> diskit_core::Capabilities {
    let caps = diskit_core::Capabilities {
        can_write: true,
        can_flush: true,
        can_fua: true,
        can_trim: false,
        can_write_zeroes: true,
        can_zero: zero,
        can_fast_zero: fast_zero,
        can_extents: true,
        can_multi_conn: true,
        can_cache: false,
        is_rotational: false,
    };
    if writable { caps } else { caps.read_only() }
}
