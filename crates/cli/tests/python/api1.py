# diskit's test script (not one of nbdkit's): nbdkit's python plugin API
# version 1 (no API_VERSION): pread returns the bytes, the other callbacks
# take no flags.

disk = bytearray(65536)


def open(readonly):
    return 1


def get_size(h):
    return len(disk)


def pread(h, count, offset):
    return disk[offset:offset + count]


def pwrite(h, buf, offset):
    disk[offset:offset + len(buf)] = buf


def flush(h):
    pass


def trim(h, count, offset):
    pass


def zero(h, count, offset, may_trim):
    disk[offset:offset + count] = bytearray(count)
