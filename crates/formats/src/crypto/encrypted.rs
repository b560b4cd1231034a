//! Encrypted storage: the bytes of another storage seen through a sector
//! cipher.
//!
//! Offset `o` of the view is byte `start + o` of the storage below and lies
//! in sector `o / 512`, whose number is the sector's IV. A LUKS volume's
//! payload is such a view from its payload offset; a qcow2 image's data
//! clusters are one from offset 0 (QEMU computes their IVs from host
//! offsets). Requests that do not cover whole sectors are read-modify-
//! writes, held apart from every other write to the same sectors by a
//! range lock; whole-sector writes never wait for each other.

use std::sync::Arc;

use diskit_core::device::{check_range, write_zero_buffer};
use diskit_core::range_lock::RangeLock;
use diskit_core::storage::Preallocation;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Result, Storage, StorageRef, WriteFlags, ZeroFlags,
};

use super::{SECTOR_SIZE, SectorCipher};

/// A storage read and written through a sector cipher.
pub struct EncryptedStorage {
    inner: StorageRef,
    cipher: Arc<SectorCipher>,
    start: u64,
    writes: RangeLock,
}

impl EncryptedStorage {
    /// A view of `inner` from byte `start` (a multiple of 512) through
    /// `cipher`.
    pub fn new(inner: StorageRef, cipher: Arc<SectorCipher>, start: u64) -> EncryptedStorage {
        debug_assert!(start.is_multiple_of(SECTOR_SIZE));
        EncryptedStorage {
            inner,
            cipher,
            start,
            writes: RangeLock::new(),
        }
    }

    /// The storage below.
    pub fn inner(&self) -> &StorageRef {
        &self.inner
    }

    /// The sector-aligned range around `offset..offset+len`.
    fn around(offset: u64, len: u64) -> (u64, u64) {
        let a = offset - offset % SECTOR_SIZE;
        let b = (offset + len).div_ceil(SECTOR_SIZE) * SECTOR_SIZE;
        (a, b)
    }

    /// Reads and decrypts whole sectors at aligned `offset` into `buf`;
    /// `padded`: bytes past the end of the storage read as zeros before
    /// decryption.
    fn read_sectors(&self, buf: &mut [u8], offset: u64, padded: bool) -> Result<()> {
        if padded {
            self.inner.read_padded(buf, self.start + offset)?;
        } else {
            self.inner.read_at(buf, self.start + offset)?;
        }
        self.cipher.decrypt(offset / SECTOR_SIZE, buf);
        Ok(())
    }

    /// Reads any range, decrypting the sectors around it.
    fn read_any(&self, buf: &mut [u8], offset: u64, padded: bool) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let (a, b) = Self::around(offset, buf.len() as u64);
        if a == offset && b == offset + buf.len() as u64 {
            return self.read_sectors(buf, offset, padded);
        }
        let mut tmp = vec![0u8; (b - a) as usize];
        self.read_sectors(&mut tmp, a, padded)?;
        let skip = (offset - a) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    /// Encrypts and writes any range: partial sectors are merged with
    /// what is there. `extend`: the write may grow the storage.
    fn write_any(&self, buf: &[u8], offset: u64, fua: bool, extend: bool) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let (a, b) = Self::around(offset, buf.len() as u64);
        let aligned = a == offset && b == offset + buf.len() as u64;
        let _held = self.writes.lock(a, b, !aligned);
        let mut sectors = if aligned {
            buf.to_vec()
        } else {
            let mut tmp = vec![0u8; (b - a) as usize];
            // Sectors past the end (a growing write) start as zeros.
            self.read_sectors(&mut tmp, a, true)?;
            let skip = (offset - a) as usize;
            tmp[skip..skip + buf.len()].copy_from_slice(buf);
            tmp
        };
        self.cipher.encrypt(a / SECTOR_SIZE, &mut sectors);
        if extend {
            self.inner.write_extend(&sectors, self.start + a)?;
            if fua {
                self.inner.flush()?;
            }
            Ok(())
        } else {
            self.inner
                .write_at(&sectors, self.start + a, WriteFlags { fua })
        }
    }
}

impl BlockDevice for EncryptedStorage {
    fn size(&self) -> u64 {
        self.inner.size().saturating_sub(self.start)
    }

    fn capabilities(&self) -> Capabilities {
        // Zeros must be encrypted, and a hole below reads as ciphertext:
        // no trim, no cheap zeroing, every byte data.
        Capabilities {
            can_trim: false,
            can_zero: false,
            can_fast_zero: false,
            can_extents: false,
            ..self.inner.capabilities()
        }
    }

    fn block_size(&self) -> BlockSizeLimits {
        let below = self.inner.block_size();
        BlockSizeLimits {
            minimum: below.minimum.max(SECTOR_SIZE as u32),
            preferred: below.preferred.max(4096),
            maximum: below.maximum,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        self.read_any(buf, offset, false)
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        self.write_any(buf, offset, flags.fua, false)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast {
            return Err(diskit_core::Error::new(
                diskit_core::ErrorKind::NotSupported,
                "zeroing an encrypted range writes encrypted zeros: not fast",
            ));
        }
        check_range(self.size(), offset, len)?;
        write_zero_buffer(self, offset, len, flags.fua)
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn describe(&self) -> String {
        format!("encrypted {}", self.inner.describe())
    }
}

impl Storage for EncryptedStorage {
    fn location(&self) -> &str {
        self.inner.location()
    }

    fn resolve(&self, name: &str) -> String {
        self.inner.resolve(name)
    }

    fn file_len(&self) -> Result<u64> {
        Ok(self.inner.file_len()?.saturating_sub(self.start))
    }

    fn read_padded(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read_any(buf, offset, true)
    }

    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_any(buf, offset, false, true)
    }

    fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
        self.inner.resize(self.start + new_len, prealloc)
    }

    fn protocol(&self) -> &'static str {
        self.inner.protocol()
    }

    fn allocated_bytes(&self) -> Option<u64> {
        self.inner.allocated_bytes()
    }

    fn is_fixed_size(&self) -> bool {
        self.inner.is_fixed_size()
    }

    fn writes_in_order(&self) -> bool {
        self.inner.writes_in_order()
    }

    fn rewritable_head(&self) -> u64 {
        self.inner.rewritable_head().saturating_sub(self.start)
    }

    fn lock_image(&self, perm: u8, unshare: u8) -> Result<()> {
        self.inner.lock_image(perm, unshare)
    }
}
