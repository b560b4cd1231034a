//! Whether the device below already holds given bytes: the check of the
//! filters that allow a write only when it changes nothing (protect,
//! checkwrite).

use diskit_core::{BlockDevice, Result, zero::is_zero};

/// The most read from below at once.
const CHUNK: usize = 4 << 20;

/// What a write would leave in a range.
#[derive(Clone, Copy)]
pub enum Expected<'a> {
    /// These bytes (a write).
    Bytes(&'a [u8]),
    /// Zeros, `len` of them (write-zeroes, trim).
    Zeros(u64),
}

impl Expected<'_> {
    /// The length of the range.
    pub fn len(&self) -> u64 {
        match self {
            Expected::Bytes(b) => b.len() as u64,
            Expected::Zeros(n) => *n,
        }
    }

    /// The part `from..from+len` of it.
    pub fn part(&self, from: u64, len: u64) -> Expected<'_> {
        match self {
            Expected::Bytes(b) => Expected::Bytes(&b[from as usize..(from + len) as usize]),
            Expected::Zeros(_) => Expected::Zeros(len),
        }
    }
}

/// Whether `next` holds `expected` at `offset`, read chunk by chunk.
pub fn below_holds(next: &dyn BlockDevice, offset: u64, expected: Expected<'_>) -> Result<bool> {
    let len = expected.len();
    let mut buf = vec![0u8; len.min(CHUNK as u64) as usize];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(CHUNK as u64);
        let got = &mut buf[..n as usize];
        next.read_at(got, offset + done)?;
        let same = match expected.part(done, n) {
            Expected::Bytes(want) => want == got,
            Expected::Zeros(_) => is_zero(got),
        };
        if !same {
            return Ok(false);
        }
        done += n;
    }
    Ok(true)
}
