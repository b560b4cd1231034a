//! Disk encryption as QEMU does it: per-sector ciphers with IV generators,
//! PBKDF2 and the LUKS anti-forensic splitter, and the secrets that unlock
//! them.
//!
//! The cryptography is RustCrypto's (aes, twofish, serpent, cast5, xts-mode,
//! cbc, pbkdf2, sha1, sha2, ripemd); this module only names, combines and
//! keys it. Key material lives in [`Zeroizing`](zeroize::Zeroizing) buffers
//! (and key schedules are wiped on drop) and is never formatted into a
//! message.

pub mod afsplit;
pub mod algs;
pub mod encrypted;
pub mod secret;
pub mod sector;

pub use algs::{CipherAlg, CipherMode, HashAlg, IvGenAlg};
pub use secret::{Secret, Secrets};
pub use sector::SectorCipher;

/// Encrypted data is cut into sectors of this size, each with its own IV.
pub const SECTOR_SIZE: u64 = 512;
