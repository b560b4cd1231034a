//! qcow2's row in the format table.

use std::sync::Arc;

use diskit_core::{BlockDevice, Result, Storage, StorageRef};

use super::amend::{self, Amend};
use super::create::Qcow2CreateOptions;
use super::measure::{Measurement, Source};
use super::ops::Qcow2Image;
use crate::check::{CheckReport, Repair};
use crate::creation::Creation;
use crate::driver::{BackingName, FormatDriver, Measured, Opened, Opening};
use crate::image_ops::Capability;
use crate::{Format, OptionList};

/// qcow2's probe: the qcow magic with version 2 or more.
pub fn probe(h: &[u8], _: &str) -> u32 {
    u32::from(qcow_version(h).is_some_and(|v| v >= 2)) * 100
}

/// The version field of a qcow or qcow2 header, when the magic matches.
pub(crate) fn qcow_version(h: &[u8]) -> Option<u32> {
    (h.len() >= 8 && h[..4] == *b"QFI\xfb").then(|| u32::from_be_bytes([h[4], h[5], h[6], h[7]]))
}

/// The creation options qcow2 offers.
const OFFERED: crate::creation::Offered = crate::creation::Offered(&[
    "backing_file=<str>     - File name of a base image",
    "backing_fmt=<str>      - Image format of the base image",
    "cluster_size=<size>    - qcow2 cluster size",
    "compat=<str>           - Compatibility level (v2 [0.10] or v3 [1.1])",
    "compression_type=<str> - Compression method used for image cluster compression",
    "data_file=<str>        - File name of an external data file",
    "data_file_raw=<bool (on/off)> - The external data file must stay valid as a raw image",
    "encrypt.cipher-alg=<str> - Name of encryption cipher algorithm",
    "encrypt.cipher-mode=<str> - Name of encryption cipher mode",
    "encrypt.format=<str>   - Encrypt the image, format choices: 'aes', 'luks'",
    "encrypt.hash-alg=<str> - Name of encryption hash algorithm",
    "encrypt.iter-time=<num> - Time to spend in PBKDF in milliseconds",
    "encrypt.ivgen-alg=<str> - Name of IV generator algorithm",
    "encrypt.ivgen-hash-alg=<str> - Name of IV generator hash algorithm",
    "encrypt.key-secret=<str> - ID of secret providing qcow AES key or LUKS passphrase",
    "encryption=<bool (on/off)> - Encrypt the image with format 'aes'. (Deprecated in favor of encrypt.format=aes)",
    "extended_l2=<bool (on/off)> - Extended L2 tables",
    "lazy_refcounts=<bool (on/off)> - Postpone refcount updates",
    "preallocation=<str>    - Preallocation mode (allowed values: off, metadata, falloc, full)",
    "refcount_bits=<num>    - Width of a reference count entry in bits",
    "size=<size>            - Virtual disk size",
]);

/// The qcow2 driver.
pub struct Qcow2Driver;

impl FormatDriver for Qcow2Driver {
    fn name(&self) -> &'static str {
        "qcow2"
    }

    fn open_keys(&self) -> &'static [&'static str] {
        &[
            "backing",
            "data-file",
            "l2-cache-size",
            "l2-cache-entry-size",
            "encrypt.key-secret",
            "encrypt.format",
        ]
    }

    fn children(&self) -> &'static [&'static str] {
        &["backing", "data-file"]
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let (storage, opts, implied) = (at.storage, at.opts, at.implied);
        let q = Arc::new(super::open::open(
            storage.clone(),
            super::Qcow2Options {
                writable: opts.writable,
                l2_cache_size: opts.l2_cache_size,
                l2_cache_entry_size: opts
                    .node_options
                    .iter()
                    .find(|(k, _)| k == "l2-cache-entry-size")
                    .map(|(k, v)| crate::options::size_value(k, v))
                    .transpose()?,
                snapshot: opts.snapshot.clone(),
                key_secret: opts.key_secret.clone(),
                encrypt_format: opts
                    .node_options
                    .iter()
                    .find(|(k, _)| k == "encrypt.format")
                    .map(|(_, v)| v.clone()),
                metadata_only: opts.metadata_only,
                host_zeros: opts.host_zeros,
                keep_allocations: opts.keep_allocations,
            },
            implied,
        )?);
        Ok(Opened {
            device: q.clone(),
            image: Arc::new(Qcow2Image::new(q, storage)),
        })
    }

    fn supports(&self, what: Capability) -> bool {
        match what {
            Capability::Snapshots
            | Capability::Bitmaps
            | Capability::Compression
            | Capability::Check
            | Capability::Amend
            | Capability::BackingFile
            | Capability::MakeEmpty
            | Capability::MetadataPreallocation => true,
        }
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn Creation>> {
        Ok(Box::new(Qcow2CreateOptions::parse(options)?))
    }

    fn check(&self, storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
        super::check::check(storage, repair)
    }

    fn amend_help(&self) -> Option<String> {
        Some(amend::help())
    }

    fn check_amend_options(&self, options: &OptionList) -> Result<()> {
        Amend::parse(options).map(drop)
    }

    fn change_backing_file(&self, file: &dyn Storage, to: Option<BackingName<'_>>) -> Result<()> {
        super::backing::change_backing_file(file, to)
    }

    fn check_create_options(&self, options: &OptionList) -> Result<()> {
        Qcow2CreateOptions::parse(options).map(drop)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("qcow2", with_file)
    }

    fn measure(&self, options: &OptionList, of: Measured<'_>) -> Result<Measurement> {
        let mut opts = Qcow2CreateOptions::parse(options)?;
        let source = match of {
            Measured::Size(s) => {
                opts.set_size(s);
                None
            }
            Measured::Image(img) => Some(Source {
                device: &*img.device,
                qcow2_file: (img.format == Format::QCOW2).then_some(&*img.file as &dyn BlockDevice),
            }),
        };
        super::measure::measure(&opts, source)
    }
}

impl Creation for Qcow2CreateOptions {
    fn size(&self) -> Option<u64> {
        self.size
    }

    fn set_size(&mut self, size: u64) {
        Qcow2CreateOptions::set_size(self, size);
    }

    fn backing_file(&self) -> Option<&str> {
        self.backing_file.as_deref()
    }

    fn backing_format(&self) -> Option<&str> {
        self.backing_fmt.as_deref()
    }

    fn set_backing_file(&mut self, name: &str) {
        Qcow2CreateOptions::set_backing_file(self, name);
    }

    fn set_backing_format(&mut self, name: &str) {
        self.set_backing_fmt(name);
    }

    fn summary(&self) -> String {
        format!(" {}", Qcow2CreateOptions::summary(self))
    }

    fn create(&self, target: &mut dyn crate::creation::NewFiles) -> Result<()> {
        super::create::create(target, self)
    }
}
