"""Requests a synthetic disk answers: each line of output is one request's
outcome, "ok" or the errno's name, so that two servers can be compared.

Usage: synth_ops.py URI OFFSET LENGTH
Reads OFFSET..OFFSET+LENGTH, writes the same bytes back, writes them
changed, zeroes (plain and fast), trims, and reads a byte past the end."""

import errno
import sys

import nbd

uri, offset, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = nbd.NBD()
h.connect_uri(uri)


def outcome(what, f):
    try:
        f()
        print(what, "ok")
    except nbd.Error as e:
        print(what, errno.errorcode.get(e.errnum, e.errnum))


data = h.pread(length, offset)
if h.is_read_only():
    print("read-only")
else:
    outcome("write-same", lambda: h.pwrite(data, offset))
    changed = bytes(b ^ 0x01 for b in data)
    outcome("write-changed", lambda: h.pwrite(changed, offset))
    if h.can_zero():
        outcome("zero", lambda: h.zero(length, offset))
    if h.can_fast_zero():
        outcome("zero-fast", lambda: h.zero(length, offset, nbd.CMD_FLAG_FAST_ZERO))
    if h.can_trim():
        outcome("trim", lambda: h.trim(length, offset))
    print("after", h.pread(length, offset) == data)
outcome("past-end", lambda: h.pread(1, h.get_size()))
