# diskit's test script (not one of nbdkit's): a small disk whose reads
# work and whose writes fail with the errno the script sets, to check that
# nbdkit.set_error reaches the client. With key "fail=EPERM" (any errno
# name) another errno; with "plain=1" the script raises without setting
# one (EIO). cleanup() says it ran, on standard error.

import errno
import sys

import nbdkit

API_VERSION = 2

err = errno.ENOSPC
plain = False


def config(key, value):
    global err, plain
    if key == "fail":
        err = getattr(errno, value)
    elif key == "plain":
        plain = True
    else:
        raise RuntimeError("unknown parameter: " + key)


def open(readonly):
    return {}


def get_size(h):
    return 65536


def pread(h, buf, offset, flags):
    buf[:] = b"\x5a" * len(buf)


def pwrite(h, buf, offset, flags):
    if not plain:
        nbdkit.set_error(err)
    raise RuntimeError("write refused at %d" % offset)


def cleanup():
    sys.stderr.write("cleanup called\n")
