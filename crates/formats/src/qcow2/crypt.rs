//! Encrypted qcow2 images: LUKS (`encrypt.format=luks`) and the legacy
//! AES-CBC of old QEMU (`encrypt.format=aes`, read only).
//!
//! With LUKS, a LUKS header (and its key slots) lives in clusters named by
//! the "full disk encryption header" extension, and each data cluster is
//! encrypted in 512-byte sectors whose IVs come from their host offsets:
//! the data storage is an [`EncryptedStorage`] view of the file from 0.
//! Legacy AES keys AES-128-CBC with the passphrase itself (cut or padded
//! to 16 bytes) and takes IVs from guest offsets: reads decrypt after the
//! bytes are fetched (see [`MappedFormat::guest_cipher`]).
//!
//! [`MappedFormat::guest_cipher`]: crate::mapped::MappedFormat::guest_cipher

use std::sync::Arc;

use diskit_core::{Error, ErrorKind, Result, StorageRef};

use super::header::{Header, ext};
use crate::crypto::encrypted::EncryptedStorage;
use crate::crypto::{CipherAlg, CipherMode, IvGenAlg, SectorCipher};

/// `crypt_method` of an unencrypted image.
pub const NONE: u32 = 0;
/// `crypt_method` of legacy AES-CBC.
pub const AES: u32 = 1;
/// `crypt_method` of LUKS.
pub const LUKS: u32 = 2;

/// Where the LUKS header and key slots lie: (offset, length) from the
/// header extension, checked to be whole, aligned clusters.
pub fn luks_area(h: &Header) -> Result<(u64, u64)> {
    let e = h.extension(ext::CRYPTO).ok_or_else(|| {
        Error::invalid("qcow2 image is encrypted with LUKS but has no encryption header extension")
    })?;
    if e.data.len() != 16 {
        return Err(Error::invalid(format!(
            "encryption header extension has {} bytes (expected 16)",
            e.data.len()
        )));
    }
    let offset = u64::from_be_bytes(e.data[..8].try_into().expect("8 bytes"));
    let length = u64::from_be_bytes(e.data[8..].try_into().expect("8 bytes"));
    let cs = h.cluster_size();
    if offset == 0 || !offset.is_multiple_of(cs) {
        return Err(Error::invalid(format!(
            "encryption header offset {offset:#x} is not a cluster boundary"
        )));
    }
    if length == 0 || offset.checked_add(length).is_none() {
        return Err(Error::invalid(format!(
            "encryption header length {length} is invalid"
        )));
    }
    Ok((offset, length))
}

/// What an encrypted image reads and writes its data through.
pub struct DataPath {
    /// The data storage (encrypted for LUKS).
    pub data: StorageRef,
    /// Legacy AES's cipher, keyed by guest sectors.
    pub guest_cipher: Option<Arc<SectorCipher>>,
}

/// Sets up the data path of the image with header `h` over `data` (the
/// file, or the external data file), unlocking it with the open's secret.
/// A metadata-only open (info) unlocks nothing.
pub fn data_path(
    file: &StorageRef,
    data: StorageRef,
    h: &Header,
    opts: &super::open::Qcow2Options,
) -> Result<DataPath> {
    let plain = |data| DataPath {
        data,
        guest_cipher: None,
    };
    check_format(h, opts.encrypt_format.as_deref())?;
    match h.crypt_method {
        NONE => Ok(plain(data)),
        LUKS => {
            let (offset, length) = luks_area(h)?;
            let lh = crate::luks::read_header(&**file, offset)?;
            let needed = lh
                .slots
                .iter()
                .map(|s| s.key_offset as u64)
                .max()
                .unwrap_or(0)
                * 512
                + lh.split_len();
            if needed > length {
                return Err(Error::invalid(format!(
                    "LUKS key material runs past the encryption header area ({needed} > {length} bytes)"
                )));
            }
            if opts.metadata_only {
                return Ok(plain(data));
            }
            let cipher =
                crate::luks::unlock_cipher(&lh, &**file, offset, opts.key_secret.as_deref())
                    .map_err(|e| rename_key(e, "encrypt.key-secret"))?;
            Ok(plain(Arc::new(EncryptedStorage::new(data, cipher, 0))))
        }
        AES => {
            if opts.writable {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    "legacy AES-encrypted qcow2 images are read only in diskit: \
                     convert the image to one encrypted with LUKS",
                ));
            }
            if opts.metadata_only {
                return Ok(plain(data));
            }
            let pass = crate::luks::passphrase(opts.key_secret.as_deref())
                .map_err(|e| rename_key(e, "encrypt.key-secret"))?;
            // The passphrase is the key: cut or padded with zeros to 16 bytes.
            let mut key = zeroize::Zeroizing::new([0u8; 16]);
            let n = pass.bytes().len().min(16);
            key[..n].copy_from_slice(&pass.bytes()[..n]);
            let cipher = SectorCipher::new(
                CipherAlg::Aes128,
                CipherMode::Cbc,
                IvGenAlg::Plain64,
                None,
                &*key,
            )?;
            Ok(DataPath {
                data,
                guest_cipher: Some(Arc::new(cipher)),
            })
        }
        other => Err(Error::new(
            ErrorKind::NotSupported,
            format!("Unsupported encryption method: {other}"),
        )),
    }
}

/// Refuses an `encrypt.format` that is not what the header says, in
/// QEMU's words.
fn check_format(h: &Header, asked: Option<&str>) -> Result<()> {
    let Some(asked) = asked else {
        return Ok(());
    };
    let have = match h.crypt_method {
        NONE => {
            return Err(Error::invalid(format!(
                "No encryption in image header, but options specified format '{asked}'"
            )));
        }
        AES => "aes",
        LUKS => "luks",
        // Refused below with its own message.
        _ => return Ok(()),
    };
    if asked != have {
        return Err(Error::invalid(format!(
            "Header reported '{have}' encryption format but options specify '{asked}'"
        )));
    }
    Ok(())
}

/// QEMU names the qcow2 option `encrypt.key-secret` in its message.
fn rename_key(e: Error, key: &str) -> Error {
    if e.to_string().contains("Parameter 'key-secret'") {
        Error::new(
            e.kind(),
            format!("Parameter '{key}' is required for cipher"),
        )
    } else {
        e
    }
}

impl super::device::Qcow2Format {
    /// Encrypts a new, empty image with LUKS as QEMU does once the image
    /// exists: the LUKS header and its key slots in newly allocated,
    /// zeroed clusters, then the image header marked (crypt_method 2, the
    /// extension written first) and synced.
    pub fn set_up_luks(&self, plan: &crate::luks::create::Plan, pass: &[u8]) -> Result<()> {
        use super::header::HeaderExtension;
        let length = crate::luks::create::payload_offset(plan);
        let geo = self.geometry();
        let cs = geo.cluster_size();
        let mut meta = self.lock();
        let (first, _) = meta.refs()?.alloc(length.div_ceil(cs))?;
        meta.write_back()?;
        drop(meta);
        let offset = geo.host_offset(first).0;
        let zeros = vec![0u8; (length.div_ceil(cs) * cs) as usize];
        self.file.write_extend(&zeros, offset)?;
        crate::luks::create::format_volume(&*self.file, offset, plan, pass)?;
        let mut h = super::open::read_header(&*self.file)?;
        h.crypt_method = LUKS;
        let mut data = offset.to_be_bytes().to_vec();
        data.extend_from_slice(&length.to_be_bytes());
        h.extensions.retain(|e| e.kind != ext::CRYPTO);
        h.extensions.insert(
            0,
            HeaderExtension {
                kind: ext::CRYPTO,
                data,
            },
        );
        self.file.flush()?;
        self.file.write_extend(&h.to_bytes()?, 0)?;
        self.file.flush()
    }
}
