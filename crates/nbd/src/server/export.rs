//! Exports: a named device with its description, its read-only switch, the
//! Exports: a named device with its description, its read-only switch,
//! the metadata contexts and transmission flags it offers (from its
//! device, or as QEMU's server advertises them) and its request counters.

use std::sync::Arc;

use diskit_core::{BlockDevice, BlockSizeLimits, Capabilities, DeviceRef};

use super::bitmap::ExportBitmap;
use super::stats::Stats;
use crate::proto::consts::*;

/// The longest READ or WRITE payload any export accepts, whatever its
/// device advertises (nbdkit's limit too).
pub const MAX_PAYLOAD: u32 = 64 << 20;

/// The largest request QEMU's NBD server advertises (NBD_MAX_BUFFER_SIZE).
const QEMU_MAX_BLOCK: u32 = 32 << 20;

/// How an export advertises itself: its transmission flags and block
/// sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Advertising {
    /// From its device's capabilities and block sizes (nbdkit's way).
    #[default]
    Device,
    /// As QEMU's NBD server does (qemu-nbd): FLUSH, FUA and CACHE always,
    /// TRIM, WRITE_ZEROES and FAST_ZERO whenever writable (the device
    /// takes them all: trims are advisory, zeroes fall back to writes, a
    /// fast zero it cannot do fails with ENOTSUP), MULTI_CONN as
    /// `multi_conn` says; block sizes of `minimum` (at least the
    /// device's), 4 KiB preferred (at least the minimum) and 32 MiB at
    /// most.
    Qemu {
        /// Whether to advertise NBD_FLAG_CAN_MULTI_CONN (qemu-nbd: when
        /// more than one client may connect).
        multi_conn: bool,
        /// The minimum block size QEMU reports (1, or 512 over a raw
        /// image whose format was probed).
        minimum: u32,
    },
}

/// One export: what a client reaches by name.
pub struct Export {
    name: String,
    description: String,
    device: DeviceRef,
    read_only: bool,
    allocation_depth: bool,
    bitmaps: Vec<Arc<ExportBitmap>>,
    advertising: Advertising,
    stats: Stats,
}

impl Export {
    /// Exports `device` under `name`.
    pub fn new(name: impl Into<String>, device: DeviceRef) -> Export {
        Export {
            name: name.into(),
            description: String::new(),
            device,
            read_only: false,
            allocation_depth: true,
            bitmaps: Vec::new(),
            advertising: Advertising::default(),
            stats: Stats::default(),
        }
    }

    /// Whether `qemu:allocation-depth` is offered: by default, as `diskit
    /// serve` always has; qemu-nbd offers it only with `-A`.
    pub fn with_allocation_depth(mut self, offered: bool) -> Export {
        self.allocation_depth = offered;
        self
    }

    /// The dirty bitmaps served as `qemu:dirty-bitmap:NAME` (qemu-nbd's
    /// `-B NAME`), in the order given; their names must differ.
    pub fn with_bitmaps(mut self, bitmaps: Vec<Arc<ExportBitmap>>) -> Export {
        self.bitmaps = bitmaps;
        self
    }

    /// The dirty bitmaps served.
    pub fn bitmaps(&self) -> &[Arc<ExportBitmap>] {
        &self.bitmaps
    }

    /// Records that guest bytes `[offset, offset + len)` are being written
    /// (a write, zero or trim): the enabled bitmaps mark them dirty.
    pub fn note_write(&self, offset: u64, len: u64) {
        for b in &self.bitmaps {
            b.note_write(offset, len);
        }
    }

    /// Sets how the export advertises itself.
    pub fn with_advertising(mut self, advertising: Advertising) -> Export {
        self.advertising = advertising;
        self
    }

    /// Sets the description shown by LIST and INFO.
    pub fn with_description(mut self, description: impl Into<String>) -> Export {
        self.description = description.into();
        self
    }

    /// Serves the device read-only, whatever it can do.
    pub fn with_read_only(mut self, read_only: bool) -> Export {
        self.read_only = read_only;
        self
    }

    /// The export's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The export's description ("" when none).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Whether the export is served read-only whatever its device can do.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The device behind the export.
    pub fn device(&self) -> &DeviceRef {
        &self.device
    }

    /// Request counters of every connection to this export.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// What the export offers: the device's capabilities, minus writes
    /// when served read-only.
    pub fn capabilities(&self) -> Capabilities {
        self.capabilities_of(&*self.device)
    }

    /// What the export offers through `device`: the export's own device or
    /// a connection's view of it ([`diskit_core::BlockDevice::connect`]),
    /// which may answer for itself (nbdkit's plugins answer per connection).
    pub fn capabilities_of(&self, device: &dyn BlockDevice) -> Capabilities {
        let caps = device.capabilities();
        if self.read_only || !caps.can_write {
            caps.read_only()
        } else {
            caps
        }
    }

    /// Block size constraints, made valid for the protocol: a minimum that
    /// is a power of two up to 64 KiB, a preferred size that is a power of
    /// two at least max(minimum, 512) and at most 32 MiB, and a maximum at
    /// least the preferred size. The maximum is advertised as the device
    /// gives it (up to 4 GiB - 1, as nbdkit's blocksize filter does); what
    /// the server accepts in one READ or WRITE is [`Export::max_payload`].
    pub fn block_size(&self) -> BlockSizeLimits {
        self.block_size_of(&*self.device)
    }

    /// [`Export::block_size`] through `device` (see
    /// [`Export::capabilities_of`]).
    pub fn block_size_of(&self, device: &dyn BlockDevice) -> BlockSizeLimits {
        let b = device.block_size();
        let minimum = b.minimum.clamp(1, 64 * 1024).next_power_of_two();
        if let Advertising::Qemu { minimum: qemu, .. } = self.advertising {
            let minimum = minimum.max(qemu.clamp(1, 64 * 1024).next_power_of_two());
            return BlockSizeLimits {
                minimum,
                preferred: minimum.max(4096),
                maximum: QEMU_MAX_BLOCK.max(minimum),
            };
        }
        let preferred = b
            .preferred
            .clamp(minimum.max(512), 32 << 20)
            .next_power_of_two();
        let maximum = b.maximum.max(preferred);
        BlockSizeLimits {
            minimum,
            preferred,
            maximum,
        }
    }

    /// The longest READ or WRITE payload the server accepts: the advertised
    /// maximum, capped at [`MAX_PAYLOAD`].
    pub fn max_payload(&self) -> u32 {
        self.max_payload_of(&*self.device)
    }

    /// [`Export::max_payload`] through `device`.
    pub fn max_payload_of(&self, device: &dyn BlockDevice) -> u32 {
        self.block_size_of(device).maximum.min(MAX_PAYLOAD)
    }

    /// The transmission flags advertised to a client; DF only once
    /// structured replies are negotiated. Each flag is set only when the
    /// device really has the capability. WRITE_ZEROES is offered on every
    /// writable export whose device does not hide it
    /// ([`diskit_core::BlockDevice::write_zeroes`] always works: a device
    /// without a cheap path writes zeros itself), and FAST_ZERO only with
    /// WRITE_ZEROES, when the device can sometimes zero cheaply.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        self.transmission_flags_of(&*self.device, structured)
    }

    /// [`Export::transmission_flags`] through `device`.
    pub fn transmission_flags_of(&self, device: &dyn BlockDevice, structured: bool) -> u16 {
        let c = self.capabilities_of(device);
        let mut f = TFLAG_HAS_FLAGS;
        let mut set = |cond: bool, flag: u16| {
            if cond {
                f |= flag;
            }
        };
        if let Advertising::Qemu { multi_conn, .. } = self.advertising {
            set(true, TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_CACHE);
            set(!c.can_write, TFLAG_READ_ONLY);
            let writes = TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
            set(c.can_write, writes);
            set(multi_conn, TFLAG_CAN_MULTI_CONN);
            set(structured, TFLAG_SEND_DF);
            return f;
        }
        set(!c.can_write, TFLAG_READ_ONLY);
        // Every writable export takes FLUSH, a no-op where nothing is
        // volatile (nbdkit's memory plugin advertises it too; clients that
        // flush at the end must not fail).
        set(c.can_flush || c.can_write, TFLAG_SEND_FLUSH);
        set(c.can_write && c.can_fua, TFLAG_SEND_FUA);
        set(c.is_rotational, TFLAG_ROTATIONAL);
        set(c.can_write && c.can_trim, TFLAG_SEND_TRIM);
        let zeroes = c.can_write && c.can_write_zeroes;
        set(zeroes, TFLAG_SEND_WRITE_ZEROES);
        set(structured, TFLAG_SEND_DF);
        set(c.can_multi_conn, TFLAG_CAN_MULTI_CONN);
        set(c.can_cache, TFLAG_SEND_CACHE);
        set(zeroes && c.can_fast_zero, TFLAG_SEND_FAST_ZERO);
        f
    }
}

/// The exports of a server, one of them the default ("" reaches it).
#[derive(Clone, Default)]
pub struct ExportSet {
    exports: Vec<Arc<Export>>,
    default: Option<usize>,
    /// Whether unknown names reach the default export.
    any_name: bool,
}

impl ExportSet {
    /// An empty set.
    pub fn new() -> ExportSet {
        ExportSet::default()
    }

    /// Adds an export; the first one added is the default.
    pub fn add(&mut self, export: Export) -> Arc<Export> {
        let e = Arc::new(export);
        self.exports.push(e.clone());
        if self.default.is_none() {
            self.default = Some(self.exports.len() - 1);
        }
        e
    }

    /// Looks an export up by name; "" is the default export, and so is
    /// any other name when the set [`answers_any_name`](Self::answers_any_name).
    pub fn find(&self, name: &str) -> Option<Arc<Export>> {
        if let Some(e) = self.exports.iter().find(|e| e.name == name) {
            return Some(e.clone());
        }
        if name.is_empty() || self.any_name {
            return self.default.map(|i| self.exports[i].clone());
        }
        None
    }

    /// Makes every name a client asks for reach the default export, as
    /// nbdkit serves its plugin under any name (the name is the
    /// connection's, given to the layers in [`diskit_core::Session`]);
    /// qemu-nbd refuses names it does not export.
    pub fn answers_any_name(mut self, any: bool) -> ExportSet {
        self.any_name = any;
        self
    }

    /// Every export, in the order added.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.exports.iter()
    }
}

/// The metadata contexts an export may offer for block status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MetaContext {
    /// `base:allocation`: HOLE and ZERO bits.
    BaseAllocation,
    /// `qemu:allocation-depth`: 0 unallocated, 1 this layer, n+1 the n-th backing file.
    AllocationDepth,
    /// `qemu:dirty-bitmap:NAME`: the export's bitmap at this index.
    DirtyBitmap(usize),
}

impl MetaContext {
    /// The id given to the context by SET_META_CONTEXT.
    pub fn id(self) -> u32 {
        match self {
            MetaContext::BaseAllocation => 1,
            MetaContext::AllocationDepth => 2,
            MetaContext::DirtyBitmap(i) => 3u32.saturating_add(i as u32),
        }
    }
}

impl Export {
    /// Every context the export offers, in the order replies list them
    /// (qemu-nbd's: base, allocation depth, then the bitmaps).
    pub fn contexts(&self) -> Vec<MetaContext> {
        let mut v = vec![MetaContext::BaseAllocation];
        if self.allocation_depth {
            v.push(MetaContext::AllocationDepth);
        }
        v.extend((0..self.bitmaps.len()).map(MetaContext::DirtyBitmap));
        v
    }

    /// The name of one of the export's contexts.
    pub fn context_name(&self, ctx: MetaContext) -> String {
        match ctx {
            MetaContext::BaseAllocation => "base:allocation".into(),
            MetaContext::AllocationDepth => "qemu:allocation-depth".into(),
            MetaContext::DirtyBitmap(i) => self.bitmaps[i].context_name(),
        }
    }

    /// The contexts a LIST_META_CONTEXT query names: an exact name, or a
    /// namespace left empty ("base:", "qemu:", "qemu:dirty-bitmap:") for
    /// all of it, as qemu-nbd reads them. Unknown names match nothing.
    pub fn list_matches(&self, query: &str) -> Vec<MetaContext> {
        self.matches(query, true)
    }

    /// The context a SET_META_CONTEXT query selects: exact names only (a
    /// bitmap the export does not serve selects nothing).
    pub fn set_match(&self, query: &str) -> Option<MetaContext> {
        self.matches(query, false).first().copied()
    }

    /// What `query` names; empty namespaces only when listing.
    fn matches(&self, query: &str, list: bool) -> Vec<MetaContext> {
        let bitmaps = || (0..self.bitmaps.len()).map(MetaContext::DirtyBitmap);
        if let Some(rest) = query.strip_prefix("base:") {
            return match rest {
                "allocation" => vec![MetaContext::BaseAllocation],
                "" if list => vec![MetaContext::BaseAllocation],
                _ => Vec::new(),
            };
        }
        let Some(rest) = query.strip_prefix("qemu:") else {
            return Vec::new();
        };
        let depth = self
            .allocation_depth
            .then_some(MetaContext::AllocationDepth);
        if rest.is_empty() {
            return if list {
                depth.into_iter().chain(bitmaps()).collect()
            } else {
                Vec::new()
            };
        }
        if rest == "allocation-depth" {
            return depth.into_iter().collect();
        }
        match rest.strip_prefix("dirty-bitmap:") {
            Some("") if list => bitmaps().collect(),
            Some("") => Vec::new(),
            Some(name) => bitmaps()
                .filter(
                    |&c| matches!(c, MetaContext::DirtyBitmap(i) if self.bitmaps[i].name() == name),
                )
                .take(1)
                .collect(),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diskit_backends::{MemoryDevice, PatternDevice};

    #[test]
    fn flags_follow_capabilities() {
        let mem = Export::new("m", Arc::new(MemoryDevice::new(1 << 20)));
        let f = mem.transmission_flags(false);
        assert_eq!(f & TFLAG_READ_ONLY, 0);
        assert_ne!(f & TFLAG_SEND_TRIM, 0);
        assert_ne!(f & TFLAG_SEND_FAST_ZERO, 0);
        assert_ne!(f & TFLAG_SEND_FLUSH, 0, "a no-op, but taken");
        assert_eq!(f & TFLAG_SEND_DF, 0);
        assert_ne!(mem.transmission_flags(true) & TFLAG_SEND_DF, 0);
        let ro = Export::new("m", Arc::new(MemoryDevice::new(1 << 20))).with_read_only(true);
        let f = ro.transmission_flags(true);
        assert_ne!(f & TFLAG_READ_ONLY, 0);
        assert_eq!(
            f & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FUA | TFLAG_SEND_FAST_ZERO),
            0
        );
        let pat = Export::new("p", Arc::new(PatternDevice::new(1 << 20)));
        assert_ne!(pat.transmission_flags(false) & TFLAG_READ_ONLY, 0);
    }

    #[test]
    fn qemu_advertising_is_qemus_flag_set_and_block_sizes() {
        let qemu = |multi_conn, minimum| Advertising::Qemu {
            multi_conn,
            minimum,
        };
        let ro = Export::new("r", Arc::new(PatternDevice::new(1 << 20)))
            .with_advertising(qemu(false, 1));
        let always = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_CACHE;
        assert_eq!(
            ro.transmission_flags(true),
            always | TFLAG_READ_ONLY | TFLAG_SEND_DF
        );
        let rw = Export::new("w", Arc::new(MemoryDevice::new(1 << 20)))
            .with_advertising(qemu(true, 512));
        let writes = TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
        assert_eq!(
            rw.transmission_flags(false),
            always | writes | TFLAG_CAN_MULTI_CONN
        );
        let b = rw.block_size();
        assert_eq!((b.minimum, b.preferred, b.maximum), (512, 4096, 32 << 20));
        let b = ro.block_size();
        assert_eq!((b.minimum, b.preferred, b.maximum), (1, 4096, 32 << 20));
        assert_eq!(ro.max_payload(), 32 << 20);
    }

    /// Hides write-zeroes and accepts requests of any size, as nbdkit's
    /// nozero and blocksize filters do.
    struct NoZeroAnySize;

    impl diskit_core::Filter for NoZeroAnySize {
        fn name(&self) -> &str {
            "test"
        }
        fn capabilities(&self, next: &dyn diskit_core::BlockDevice) -> Capabilities {
            Capabilities {
                can_write_zeroes: false,
                ..next.capabilities()
            }
        }
        fn block_size(&self, _next: &dyn diskit_core::BlockDevice) -> BlockSizeLimits {
            BlockSizeLimits {
                minimum: 1,
                preferred: 4096,
                maximum: u32::MAX,
            }
        }
    }

    #[test]
    fn hidden_write_zeroes_and_large_maximum_block_sizes() {
        let mem = Arc::new(MemoryDevice::new(1 << 20));
        let dev = Arc::new(diskit_core::Filtered::new(NoZeroAnySize, mem.clone()));
        let e = Export::new("f", dev);
        let f = e.transmission_flags(true);
        assert_eq!(f & (TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO), 0);
        assert_ne!(f & TFLAG_SEND_TRIM, 0);
        assert_eq!(
            e.block_size().maximum,
            u32::MAX,
            "advertised as the device says"
        );
        assert_eq!(e.max_payload(), MAX_PAYLOAD, "but payloads stay bounded");
        let plain = Export::new("m", mem);
        assert_eq!(plain.block_size().maximum, 64 << 20);
        assert_eq!(plain.max_payload(), 64 << 20);
    }

    #[test]
    fn default_export_and_contexts() {
        let mut set = ExportSet::new();
        set.add(Export::new("a", Arc::new(MemoryDevice::new(512))));
        set.add(Export::new("b", Arc::new(MemoryDevice::new(512))));
        let a = set.find("").unwrap();
        assert_eq!(a.name(), "a");
        assert_eq!(set.find("b").unwrap().name(), "b");
        assert!(set.find("c").is_none());
        assert_eq!(a.list_matches("qemu:"), vec![MetaContext::AllocationDepth]);
        assert_eq!(a.list_matches("base:allocation").len(), 1);
        assert!(a.list_matches("qemu:dirty-bitmap:x").is_empty());
        assert!(a.list_matches("qemu:dirty-bitmap:").is_empty());
        assert_eq!(a.set_match("base:"), None);
        assert_eq!(a.set_match("qemu:dirty-bitmap:x"), None);
    }

    #[test]
    fn bitmap_contexts_as_qemu_nbd_names_them() {
        use diskit_core::bits::Bits;
        let bitmap = |n: &str| Arc::new(ExportBitmap::new(n, Bits::new(512, 16), false));
        let e = Export::new("e", Arc::new(MemoryDevice::new(512)))
            .with_allocation_depth(false)
            .with_bitmaps(vec![bitmap("b0"), bitmap("b1")]);
        let b0 = MetaContext::DirtyBitmap(0);
        let b1 = MetaContext::DirtyBitmap(1);
        assert_eq!(
            e.contexts(),
            vec![MetaContext::BaseAllocation, b0, b1],
            "no allocation depth unless asked"
        );
        assert_eq!(e.list_matches("qemu:"), vec![b0, b1]);
        assert_eq!(e.list_matches("qemu:dirty-bitmap:"), vec![b0, b1]);
        assert_eq!(e.list_matches("qemu:dirty-bitmap:b1"), vec![b1]);
        assert!(e.list_matches("qemu:allocation-depth").is_empty());
        assert!(e.list_matches("qemu:dirty-bitmap").is_empty());
        assert_eq!(e.set_match("qemu:dirty-bitmap:b1"), Some(b1));
        assert_eq!(e.set_match("qemu:dirty-bitmap:b2"), None);
        assert_eq!(e.set_match("qemu:dirty-bitmap:"), None);
        assert_eq!(e.set_match("qemu:allocation-depth"), None);
        assert_eq!(e.context_name(b1), "qemu:dirty-bitmap:b1");
        assert_ne!(b0.id(), b1.id());
        assert_ne!(b0.id(), MetaContext::AllocationDepth.id());
    }
}
