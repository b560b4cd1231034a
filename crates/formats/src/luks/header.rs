//! The LUKS1 header: parsed and validated in one place, and written.
//!
//! 592 bytes, big-endian: magic, version, cipher name, cipher mode (with
//! its IV generator, "xts-plain64", "cbc-essiv:sha256"), hash, payload
//! offset (sectors), key length, master key digest with its salt and
//! iterations, UUID, and eight key slots (state, PBKDF2 iterations and
//! salt, key material offset in sectors, anti-forensic stripes).

use diskit_core::{Error, ErrorKind, Result};

use crate::crypto::sector::{check_combination, key_bytes};
use crate::crypto::{CipherAlg, CipherMode, HashAlg, IvGenAlg, SECTOR_SIZE};

/// The first bytes of every LUKS volume.
pub const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
/// Bytes of the header proper.
pub const HEADER_LEN: usize = 592;
/// Key slots in a LUKS1 header.
pub const SLOTS: usize = 8;
/// Stripes of the anti-forensic split, the only count in use.
pub const STRIPES: u32 = 4000;
/// A key slot in use.
pub const SLOT_ACTIVE: u32 = 0x00AC_71F3;
/// A key slot not in use.
pub const SLOT_INACTIVE: u32 = 0x0000_DEAD;
/// Bytes of the master key digest.
pub const DIGEST_LEN: usize = 20;
/// Bytes of each salt.
pub const SALT_LEN: usize = 32;
/// The key material of each slot starts at a multiple of this.
pub const ALIGN: u64 = 4096;

/// One key slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySlot {
    /// Whether it holds a copy of the master key.
    pub active: bool,
    /// PBKDF2 iterations for the passphrase.
    pub iterations: u32,
    /// PBKDF2 salt.
    pub salt: [u8; SALT_LEN],
    /// Where its key material starts, in sectors.
    pub key_offset: u32,
    /// Anti-forensic stripes.
    pub stripes: u32,
}

/// A parsed, validated LUKS1 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The payload cipher.
    pub cipher: CipherAlg,
    /// Its chaining mode.
    pub mode: CipherMode,
    /// Its IV generator.
    pub ivgen: IvGenAlg,
    /// ESSIV's hash, if any.
    pub ivgen_hash: Option<HashAlg>,
    /// The hash of PBKDF2 and the splitter.
    pub hash: HashAlg,
    /// Where the payload starts, in sectors.
    pub payload_offset: u32,
    /// The master key length in bytes.
    pub key_bytes: u32,
    /// PBKDF2 digest of the master key.
    pub mk_digest: [u8; DIGEST_LEN],
    /// Its salt.
    pub mk_digest_salt: [u8; SALT_LEN],
    /// Its iterations.
    pub mk_digest_iterations: u32,
    /// The volume UUID, as text.
    pub uuid: String,
    /// The key slots.
    pub slots: [KeySlot; SLOTS],
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// A NUL-terminated text field.
fn text(b: &[u8], what: &str) -> Result<String> {
    let end = b
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| corrupt(format!("LUKS header {what} is not NUL terminated")))?;
    std::str::from_utf8(&b[..end])
        .map(str::to_string)
        .map_err(|_| corrupt(format!("LUKS header {what} is not text")))
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidInput, msg)
}

fn put_text(b: &mut [u8], s: &str) {
    b[..s.len()].copy_from_slice(s.as_bytes());
}

/// The mode field of a LUKS header for `mode` with `ivgen` ("xts-plain64",
/// "cbc-essiv:sha256", "ecb").
pub fn mode_text(mode: CipherMode, ivgen: IvGenAlg, ivhash: Option<HashAlg>) -> String {
    match (mode, ivgen, ivhash) {
        (CipherMode::Ecb, _, _) => "ecb".into(),
        (m, IvGenAlg::Essiv, Some(h)) => format!("{}-essiv:{}", m.name(), h.name()),
        (m, g, _) => format!("{}-{}", m.name(), g.name()),
    }
}

/// Parses the mode field ("xts-plain64", "cbc-essiv:sha256"; a hash
/// after another IV generator is ignored, as dm-crypt does).
fn parse_mode(s: &str) -> Result<(CipherMode, IvGenAlg, Option<HashAlg>)> {
    if s == "ecb" {
        return Ok((CipherMode::Ecb, IvGenAlg::Plain64, None));
    }
    let (mode, iv) = s
        .split_once('-')
        .ok_or_else(|| corrupt(format!("Unexpected cipher mode string format '{s}'")))?;
    let mode = CipherMode::from_name(mode)
        .map_err(|_| corrupt(format!("Cipher mode '{mode}' not supported")))?;
    let (iv, hash) = match iv.split_once(':') {
        Some((iv, h)) => (iv, Some(hash_named(h)?)),
        None => (iv, None),
    };
    let iv = IvGenAlg::from_name(iv)
        .map_err(|_| corrupt(format!("IV generator '{iv}' not supported")))?;
    match (iv, hash) {
        (IvGenAlg::Essiv, None) => Err(corrupt("Missing IV generator hash specification")),
        // ECB takes no IV: whatever generator is named is unused.
        _ if mode == CipherMode::Ecb => Ok((mode, IvGenAlg::Plain64, None)),
        (IvGenAlg::Essiv, h) => Ok((mode, iv, h)),
        (_, _) => Ok((mode, iv, None)),
    }
}

fn hash_named(h: &str) -> Result<HashAlg> {
    HashAlg::from_name(h).map_err(|_| corrupt(format!("Hash algorithm '{h}' not supported")))
}

impl Header {
    /// Parses and validates the header at the start of `b` (at least
    /// [`HEADER_LEN`] bytes); `max_iterations` caps PBKDF2 counts.
    pub fn parse(b: &[u8], max_iterations: u32) -> Result<Header> {
        if b.len() < HEADER_LEN || b[..6] != MAGIC {
            return Err(corrupt("Volume is not in LUKS format"));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!("LUKS version {version} is not supported"),
            ));
        }
        let cipher_name = text(&b[8..40], "cipher name")?;
        let cipher_mode = text(&b[40..72], "cipher mode")?;
        let hash_spec = text(&b[72..104], "hash")?;
        let payload_offset = be32(b, 104);
        let key_bytes_field = be32(b, 108);
        let (mode, ivgen, ivgen_hash) = parse_mode(&cipher_mode)?;
        let cipher = CipherAlg::from_family(&cipher_name, {
            // XTS keys are two cipher keys.
            let half = cipher_mode.starts_with("xts-");
            if half {
                key_bytes_field as usize / 2
            } else {
                key_bytes_field as usize
            }
        })
        .ok_or_else(|| {
            Error::new(
                ErrorKind::NotSupported,
                format!(
                    "Algorithm '{cipher_name}' with key size {} bytes not supported",
                    if cipher_mode.starts_with("xts-") {
                        key_bytes_field / 2
                    } else {
                        key_bytes_field
                    }
                ),
            )
        })?;
        check_combination(cipher, mode, ivgen, ivgen_hash)?;
        if key_bytes(cipher, mode) != key_bytes_field as usize {
            return Err(corrupt(format!(
                "LUKS key length {key_bytes_field} does not fit {cipher_name}-{cipher_mode}"
            )));
        }
        let hash = hash_named(&hash_spec)?;
        let mut mk_digest = [0u8; DIGEST_LEN];
        mk_digest.copy_from_slice(&b[112..132]);
        let mut mk_digest_salt = [0u8; SALT_LEN];
        mk_digest_salt.copy_from_slice(&b[132..164]);
        let mk_digest_iterations = be32(b, 164);
        let uuid = text(&b[168..208], "UUID")?;
        let mut slots = Vec::with_capacity(SLOTS);
        for i in 0..SLOTS {
            let at = 208 + i * 48;
            let mut salt = [0u8; SALT_LEN];
            salt.copy_from_slice(&b[at + 8..at + 40]);
            let state = be32(b, at);
            let active = match state {
                SLOT_ACTIVE => true,
                SLOT_INACTIVE => false,
                _ => {
                    return Err(corrupt(format!(
                        "Keyslot {i} state (active/disable) is corrupted"
                    )));
                }
            };
            slots.push(KeySlot {
                active,
                iterations: be32(b, at + 4),
                salt,
                key_offset: be32(b, at + 40),
                stripes: be32(b, at + 44),
            });
        }
        let h = Header {
            cipher,
            mode,
            ivgen,
            ivgen_hash,
            hash,
            payload_offset,
            key_bytes: key_bytes_field,
            mk_digest,
            mk_digest_salt,
            mk_digest_iterations,
            uuid,
            slots: slots.try_into().expect("eight slots"),
        };
        h.validate(max_iterations)?;
        Ok(h)
    }

    /// Bytes of one slot's key material (before rounding to sectors).
    pub fn split_len(&self) -> u64 {
        self.key_bytes as u64 * STRIPES as u64
    }

    /// Checks the layout: slots after the header, apart from each other
    /// and before the payload; counts in range.
    fn validate(&self, max_iterations: u32) -> Result<()> {
        let header_sectors = (HEADER_LEN as u64).div_ceil(SECTOR_SIZE);
        if self.mk_digest_iterations == 0 {
            return Err(corrupt("LUKS key iteration count is zero"));
        }
        if self.mk_digest_iterations > max_iterations {
            return Err(corrupt(format!(
                "LUKS key iteration count {} is larger than {max_iterations}",
                self.mk_digest_iterations
            )));
        }
        if (self.payload_offset as u64) < header_sectors {
            return Err(corrupt("LUKS payload is overlapping with the header"));
        }
        let split_sectors = self.split_len().div_ceil(SECTOR_SIZE);
        for (i, s) in self.slots.iter().enumerate() {
            if s.stripes != STRIPES {
                return Err(corrupt(format!(
                    "Keyslot {i} is corrupted (stripes {} != {STRIPES})",
                    s.stripes
                )));
            }
            let start = s.key_offset as u64;
            let end = start + split_sectors;
            if start < header_sectors {
                return Err(corrupt(format!(
                    "Keyslot {i} is overlapping with the LUKS header"
                )));
            }
            // The payload of a volume inside qcow2 (offset 0 there) is
            // elsewhere; a standalone one starts after every slot.
            if self.payload_offset != 0 && end > self.payload_offset as u64 {
                return Err(corrupt(format!(
                    "Keyslot {i} is overlapping with the encrypted payload"
                )));
            }
            if s.active && s.iterations == 0 {
                return Err(corrupt(format!("Keyslot {i} iteration count is zero")));
            }
            if s.active && s.iterations > max_iterations {
                return Err(corrupt(format!(
                    "Keyslot {i} iteration count {} is larger than {max_iterations}",
                    s.iterations
                )));
            }
            for (j, t) in self.slots.iter().enumerate().skip(i + 1) {
                let (a, b) = (t.key_offset as u64, t.key_offset as u64 + split_sectors);
                if start < b && a < end {
                    return Err(corrupt(format!(
                        "Keyslots {i} and {j} are overlapping in the header"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The header as stored.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..6].copy_from_slice(&MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        put_text(&mut b[8..40], self.cipher.luks_family());
        put_text(
            &mut b[40..72],
            &mode_text(self.mode, self.ivgen, self.ivgen_hash),
        );
        put_text(&mut b[72..104], self.hash.name());
        b[104..108].copy_from_slice(&self.payload_offset.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.mk_digest);
        b[132..164].copy_from_slice(&self.mk_digest_salt);
        b[164..168].copy_from_slice(&self.mk_digest_iterations.to_be_bytes());
        put_text(&mut b[168..207], &self.uuid);
        for (i, s) in self.slots.iter().enumerate() {
            let at = 208 + i * 48;
            let state = if s.active { SLOT_ACTIVE } else { SLOT_INACTIVE };
            b[at..at + 4].copy_from_slice(&state.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&s.iterations.to_be_bytes());
            b[at + 8..at + 40].copy_from_slice(&s.salt);
            b[at + 40..at + 44].copy_from_slice(&s.key_offset.to_be_bytes());
            b[at + 44..at + 48].copy_from_slice(&s.stripes.to_be_bytes());
        }
        b
    }
}
