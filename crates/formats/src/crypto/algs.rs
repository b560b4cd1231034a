//! The names of ciphers, modes, IV generators and hashes, as QEMU and the
//! LUKS header spell them, and what each needs.

use diskit_core::{Error, Result};

/// A block cipher and its key size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CipherAlg {
    /// AES with a 128-bit key.
    Aes128,
    /// AES with a 192-bit key.
    Aes192,
    /// AES with a 256-bit key.
    Aes256,
    /// CAST5 (CAST-128) with a 128-bit key.
    Cast5_128,
    /// Serpent with a 128-bit key.
    Serpent128,
    /// Serpent with a 192-bit key.
    Serpent192,
    /// Serpent with a 256-bit key.
    Serpent256,
    /// Twofish with a 128-bit key.
    Twofish128,
    /// Twofish with a 192-bit key.
    Twofish192,
    /// Twofish with a 256-bit key.
    Twofish256,
}

/// Every cipher, for lookups by name.
const CIPHERS: &[CipherAlg] = &[
    CipherAlg::Aes128,
    CipherAlg::Aes192,
    CipherAlg::Aes256,
    CipherAlg::Cast5_128,
    CipherAlg::Serpent128,
    CipherAlg::Serpent192,
    CipherAlg::Serpent256,
    CipherAlg::Twofish128,
    CipherAlg::Twofish192,
    CipherAlg::Twofish256,
];

impl CipherAlg {
    /// QEMU's name (`cipher-alg=`).
    pub fn name(self) -> &'static str {
        match self {
            CipherAlg::Aes128 => "aes-128",
            CipherAlg::Aes192 => "aes-192",
            CipherAlg::Aes256 => "aes-256",
            CipherAlg::Cast5_128 => "cast5-128",
            CipherAlg::Serpent128 => "serpent-128",
            CipherAlg::Serpent192 => "serpent-192",
            CipherAlg::Serpent256 => "serpent-256",
            CipherAlg::Twofish128 => "twofish-128",
            CipherAlg::Twofish192 => "twofish-192",
            CipherAlg::Twofish256 => "twofish-256",
        }
    }

    /// Parses QEMU's name.
    pub fn from_name(name: &str) -> Result<CipherAlg> {
        CIPHERS
            .iter()
            .copied()
            .find(|c| c.name() == name)
            .ok_or_else(|| Error::invalid(format!("Unsupported cipher algorithm '{name}'")))
    }

    /// The family name a LUKS header stores ("aes", "serpent").
    pub fn luks_family(self) -> &'static str {
        match self {
            CipherAlg::Aes128 | CipherAlg::Aes192 | CipherAlg::Aes256 => "aes",
            CipherAlg::Cast5_128 => "cast5",
            CipherAlg::Serpent128 | CipherAlg::Serpent192 | CipherAlg::Serpent256 => "serpent",
            CipherAlg::Twofish128 | CipherAlg::Twofish192 | CipherAlg::Twofish256 => "twofish",
        }
    }

    /// The cipher of `family` with a key of `key_bytes` bytes.
    pub fn from_family(family: &str, key_bytes: usize) -> Option<CipherAlg> {
        CIPHERS
            .iter()
            .copied()
            .find(|c| c.luks_family() == family && c.key_bytes() == key_bytes)
    }

    /// The key length in bytes.
    pub fn key_bytes(self) -> usize {
        match self {
            CipherAlg::Aes128
            | CipherAlg::Cast5_128
            | CipherAlg::Serpent128
            | CipherAlg::Twofish128 => 16,
            CipherAlg::Aes192 | CipherAlg::Serpent192 | CipherAlg::Twofish192 => 24,
            CipherAlg::Aes256 | CipherAlg::Serpent256 | CipherAlg::Twofish256 => 32,
        }
    }

    /// The block length in bytes.
    pub fn block_bytes(self) -> usize {
        match self {
            CipherAlg::Cast5_128 => 8,
            _ => 16,
        }
    }
}

/// How blocks of a sector are chained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CipherMode {
    /// Each block alone (no IV).
    Ecb,
    /// Cipher block chaining from the sector's IV.
    Cbc,
    /// XTS with the sector's IV as tweak (the key is two cipher keys).
    Xts,
}

impl CipherMode {
    /// QEMU's name (`cipher-mode=`).
    pub fn name(self) -> &'static str {
        match self {
            CipherMode::Ecb => "ecb",
            CipherMode::Cbc => "cbc",
            CipherMode::Xts => "xts",
        }
    }

    /// Parses QEMU's name.
    pub fn from_name(name: &str) -> Result<CipherMode> {
        match name {
            "ecb" => Ok(CipherMode::Ecb),
            "cbc" => Ok(CipherMode::Cbc),
            "xts" => Ok(CipherMode::Xts),
            _ => Err(Error::invalid(format!("Unsupported cipher mode '{name}'"))),
        }
    }
}

/// How a sector's IV is made from its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvGenAlg {
    /// The low 32 bits of the sector number, little-endian.
    Plain,
    /// The sector number, 64 bits little-endian.
    Plain64,
    /// The plain64 IV encrypted with a key that is the hash of the data key.
    Essiv,
}

impl IvGenAlg {
    /// QEMU's name (`ivgen-alg=`).
    pub fn name(self) -> &'static str {
        match self {
            IvGenAlg::Plain => "plain",
            IvGenAlg::Plain64 => "plain64",
            IvGenAlg::Essiv => "essiv",
        }
    }

    /// Parses QEMU's name.
    pub fn from_name(name: &str) -> Result<IvGenAlg> {
        match name {
            "plain" => Ok(IvGenAlg::Plain),
            "plain64" => Ok(IvGenAlg::Plain64),
            "essiv" => Ok(IvGenAlg::Essiv),
            _ => Err(Error::invalid(format!("Unsupported IV generator '{name}'"))),
        }
    }
}

/// A hash, for PBKDF2, the anti-forensic splitter and ESSIV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    /// SHA-1.
    Sha1,
    /// SHA-224.
    Sha224,
    /// SHA-256.
    Sha256,
    /// SHA-384.
    Sha384,
    /// SHA-512.
    Sha512,
    /// RIPEMD-160.
    Ripemd160,
}

const HASHES: &[HashAlg] = &[
    HashAlg::Sha1,
    HashAlg::Sha224,
    HashAlg::Sha256,
    HashAlg::Sha384,
    HashAlg::Sha512,
    HashAlg::Ripemd160,
];

impl HashAlg {
    /// QEMU's (and the LUKS header's) name.
    pub fn name(self) -> &'static str {
        match self {
            HashAlg::Sha1 => "sha1",
            HashAlg::Sha224 => "sha224",
            HashAlg::Sha256 => "sha256",
            HashAlg::Sha384 => "sha384",
            HashAlg::Sha512 => "sha512",
            HashAlg::Ripemd160 => "ripemd160",
        }
    }

    /// Parses QEMU's name.
    pub fn from_name(name: &str) -> Result<HashAlg> {
        HASHES
            .iter()
            .copied()
            .find(|h| h.name() == name)
            .ok_or_else(|| Error::invalid(format!("Unsupported hash algorithm '{name}'")))
    }

    /// The digest length in bytes.
    pub fn digest_bytes(self) -> usize {
        match self {
            HashAlg::Sha1 | HashAlg::Ripemd160 => 20,
            HashAlg::Sha224 => 28,
            HashAlg::Sha256 => 32,
            HashAlg::Sha384 => 48,
            HashAlg::Sha512 => 64,
        }
    }

    /// The digest of the concatenation of `parts`.
    pub fn digest(self, parts: &[&[u8]]) -> Vec<u8> {
        use sha2::Digest;
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut d = D::new();
            for p in parts {
                d.update(p);
            }
            d.finalize().to_vec()
        }
        match self {
            HashAlg::Sha1 => run::<sha1::Sha1>(parts),
            HashAlg::Sha224 => run::<sha2::Sha224>(parts),
            HashAlg::Sha256 => run::<sha2::Sha256>(parts),
            HashAlg::Sha384 => run::<sha2::Sha384>(parts),
            HashAlg::Sha512 => run::<sha2::Sha512>(parts),
            HashAlg::Ripemd160 => run::<ripemd::Ripemd160>(parts),
        }
    }

    /// PBKDF2 with HMAC over this hash: fills `out` from `password` and
    /// `salt` in `iterations` rounds.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        use hmac::Hmac;
        use pbkdf2::pbkdf2;
        // HMAC accepts keys of any length: this cannot fail.
        let r = match self {
            HashAlg::Sha1 => pbkdf2::<Hmac<sha1::Sha1>>(password, salt, iterations, out),
            HashAlg::Sha224 => pbkdf2::<Hmac<sha2::Sha224>>(password, salt, iterations, out),
            HashAlg::Sha256 => pbkdf2::<Hmac<sha2::Sha256>>(password, salt, iterations, out),
            HashAlg::Sha384 => pbkdf2::<Hmac<sha2::Sha384>>(password, salt, iterations, out),
            HashAlg::Sha512 => pbkdf2::<Hmac<sha2::Sha512>>(password, salt, iterations, out),
            HashAlg::Ripemd160 => {
                pbkdf2::<Hmac<ripemd::Ripemd160>>(password, salt, iterations, out)
            }
        };
        debug_assert!(r.is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6070's first PBKDF2-HMAC-SHA1 vector.
    #[test]
    fn pbkdf2_matches_rfc_6070() {
        let mut out = [0u8; 20];
        HashAlg::Sha1.pbkdf2(b"password", b"salt", 2, &mut out);
        let want = [
            0xea, 0x6c, 0x01, 0x4d, 0xc7, 0x2d, 0x6f, 0x8c, 0xcd, 0x1e, 0xd9, 0x2a, 0xce, 0x1d,
            0x41, 0xf0, 0xd8, 0xde, 0x89, 0x57,
        ];
        assert_eq!(out, want);
    }

    #[test]
    fn names_round_trip() {
        for c in CIPHERS {
            assert_eq!(CipherAlg::from_name(c.name()).unwrap(), *c);
            assert_eq!(
                CipherAlg::from_family(c.luks_family(), c.key_bytes()),
                Some(*c)
            );
        }
        for h in HASHES {
            assert_eq!(HashAlg::from_name(h.name()).unwrap(), *h);
            assert_eq!(h.digest(&[b"x"]).len(), h.digest_bytes());
        }
        assert!(CipherAlg::from_name("rot13").is_err());
    }
}
