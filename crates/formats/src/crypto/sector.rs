//! Sector ciphers: a block cipher, a chaining mode and an IV generator,
//! keyed once, encrypting and decrypting runs of 512-byte sectors.

use cipher::generic_array::GenericArray;
use cipher::{
    BlockCipher, BlockDecrypt, BlockDecryptMut, BlockEncrypt, BlockEncryptMut, InnerIvInit, KeyInit,
};
use diskit_core::{Error, Result};
use zeroize::Zeroizing;

use super::SECTOR_SIZE;
use super::algs::{CipherAlg, CipherMode, HashAlg, IvGenAlg};

/// Encrypts one block in place (the ESSIV IV cipher).
type BlockFn = Box<dyn Fn(&mut [u8]) + Send + Sync>;

/// How sector numbers become IVs.
enum IvGen {
    Plain,
    Plain64,
    Essiv(BlockFn),
}

impl IvGen {
    fn fill(&self, sector: u64, iv: &mut [u8]) {
        iv.fill(0);
        match self {
            IvGen::Plain => iv[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
            IvGen::Plain64 => iv[..8].copy_from_slice(&sector.to_le_bytes()),
            IvGen::Essiv(encrypt) => {
                iv[..8].copy_from_slice(&sector.to_le_bytes());
                encrypt(iv);
            }
        }
    }
}

/// What a keyed cipher does to a run of sectors.
trait Transform: Send + Sync {
    fn encrypt(&self, sector: u64, buf: &mut [u8]);
    fn decrypt(&self, sector: u64, buf: &mut [u8]);
}

/// A block cipher in one of the modes.
struct Engine<C: BlockCipher + BlockEncrypt + BlockDecrypt> {
    mode: Mode<C>,
    ivgen: IvGen,
}

enum Mode<C: BlockCipher + BlockEncrypt + BlockDecrypt> {
    Ecb(C),
    Cbc(C),
    Xts(xts_mode::Xts128<C>),
}

impl<C> Engine<C>
where
    C: BlockCipher + BlockEncrypt + BlockDecrypt + Clone + Send + Sync,
{
    /// Encrypts (`forward`) or decrypts each sector of `buf` in place.
    fn run(&self, first: u64, buf: &mut [u8], forward: bool) {
        let bs = C::block_size();
        let mut iv = [0u8; 16];
        for (i, sector) in buf.chunks_exact_mut(SECTOR_SIZE as usize).enumerate() {
            let n = first + i as u64;
            match &self.mode {
                Mode::Ecb(c) => {
                    for b in sector.chunks_exact_mut(bs) {
                        let b = GenericArray::from_mut_slice(b);
                        if forward {
                            c.encrypt_block(b)
                        } else {
                            c.decrypt_block(b)
                        }
                    }
                }
                Mode::Cbc(c) => {
                    self.ivgen.fill(n, &mut iv[..bs]);
                    let iv = GenericArray::from_slice(&iv[..bs]);
                    if forward {
                        let mut e = cbc::Encryptor::<C>::inner_iv_init(c.clone(), iv);
                        for b in sector.chunks_exact_mut(bs) {
                            e.encrypt_block_mut(GenericArray::from_mut_slice(b));
                        }
                    } else {
                        let mut d = cbc::Decryptor::<C>::inner_iv_init(c.clone(), iv);
                        for b in sector.chunks_exact_mut(bs) {
                            d.decrypt_block_mut(GenericArray::from_mut_slice(b));
                        }
                    }
                }
                Mode::Xts(x) => {
                    self.ivgen.fill(n, &mut iv);
                    if forward {
                        x.encrypt_sector(sector, iv)
                    } else {
                        x.decrypt_sector(sector, iv)
                    }
                }
            }
        }
    }
}

impl<C> Transform for Engine<C>
where
    C: BlockCipher + BlockEncrypt + BlockDecrypt + Clone + Send + Sync,
{
    fn encrypt(&self, first: u64, buf: &mut [u8]) {
        self.run(first, buf, true)
    }

    fn decrypt(&self, first: u64, buf: &mut [u8]) {
        self.run(first, buf, false)
    }
}

/// A keyed sector cipher (cipher, mode, IV generator).
pub struct SectorCipher {
    inner: Box<dyn Transform>,
    alg: CipherAlg,
    mode: CipherMode,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        write!(f, "SectorCipher({}-{})", self.alg.name(), self.mode.name())
    }
}

/// The key length a cipher in `mode` takes (XTS: two keys).
pub fn key_bytes(alg: CipherAlg, mode: CipherMode) -> usize {
    match mode {
        CipherMode::Xts => alg.key_bytes() * 2,
        _ => alg.key_bytes(),
    }
}

/// Checks that the combination can be keyed (before any key exists).
pub fn check_combination(
    alg: CipherAlg,
    mode: CipherMode,
    ivgen: IvGenAlg,
    ivhash: Option<HashAlg>,
) -> Result<()> {
    if mode == CipherMode::Xts && alg.block_bytes() != 16 {
        return Err(Error::invalid(format!(
            "Cipher '{}' cannot be used in xts mode (it needs 16-byte blocks)",
            alg.name()
        )));
    }
    if ivgen == IvGenAlg::Essiv {
        let hash = ivhash.ok_or_else(|| Error::invalid("Missing IV generator hash for essiv"))?;
        essiv_alg(alg, hash)?;
    }
    Ok(())
}

/// The cipher ESSIV encrypts IVs with: `alg`'s family, keyed by a digest
/// of `hash`.
fn essiv_alg(alg: CipherAlg, hash: HashAlg) -> Result<CipherAlg> {
    CipherAlg::from_family(alg.luks_family(), hash.digest_bytes()).ok_or_else(|| {
        Error::invalid(format!(
            "Cipher '{}' has no key size for the {} bytes of a {} digest (essiv)",
            alg.name(),
            hash.digest_bytes(),
            hash.name()
        ))
    })
}

fn keyed<C: KeyInit>(key: &[u8]) -> Result<C> {
    C::new_from_slice(key).map_err(|_| Error::invalid("Invalid cipher key length"))
}

fn engine<C>(mode: CipherMode, key: &[u8], ivgen: IvGen) -> Result<Box<dyn Transform>>
where
    C: BlockCipher + BlockEncrypt + BlockDecrypt + KeyInit + Clone + Send + Sync + 'static,
{
    let mode = match mode {
        CipherMode::Ecb => Mode::Ecb(keyed::<C>(key)?),
        CipherMode::Cbc => Mode::Cbc(keyed::<C>(key)?),
        CipherMode::Xts => {
            let (k1, k2) = key.split_at(key.len() / 2);
            Mode::Xts(xts_mode::Xts128::new(keyed::<C>(k1)?, keyed::<C>(k2)?))
        }
    };
    Ok(Box::new(Engine { mode, ivgen }))
}

fn block_fn<C>(key: &[u8]) -> Result<BlockFn>
where
    C: BlockEncrypt + KeyInit + Send + Sync + 'static,
{
    let c = keyed::<C>(key)?;
    Ok(Box::new(move |b: &mut [u8]| {
        c.encrypt_block(GenericArray::from_mut_slice(b))
    }))
}

/// Runs `$f::<Type>($args)` for the concrete cipher type of `$alg`.
macro_rules! with_cipher {
    ($alg:expr, $f:ident, $($args:expr),*) => {
        match $alg {
            CipherAlg::Aes128 => $f::<aes::Aes128>($($args),*),
            CipherAlg::Aes192 => $f::<aes::Aes192>($($args),*),
            CipherAlg::Aes256 => $f::<aes::Aes256>($($args),*),
            CipherAlg::Cast5_128 => $f::<cast5::Cast5>($($args),*),
            CipherAlg::Serpent128 | CipherAlg::Serpent192 | CipherAlg::Serpent256 => {
                $f::<serpent::Serpent>($($args),*)
            }
            CipherAlg::Twofish128 | CipherAlg::Twofish192 | CipherAlg::Twofish256 => {
                $f::<twofish::Twofish>($($args),*)
            }
        }
    };
}

impl SectorCipher {
    /// Keys a sector cipher with `key` (of [`key_bytes`] bytes).
    pub fn new(
        alg: CipherAlg,
        mode: CipherMode,
        ivgen: IvGenAlg,
        ivhash: Option<HashAlg>,
        key: &[u8],
    ) -> Result<SectorCipher> {
        check_combination(alg, mode, ivgen, ivhash)?;
        if key.len() != key_bytes(alg, mode) {
            return Err(Error::invalid(format!(
                "Key of {} bytes for {}-{} (expected {})",
                key.len(),
                alg.name(),
                mode.name(),
                key_bytes(alg, mode)
            )));
        }
        let generator = match ivgen {
            IvGenAlg::Plain => IvGen::Plain,
            IvGenAlg::Plain64 => IvGen::Plain64,
            IvGenAlg::Essiv => {
                let hash = ivhash.expect("checked above");
                let essiv = essiv_alg(alg, hash)?;
                let digest = Zeroizing::new(hash.digest(&[key]));
                IvGen::Essiv(with_cipher!(essiv, block_fn, &digest)?)
            }
        };
        let inner = with_cipher!(alg, engine, mode, key, generator)?;
        Ok(SectorCipher { inner, alg, mode })
    }

    /// Encrypts `buf` (whole sectors) in place; its first sector is number
    /// `sector`.
    pub fn encrypt(&self, sector: u64, buf: &mut [u8]) {
        debug_assert!(buf.len().is_multiple_of(SECTOR_SIZE as usize));
        self.inner.encrypt(sector, buf)
    }

    /// Decrypts `buf` (whole sectors) in place; its first sector is number
    /// `sector`.
    pub fn decrypt(&self, sector: u64, buf: &mut [u8]) {
        debug_assert!(buf.len().is_multiple_of(SECTOR_SIZE as usize));
        self.inner.decrypt(sector, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_round_trips() {
        let key: Vec<u8> = (0..64u8).collect();
        let plain: Vec<u8> = (0..2048u32).map(|i| (i * 7) as u8).collect();
        for alg in [
            CipherAlg::Aes128,
            CipherAlg::Aes256,
            CipherAlg::Cast5_128,
            CipherAlg::Serpent256,
            CipherAlg::Twofish128,
        ] {
            for mode in [CipherMode::Ecb, CipherMode::Cbc, CipherMode::Xts] {
                for iv in [IvGenAlg::Plain, IvGenAlg::Plain64, IvGenAlg::Essiv] {
                    let hash = Some(HashAlg::Sha256);
                    if check_combination(alg, mode, iv, hash).is_err() {
                        continue;
                    }
                    let k = &key[..key_bytes(alg, mode)];
                    let c = SectorCipher::new(alg, mode, iv, hash, k).unwrap();
                    let mut buf = plain.clone();
                    c.encrypt(7, &mut buf);
                    assert_ne!(buf, plain);
                    c.decrypt(7, &mut buf);
                    assert_eq!(buf, plain, "{alg:?} {mode:?} {iv:?}");
                }
            }
        }
    }

    /// IEEE 1619 XTS-AES-128 vector 2 (sector 0x3333333333, data 0x44..).
    #[test]
    fn xts_aes_matches_ieee_1619() {
        let mut key = vec![0x11u8; 16];
        key.extend([0x22u8; 16]);
        let c = SectorCipher::new(
            CipherAlg::Aes128,
            CipherMode::Xts,
            IvGenAlg::Plain64,
            None,
            &key,
        )
        .unwrap();
        let mut sector = [0x44u8; 512];
        c.encrypt(0x33_3333_3333, &mut sector);
        let want = [
            0xc4, 0x54, 0x18, 0x5e, 0x6a, 0x16, 0x93, 0x6e, 0x39, 0x33, 0x40, 0x38, 0xac, 0xef,
            0x83, 0x8b, 0xfb, 0x18, 0x6f, 0xff, 0x74, 0x80, 0xad, 0xc4, 0x28, 0x93, 0x82, 0xec,
            0xd6, 0xd3, 0x94, 0xf0,
        ];
        // The vector is for 32 bytes: XTS blocks do not depend on what
        // follows them (no ciphertext stealing on whole blocks).
        assert_eq!(&sector[..32], &want);
    }
}
