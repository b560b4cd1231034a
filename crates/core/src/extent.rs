//! Extents: what a range of a device is made of.
//!
//! One description feeds `map`, NBD block status and convert's hole
//! skipping: whether a range reads as zeros, whether it has data allocated,
//! at which layer of a backing chain it was found, and where it lives in
//! that layer's file.

/// Flags of an extent, in qemu-img map's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExtentFlags {
    /// The range reads as zeros.
    pub zero: bool,
    /// The range has data allocated (false: a hole; NBD_STATE_HOLE).
    pub data: bool,
    /// The range is allocated in some layer of the chain (qemu's "present").
    pub present: bool,
    /// The data is stored compressed.
    pub compressed: bool,
}

/// A run of bytes with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (> 0).
    pub length: u64,
    /// Allocation state.
    pub flags: ExtentFlags,
    /// The layer of the backing chain that answered (0 = this device).
    pub depth: u32,
    /// Where the first byte lives in the answering layer's file, when it
    /// lives at a plain offset there.
    pub host_offset: Option<u64>,
}

impl Extent {
    /// Allocated data at this layer, location unknown.
    pub fn data(length: u64) -> Extent {
        Extent {
            length,
            flags: ExtentFlags {
                zero: false,
                data: true,
                present: true,
                compressed: false,
            },
            depth: 0,
            host_offset: None,
        }
    }

    /// A hole that reads as zeros, at this layer.
    pub fn hole(length: u64) -> Extent {
        Extent {
            length,
            flags: ExtentFlags {
                zero: true,
                data: false,
                present: true,
                compressed: false,
            },
            depth: 0,
            host_offset: None,
        }
    }

    /// Sets the host offset of the first byte.
    pub fn at_host(mut self, offset: u64) -> Extent {
        self.host_offset = Some(offset);
        self
    }

    /// Whether the range reads as zeros without looking at it.
    pub fn is_zero(&self) -> bool {
        self.flags.zero
    }

    /// Whether `next` continues `self` with the same state, so the two can merge.
    pub fn can_merge(&self, next: &Extent) -> bool {
        self.flags == next.flags
            && self.depth == next.depth
            && match (self.host_offset, next.host_offset) {
                (None, None) => true,
                (Some(a), Some(b)) => a.checked_add(self.length) == Some(b),
                _ => false,
            }
    }
}

/// Appends `e` to `list`, merging it into the last extent when possible.
pub fn push_merged(list: &mut Vec<Extent>, e: Extent) {
    if e.length == 0 {
        return;
    }
    if let Some(last) = list.last_mut()
        && last.can_merge(&e)
    {
        last.length += e.length;
        return;
    }
    list.push(e);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_needs_same_flags_and_contiguous_host_offsets() {
        let mut v = Vec::new();
        push_merged(&mut v, Extent::data(10).at_host(0));
        push_merged(&mut v, Extent::data(5).at_host(10));
        push_merged(&mut v, Extent::data(5).at_host(100));
        push_merged(&mut v, Extent::hole(5));
        push_merged(&mut v, Extent::hole(0));
        push_merged(&mut v, Extent::hole(7));
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].length, 15);
        assert_eq!(v[2].length, 12);
    }
}
