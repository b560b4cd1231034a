//! A new object, written by multipart upload: writes fill parts held in
//! memory; a part is uploaded in the background once it is full (or once
//! the writes have gone [`WINDOW`] parts past it), several at once; the
//! first part stays in memory until the end, so that a format may write
//! its header last. `close` uploads what remains (bytes never written are
//! zeros) and completes the upload; a failure, or a drop without a
//! completed close, aborts it, so that no part is left behind and the
//! object is never seen half-written.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};

use diskit_core::sync::lock;
use diskit_core::workers::Workers;
use diskit_core::{
    BlockDevice, BlockSizeLimits, Capabilities, Error, ErrorKind, Preallocation, Result, WriteFlags,
};

use crate::client::Client;
use crate::config::S3Options;
use crate::name::S3Name;

/// S3's smallest part (but the last).
pub const MIN_PART: u64 = 5 << 20;
/// S3's largest part.
pub const MAX_PART: u64 = 5 << 30;
/// S3's most parts in one upload.
pub const MAX_PARTS: u64 = 10_000;
/// The part size diskit uses at least (the AWS CLI's).
const DEFAULT_PART: u64 = 8 << 20;
/// How many parts past a part the writes may go before it is uploaded
/// whether full or not (the bytes it lacks are zeros): the memory held
/// for writes that come out of order.
const WINDOW: u64 = 4;

/// The part size for an object of about `size` bytes: at least 8 MiB,
/// and large enough that the object, and a quarter more (a format's
/// metadata), fits in S3's 10,000 parts; whole MiB.
pub fn part_size(size: u64) -> u64 {
    let room = size.saturating_add(size / 4);
    let per_part = room.div_ceil(MAX_PARTS).next_multiple_of(1 << 20);
    per_part.clamp(DEFAULT_PART, MAX_PART)
}

/// A part held in memory, and which of its bytes were written.
struct Part {
    data: Vec<u8>,
    /// Written ranges within the part, sorted and merged.
    written: Vec<(u64, u64)>,
}

impl Part {
    fn new(size: u64) -> Part {
        Part {
            data: vec![0; size as usize],
            written: Vec::new(),
        }
    }

    /// Notes `a..b` written.
    fn mark(&mut self, a: u64, b: u64) {
        let (mut a, mut b) = (a, b);
        self.written.retain(|&(x, y)| {
            if y < a || x > b {
                true
            } else {
                a = a.min(x);
                b = b.max(y);
                false
            }
        });
        let at = self.written.partition_point(|&(x, _)| x < a);
        self.written.insert(at, (a, b));
    }

    fn full(&self) -> bool {
        self.written == [(0, self.data.len() as u64)]
    }
}

/// Where the upload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Taking writes.
    Open,
    /// The object is there.
    Completed,
    /// Given up: nothing is left of it.
    Aborted,
}

struct State {
    /// The object's length now.
    len: u64,
    /// Parts held in memory, by index (from 0).
    held: BTreeMap<u64, Part>,
    /// Parts sent or being sent, by index: their entity tags once there.
    sent: HashMap<u64, Option<String>>,
    /// The multipart upload's id, once started.
    upload_id: Option<String>,
    /// The first failure of a background upload.
    failed: Option<Error>,
    stage: Stage,
}

/// A part on its way.
struct PartJob {
    id: String,
    index: u64,
    data: Vec<u8>,
}

struct Shared {
    client: Client,
    part: u64,
    state: Mutex<State>,
    /// Signalled when a part's upload ends.
    changed: Condvar,
}

/// A new S3 object being written, front to back.
pub struct S3Writer {
    shared: Arc<Shared>,
    /// Threads that upload parts, started at the first one.
    pool: Workers,
}

impl std::fmt::Debug for S3Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Writer")
            .field("name", &self.shared.client.what)
            .finish_non_exhaustive()
    }
}

impl S3Writer {
    /// A new object `name` of `len` bytes (it grows as written past its
    /// end), with parts sized for an object of about `size_hint` bytes.
    /// Nothing is sent before the first part is full.
    pub fn create(name: &S3Name, opts: &S3Options, len: u64, size_hint: u64) -> Result<S3Writer> {
        let client = Client::new(name, opts)?;
        Ok(S3Writer {
            shared: Arc::new(Shared {
                client,
                part: part_size(size_hint.max(len)),
                state: Mutex::new(State {
                    len,
                    held: BTreeMap::new(),
                    sent: HashMap::new(),
                    upload_id: None,
                    failed: None,
                    stage: Stage::Open,
                }),
                changed: Condvar::new(),
            }),
            pool: Workers::new("diskit-s3-upload", opts.connections.clamp(1, 8)),
        })
    }

    /// The part size.
    pub fn part_size(&self) -> u64 {
        self.shared.part
    }

    fn what(&self) -> &str {
        &self.shared.client.what
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.shared.state)
    }

    /// Writes `buf` at `offset`, growing the object when `grow`.
    fn write(&self, buf: &[u8], offset: u64, grow: bool) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::new(ErrorKind::Overflow, "write past the largest offset"))?;
        let part = self.shared.part;
        let mut st = self.state();
        self.usable(&st)?;
        if end > st.len {
            if !grow {
                return Err(Error::new(
                    ErrorKind::NoSpace,
                    format!(
                        "write ends at {end}, past the end of {} ({} bytes)",
                        self.what(),
                        st.len
                    ),
                ));
            }
            self.check_parts(end)?;
            st.len = end;
        }
        let mut jobs = Vec::new();
        let mut at = offset;
        let mut rest = buf;
        while !rest.is_empty() {
            let index = at / part;
            let within = at % part;
            let n = (part - within).min(rest.len() as u64) as usize;
            if st.sent.contains_key(&index) {
                return Err(self.behind(at, index));
            }
            let p = st.held.entry(index).or_insert_with(|| Part::new(part));
            p.data[within as usize..within as usize + n].copy_from_slice(&rest[..n]);
            p.mark(within, within + n as u64);
            let full = index > 0 && p.full();
            if full {
                jobs.push(self.take_part(&mut st, index)?);
            }
            at += n as u64;
            rest = &rest[n..];
        }
        // Parts the writes have left well behind go, full or not.
        let reached = (end.max(1) - 1) / part;
        let behind: Vec<u64> = st
            .held
            .keys()
            .copied()
            .filter(|&i| i > 0 && i + WINDOW <= reached)
            .collect();
        for i in behind {
            jobs.push(self.take_part(&mut st, i)?);
        }
        drop(st);
        self.start(jobs);
        Ok(())
    }

    /// Fails when the upload is over or a part failed.
    fn usable(&self, st: &State) -> Result<()> {
        if let Some(e) = &st.failed {
            return Err(again(e));
        }
        match st.stage {
            Stage::Open => Ok(()),
            _ => Err(Error::new(
                ErrorKind::Io,
                format!("{}: the upload is over", self.what()),
            )),
        }
    }

    /// Refuses a length that S3's 10,000 parts cannot hold.
    fn check_parts(&self, len: u64) -> Result<()> {
        if len.div_ceil(self.shared.part) > MAX_PARTS {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "{}: {len} bytes do not fit in S3's {MAX_PARTS} parts of {} bytes",
                    self.what(),
                    self.shared.part
                ),
            ));
        }
        Ok(())
    }

    fn behind(&self, offset: u64, index: u64) -> Error {
        Error::new(
            ErrorKind::NotSupported,
            format!(
                "{}: S3 objects are written front to back: the bytes at {offset} belong to \
                 part {} of {} bytes, uploaded already",
                self.what(),
                index + 1,
                self.shared.part
            ),
        )
    }

    /// Takes part `index` (held, or zeros when never written) out to be
    /// uploaded, starting the multipart upload first if need be.
    fn take_part(&self, st: &mut State, index: u64) -> Result<PartJob> {
        if st.upload_id.is_none() {
            st.upload_id = Some(self.shared.client.create_upload()?);
        }
        let id = st.upload_id.clone().unwrap_or_default();
        let len = (st.len - index * self.shared.part).min(self.shared.part) as usize;
        let mut data = match st.held.remove(&index) {
            Some(p) => p.data,
            None => vec![0; len],
        };
        data.truncate(len);
        st.sent.insert(index, None);
        Ok(PartJob { id, index, data })
    }

    /// Uploads parts in the background (the state's lock not held: the
    /// pool makes its caller wait while it is busy, and its jobs take the
    /// lock when they end).
    fn start(&self, jobs: Vec<PartJob>) {
        for PartJob { id, index, data } in jobs {
            let shared = self.shared.clone();
            self.pool.run(move || {
                let number = (index + 1) as u16;
                let r = shared.client.upload_part(&id, number, &data);
                let mut st = lock(&shared.state);
                match r {
                    Ok(etag) => {
                        st.sent.insert(index, Some(etag));
                    }
                    Err(e) => {
                        st.sent.remove(&index);
                        st.failed.get_or_insert(e);
                    }
                }
                shared.changed.notify_all();
            });
        }
    }

    /// Waits until no upload is in flight; the first failure, if any.
    fn settle<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State>,
    ) -> (std::sync::MutexGuard<'a, State>, Result<()>) {
        while st.sent.values().any(Option::is_none) && st.failed.is_none() {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        // A failure may leave others in flight: wait for them too, so that
        // an abort finds every part.
        while st.sent.values().any(Option::is_none) {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        let r = match &st.failed {
            Some(e) => Err(again(e)),
            None => Ok(()),
        };
        (st, r)
    }

    /// Uploads what remains and completes the object.
    fn finish(&self) -> Result<()> {
        let part = self.shared.part;
        let mut st = self.state();
        self.usable(&st)?;
        let parts = st.len.div_ceil(part).max(1);
        if st.upload_id.is_none() && parts == 1 {
            // One part: one request, no multipart upload.
            let len = st.len as usize;
            let mut data = st.held.remove(&0).map(|p| p.data).unwrap_or_default();
            data.resize(len, 0);
            drop(st);
            let r = self.shared.client.put(&data);
            let mut st = self.state();
            st.stage = if r.is_ok() {
                Stage::Completed
            } else {
                Stage::Aborted
            };
            return r;
        }
        let mut jobs = Vec::new();
        for i in 0..parts {
            if !st.sent.contains_key(&i) {
                jobs.push(self.take_part(&mut st, i)?);
            }
        }
        drop(st);
        self.start(jobs);
        let (st, r) = self.settle(self.state());
        r?;
        let etags: Vec<String> = (0..parts)
            .map(|i| st.sent.get(&i).cloned().flatten().unwrap_or_default())
            .collect();
        let id = st.upload_id.clone().unwrap_or_default();
        drop(st);
        self.shared.client.complete(&id, &etags)?;
        self.state().stage = Stage::Completed;
        Ok(())
    }

    /// Gives the object up: aborts the upload (its parts go), or removes
    /// the object when it was completed already.
    pub fn discard(&self) -> Result<()> {
        let st = self.state();
        let (mut st, _) = self.settle(st);
        let stage = std::mem::replace(&mut st.stage, Stage::Aborted);
        let id = st.upload_id.take();
        st.held.clear();
        drop(st);
        match (stage, id) {
            (Stage::Completed, _) => self.shared.client.delete(),
            (Stage::Open, Some(id)) => self.shared.client.abort(&id),
            _ => Ok(()),
        }
    }
}

/// The failure of a part, for each call that meets it.
fn again(e: &Error) -> Error {
    Error::new(e.kind(), e.to_string())
}

impl Drop for S3Writer {
    fn drop(&mut self) {
        let open = self.state().stage == Stage::Open;
        if open {
            let _ = self.discard();
        }
    }
}

impl BlockDevice for S3Writer {
    fn size(&self) -> u64 {
        self.state().len
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            can_write: true,
            can_flush: true,
            can_write_zeroes: true,
            can_multi_conn: false,
            ..Capabilities::READ_ONLY
        }
    }
    fn block_size(&self) -> BlockSizeLimits {
        BlockSizeLimits {
            minimum: 1,
            preferred: 1 << 20,
            maximum: 32 << 20,
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let part = self.shared.part;
        let st = self.state();
        diskit_core::device::check_range(st.len, offset, buf.len() as u64)?;
        let mut at = offset;
        let mut done = 0;
        while done < buf.len() {
            let index = at / part;
            let within = (at % part) as usize;
            let n = (part as usize - within).min(buf.len() - done);
            let out = &mut buf[done..done + n];
            match st.held.get(&index) {
                Some(p) => out.copy_from_slice(&p.data[within..within + n]),
                None if st.sent.contains_key(&index) => return Err(self.behind(at, index)),
                None => out.fill(0),
            }
            at += n as u64;
            done += n;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        self.write(buf, offset, false)
    }
    /// Waits for the parts in flight; the object is complete only at
    /// [`close`](BlockDevice::close).
    fn flush(&self) -> Result<()> {
        let st = self.state();
        let (_st, r) = self.settle(st);
        r
    }
    fn describe(&self) -> String {
        self.shared.client.what.clone()
    }
    fn close(&self) -> Result<()> {
        if self.state().stage != Stage::Open {
            return Ok(());
        }
        let r = self.finish();
        if r.is_err() {
            let _ = self.discard();
        }
        r
    }
}

impl diskit_core::Storage for S3Writer {
    fn location(&self) -> &str {
        &self.shared.client.what
    }
    fn writes_in_order(&self) -> bool {
        true
    }
    /// The first part, held in memory until the end.
    fn rewritable_head(&self) -> u64 {
        self.shared.part
    }
    fn protocol(&self) -> &'static str {
        "s3"
    }
    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write(buf, offset, true)
    }
    fn resize(&self, new_len: u64, _prealloc: Preallocation) -> Result<()> {
        let part = self.shared.part;
        let mut st = self.state();
        self.usable(&st)?;
        self.check_parts(new_len)?;
        if let Some(&last) = st.sent.keys().max()
            && new_len < (last + 1) * part
        {
            return Err(self.behind(new_len, last));
        }
        if new_len < st.len {
            // Bytes cut off read as zeros if the object grows again.
            let from = new_len;
            for (&i, p) in st.held.iter_mut() {
                let start = i * part;
                if start + part > from {
                    let cut = from.saturating_sub(start) as usize;
                    p.data[cut..].fill(0);
                    p.written.retain(|&(a, _)| a < cut as u64);
                    if let Some(w) = p.written.last_mut() {
                        w.1 = w.1.min(cut as u64);
                    }
                }
            }
            st.held.retain(|&i, _| i * part < new_len || i == 0);
        }
        st.len = new_len;
        Ok(())
    }
    fn is_fixed_size(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_sizes_keep_within_s3_limits() {
        assert_eq!(part_size(0), 8 << 20);
        assert_eq!(part_size(1 << 30), 8 << 20);
        // 100 GiB: 125 GiB over 10,000 parts, 13 MiB each.
        assert_eq!(part_size(100 << 30), 13 << 20);
        assert!(part_size(100 << 30) * MAX_PARTS >= 125 << 30);
        assert_eq!(part_size(u64::MAX), MAX_PART);
        assert!(part_size(1 << 40) >= MIN_PART);
    }

    #[test]
    fn written_ranges_merge_until_the_part_is_full() {
        let mut p = Part::new(100);
        p.mark(10, 20);
        p.mark(50, 100);
        p.mark(15, 30);
        assert_eq!(p.written, vec![(10, 30), (50, 100)]);
        assert!(!p.full());
        p.mark(0, 10);
        p.mark(30, 50);
        assert_eq!(p.written, vec![(0, 100)]);
        assert!(p.full());
    }
}
