"""Runs NBD requests against a server and prints what came back, one line
per request, so that two servers (nbdkit and diskit serve, with the same
filters over the same data) can be compared line by line.

Usage: filter_ops.py URI OPS_JSON

OPS_JSON is a list of requests, each a list:
  ["read", OFF, LEN]                 -> ok + digest of the bytes
  ["write", OFF, LEN, SEED, FLAG...] -> ok (SEED 0 writes zeros)
  ["zero", OFF, LEN, FLAG...]
  ["trim", OFF, LEN, FLAG...]
  ["cache", OFF, LEN]
  ["flush"]
  ["status", OFF, LEN, FLAG...]      -> ok + the extents of the whole range
                                        (asked again until covered, merged)
  ["size"]                           -> the export size
FLAG is one of fua, fast, nohole, req_one. A failed request prints
"error" and the errno name. libnbd does not check bounds (requests past
the end reach the server, so its own checks are what is compared), but
still refuses commands and flags the server did not advertise: nbdkit
1.32 aborts on some of those (a FAST_ZERO it did not offer). The last
line is the digest of the whole disk.
"""

import errno
import hashlib
import json
import sys

import nbd

URI, OPS = sys.argv[1], json.loads(sys.argv[2])
FLAGS = {
    "fua": nbd.CMD_FLAG_FUA,
    "fast": nbd.CMD_FLAG_FAST_ZERO,
    "nohole": nbd.CMD_FLAG_NO_HOLE,
    "req_one": nbd.CMD_FLAG_REQ_ONE,
}
CHUNK = 1 << 20


def flags(names):
    f = 0
    for n in names:
        f |= FLAGS[n]
    return f


def data(off, n, seed):
    if seed == 0:
        return bytes(n)
    return bytes(((off + i) * 131 + seed * 17 + (off + i) // 509) & 0xFF or 1 for i in range(n))


def digest(b):
    return hashlib.sha256(b).hexdigest()[:16]


def status(h, off, n, fl):
    out = []

    def cb(meta, entry_off, entries, err):
        nonlocal pos
        if meta != "base:allocation":
            return 0
        for i in range(0, len(entries), 2):
            length, flags_ = entries[i], entries[i + 1]
            if out and out[-1][1] == flags_:
                out[-1][0] += length
            else:
                out.append([length, flags_])
            pos += length
        return 0

    pos = off
    end = off + n
    while pos < end:
        before = pos
        h.block_status(end - pos, pos, cb, fl)
        if pos == before:
            raise RuntimeError("block status made no progress")
    # The last extent may run past the request: cut it.
    over = pos - end
    if over:
        out[-1][0] -= over
    return " ".join("%d:%d" % (length, f) for length, f in out)


def run(h, op):
    name, args = op[0], op[1:]
    if name == "read":
        return "ok " + digest(h.pread(args[1], args[0]))
    if name == "write":
        off, n, seed = args[:3]
        h.pwrite(data(off, n, seed), off, flags(args[3:]))
    elif name == "zero":
        h.zero(args[1], args[0], flags(args[2:]))
    elif name == "trim":
        h.trim(args[1], args[0], flags(args[2:]))
    elif name == "cache":
        h.cache(args[1], args[0])
    elif name == "flush":
        h.flush()
    elif name == "status":
        return "ok " + status(h, args[0], args[1], flags(args[2:]))
    elif name == "size":
        return "ok %d" % h.get_size()
    else:
        raise ValueError("unknown op %r" % name)
    return "ok"


def main():
    h = nbd.NBD()
    h.add_meta_context("base:allocation")
    h.connect_uri(URI)
    h.set_strict_mode(h.get_strict_mode() & ~nbd.STRICT_BOUNDS)
    for op in OPS:
        try:
            r = run(h, op)
        except nbd.Error as e:
            name = e.errno if isinstance(e.errno, str) else errno.errorcode.get(e.errno, e.errno)
            r = "error %s" % name
        print(json.dumps(op), "->", r)
    size = h.get_size()
    whole = hashlib.sha256()
    for off in range(0, size, CHUNK):
        whole.update(h.pread(min(CHUNK, size - off), off))
    print("disk", size, whole.hexdigest()[:16])
    h.shutdown()


main()
