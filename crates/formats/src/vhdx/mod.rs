//! VHDX, Hyper-V's format (`-f vhdx`): two headers, a region table, a
//! metadata region, a log that journals metadata updates, and a BAT of
//! payload blocks (1 MiB to 256 MiB) interleaved with sector bitmap
//! entries.
//!
//! [`header`] parses and validates every structure but the log; [`log`]
//! finds, replays and writes log entries; [`device`] maps (the generic
//! mapped layer reads) and writes; creation, `check` (and `-r all`, which
//! replays the log) and `info` are here, with qemu-img's options, messages
//! and exit codes.
//!
//! As in QEMU 10: differencing images (with a parent) are refused at open
//! ("not supported"); an image whose log needs replaying opens only for
//! writing (the log is replayed then) and is refused read-only with
//! QEMU's message; `measure` and `resize` are refused with qemu-img's
//! messages. `map` shows the whole disk as one data extent, as qemu-img
//! does (QEMU's driver reports no allocation), while the device itself
//! reports the real allocation, so that convert and `serve` skip what
//! reads as zeros.

pub mod device;
pub mod header;
pub mod log;

use std::sync::Arc;

use diskit_core::{Error, Preallocation, Result, Storage, StorageRef};

use crate::check::{CheckReport, Repair};
use crate::creation::{Basics, FormatOptions, NewFiles, Offered, Planned, given_summary};
use crate::driver::{FormatDriver, Opened, Opening};
use crate::image_ops::{Capability, FormatImage};
use crate::info::FormatInfo;
use crate::options::bool_value;
use crate::{Format, OptionList, Prealloc};

use device::{Mode, Vhdx};
use header::{
    CREATOR_AT, DEFAULT_LOG, Geometry, HEADER_BLOCK, HEADER_OFFSETS, Header, LOG_OFFSET, MAX_BLOCK,
    MAX_SIZE, MIB, Metadata, NULL_GUID, PAYLOAD_FULLY_PRESENT, PAYLOAD_ZERO, REGION_TABLE_OFFSET,
    REGION_TABLE2_OFFSET, Region, RegionTable, SECTOR, SIGNATURE,
};

/// The creation options vhdx offers.
const OFFERED: Offered = Offered(&[
    "block_size=<size>      - Block Size; min 1MB, max 256MB. 0 means auto-calculate based on image size.",
    "block_state_zero=<bool (on/off)> - Force use of payload blocks of type 'ZERO'. Non-standard, but default.  Do not set to 'off' when using 'qemu-img convert' with subformat=dynamic.",
    "log_size=<size>        - Log size; min 1MB.",
    "size=<size>            - Virtual disk size; max of 64TB.",
    "subformat=<str>        - VHDX format type, can be either 'dynamic' or 'fixed'. Default is 'dynamic'.",
]);

/// Creation options, as given (checked when the image is made, after
/// qemu-img's "Formatting" line).
#[derive(Debug, Clone, Default)]
pub struct VhdxCreateOptions {
    /// `log_size=`.
    pub log_size: Option<u64>,
    /// `block_size=` (0: chosen from the size).
    pub block_size: Option<u64>,
    /// `subformat=` as given.
    pub subformat: Option<String>,
    /// `block_state_zero=`, and its text as given.
    pub block_state_zero: Option<(bool, String)>,
    /// Protocol options as given, for the "Formatting" line.
    given: Vec<(String, String)>,
}

impl VhdxCreateOptions {
    /// Parses `-o`: unknown keys and malformed values are errors.
    pub fn parse(options: &OptionList) -> Result<VhdxCreateOptions> {
        OFFERED.check(options)?;
        Ok(VhdxCreateOptions {
            log_size: options.size("log_size")?,
            block_size: options.size("block_size")?,
            subformat: options.text("subformat"),
            block_state_zero: options
                .get("block_state_zero")
                .map(|v| bool_value("block_state_zero", v).map(|b| (b, v.to_string())))
                .transpose()?,
            given: options.given(&["preallocation", "nocow", "extent_size_hint"]),
        })
    }
}

/// The layout of a new image.
struct Plan {
    size: u64,
    log_size: u64,
    fixed: bool,
    zero_blocks: bool,
    geo: Geometry,
}

impl Plan {
    /// Checks the options as `qemu-img create -f vhdx` does, in its order
    /// and with its messages, and lays the image out.
    fn new(size: u64, o: &VhdxCreateOptions) -> Result<Plan> {
        let fixed = match o.subformat.as_deref() {
            None | Some("dynamic") => false,
            Some("fixed") => true,
            Some(v) => {
                return Err(Error::invalid(format!(
                    "Parameter 'subformat' does not accept value '{v}'"
                )));
            }
        };
        let size = size
            .checked_next_multiple_of(512)
            .filter(|s| *s <= MAX_SIZE)
            .ok_or_else(|| Error::invalid("Image size too large; max of 64TB"))?;
        let log_size = o
            .log_size
            .unwrap_or(DEFAULT_LOG)
            .checked_next_multiple_of(MIB)
            .unwrap_or(u64::MAX);
        if log_size > u32::MAX as u64 {
            return Err(Error::invalid("Log size must be smaller than 4 GB"));
        }
        if log_size < MIB {
            return Err(Error::invalid("Log size must be a multiple of 1 MB"));
        }
        let mut bs = o
            .block_size
            .unwrap_or(0)
            .checked_next_multiple_of(MIB)
            .unwrap_or(u64::MAX)
            .min(MAX_BLOCK);
        if bs == 0 {
            bs = header::default_block_size(size);
        }
        if !bs.is_power_of_two() {
            return Err(Error::invalid("Block size must be a power of two"));
        }
        Ok(Plan {
            size,
            log_size,
            fixed,
            zero_blocks: o.block_state_zero.as_ref().is_none_or(|(b, _)| *b),
            geo: Geometry::new(size, bs)?,
        })
    }

    fn bat_offset(&self) -> u64 {
        LOG_OFFSET + self.log_size
    }

    fn metadata_offset(&self) -> u64 {
        self.bat_offset() + self.geo.bat_region_len()
    }

    /// Where payload data starts: 4 MiB after the metadata's 1 MiB.
    fn data_start(&self) -> u64 {
        self.metadata_offset() + 5 * MIB
    }

    /// The BAT entry of index `i`.
    fn bat_entry(&self, i: u64) -> u64 {
        if self.geo.is_bitmap_index(i) || i >= self.geo.used_entries() {
            return 0;
        }
        let b = i - i / (self.geo.chunk_ratio + 1);
        match (self.fixed, self.zero_blocks) {
            (_, true) => PAYLOAD_ZERO,
            (false, false) => 0,
            (true, false) => (self.data_start() + b * self.geo.block_size) | PAYLOAD_FULLY_PRESENT,
        }
    }

    /// Makes the image in `dev`.
    fn write(&self, dev: &dyn Storage) -> Result<()> {
        let mut ident = vec![0u8; 64];
        ident[..8].copy_from_slice(SIGNATURE);
        let creator: Vec<u8> = format!("diskit v{}", env!("CARGO_PKG_VERSION"))
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        ident[CREATOR_AT..CREATOR_AT + creator.len()].copy_from_slice(&creator);
        dev.write_extend(&ident, 0)?;
        let mut seq = [0u8; 4];
        crate::luks::keys::random(&mut seq)?;
        let mut h = Header {
            sequence: u32::from_le_bytes(seq) as u64,
            file_write_guid: header::new_guid()?,
            data_write_guid: header::new_guid()?,
            log_guid: NULL_GUID,
            log_version: 0,
            version: 1,
            log_length: self.log_size as u32,
            log_offset: LOG_OFFSET,
        };
        for at in HEADER_OFFSETS {
            let mut b = vec![0u8; HEADER_BLOCK];
            h.write_into(&mut b);
            dev.write_extend(&b, at)?;
            h.sequence += 1;
        }
        let rt = RegionTable {
            bat: Region {
                offset: self.bat_offset(),
                length: self.geo.bat_region_len() as u32,
            },
            metadata: Region {
                offset: self.metadata_offset(),
                length: MIB as u32,
            },
        }
        .to_bytes();
        dev.write_extend(&rt, REGION_TABLE_OFFSET)?;
        dev.write_extend(&rt, REGION_TABLE2_OFFSET)?;
        let md = Metadata {
            block_size: self.geo.block_size as u32,
            leave_allocated: self.fixed,
            virtual_size: self.size,
            logical_sector: SECTOR,
            physical_sector: SECTOR,
            page83: header::new_guid()?,
        };
        dev.write_extend(&md.to_bytes(), self.metadata_offset())?;
        if self.fixed || self.zero_blocks {
            // The entries that are not zero, a MiB of BAT at a time.
            let used = self.geo.used_entries();
            let per = MIB / 8;
            let mut first = 0;
            while first < used {
                let n = per.min(used - first);
                let b: Vec<u8> = (first..first + n)
                    .flat_map(|i| self.bat_entry(i).to_le_bytes())
                    .collect();
                dev.write_extend(&b, self.bat_offset() + first * 8)?;
                first += n;
            }
        }
        let end = self.data_start() + if self.fixed { self.size } else { 0 };
        dev.resize(end, Preallocation::Off)
    }
}

/// Makes a VHDX image of `size` bytes at `path`, as `qemu-img create -f
/// vhdx` does (a failed creation removes the file it made).
pub fn create(
    target: &mut dyn crate::creation::NewFiles,
    size: u64,
    o: &VhdxCreateOptions,
) -> Result<()> {
    let plan = Plan::new(size, o)?;
    crate::creation::make_image(target, |dev| plan.write(dev))
}

impl FormatOptions for VhdxCreateOptions {
    fn summary(&self, _: &Basics) -> String {
        let mut out = format!(
            " log_size={} block_size={}",
            self.log_size.unwrap_or(DEFAULT_LOG),
            self.block_size.unwrap_or(0)
        );
        if let Some(s) = &self.subformat {
            out += &format!(" subformat={s}");
        }
        if let Some((_, t)) = &self.block_state_zero {
            out += &format!(" block_state_zero={t}");
        }
        out + &given_summary(&self.given)
    }

    fn make(&self, target: &mut dyn NewFiles, size: u64, _: &Basics) -> Result<()> {
        create(target, size, self)
    }
}

/// Checks the image as qemu-img does: with `repair`, it is opened for
/// writing, which replays its log (one corruption fixed); then every
/// payload block's BAT entry is checked (errors cannot be repaired).
pub fn check(storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
    let v = Vhdx::open(
        storage.clone(),
        Mode {
            writable: repair != Repair::None,
            for_check: true,
            host_zeros: false,
        },
    )?;
    let mut r = CheckReport::default();
    if v.replayed() {
        r.corruptions_fixed = 1;
    }
    r.messages = v.bat_errors(false)?;
    r.corruptions = r.messages.len() as u64;
    Ok(r)
}

/// vhdx's probe: the file identifier's signature.
pub fn probe(h: &[u8], _: &str) -> u32 {
    crate::probe::magic_at(h, 0, b"vhdxfile")
}

/// The vhdx driver.
pub struct VhdxDriver;

impl FormatDriver for VhdxDriver {
    fn name(&self) -> &'static str {
        "vhdx"
    }

    fn open(&self, at: Opening<'_>) -> Result<Opened> {
        let Opening { storage, opts, .. } = at;
        let v = Arc::new(
            Vhdx::open(
                storage,
                Mode {
                    writable: opts.writable,
                    for_check: false,
                    host_zeros: opts.host_zeros,
                },
            )?
            .keeping_allocations(opts.keep_allocations),
        );
        Ok(Opened {
            device: v.clone(),
            image: Arc::new(VhdxImage {
                block_size: v.metadata().block_size as u64,
            }),
        })
    }

    fn supports(&self, what: Capability) -> bool {
        matches!(what, Capability::Check)
    }

    fn parse_create(&self, options: &OptionList) -> Result<Box<dyn crate::Creation>> {
        Planned::boxed(options, VhdxCreateOptions::parse(options)?)
    }

    fn create_help(&self, with_file: bool) -> String {
        OFFERED.help("vhdx", with_file)
    }

    fn check(&self, storage: &StorageRef, repair: Repair) -> Result<CheckReport> {
        check(storage, repair)
    }
}

/// An open VHDX image.
pub struct VhdxImage {
    block_size: u64,
}

impl FormatImage for VhdxImage {
    fn format(&self) -> Format {
        Format::VHDX
    }

    fn info(&self) -> Result<Option<FormatInfo>> {
        Ok(Some(FormatInfo::plain(Some(self.block_size))))
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.block_size)
    }

    fn reports_allocation(&self) -> bool {
        false
    }

    fn check_resize(&self, _new_size: u64, _prealloc: Option<Prealloc>) -> Result<()> {
        Ok(())
    }

    fn resize(&self, _new_size: u64, _shrink: bool, _prealloc: Prealloc) -> Result<()> {
        Err(Error::unsupported(
            "Image format driver does not support resize",
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use diskit_backends::MemoryDevice;
    use diskit_core::{
        BlockDevice, Capabilities, Preallocation, Result, Storage, StorageRef, WriteFlags,
        ZeroFlags,
    };

    use super::device::{Mode, Vhdx};
    use super::*;

    /// What a writer did to its file, in order.
    #[derive(Clone)]
    enum Op {
        Write(u64, Vec<u8>),
        Resize(u64),
        Flush,
    }

    /// Memory storage that records every change.
    struct Recorder {
        inner: Arc<MemoryDevice>,
        ops: Mutex<Vec<Op>>,
    }

    impl Recorder {
        fn log(&self, op: Op) {
            diskit_core::sync::lock(&self.ops).push(op);
        }
    }

    impl BlockDevice for Recorder {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn capabilities(&self) -> Capabilities {
            self.inner.capabilities()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
            self.log(Op::Write(offset, buf.to_vec()));
            self.inner.write_at(buf, offset, flags)
        }
        fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
            self.log(Op::Write(offset, vec![0; len as usize]));
            self.inner.write_zeroes(offset, len, flags)
        }
        fn flush(&self) -> Result<()> {
            self.log(Op::Flush);
            Ok(())
        }
    }

    impl Storage for Recorder {
        fn location(&self) -> &str {
            "recorder"
        }
        fn protocol(&self) -> &'static str {
            "memory"
        }
        fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
            self.log(Op::Write(offset, buf.to_vec()));
            self.inner.write_extend(buf, offset)
        }
        fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
            self.log(Op::Resize(new_len));
            self.inner.resize(new_len, prealloc)
        }
    }

    fn memory(bytes: &[u8]) -> Arc<MemoryDevice> {
        let m = Arc::new(MemoryDevice::new(0));
        m.write_extend(bytes, 0).unwrap();
        m
    }

    fn new_image(size: u64, opts: &str) -> Vec<u8> {
        let mut list = OptionList::new();
        list.parse_into(opts).unwrap();
        let o = VhdxCreateOptions::parse(&list).unwrap();
        let m = Arc::new(MemoryDevice::new(0));
        Plan::new(size, &o).unwrap().write(&*m).unwrap();
        let mut b = vec![0u8; m.size() as usize];
        m.read_at(&mut b, 0).unwrap();
        b
    }

    const BS: u64 = 1 << 20;

    /// The writes the crash test makes: (guest offset, length, byte).
    const WRITES: &[(u64, u64, u8)] = &[
        (4096, 70_000, 0x11),
        (3 * BS, BS, 0x22),
        (7 * BS + 5, 3, 0x33),
        (4096, 100, 0x44),
        (9 * BS - 10, 20, 0x55),
    ];

    #[test]
    fn an_image_cut_short_by_a_kill_or_a_power_loss_opens_with_old_or_new_data() {
        let base = new_image(16 * BS, "block_size=1M");
        let rec = Arc::new(Recorder {
            inner: memory(&base),
            ops: Mutex::new(Vec::new()),
        });
        {
            let v = Vhdx::open(
                rec.clone() as StorageRef,
                Mode {
                    writable: true,
                    ..Mode::default()
                },
            )
            .unwrap();
            for (i, &(g, n, byte)) in WRITES.iter().enumerate() {
                v.write_at(&vec![byte; n as usize], g, WriteFlags::NONE)
                    .unwrap();
                if i % 2 == 1 {
                    v.flush().unwrap();
                }
            }
            v.close().unwrap();
        }
        let ops = diskit_core::sync::lock(&rec.ops).clone();
        assert!(ops.len() > 20, "{} changes", ops.len());
        let mut replays = 0;
        for k in 0..=ops.len() {
            let done: Vec<&Op> = ops[..k].iter().collect();
            replays += usize::from(crashed_at(
                &base,
                &done,
                &format!("after {k} changes"),
                k == ops.len(),
            ));
        }
        assert!(replays > 0, "some crash points leave a log to replay");
        // Power lost: what was flushed is there, and any part of what was
        // written since.
        let flushes: Vec<usize> = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, Op::Flush))
            .map(|(i, _)| i)
            .collect();
        let mut start = 0;
        for &end in flushes.iter().chain([&ops.len()]) {
            let epoch = &ops[start..end];
            let tries = if epoch.len() <= 10 {
                1u64 << epoch.len()
            } else {
                256
            };
            for t in 0..tries {
                let mask = if epoch.len() <= 10 {
                    t
                } else {
                    t.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (t << 7)
                };
                let mut done: Vec<&Op> = ops[..start].iter().collect();
                done.extend(
                    epoch
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| mask >> (i % 64) & 1 == 1)
                        .map(|(_, o)| o),
                );
                crashed_at(
                    &base,
                    &done,
                    &format!("epoch {start}..{end}, subset {mask:#x}"),
                    false,
                );
            }
            start = end + 1;
        }
    }

    /// Opens the image made of `base` and `done` (replaying its log if it
    /// has one to replay, which it returns): it must read as before the
    /// writes or as some of them (`all`: all of them).
    fn crashed_at(base: &[u8], done: &[&Op], what: &str, all: bool) -> bool {
        let mut replayed = false;
        {
            let m = memory(base);
            for op in done {
                match op {
                    Op::Write(at, b) => m.write_extend(b, *at).unwrap(),
                    Op::Resize(n) => m.resize(*n, Preallocation::Off).unwrap(),
                    Op::Flush => {}
                }
            }
            let k = what;
            let v = match Vhdx::open(m.clone() as StorageRef, Mode::default()) {
                Ok(v) => v,
                Err(e) => {
                    assert!(e.to_string().contains("needs to be replayed"), "{k}: {e}");
                    replayed = true;
                    let rw = Mode {
                        writable: true,
                        ..Mode::default()
                    };
                    drop(Vhdx::open(m.clone() as StorageRef, rw).unwrap());
                    Vhdx::open(m as StorageRef, Mode::default()).unwrap()
                }
            };
            assert!(v.bat_errors(false).unwrap().is_empty(), "{k}");
            // Every byte reads as before the writes or as one of them.
            let mut disk = vec![0u8; 16 * BS as usize];
            v.read_at(&mut disk, 0).unwrap();
            for (i, &b) in disk.iter().enumerate() {
                let i = i as u64;
                let ok = b == 0
                    || WRITES
                        .iter()
                        .any(|&(g, n, byte)| (g..g + n).contains(&i) && b == byte);
                assert!(ok, "{k}: byte {i} is {b:#x}");
            }
            if all {
                let mut want = vec![0u8; 16 * BS as usize];
                for &(g, n, byte) in WRITES {
                    want[g as usize..(g + n) as usize].fill(byte);
                }
                assert!(disk == want, "all changes: the written data");
            }
        }
        replayed
    }

    #[test]
    fn options_are_checked_as_qemu_img() {
        let plan = |opts: &str, size: u64| {
            let mut list = OptionList::new();
            list.parse_into(opts).unwrap();
            Plan::new(size, &VhdxCreateOptions::parse(&list).unwrap())
        };
        let p = plan("", 100 << 20).unwrap();
        assert_eq!(p.geo.block_size, 8 << 20);
        assert_eq!(p.data_start(), 8 << 20);
        assert_eq!(
            plan("block_size=100K", 1 << 30).unwrap().geo.block_size,
            MIB
        );
        assert_eq!(
            plan("block_size=1G", 1 << 30).unwrap().geo.block_size,
            MAX_BLOCK
        );
        assert_eq!(plan("log_size=1536K", 1 << 20).unwrap().log_size, 2 * MIB);
        for (opts, size, msg) in [
            ("", MAX_SIZE + 1, "Image size too large"),
            ("log_size=4G", 1, "smaller than 4 GB"),
            ("log_size=0", 1, "multiple of 1 MB"),
            ("block_size=3M", 1, "power of two"),
            ("subformat=Fixed", 1, "does not accept value 'Fixed'"),
        ] {
            let e = plan(opts, size).err().unwrap().to_string();
            assert!(e.contains(msg), "{opts}: {e}");
        }
    }
}
