//! Exports: a named device with its description, its read-only switch, the
//! metadata contexts and transmission flags it offers (from its device, or
//! as QEMU's server advertises them) and its request counters.

use std::sync::Arc;

use diskit_core::{BlockSizeLimits, Capabilities, DeviceRef};

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

/// The metadata contexts an export offers besides `base:allocation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contexts {
    /// `qemu:allocation-depth` (nbdkit-style servers offer it always,
    /// qemu-nbd with `-A`).
    pub allocation_depth: bool,
    /// The persistent dirty bitmaps to offer as `qemu:dirty-bitmap:NAME`
    /// (qemu-nbd's `-B NAME`), in the order given. Contexts for them are
    /// not served yet: the qemu-nbd command refuses `-B` before an export
    /// is made.
    pub bitmaps: Vec<String>,
}

impl Default for Contexts {
    fn default() -> Self {
        Contexts {
            allocation_depth: true,
            bitmaps: Vec::new(),
        }
    }
}

/// One export: what a client reaches by name.
pub struct Export {
    name: String,
    description: String,
    device: DeviceRef,
    read_only: bool,
    advertising: Advertising,
    contexts: Contexts,
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
            advertising: Advertising::default(),
            contexts: Contexts::default(),
            stats: Stats::default(),
        }
    }

    /// Sets how the export advertises itself.
    pub fn with_advertising(mut self, advertising: Advertising) -> Export {
        self.advertising = advertising;
        self
    }

    /// Sets the metadata contexts offered besides `base:allocation`.
    pub fn with_contexts(mut self, contexts: Contexts) -> Export {
        self.contexts = contexts;
        self
    }

    /// The metadata contexts the export offers, `base:allocation` first.
    pub fn meta_contexts(&self) -> Vec<MetaContext> {
        MetaContext::ALL
            .into_iter()
            .filter(|c| match c {
                MetaContext::BaseAllocation => true,
                MetaContext::AllocationDepth => self.contexts.allocation_depth,
            })
            .collect()
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
        let caps = self.device.capabilities();
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
        let b = self.device.block_size();
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
        self.block_size().maximum.min(MAX_PAYLOAD)
    }

    /// The transmission flags advertised to a client; DF only once
    /// structured replies are negotiated. Each flag is set only when the
    /// device really has the capability. WRITE_ZEROES is offered on every
    /// writable export whose device does not hide it
    /// ([`diskit_core::BlockDevice::write_zeroes`] always works: a device
    /// without a cheap path writes zeros itself), and FAST_ZERO only with
    /// WRITE_ZEROES, when the device can sometimes zero cheaply.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let c = self.capabilities();
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

    /// Looks an export up by name; "" is the default export.
    pub fn find(&self, name: &str) -> Option<Arc<Export>> {
        if let Some(e) = self.exports.iter().find(|e| e.name == name) {
            return Some(e.clone());
        }
        if name.is_empty() {
            return self.default.map(|i| self.exports[i].clone());
        }
        None
    }

    /// Every export, in the order added.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.exports.iter()
    }
}

/// The metadata contexts this server offers for block status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaContext {
    /// `base:allocation`: HOLE and ZERO bits.
    BaseAllocation,
    /// `qemu:allocation-depth`: 0 unallocated, 1 this layer, n+1 the n-th backing file.
    AllocationDepth,
}

impl MetaContext {
    /// Every context offered.
    pub const ALL: [MetaContext; 2] = [MetaContext::BaseAllocation, MetaContext::AllocationDepth];

    /// The context's name.
    pub fn name(self) -> &'static str {
        match self {
            MetaContext::BaseAllocation => "base:allocation",
            MetaContext::AllocationDepth => "qemu:allocation-depth",
        }
    }

    /// The id given to the context by SET_META_CONTEXT.
    pub fn id(self) -> u32 {
        match self {
            MetaContext::BaseAllocation => 1,
            MetaContext::AllocationDepth => 2,
        }
    }

    /// The contexts of `offered` a LIST_META_CONTEXT query names: an
    /// exact name, or a namespace wildcard ("base:", "qemu:"). Unknown
    /// names match nothing.
    pub fn list_matches(query: &str, offered: &[MetaContext]) -> Vec<MetaContext> {
        offered
            .iter()
            .copied()
            .filter(|c| {
                let name = c.name();
                query == name || (query.ends_with(':') && name.starts_with(query))
            })
            .collect()
    }

    /// The context of `offered` a SET_META_CONTEXT query selects: exact
    /// names only.
    pub fn set_match(query: &str, offered: &[MetaContext]) -> Option<MetaContext> {
        offered.iter().copied().find(|c| c.name() == query)
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
        assert_eq!(set.find("").unwrap().name(), "a");
        assert_eq!(set.find("b").unwrap().name(), "b");
        assert!(set.find("c").is_none());
        let all = MetaContext::ALL;
        assert_eq!(
            MetaContext::list_matches("qemu:", &all),
            vec![MetaContext::AllocationDepth]
        );
        assert_eq!(MetaContext::list_matches("base:allocation", &all).len(), 1);
        assert!(MetaContext::list_matches("qemu:dirty-bitmap:x", &all).is_empty());
        assert_eq!(MetaContext::set_match("base:", &all), None);
        let plain = Export::new("p", Arc::new(MemoryDevice::new(512))).with_contexts(Contexts {
            allocation_depth: false,
            bitmaps: Vec::new(),
        });
        let offered = plain.meta_contexts();
        assert_eq!(offered, vec![MetaContext::BaseAllocation]);
        assert!(MetaContext::list_matches("qemu:", &offered).is_empty());
        assert_eq!(
            MetaContext::set_match("qemu:allocation-depth", &offered),
            None
        );
    }
}
