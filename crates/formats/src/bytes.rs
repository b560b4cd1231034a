//! Integers at byte offsets of on-disk structures, little and big endian.
//! The caller has checked the bounds: a short slice panics.

/// The little-endian u16 at `at`.
pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian u32 at `at`.
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The little-endian u64 at `at`.
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The big-endian u16 at `at`.
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// The big-endian u32 at `at`.
pub fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The big-endian u64 at `at`.
pub fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Little-endian u32s end to end (a block map, a directory).
pub(crate) fn le32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| le32(c, 0)).collect()
}

/// Little-endian u64s end to end (a table).
pub(crate) fn le64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| le64(c, 0)).collect()
}
