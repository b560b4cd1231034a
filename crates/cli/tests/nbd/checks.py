"""Checks of `diskit serve` through libnbd (python3 nbd module).

Usage: checks.py MODE URI
  rw  URI  writable export over a 4 MiB file: 64 KiB of 0x11 at 0,
           64 KiB of 0x22 at 1 MiB, holes elsewhere
  ro  URI  the same file, served read-only
  mem URI  a memory export
Exits non-zero (with a message) on the first failed check.
"""

import errno
import os
import subprocess
import sys

import nbd

MODE, URI = sys.argv[1], sys.argv[2]
K = 1024
M = 1024 * K


def connect(meta=True, strict=True):
    h = nbd.NBD()
    if meta:
        h.add_meta_context("base:allocation")
    # The TLS runs pass tls-certificates=DIR in the URI.
    h.set_uri_allow_local_file(True)
    h.connect_uri(URI)
    if not strict:
        h.set_strict_mode(0)
    return h


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)


def expect_error(name, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except nbd.Error as e:
        got = e.errno if isinstance(e.errno, str) else errno.errorcode.get(e.errno)
        check(got == name, "%s: expected %s, got %s (%s)" % (fn.__name__, name, got, e.string))
        return
    sys.exit("FAILED: %s succeeded, expected %s" % (fn.__name__, name))


def chunks_of(h, count, offset, flags=0):
    got = []

    def chunk(buf, off, status, err):
        got.append((off, len(buf), status, bytes(buf)))
        return 0

    h.pread_structured(count, offset, chunk, flags)
    return sorted(got)


def extents_of(h, count, offset, flags=0):
    got = {}

    def extent(ctx, off, entries, err):
        got[ctx] = (off, list(entries))
        return 0

    h.block_status(count, offset, extent, flags)
    return got


def structured_reads(h):
    got = chunks_of(h, 2 * M, 0)
    holes = [c for c in got if c[2] == nbd.READ_HOLE]
    data = [c for c in got if c[2] == nbd.READ_DATA]
    check(holes, "sparse read sent no hole chunk: %r" % [(c[0], c[1], c[2]) for c in got])
    check(sum(c[1] for c in got) == 2 * M, "chunks do not cover the read")
    check(sum(c[1] for c in holes) >= 2 * M - 256 * K, "holes cost bandwidth")
    for off, n, _, buf in data:
        for i in range(0, n, 4096):
            pos = off + i
            want = 0x11 if pos < 64 * K else 0x22 if M <= pos < M + 64 * K else 0
            check(buf[i] == want, "data byte at %d is %d, want %d" % (pos, buf[i], want))
    # DF: one data chunk with the zeros in it.
    got = chunks_of(h, 256 * K, 0, nbd.CMD_FLAG_DF)
    check(len(got) == 1 and got[0][2] == nbd.READ_DATA, "DF read was fragmented")
    check(got[0][3][:64 * K] == b"\x11" * (64 * K) and got[0][3][64 * K:] == bytes(192 * K), "DF data")


def block_status(h):
    got = extents_of(h, 2 * M, 0)
    off, e = got["base:allocation"]
    check(off == 0, "block status offset")
    check(e[0:2] == [64 * K, 0], "first extent should be 64 KiB of data: %r" % e[:4])
    check(e[3] == 3, "second extent should be a hole: %r" % e[:4])
    got = extents_of(h, 2 * M, 0, nbd.CMD_FLAG_REQ_ONE)
    check(len(got["base:allocation"][1]) == 2, "REQ_ONE gave more than one extent")


def fast_zero(h):
    check(h.can_fast_zero(), "fast zero not advertised")
    h.pwrite(b"\x44" * (64 * K), 3 * M)
    # May trim: punching a hole is cheap.
    h.zero(64 * K, 3 * M, nbd.CMD_FLAG_FAST_ZERO)
    check(h.pread(64 * K, 3 * M) == bytes(64 * K), "fast zero left data")
    # Without trimming it may be cheap or not: either zeros or ENOTSUP
    # with the data untouched.
    h.pwrite(b"\x45" * (64 * K), 3 * M)
    try:
        h.zero(64 * K, 3 * M, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE)
        check(h.pread(64 * K, 3 * M) == bytes(64 * K), "fast zero (no hole) left data")
    except nbd.Error as e:
        check(e.errno in ("ENOTSUP", "EOPNOTSUPP", errno.ENOTSUP), "fast zero error %r" % e.errno)
        check(h.pread(64 * K, 3 * M) == b"\x45" * (64 * K), "failed fast zero changed data")


def zero_trim_flush_cache(h):
    for flag in ("can_zero", "can_trim", "can_flush", "can_cache", "can_fua", "can_multi_conn"):
        check(getattr(h, flag)(), flag + " is false")
    h.pwrite(b"\x33" * (64 * K), 3 * M + 64 * K, nbd.CMD_FLAG_FUA)
    h.zero(64 * K, 3 * M + 64 * K, nbd.CMD_FLAG_NO_HOLE)
    check(h.pread(64 * K, 3 * M + 64 * K) == bytes(64 * K), "zero left data")
    h.pwrite(b"\x34" * (64 * K), 3 * M + 64 * K)
    h.zero(64 * K, 3 * M + 64 * K, nbd.CMD_FLAG_FUA)
    check(h.pread(64 * K, 3 * M + 64 * K) == bytes(64 * K), "zero (may trim) left data")
    h.pwrite(b"\x35" * (64 * K), 3 * M + 64 * K)
    h.trim(64 * K, 3 * M + 64 * K)
    h.flush()
    h.cache(64 * K, 0)
    h.trim(4 * K, 3 * M, nbd.CMD_FLAG_FUA)


def many_writes(h):
    n = 256
    bufs = [nbd.Buffer.from_bytearray(bytearray([i % 251 + 1]) * 4096) for i in range(n)]
    cookies = [h.aio_pwrite(bufs[i], 2 * M + i * 4096) for i in range(n)]
    peak = h.aio_in_flight()
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for c in cookies:
        check(h.aio_command_completed(c), "write not completed")
    check(peak >= 200, "only %d requests were in flight" % peak)
    data = h.pread(n * 4096, 2 * M)
    for i in range(n):
        check(data[i * 4096] == i % 251 + 1 and data[i * 4096 + 4095] == i % 251 + 1,
              "write %d did not land" % i)


def disconnect_with_writes_in_flight():
    h = connect()
    n = 128
    bufs = [nbd.Buffer.from_bytearray(bytearray([0x80 + i % 100]) * 8192) for i in range(n)]
    for i in range(n):
        h.aio_pwrite(bufs[i], 2 * M + i * 8192)
    h.shutdown()
    del h
    h = connect()
    data = h.pread(n * 8192, 2 * M)
    for i in range(n):
        check(data[i * 8192:(i + 1) * 8192] == bytes([0x80 + i % 100]) * 8192,
              "write %d in flight at disconnect was lost" % i)


def abandoned_reads():
    # Clients that leave with big reads unanswered (this script in mode
    # "abandon"): their replies meet a closed socket, which must end those
    # connections, not the server.
    for _ in range(3):
        subprocess.run([sys.executable, __file__, "abandon", URI], check=True)
    h = connect()
    check(h.pread(4096, 0)[0] == 0x11, "server gone after clients left with reads in flight")


def abandon():
    h = connect()
    bufs = [nbd.Buffer(4 * M) for _ in range(16)]
    for b in bufs:
        h.aio_pread(b, 0)
    h.poll(0)
    os._exit(0)


def multi_conn():
    a, b, c = connect(), connect(), connect()
    check(a.can_multi_conn(), "multi-conn")
    a.pwrite(b"\x77" * 4096, 3 * M + 512 * K)
    b.flush()
    check(c.pread(4096, 3 * M + 512 * K) == b"\x77" * 4096, "write not visible on another connection")


def out_of_range(h):
    size = h.get_size()
    expect_error("EINVAL", h.pread, 4096, size - 2048)
    expect_error("ENOSPC", h.pwrite, b"x" * 4096, size - 2048)
    expect_error("ENOSPC", h.zero, 4096, size)
    expect_error("EINVAL", h.trim, 4096, size)
    expect_error("EINVAL", h.cache, 4096, size + 4096)
    expect_error("EINVAL", h.block_status, 4096, size, lambda *a: 0)
    expect_error("EINVAL", h.pread, 0, 0)
    check(h.pread(4096, 0)[0] == 0x11, "connection unusable after errors")


def oversized(h):
    mx = h.get_block_size(nbd.SIZE_MAXIMUM)
    if mx >= 64 * M:
        # libnbd never sends more than 64 MiB in one request: the server
        # beyond its maximum is checked byte by byte in raw_socket.rs.
        return
    big = mx + M
    expect_error("EINVAL", h.pread, big, 0)
    expect_error("EOVERFLOW", h.pread, big, 0, nbd.CMD_FLAG_DF)
    # A write payload beyond the maximum is read and discarded.
    expect_error("EINVAL", h.pwrite, b"\x99" * big, 0)
    check(h.pread(4096, 0)[0] == 0x11, "connection unusable after an oversized write")


def read_only():
    h = connect(strict=False)
    check(h.is_read_only(), "export not read-only")
    for flag in ("can_zero", "can_trim", "can_fua", "can_fast_zero"):
        check(not getattr(h, flag)(), flag + " advertised on a read-only export")
    expect_error("EPERM", h.pwrite, b"x" * 512, 0)
    expect_error("EPERM", h.zero, 512, 0)
    expect_error("EPERM", h.trim, 512, 0)
    check(h.pread(512, 0) == b"\x11" * 512, "read on a read-only export")


if MODE == "rw":
    h = connect()
    structured_reads(h)
    block_status(h)
    fast_zero(h)
    zero_trim_flush_cache(h)
    many_writes(h)
    disconnect_with_writes_in_flight()
    abandoned_reads()
    multi_conn()
    h2 = connect(strict=False)
    out_of_range(h2)
    oversized(h2)
elif MODE == "abandon":
    abandon()
elif MODE == "ro":
    read_only()
elif MODE == "mem":
    h = connect()
    # As nbdkit's memory plugin: flush and cache are taken (no-ops).
    check(h.can_flush() and h.can_cache(), "memory lacks flush or cache")
    h.flush()
    h.cache(4096, 0)
    h.pwrite(b"\x12" * (64 * K), 64 * K)
    h.zero(64 * K, 64 * K, nbd.CMD_FLAG_FAST_ZERO)
    check(h.pread(64 * K, 64 * K) == bytes(64 * K), "fast zero on memory")
    many_writes(h)
    got = chunks_of(h, 1 * M, 0)
    check(any(c[2] == nbd.READ_HOLE for c in got), "memory holes not sent as holes")
else:
    sys.exit("unknown mode " + MODE)
print("ok")
