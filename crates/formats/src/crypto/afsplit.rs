//! The LUKS anti-forensic splitter: a key spread over many stripes so that
//! destroying any part of them destroys the key.
//!
//! Merging: `d` starts as zeros; for each stripe but the last, `d` becomes
//! `diffuse(d XOR stripe)`; the key is `d XOR` the last stripe. Diffusion
//! hashes each digest-sized piece of `d` prefixed with its index (32 bits,
//! big-endian), the last piece truncated to what is left.

use zeroize::Zeroizing;

use super::algs::HashAlg;

fn diffuse(hash: HashAlg, buf: &mut [u8]) {
    let dl = hash.digest_bytes();
    for (i, piece) in buf.chunks_mut(dl).enumerate() {
        let h = Zeroizing::new(hash.digest(&[&(i as u32).to_be_bytes(), piece]));
        let n = piece.len();
        piece.copy_from_slice(&h[..n]);
    }
}

fn xor_into(d: &mut [u8], s: &[u8]) {
    for (a, b) in d.iter_mut().zip(s) {
        *a ^= b;
    }
}

/// Merges `split` (`stripes` stripes of `key_len` bytes) into the key.
pub fn merge(hash: HashAlg, split: &[u8], key_len: usize, stripes: usize) -> Zeroizing<Vec<u8>> {
    assert_eq!(split.len(), key_len * stripes);
    let mut d = Zeroizing::new(vec![0u8; key_len]);
    for stripe in split.chunks_exact(key_len).take(stripes - 1) {
        xor_into(&mut d, stripe);
        diffuse(hash, &mut d);
    }
    xor_into(&mut d, &split[(stripes - 1) * key_len..]);
    d
}

/// Splits `key` into `stripes` stripes; `random` fills the first
/// `stripes - 1` with fresh random bytes.
pub fn split(
    hash: HashAlg,
    key: &[u8],
    stripes: usize,
    random: &mut dyn FnMut(&mut [u8]),
) -> Zeroizing<Vec<u8>> {
    let n = key.len();
    let mut out = Zeroizing::new(vec![0u8; n * stripes]);
    random(&mut out[..n * (stripes - 1)]);
    let mut d = Zeroizing::new(vec![0u8; n]);
    for stripe in out.chunks_exact(n).take(stripes - 1) {
        xor_into(&mut d, stripe);
        diffuse(hash, &mut d);
    }
    xor_into(&mut d, key);
    out[(stripes - 1) * n..].copy_from_slice(&d);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_merge_gives_the_key() {
        let key: Vec<u8> = (0..64u8).collect();
        let mut seed = 1u8;
        let mut random = |b: &mut [u8]| {
            for x in b {
                seed = seed.wrapping_mul(31).wrapping_add(7);
                *x = seed;
            }
        };
        for hash in [HashAlg::Sha1, HashAlg::Sha256, HashAlg::Sha512] {
            let s = split(hash, &key, 4000, &mut random);
            assert_eq!(&merge(hash, &s, 64, 4000)[..], &key[..]);
            let mut broken = s.clone();
            broken[100] ^= 1;
            assert_ne!(&merge(hash, &broken, 64, 4000)[..], &key[..]);
        }
    }
}
