# diskit's test script (not one of nbdkit's): the thread model given as
# "model=parallel" (or serialize_requests, serialize_all_requests, ...);
# each read takes 50 ms (sleeping, without the GIL) and fills its buffer
# with the largest number of reads seen running at once so far.

import threading
import time

import nbdkit

API_VERSION = 2

model = nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS
lock = threading.Lock()
running = 0
most = 0


def config(key, value):
    global model
    if key == "model":
        model = getattr(nbdkit, "THREAD_MODEL_" + value.upper())
    else:
        raise RuntimeError("unknown parameter: " + key)


def thread_model():
    return model


def open(readonly):
    return {}


def get_size(h):
    return 1 << 20


def pread(h, buf, offset, flags):
    global running, most
    with lock:
        running += 1
        most = max(most, running)
    time.sleep(0.05)
    with lock:
        running -= 1
    buf[:] = bytes([most]) * len(buf)
