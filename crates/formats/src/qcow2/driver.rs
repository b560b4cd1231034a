//! qcow2's row in the format table.

use std::path::Path;
use std::sync::Arc;

use diskit_core::{BlockDevice, Result, StorageRef};

use super::create::Qcow2CreateOptions;
use super::measure::{Measurement, Source};
use crate::driver::{FormatDriver, Opened, one_size};
use crate::implied::ImpliedFiles;
use crate::{Image, OpenOptions, OptionList};

/// The qcow2 driver.
pub struct Qcow2Driver;

impl FormatDriver for Qcow2Driver {
    fn name(&self) -> &'static str {
        "qcow2"
    }

    fn probe(&self, head: &[u8], filename: &str) -> u32 {
        crate::probe::qcow2(head, filename)
    }

    fn open_keys(&self) -> &'static [&'static str] {
        &["backing", "data-file", "l2-cache-size"]
    }

    fn children(&self) -> &'static [&'static str] {
        &["backing", "data-file"]
    }

    fn open(
        &self,
        storage: StorageRef,
        opts: &OpenOptions,
        implied: &mut dyn ImpliedFiles,
    ) -> Result<Opened> {
        let q = Arc::new(super::open::open(
            storage,
            super::Qcow2Options {
                writable: opts.writable,
                direct: opts.direct,
                l2_cache_size: opts.l2_cache_size,
                snapshot: opts.snapshot.clone(),
            },
            implied,
        )?);
        Ok(Opened {
            device: q.clone(),
            qcow2: Some(q),
        })
    }

    fn create(&self, path: &Path, size: Option<u64>, options: &OptionList) -> Result<u64> {
        let mut opts = Qcow2CreateOptions::parse(options)?;
        let given = size;
        let size = one_size(size, opts.size)?;
        if given.is_some() {
            opts.set_size(size);
        }
        super::create::create(path, &opts)?;
        Ok(size)
    }

    fn check_create_options(&self, options: &OptionList) -> Result<()> {
        Qcow2CreateOptions::parse(options).map(drop)
    }

    fn create_help(&self, with_file: bool) -> String {
        super::create::create_help(with_file)
    }

    fn measure(
        &self,
        options: &OptionList,
        size: Option<u64>,
        source: Option<&Image>,
    ) -> Result<Measurement> {
        let mut opts = Qcow2CreateOptions::parse(options)?;
        if let Some(s) = size {
            opts.set_size(s);
        }
        let source = source.map(|img| Source {
            device: &*img.device,
            qcow2_file: img
                .qcow2
                .is_some()
                .then_some(&*img.file as &dyn BlockDevice),
        });
        super::measure::measure(&opts, source)
    }
}
