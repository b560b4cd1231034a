//! A request as the filters that look at requests or act before them see
//! it (log, stats; delay, error, rate): its kind, its range and its
//! flags, whether it came through a method or was submitted.

use diskit_core::aio::Request;
use diskit_core::{WriteFlags, ZeroFlags};

/// The kinds of request, in the order nbdkit's stats filter lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
    Trim,
    Zero,
    Extents,
    Cache,
    Flush,
}

/// One request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    /// What it asks.
    pub(crate) op: Op,
    /// Where (0 for a flush).
    pub(crate) offset: u64,
    /// How many bytes (0 for a flush).
    pub(crate) len: u64,
    /// Its flags: FUA for writes and trims, all of them for zeroes.
    pub(crate) flags: ZeroFlags,
}

impl Call {
    /// A request without flags.
    pub(crate) fn new(op: Op, offset: u64, len: u64) -> Call {
        Call {
            op,
            offset,
            len,
            flags: ZeroFlags::default(),
        }
    }

    /// A write or a trim with `flags`.
    pub(crate) fn writing(op: Op, offset: u64, len: u64, flags: WriteFlags) -> Call {
        Call {
            flags: ZeroFlags {
                fua: flags.fua,
                ..ZeroFlags::default()
            },
            ..Call::new(op, offset, len)
        }
    }

    /// A write-zeroes with `flags`.
    pub(crate) fn zero(offset: u64, len: u64, flags: ZeroFlags) -> Call {
        Call {
            flags,
            ..Call::new(Op::Zero, offset, len)
        }
    }

    /// A submitted request.
    pub(crate) fn of(req: &Request) -> Call {
        let (offset, len) = req.span();
        match req {
            Request::Read { .. } | Request::ReadTo { .. } => Call::new(Op::Read, offset, len),
            Request::Write { flags, .. } => Call::writing(Op::Write, offset, len, *flags),
            Request::Zero { flags, .. } => Call::zero(offset, len, *flags),
        }
    }
}
