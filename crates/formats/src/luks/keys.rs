//! Key slots: unlocking the master key with a passphrase, storing it in a
//! slot, erasing a slot, and choosing PBKDF2 iteration counts.
//!
//! A slot holds the master key split into [`STRIPES`] stripes
//! (crypto::afsplit), encrypted with a key derived from the passphrase by
//! PBKDF2 (the slot's salt and iterations), in sectors numbered from 0.
//! The master key is right when its PBKDF2 digest (the header's salt and
//! iterations) matches the header's.

use std::time::{Duration, Instant};

use diskit_core::{Error, ErrorKind, Result, Storage};
use zeroize::Zeroizing;

use super::header::{DIGEST_LEN, Header, KeySlot, SALT_LEN, STRIPES};
use crate::crypto::{HashAlg, SECTOR_SIZE, SectorCipher, afsplit};

/// Fills `buf` with random bytes from the operating system.
pub fn random(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| Error::new(ErrorKind::Io, format!("no random bytes: {e}")))
}

/// The bytes of a slot's key material, whole sectors.
fn material_len(h: &Header) -> usize {
    (h.split_len().div_ceil(SECTOR_SIZE) * SECTOR_SIZE) as usize
}

fn slot_cipher(h: &Header, key: &[u8]) -> Result<SectorCipher> {
    SectorCipher::new(h.cipher, h.mode, h.ivgen, h.ivgen_hash, key)
}

/// Whether `key` is the volume's master key.
pub fn is_master_key(h: &Header, key: &[u8]) -> bool {
    let mut digest = Zeroizing::new([0u8; DIGEST_LEN]);
    h.hash
        .pbkdf2(key, &h.mk_digest_salt, h.mk_digest_iterations, &mut *digest);
    // Compared in full whatever differs first.
    digest
        .iter()
        .zip(h.mk_digest.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// The master key in `slot`, if `pass` opens it.
fn try_slot(
    h: &Header,
    slot: &KeySlot,
    storage: &dyn Storage,
    base: u64,
    pass: &[u8],
) -> Result<Option<Zeroizing<Vec<u8>>>> {
    let kb = h.key_bytes as usize;
    let mut derived = Zeroizing::new(vec![0u8; kb]);
    h.hash
        .pbkdf2(pass, &slot.salt, slot.iterations, &mut derived);
    let mut material = Zeroizing::new(vec![0u8; material_len(h)]);
    storage
        .read_padded(&mut material, base + slot.key_offset as u64 * SECTOR_SIZE)
        .map_err(|e| e.context("Unable to read key slot material"))?;
    slot_cipher(h, &derived)?.decrypt(0, &mut material);
    let key = afsplit::merge(
        h.hash,
        &material[..h.split_len() as usize],
        kb,
        STRIPES as usize,
    );
    Ok(is_master_key(h, &key).then_some(key))
}

/// Unlocks the master key with `pass`, trying every active slot (or only
/// `only`); the header sits `base` bytes into `storage`. Gives the key and
/// the slot that opened it.
pub fn unlock(
    h: &Header,
    storage: &dyn Storage,
    base: u64,
    pass: &[u8],
    only: Option<usize>,
) -> Result<(Zeroizing<Vec<u8>>, usize)> {
    for (i, slot) in h.slots.iter().enumerate() {
        if !slot.active || only.is_some_and(|o| o != i) {
            continue;
        }
        if let Some(key) = try_slot(h, slot, storage, base, pass)? {
            return Ok((key, i));
        }
    }
    Err(Error::new(
        ErrorKind::PermissionDenied,
        match only {
            Some(i) => format!("Invalid password, cannot unlock keyslot {i}"),
            None => "Invalid password, cannot unlock any keyslot".to_string(),
        },
    ))
}

/// Stores `master_key` in slot `i` under `pass` with `iterations`, writing
/// its key material, and marks it active in `h` (the caller writes the
/// header).
pub fn store_slot(
    h: &mut Header,
    storage: &dyn Storage,
    base: u64,
    i: usize,
    pass: &[u8],
    master_key: &[u8],
    iterations: u32,
) -> Result<()> {
    let kb = h.key_bytes as usize;
    let mut salt = [0u8; SALT_LEN];
    random(&mut salt)?;
    let mut derived = Zeroizing::new(vec![0u8; kb]);
    h.hash.pbkdf2(pass, &salt, iterations, &mut derived);
    let mut failed = None;
    let split = afsplit::split(h.hash, master_key, STRIPES as usize, &mut |b| {
        if let Err(e) = random(b) {
            failed = Some(e);
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    let mut material = Zeroizing::new(vec![0u8; material_len(h)]);
    material[..split.len()].copy_from_slice(&split);
    slot_cipher(h, &derived)?.encrypt(0, &mut material);
    storage.write_extend(&material, base + h.slots[i].key_offset as u64 * SECTOR_SIZE)?;
    let s = &mut h.slots[i];
    s.active = true;
    s.iterations = iterations;
    s.salt = salt;
    Ok(())
}

/// Erases slot `i`: its key material overwritten with random bytes, the
/// slot marked inactive in `h` (the caller writes the header).
pub fn erase_slot(h: &mut Header, storage: &dyn Storage, base: u64, i: usize) -> Result<()> {
    let mut garbage = vec![0u8; material_len(h)];
    random(&mut garbage)?;
    storage.write_extend(&garbage, base + h.slots[i].key_offset as u64 * SECTOR_SIZE)?;
    let s = &mut h.slots[i];
    s.active = false;
    s.iterations = 0;
    s.salt = [0; SALT_LEN];
    Ok(())
}

/// PBKDF2 iterations of `hash` producing `out_len` bytes that take
/// `iter_time` on this machine (measured), at least `min`.
pub fn iterations_for(hash: HashAlg, out_len: usize, iter_time: Duration, min: u32) -> u32 {
    let mut out = vec![0u8; out_len];
    let mut rounds = 1u32 << 10;
    // Measure for about 50 ms: long enough to be steady.
    let per_sec = loop {
        let t = Instant::now();
        hash.pbkdf2(b"diskit-benchmark", &[0u8; SALT_LEN], rounds, &mut out);
        let took = t.elapsed();
        if took >= Duration::from_millis(50) || rounds >= 1 << 30 {
            break rounds as f64 / took.as_secs_f64().max(1e-9);
        }
        rounds = rounds.saturating_mul(2);
    };
    let n = per_sec * iter_time.as_secs_f64();
    (n.min(u32::MAX as f64) as u32).max(min)
}
