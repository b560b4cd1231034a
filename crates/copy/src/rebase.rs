//! The data half of a safe rebase: before an image changes its backing file,
//! everything it does not hold itself and that reads differently through the
//! new backing file than through the old one is written into the image, so
//! that what it shows stays the same.
//!
//! As qemu-img does: the image is walked in pieces of up to 2 MiB; ranges
//! the image allocates are skipped; the rest, widened to `align` (the
//! image's subcluster size, so that no write needs copy-on-write), is read
//! from both backing files (zeros past their ends) and compared in blocks of
//! `align` bytes; differing runs get the old content, written as zeroes past
//! the end of the old backing file. Works on any devices.

use diskit_core::{BlockDevice, Result, WriteFlags, ZeroFlags, extent};

use crate::Progress;

/// Bytes compared per piece.
const PIECE: u64 = 2 << 20;

/// The backing files around a rebase.
pub struct Backings<'a> {
    /// What the image's unallocated ranges read from now (None: zeros).
    pub old: Option<&'a dyn BlockDevice>,
    /// What they will read from (None: zeros).
    pub new: Option<&'a dyn BlockDevice>,
}

/// Whether `[offset, ...)` is allocated in `dev` itself (not in a layer
/// below), and for how many bytes (at most `max`) that holds.
pub fn allocated_here(dev: &dyn BlockDevice, offset: u64, max: u64) -> Result<(bool, u64)> {
    let mut state = None;
    let mut n = 0;
    // A device that stops answering: stop there (nothing at all: call one
    // byte its own).
    let mut walk = extent::walk(dev, offset, max);
    while let Some(e) = walk.next_answered()? {
        let here = e.depth == 0 && e.flags.present;
        match state {
            None => state = Some(here),
            Some(s) if s != here => return Ok((s, n)),
            _ => {}
        }
        n += e.length;
    }
    Ok((state.unwrap_or(true), n.max(1).min(max)))
}

/// Whether the first `chunk` bytes of `a` and `b` differ, and how many bytes
/// from the start (whole chunks, or to the end) share that answer.
pub fn compare_chunks(a: &[u8], b: &[u8], chunk: usize) -> (bool, usize) {
    let len = a.len().min(b.len());
    let chunk = chunk.max(1);
    let first = chunk.min(len);
    let differ = a[..first] != b[..first];
    let mut i = first;
    while i < len {
        let n = chunk.min(len - i);
        if (a[i..i + n] != b[i..i + n]) != differ {
            break;
        }
        i += n;
    }
    (differ, i)
}

/// Writes into `image` the old backing content of every range it does not
/// allocate where the old and new backing files differ.
pub fn copy_differences(
    image: &dyn BlockDevice,
    backings: &Backings<'_>,
    align: u64,
    progress: &Progress,
) -> Result<()> {
    copy_differences_into(image, image, backings, align, progress)
}

/// [`copy_differences`], writing through `out` (a device over the same
/// image: a compressing writer for `rebase -c`, whose writes must then be
/// whole clusters: `align` the cluster size).
pub fn copy_differences_into(
    image: &dyn BlockDevice,
    out: &dyn BlockDevice,
    backings: &Backings<'_>,
    align: u64,
    progress: &Progress,
) -> Result<()> {
    let size = image.size();
    let align = align.clamp(1, PIECE);
    let old_size = backings.old.map_or(0, |d| d.size());
    let new_size = backings.new.map_or(0, |d| d.size());
    progress.start(size);
    let mut old_buf = vec![0u8; PIECE as usize];
    let mut new_buf = vec![0u8; PIECE as usize];
    let mut offset = 0;
    while offset < size {
        let (here, n) = allocated_here(image, offset, PIECE.min(size - offset))?;
        if here {
            offset += n;
            progress.advance(n);
            continue;
        }
        // Widen to whole aligned blocks, within one piece.
        let start = offset / align * align;
        let end = (offset + n).div_ceil(align) * align;
        let n = (end - start).min(size - start).min(PIECE);
        let len = n as usize;
        read_or_zeros(backings.old, old_size, start, &mut old_buf[..len])?;
        read_or_zeros(backings.new, new_size, start, &mut new_buf[..len])?;
        let mut done = 0;
        while done < len {
            let (differ, run) =
                compare_chunks(&old_buf[done..len], &new_buf[done..len], align as usize);
            let at = start + done as u64;
            if differ {
                if at >= old_size {
                    out.write_zeroes(at, run as u64, ZeroFlags::default())?;
                } else {
                    out.write_at(&old_buf[done..done + run], at, WriteFlags::NONE)?;
                }
            }
            done += run;
        }
        progress.advance((start + n).saturating_sub(offset));
        offset = start + n;
    }
    image.flush()
}

/// Reads `buf.len()` bytes at `offset` from `dev` (of `size` bytes), zeros
/// past its end or without a device.
fn read_or_zeros(
    dev: Option<&dyn BlockDevice>,
    size: u64,
    offset: u64,
    buf: &mut [u8],
) -> Result<()> {
    let avail = size.saturating_sub(offset).min(buf.len() as u64) as usize;
    buf[avail..].fill(0);
    if let Some(d) = dev
        && avail > 0
    {
        d.read_at(&mut buf[..avail], offset)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_chunks_groups_whole_chunks() {
        let a = [0u8, 0, 1, 1, 2, 2, 3];
        let b = [0u8, 0, 1, 9, 9, 2, 3];
        assert_eq!(compare_chunks(&a, &b, 2), (false, 2));
        assert_eq!(compare_chunks(&a[2..], &b[2..], 2), (true, 4));
        assert_eq!(compare_chunks(&a[6..], &b[6..], 2), (false, 1));
        assert_eq!(compare_chunks(&a, &a, 4), (false, 7));
    }
}
