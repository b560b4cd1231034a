//! LUKS1 volumes (QEMU's `luks` format): a header with eight key slots,
//! then the payload encrypted sector by sector.
//!
//! The header is parsed in [`header`]; passphrases open key slots in
//! [`keys`]; the payload is an [`EncryptedStorage`] view of the file from
//! the payload offset. The same header, key slots and info also serve
//! qcow2's `encrypt.format=luks` (the header lives inside the qcow2 file).

pub mod create;
pub mod header;
pub mod keys;

use std::sync::Arc;

use diskit_core::{Error, ErrorKind, Result, Storage, StorageRef};

use crate::creation::Offered;
use crate::creation::Planned;
use crate::crypto::encrypted::EncryptedStorage;
use crate::crypto::{SECTOR_SIZE, Secrets, SectorCipher};
use crate::driver::{FormatDriver, Measured, Measurement, Opened, Opening};
use crate::image_ops::{Capability, FormatImage};
use crate::info::{FormatInfo, InfoValue};
use crate::{Format, OptionList, Prealloc};

use header::Header;

/// The largest PBKDF2 iteration count accepted in a header: more would
/// take minutes to try (QEMU's own counts for a 2 s iter-time stay far
/// below it).
pub const MAX_ITERATIONS: u32 = 1 << 26;

/// Reads and validates the LUKS header `base` bytes into `storage`.
pub fn read_header(storage: &dyn Storage, base: u64) -> Result<Header> {
    let mut b = [0u8; header::HEADER_LEN];
    let len = storage.file_len()?;
    if len < base + header::HEADER_LEN as u64 {
        return Err(Error::invalid(format!(
            "LUKS header at {base} is cut short by the end of the file ({len} bytes)"
        )));
    }
    storage.read_padded(&mut b, base)?;
    Header::parse(&b, MAX_ITERATIONS)
}

/// The passphrase an open names (`key-secret=ID`), with QEMU's message
/// when none is given.
pub fn passphrase(key_secret: Option<&str>) -> Result<crate::crypto::Secret> {
    let id = key_secret.ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidInput,
            "Parameter 'key-secret' is required for cipher",
        )
    })?;
    let secret = Secrets::global().get(id)?;
    // A passphrase is text, as QEMU reads it.
    if std::str::from_utf8(secret.bytes()).is_err() {
        return Err(Error::invalid(format!(
            "Data from secret {id} is not valid UTF-8"
        )));
    }
    Ok(secret)
}

/// Unlocks the header at `base` of `storage` with the open's passphrase
/// and keys the payload cipher.
pub fn unlock_cipher(
    h: &Header,
    storage: &dyn Storage,
    base: u64,
    key_secret: Option<&str>,
) -> Result<Arc<SectorCipher>> {
    let pass = passphrase(key_secret)?;
    let (key, _slot) = keys::unlock(h, storage, base, pass.bytes(), None)?;
    Ok(Arc::new(SectorCipher::new(
        h.cipher,
        h.mode,
        h.ivgen,
        h.ivgen_hash,
        &key,
    )?))
}

/// The `encrypt` data qemu-img shows for a LUKS header (`format` given
/// inside qcow2, where it sits after the UUID).
pub fn info_value(h: &Header, format: Option<&str>) -> InfoValue {
    let mut v = InfoValue::dict()
        .with("ivgen-alg", InfoValue::Str(h.ivgen.name().into()))
        .with("detached-header", InfoValue::Bool(false))
        .with("hash-alg", InfoValue::Str(h.hash.name().into()))
        .with("cipher-alg", InfoValue::Str(h.cipher.name().into()))
        .with("uuid", InfoValue::Str(h.uuid.clone()));
    if let Some(hash) = h.ivgen_hash {
        v = v.with("ivgen-hash-alg", InfoValue::Str(hash.name().into()));
    }
    if let Some(f) = format {
        v = v.with("format", InfoValue::Str(f.into()));
    }
    let slots = h
        .slots
        .iter()
        .map(|s| {
            let mut d = InfoValue::dict().with("active", InfoValue::Bool(s.active));
            if s.active {
                d = d.with("iters", InfoValue::UInt(s.iterations as u64));
            }
            d = d.with(
                "key-offset",
                InfoValue::UInt(s.key_offset as u64 * SECTOR_SIZE),
            );
            if s.active {
                d = d.with("stripes", InfoValue::UInt(s.stripes as u64));
            }
            d
        })
        .collect();
    v.with("cipher-mode", InfoValue::Str(h.mode.name().into()))
        .with("slots", InfoValue::List(slots))
        .with(
            "payload-offset",
            InfoValue::UInt(h.payload_offset as u64 * SECTOR_SIZE),
        )
        .with(
            "master-key-iters",
            InfoValue::UInt(h.mk_digest_iterations as u64),
        )
}

/// LUKS's probe: the magic, versions 1 and 2.
pub fn probe(h: &[u8], _: &str) -> u32 {
    let version = h.get(6..8).map(|v| u16::from_be_bytes([v[0], v[1]]));
    u32::from(h.starts_with(b"LUKS\xba\xbe") && matches!(version, Some(1 | 2))) * 100
}

/// The creation options luks offers.
pub(crate) const OFFERED: Offered = Offered(&[
    "cipher-alg=<str>       - Name of encryption cipher algorithm",
    "cipher-mode=<str>      - Name of encryption cipher mode",
    "detached-header=<bool (on/off)> - Create a detached LUKS header",
    "hash-alg=<str>         - Name of encryption hash algorithm",
    "iter-time=<num>        - Time to spend in PBKDF in milliseconds",
    "ivgen-alg=<str>        - Name of IV generator algorithm",
    "ivgen-hash-alg=<str>   - Name of IV generator hash algorithm",
    "key-secret=<str>       - ID of the secret that provides the keyslot passphrase",
    "size=<size>            - Virtual disk size",
]);

/// The luks driver.
pub struct LuksDriver;

impl FormatDriver for LuksDriver {
    fn name(&self) -> &'static str {
        "luks"
    }

    fn open_keys(&self) -> &'static [&'static str] {
        &["key-secret"]
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let Opening { storage, opts, .. } = at;
        let h = read_header(&*storage, 0)?;
        let payload = h.payload_offset as u64 * SECTOR_SIZE;
        if storage.file_len()? < payload {
            return Err(Error::invalid(format!(
                "LUKS payload offset {payload} is past the end of the file"
            )));
        }
        let device: diskit_core::DeviceRef = if opts.metadata_only {
            // info: the header only, as QEMU opens without I/O; nothing
            // reads the payload.
            Arc::new(Locked {
                size: storage.file_len()? - payload,
            })
        } else {
            let cipher = unlock_cipher(&h, &*storage, 0, opts.key_secret.as_deref())?;
            Arc::new(EncryptedStorage::new(storage.clone(), cipher, payload))
        };
        Ok(Opened {
            device,
            image: Arc::new(LuksImage {
                storage,
                header: h,
                key_secret: opts.key_secret.clone(),
            }),
        })
    }

    fn supports(&self, what: Capability) -> bool {
        matches!(what, Capability::Amend)
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        Planned::boxed(options, create::LuksCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("luks", with_file)
    }

    fn amend_help(&self) -> Option<String> {
        Some(create::AMEND_HELP.to_string())
    }

    fn check_amend_options(&self, options: &OptionList) -> Result<()> {
        create::check_amend(options, "")
    }

    fn measure(&self, options: &OptionList, of: Measured<'_>) -> Result<Measurement> {
        let opts = Planned::new(options, create::LuksCreateOptions::parse(options)?)?.opts;
        let v = match of {
            Measured::Size(size) => size,
            Measured::Image(img) => img.virtual_size(),
        };
        let v = v.div_ceil(SECTOR_SIZE) * SECTOR_SIZE;
        Ok(Measurement::fixed(
            create::payload_offset(&opts.plan()?) + v,
        ))
    }
}

/// The device of an image opened for its metadata only.
struct Locked {
    size: u64,
}

impl diskit_core::BlockDevice for Locked {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> diskit_core::Capabilities {
        diskit_core::Capabilities::READ_ONLY
    }

    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> Result<()> {
        Err(Error::new(
            ErrorKind::PermissionDenied,
            "the LUKS volume was opened without its key",
        ))
    }
}

/// An open LUKS volume.
pub struct LuksImage {
    storage: StorageRef,
    header: Header,
    key_secret: Option<String>,
}

impl FormatImage for LuksImage {
    fn format(&self) -> Format {
        Format::LUKS
    }

    fn created_reads_as_zeros(&self) -> bool {
        // Unwritten payload decrypts to noise.
        false
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        Ok(Some(FormatInfo {
            cluster_size: None,
            encrypted: true,
            dirty: false,
            driver_info: true,
            backing_filename: None,
            backing_format: None,
            snapshots: Vec::new(),
            specific_type: "luks",
            specific: info_value(&self.header, None),
            warnings: Vec::new(),
            children: Vec::new(),
        }))
    }

    fn check_resize(&self, new_size: u64, prealloc: Option<Prealloc>) -> Result<()> {
        crate::prealloc::check_plain_resize(new_size, prealloc)
    }

    fn resize(&self, new_size: u64, _shrink: bool, prealloc: Prealloc) -> Result<()> {
        let payload = self.header.payload_offset as u64 * SECTOR_SIZE;
        crate::prealloc::resize_plain(&*self.storage, payload + new_size, prealloc)
    }

    fn amend(&self, options: &OptionList, force: bool) -> Result<()> {
        create::amend_slots(
            &*self.storage,
            0,
            &self.header,
            options,
            "",
            self.key_secret.as_deref(),
            force,
        )
    }
}
