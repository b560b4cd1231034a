//! A big-endian reader over a byte slice that never panics: every getter
//! reports a short buffer as `None`.

/// Reads big-endian integers and byte strings from a slice, front to back.
#[derive(Debug, Clone)]
pub struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Cursor<'a> {
        Cursor { buf }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// The rest of the buffer, consuming it.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N).map(|b| b.try_into().expect("length checked"))
    }

    /// A big-endian u16.
    pub fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    /// A big-endian u32.
    pub fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    /// A big-endian u64.
    pub fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    /// A string prefixed by its u32 length, as options carry names.
    pub fn string32(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.bytes(n)
    }
}

/// Appends big-endian integers and strings to a buffer.
pub trait PutBe {
    /// Appends a u16.
    fn put_u16(&mut self, v: u16);
    /// Appends a u32.
    fn put_u32(&mut self, v: u32);
    /// Appends a u64.
    fn put_u64(&mut self, v: u64);
}

impl PutBe for Vec<u8> {
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_buffers_are_none_not_panics() {
        let mut c = Cursor::new(&[0, 1, 2]);
        assert_eq!(c.u16(), Some(1));
        assert_eq!(c.u16(), None);
        assert_eq!(c.remaining(), 1);
        let mut c = Cursor::new(&[0, 0, 0, 9, 1]);
        assert_eq!(c.string32(), None);
    }
}
