//! What `info` shows of an image beyond its size, format neutral: the
//! fields of QEMU's ImageInfo that a format fills in, and its
//! format-specific data as an ordered tree.

/// A value of format-specific information: QAPI's types, objects with
/// their keys in schema order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InfoValue {
    /// A string.
    Str(String),
    /// An unsigned integer (QAPI `size`, `uint64`).
    UInt(u64),
    /// A signed integer (QAPI `int`).
    Int(i64),
    /// `true` / `false`.
    Bool(bool),
    /// An array.
    List(Vec<InfoValue>),
    /// An object, keys in schema order.
    Dict(Vec<(String, InfoValue)>),
}

impl InfoValue {
    /// An empty object.
    pub fn dict() -> InfoValue {
        InfoValue::Dict(Vec::new())
    }

    /// The object with `key` added last (a no-op on other values).
    pub fn with(mut self, key: &str, value: InfoValue) -> InfoValue {
        if let InfoValue::Dict(items) = &mut self {
            items.push((key.to_string(), value));
        }
        self
    }
}

/// An internal snapshot, as QAPI's SnapshotInfo describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its id, as shown.
    pub id: String,
    /// Its name, as shown.
    pub name: String,
    /// Bytes of saved VM state.
    pub vm_state_size: u64,
    /// When it was taken: seconds since the epoch.
    pub date_sec: u32,
    /// When it was taken: nanoseconds within the second.
    pub date_nsec: u32,
    /// The guest clock at the time, in nanoseconds.
    pub vm_clock_nsec: u64,
    /// The instruction count at the time, if recorded.
    pub icount: Option<u64>,
}

/// What an image's format adds to `info` (QEMU's ImageInfo fields and
/// ImageInfoSpecific).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatInfo {
    /// The cluster size, for formats that have clusters.
    pub cluster_size: Option<u64>,
    /// Whether the guest data is encrypted.
    pub encrypted: bool,
    /// Whether the image was not cleanly shut down.
    pub dirty: bool,
    /// Whether the driver answers QEMU's get_info for the image (false:
    /// no dirty flag and no cluster size are shown, as for a vmdk whose
    /// extents are of different kinds).
    pub driver_info: bool,
    /// The backing file name as recorded (cut at NUL, never empty).
    pub backing_filename: Option<String>,
    /// Its format as recorded (only with a backing file; never empty).
    pub backing_format: Option<String>,
    /// The internal snapshots.
    pub snapshots: Vec<SnapshotInfo>,
    /// The `type` of `format-specific`.
    pub specific_type: &'static str,
    /// The `data` of `format-specific`.
    pub specific: InfoValue,
    /// Warnings to print (without the program prefix), such as stale
    /// bitmaps.
    pub warnings: Vec<String>,
    /// Files of the image besides its own (vmdk extents), shown as child
    /// nodes and counted in its disk size.
    pub children: Vec<ChildFile>,
}

/// A file that holds part of an image, as `info` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildFile {
    /// The child's name (`extents.0`).
    pub name: String,
    /// The file's name.
    pub filename: String,
    /// Its protocol (`file`).
    pub protocol: &'static str,
    /// Bytes allocated to it, if known.
    pub actual: Option<u64>,
    /// Its length.
    pub length: u64,
}

impl FormatInfo {
    /// What a format with clusters (or none) and nothing format-specific
    /// shows (vdi, vpc, qed, vhdx): no section of its own.
    pub fn plain(cluster_size: Option<u64>) -> FormatInfo {
        FormatInfo {
            cluster_size,
            encrypted: false,
            dirty: false,
            driver_info: true,
            backing_filename: None,
            backing_format: None,
            snapshots: Vec::new(),
            specific_type: "",
            specific: InfoValue::dict(),
            warnings: Vec::new(),
            children: Vec::new(),
        }
    }
}
