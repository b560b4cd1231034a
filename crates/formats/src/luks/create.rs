//! Making LUKS volumes (`create -f luks`, and the header inside a qcow2
//! with `encrypt.format=luks`), and changing their key slots (`amend`).
//!
//! The layout is QEMU's: the header in the first 4 KiB, then eight key
//! slots' material, each rounded up to 4 KiB, then the payload. PBKDF2
//! iterations are measured on this machine to take `iter-time`
//! milliseconds (QEMU's default 2000), at least 1000.

use std::time::Duration;

use diskit_backends::Preallocation;
use diskit_core::{Error, Result, Storage};
use zeroize::Zeroizing;

use super::header::{ALIGN, HEADER_LEN, Header, KeySlot, SALT_LEN, SLOTS, STRIPES};
use super::keys;
use crate::OptionList;
use crate::creation::{Basics, FormatOptions, NewFiles, given_summary};
use crate::crypto::sector::{check_combination, key_bytes};
use crate::crypto::{CipherAlg, CipherMode, HashAlg, IvGenAlg, SECTOR_SIZE, Secrets};
use crate::options::bool_value;

/// Fewest PBKDF2 iterations QEMU writes for a slot or the key digest.
pub const MIN_ITERATIONS: u32 = 1000;
/// QEMU's default `iter-time`, in milliseconds.
pub const DEFAULT_ITER_TIME_MS: u64 = 2000;

/// What a new volume is made of.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// The cipher.
    pub cipher: CipherAlg,
    /// Its mode.
    pub mode: CipherMode,
    /// The IV generator.
    pub ivgen: IvGenAlg,
    /// ESSIV's hash.
    pub ivgen_hash: Option<HashAlg>,
    /// PBKDF2's hash.
    pub hash: HashAlg,
    /// Time to spend in PBKDF2 on this machine.
    pub iter_time: Duration,
}

/// The `-o` options of a new LUKS volume (QEMU's names; inside qcow2 each
/// with `encrypt.` before it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LuksCreateOptions {
    /// The secret id of the passphrase.
    pub key_secret: Option<String>,
    /// Options as given, for the "Formatting" line (after size).
    pub given: Vec<(String, String)>,
    cipher_alg: Option<String>,
    cipher_mode: Option<String>,
    ivgen_alg: Option<String>,
    ivgen_hash_alg: Option<String>,
    hash_alg: Option<String>,
    iter_time: Option<u64>,
    preallocation: Option<String>,
}

/// The encryption keys of a LUKS node, in QEMU's order.
pub const KEYS: &[&str] = &[
    "key-secret",
    "cipher-alg",
    "cipher-mode",
    "ivgen-alg",
    "ivgen-hash-alg",
    "hash-alg",
    "iter-time",
];

impl LuksCreateOptions {
    /// Parses the standalone format's options.
    pub fn parse(options: &OptionList) -> Result<LuksCreateOptions> {
        super::OFFERED.check(options)?;
        if let Some(v) = options.get("detached-header")
            && bool_value("detached-header", v)?
        {
            return Err(Error::unsupported(
                "detached LUKS headers are not supported by diskit",
            ));
        }
        let mut o = Self::parse_prefixed(options, "")?;
        o.preallocation = options.text("preallocation");
        o.given.extend(options.given(&[
            "detached-header",
            "preallocation",
            "nocow",
            "extent_size_hint",
        ]));
        Ok(o)
    }

    /// Parses the encryption keys, each with `prefix` before it
    /// (`encrypt.` in qcow2); other keys are the caller's.
    pub fn parse_prefixed(options: &OptionList, prefix: &str) -> Result<LuksCreateOptions> {
        let get = |k: &str| options.get(&format!("{prefix}{k}")).map(str::to_string);
        let iter_time = get("iter-time")
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    Error::invalid(format!(
                        "Parameter '{prefix}iter-time' expects a number of milliseconds"
                    ))
                })
            })
            .transpose()?;
        let mut given = Vec::new();
        for k in KEYS {
            if let Some(v) = get(k) {
                given.push((format!("{prefix}{k}"), v));
            }
        }
        let o = LuksCreateOptions {
            key_secret: get("key-secret"),
            given,
            cipher_alg: get("cipher-alg"),
            cipher_mode: get("cipher-mode"),
            ivgen_alg: get("ivgen-alg"),
            ivgen_hash_alg: get("ivgen-hash-alg"),
            hash_alg: get("hash-alg"),
            iter_time,
            preallocation: None,
        };
        o.plan()?;
        Ok(o)
    }

    /// The algorithms and iteration time, QEMU's defaults filling gaps
    /// (aes-256, xts, plain64, sha256, 2000 ms).
    pub fn plan(&self) -> Result<Plan> {
        let cipher = CipherAlg::from_name(self.cipher_alg.as_deref().unwrap_or("aes-256"))?;
        let mode = CipherMode::from_name(self.cipher_mode.as_deref().unwrap_or("xts"))?;
        let ivgen = IvGenAlg::from_name(self.ivgen_alg.as_deref().unwrap_or("plain64"))?;
        let ivgen_hash = match (&self.ivgen_hash_alg, ivgen) {
            (Some(h), _) => Some(HashAlg::from_name(h)?),
            (None, IvGenAlg::Essiv) => Some(HashAlg::Sha256),
            (None, _) => None,
        };
        let ivgen_hash = if ivgen == IvGenAlg::Essiv {
            ivgen_hash
        } else {
            None
        };
        let hash = HashAlg::from_name(self.hash_alg.as_deref().unwrap_or("sha256"))?;
        check_combination(cipher, mode, ivgen, ivgen_hash)?;
        Ok(Plan {
            cipher,
            mode,
            ivgen,
            ivgen_hash,
            hash,
            iter_time: Duration::from_millis(self.iter_time.unwrap_or(DEFAULT_ITER_TIME_MS)),
        })
    }

    /// The passphrase, with QEMU's message when no secret is named.
    pub fn passphrase(&self) -> Result<crate::crypto::Secret> {
        super::passphrase(self.key_secret.as_deref())
    }
}

/// Sectors of one slot's key material, rounded to [`ALIGN`].
fn slot_sectors(plan: &Plan) -> u64 {
    let kb = key_bytes(plan.cipher, plan.mode) as u64;
    (kb * STRIPES as u64).div_ceil(ALIGN) * ALIGN / SECTOR_SIZE
}

/// Bytes before the payload of a volume made to `plan`.
pub fn payload_offset(plan: &Plan) -> u64 {
    (ALIGN / SECTOR_SIZE + SLOTS as u64 * slot_sectors(plan)) * SECTOR_SIZE
}

/// A random RFC 4122 version 4 UUID, as text.
fn new_uuid() -> Result<String> {
    let mut b = [0u8; 16];
    keys::random(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// Writes a new LUKS header and key slot 0 (for `pass`) `base` bytes into
/// `storage`; gives the header and the master key.
pub fn format_volume(
    storage: &dyn Storage,
    base: u64,
    plan: &Plan,
    pass: &[u8],
) -> Result<(Header, Zeroizing<Vec<u8>>)> {
    let kb = key_bytes(plan.cipher, plan.mode);
    let mut master = Zeroizing::new(vec![0u8; kb]);
    keys::random(&mut master)?;
    let mut mk_salt = [0u8; SALT_LEN];
    keys::random(&mut mk_salt)?;
    // QEMU: the digest gets an eighth of the time, the slot all of it.
    let mk_iters = keys::iterations_for(
        plan.hash,
        super::header::DIGEST_LEN,
        plan.iter_time / 8,
        MIN_ITERATIONS,
    );
    let slot_iters = keys::iterations_for(plan.hash, kb, plan.iter_time, MIN_ITERATIONS);
    let per_slot = slot_sectors(plan);
    let header_sectors = ALIGN / SECTOR_SIZE;
    let slots: Vec<KeySlot> = (0..SLOTS)
        .map(|i| KeySlot {
            active: false,
            iterations: 0,
            salt: [0; SALT_LEN],
            key_offset: (header_sectors + i as u64 * per_slot) as u32,
            stripes: STRIPES,
        })
        .collect();
    let mut h = Header {
        cipher: plan.cipher,
        mode: plan.mode,
        ivgen: plan.ivgen,
        ivgen_hash: plan.ivgen_hash,
        hash: plan.hash,
        payload_offset: (payload_offset(plan) / SECTOR_SIZE) as u32,
        key_bytes: kb as u32,
        mk_digest: [0; super::header::DIGEST_LEN],
        mk_digest_salt: mk_salt,
        mk_digest_iterations: mk_iters,
        uuid: new_uuid()?,
        slots: slots.try_into().expect("eight slots"),
    };
    h.hash.pbkdf2(&master, &mk_salt, mk_iters, &mut h.mk_digest);
    keys::store_slot(&mut h, storage, base, 0, pass, &master, slot_iters)?;
    write_header(storage, base, &h)?;
    Ok((h, master))
}

/// Writes `h` `base` bytes into `storage`, its 4 KiB sector padded.
pub fn write_header(storage: &dyn Storage, base: u64, h: &Header) -> Result<()> {
    let mut b = vec![0u8; ALIGN as usize];
    b[..HEADER_LEN].copy_from_slice(&h.to_bytes());
    storage.write_extend(&b, base)?;
    storage.flush()
}

/// Makes a LUKS volume of `size` bytes at `path` (the size rounded up to
/// whole sectors).
pub fn create(
    target: &mut dyn crate::creation::NewFiles,
    size: u64,
    opts: &LuksCreateOptions,
) -> Result<()> {
    let plan = opts.plan()?;
    let pass = opts.passphrase()?;
    let prealloc = match opts.preallocation.as_deref() {
        None => Preallocation::Off,
        Some(p) => Preallocation::parse(p)
            .map_err(|_| Error::invalid(format!("invalid parameter value: {p}")))?,
    };
    let size = size.div_ceil(SECTOR_SIZE) * SECTOR_SIZE;
    crate::creation::make_image(target, |dev| {
        format_volume(&dev, 0, &plan, pass.bytes())?;
        dev.resize(payload_offset(&plan) + size, prealloc)?;
        Ok(())
    })
}

impl FormatOptions for LuksCreateOptions {
    fn summary(&self, _: &Basics) -> String {
        given_summary(&self.given)
    }

    fn make(&self, target: &mut dyn NewFiles, size: u64, _: &Basics) -> Result<()> {
        create(target, size, self)
    }
}

/// `amend -f luks -o help`.
pub const AMEND_HELP: &str = "Amend options for 'luks':
  iter-time=<num>        - Time to spend in PBKDF in milliseconds
  keyslot=<num>          - Select a single keyslot to modify explicitly
  new-secret=<str>       - New secret to set in the matching keyslots. Empty string to erase
  old-secret=<str>       - Select all keyslots that match this password
  state=<str>            - Select new state of affected keyslots (active/inactive)
";

/// The key slot amend options, each with `prefix` before it.
const AMEND_KEYS: &[&str] = &["state", "keyslot", "old-secret", "new-secret", "iter-time"];

/// A key slot change asked for by `amend`.
#[derive(Debug)]
enum SlotChange {
    Activate {
        slot: Option<usize>,
        new_secret: String,
        iter_time: Duration,
    },
    Erase {
        slot: Option<usize>,
        old_secret: Option<String>,
    },
}

fn parse_amend(options: &OptionList, prefix: &str) -> Result<Option<SlotChange>> {
    let get = |k: &str| options.get(&format!("{prefix}{k}"));
    if AMEND_KEYS.iter().all(|k| get(k).is_none()) {
        return Ok(None);
    }
    let slot = get("keyslot")
        .map(|v| {
            v.parse::<usize>()
                .ok()
                .filter(|s| *s < SLOTS)
                .ok_or_else(|| Error::invalid(format!("Invalid keyslot {v} specified")))
        })
        .transpose()?;
    let iter_time = match get("iter-time") {
        Some(v) => Duration::from_millis(v.parse::<u64>().map_err(|_| {
            Error::invalid(format!(
                "Parameter '{prefix}iter-time' expects a number of milliseconds"
            ))
        })?),
        None => Duration::from_millis(DEFAULT_ITER_TIME_MS),
    };
    match get("state") {
        Some("active") => {
            if get("old-secret").is_some() {
                return Err(Error::invalid(
                    "'old-secret' must not be given when activating keyslots",
                ));
            }
            let new_secret = get("new-secret")
                .ok_or_else(|| Error::invalid("'new-secret' is required to activate a keyslot"))?
                .to_string();
            Ok(Some(SlotChange::Activate {
                slot,
                new_secret,
                iter_time,
            }))
        }
        Some("inactive") => {
            if get("new-secret").is_some() {
                return Err(Error::invalid(
                    "'new-secret' must not be given when erasing keyslots",
                ));
            }
            if get("iter-time").is_some() {
                return Err(Error::invalid(
                    "'iter-time' must not be given when erasing keyslots",
                ));
            }
            let old_secret = get("old-secret").map(str::to_string);
            if slot.is_some() && old_secret.is_some() {
                return Err(Error::invalid(
                    "'keyslot' and 'old-secret' are mutually exclusive",
                ));
            }
            if slot.is_none() && old_secret.is_none() {
                return Err(Error::invalid(
                    "One of 'keyslot' or 'old-secret' must be given when erasing keyslots",
                ));
            }
            Ok(Some(SlotChange::Erase { slot, old_secret }))
        }
        Some(other) => Err(Error::invalid(format!(
            "Parameter '{prefix}state' does not accept value '{other}'"
        ))),
        None => Err(Error::invalid(format!(
            "Parameter '{prefix}state' is missing"
        ))),
    }
}

/// Checks amend options alone (keys known, values well formed).
pub fn check_amend(options: &OptionList, prefix: &str) -> Result<()> {
    if prefix.is_empty() {
        options.check_known(AMEND_KEYS)?;
    }
    parse_amend(options, prefix).map(|_| ())
}

/// Applies the key slot change `options` asks for to the volume whose
/// header is `base` bytes into `storage`; the open's passphrase
/// (`key_secret`) gives the master key for activating. With `force`, an
/// active slot is overwritten and the last active slots are erased, as
/// qemu-img's `--force` allows.
pub fn amend_slots(
    storage: &dyn Storage,
    base: u64,
    current: &Header,
    options: &OptionList,
    prefix: &str,
    key_secret: Option<&str>,
    force: bool,
) -> Result<()> {
    let Some(change) = parse_amend(options, prefix)? else {
        return Ok(());
    };
    let mut h = current.clone();
    match change {
        SlotChange::Activate {
            slot,
            new_secret,
            iter_time,
        } => {
            let id = key_secret
                .ok_or_else(|| Error::invalid("Parameter 'key-secret' is required for cipher"))?;
            let pass = Secrets::global().get(id)?;
            let new_pass = Secrets::global().get(&new_secret)?;
            let (master, _) = keys::unlock(&h, storage, base, pass.bytes(), None)?;
            let i = match slot {
                Some(i) if h.slots[i].active && !force => {
                    return Err(Error::invalid(format!(
                        "Refusing to overwrite active keyslot {i} - please erase it first"
                    )));
                }
                Some(i) => i,
                None => h.slots.iter().position(|s| !s.active).ok_or_else(|| {
                    Error::invalid("Can't add a keyslot - all keyslots are in use")
                })?,
            };
            let iters =
                keys::iterations_for(h.hash, h.key_bytes as usize, iter_time, MIN_ITERATIONS);
            keys::store_slot(&mut h, storage, base, i, new_pass.bytes(), &master, iters)?;
        }
        SlotChange::Erase { slot, old_secret } => {
            let by_password = old_secret.is_some();
            let chosen: Vec<usize> = match (slot, old_secret) {
                (Some(i), _) => vec![i],
                (None, Some(id)) => {
                    let pass = Secrets::global().get(&id)?;
                    let mut v = Vec::new();
                    for i in 0..SLOTS {
                        if h.slots[i].active
                            && keys::unlock(&h, storage, base, pass.bytes(), Some(i)).is_ok()
                        {
                            v.push(i);
                        }
                    }
                    if v.is_empty() {
                        return Err(Error::invalid(
                            "Didn't erase a keyslot, because no keyslots match the given password",
                        ));
                    }
                    v
                }
                (None, None) => unreachable!("checked when parsed"),
            };
            let active = h.slots.iter().filter(|s| s.active).count();
            let erasing = chosen.iter().filter(|&&i| h.slots[i].active).count();
            if erasing > 0 && erasing == active && !force {
                return Err(Error::invalid(if by_password {
                    "All the active keyslots match the (old) password that was given and \
                     erasing them will erase all the data in the image irreversibly - \
                     refusing operation"
                        .to_string()
                } else {
                    format!(
                        "Attempt to erase the only active keyslot {} which will erase all the \
                         data in the image irreversibly - refusing operation",
                        chosen[0]
                    )
                }));
            }
            for i in chosen {
                keys::erase_slot(&mut h, storage, base, i)?;
            }
        }
    }
    write_header(storage, base, &h)
}
